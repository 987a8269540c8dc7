"""Timelines: Chrome-trace JSON from the runtime's events, the measured bubble, the hidden
communication, a PNG.

The runtime records, per rank, the start and end (wall clock, seconds; on a GPU from CUDA events
anchored to the host clock, :class:`DeviceClock`) of every forward (F), backward (B),
weight-gradient (W) action (under pp: the schedule's actions; without pp: each forward and
backward module call of the step, stage 0, per microbatch), every wait for a message or a
collective, and every collective (``pm.start_timeline()``; all ranks' events are gathered by
``pm.save_timeline(path)``). The trace opens in ``chrome://tracing`` or Perfetto: one process per
rank, compute on thread 0, waits on thread 1, communication on thread 2 (and 3, 4, ... when
asynchronous collectives are in flight at once: one lane each, so slices never overlap on a thread).
``mcompile timeline`` draws it with matplotlib.

A communication event (cat ``"comm"``, :class:`Recorder`) has ``kind`` (all_gather / reduce_scatter /
all_reduce / all_reduce_max), ``axis``, ``bytes`` (of the whole buffer: a gather's output, a
reduce-scatter's input, an all-reduce's tensor), ``async`` and ``source`` (``"program"``: a
program's collective through :class:`~mcompile.runtime.comm.DistCommunicator`; ``"bucket"``: a dp
gradient bucket of runtime/leaves.py or runtime/zero.py; ``"publish"``: ZeRO's parameter
all-gathers; ``"step"``: the step's own, e.g. the loss and token count over dp). A synchronous
collective spans its call; an asynchronous one its launch to its completion (gloo: the time a
watcher thread's wait for the work returns; CUDA: an event recorded on the stream the work's future
callback runs on, which waits for the collective's CUDA events: its completion on the device;
:meth:`Recorder.launched`).

The measured bubble of a rank is the part of the step (first action start to last action end
over all ranks) in which it computes nothing: ``1 - busy / span``.

The hidden communication of a rank (:func:`overlap_stats`) is interval arithmetic on one rank's
events, with ``|X|`` the total length of a union of intervals::

    comm     = U(comm events)                       (concurrent collectives counted once)
    blocked  = U(synchronous collectives) U U(waits) (the host runs no compute there)
    compute  = U(F, B, W events) - blocked
    hidden   = |comm ∩ compute|,   hidden_fraction = hidden / |comm|

so a synchronous collective inside a forward module call is never hidden, and an asynchronous one
is hidden for the part of its flight during which the rank computes. On a GPU the compute intervals
are host-side marks turned device times by events on the compute stream: the same arithmetic, on
the device's clock.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import weakref
from pathlib import Path

__all__ = ["chrome_trace", "save_trace", "load_trace", "bubble", "draw", "HostClock", "DeviceClock", "clock_for",
           "Recorder", "overlap_stats", "trace_events", "COMPUTE"]


class HostClock:
    """Marks are host times (``time.time()``, seconds): right on CPU, where every op runs on the host.

    A clock's protocol (the executor's only use of time): ``start()`` at the step's start, ``mark()``
    at every action and wait boundary (an opaque mark), ``seconds(marks)`` once at the step's end:
    the marks as wall-clock seconds, comparable across processes on one machine."""

    def start(self) -> None:
        pass

    def mark(self):
        return time.time()

    def seconds(self, marks: list) -> list[float]:
        return list(marks)


class DeviceClock:
    """Marks are CUDA events on the current stream: on NCCL, ``wait()`` only orders the streams and
    returns at once, so host times would put a wait's length into the next action's; an event
    recorded after it completes when the GPU gets past the wait.

    ``start()`` synchronizes the device once, then records a step-start event and takes the host
    time: that pair anchors the device times to the wall clock. ``seconds`` (at the step's end, where
    the executor waits anyway) synchronizes on the last mark and converts each mark to
    ``anchor + elapsed_time(start event, mark)`` (milliseconds, to seconds). ``event_cls`` and
    ``synchronize`` are injectable so the bookkeeping is tested on CPU with a fake event."""

    def __init__(self, event_cls=None, synchronize=None):
        import torch

        self.event_cls = event_cls or torch.cuda.Event
        self.synchronize = synchronize or torch.cuda.synchronize
        self._start = None
        self._anchor = 0.0

    def start(self) -> None:
        self.synchronize()  # the start event must not wait behind earlier queued work
        self._start = self.event_cls(enable_timing=True)
        self._start.record()
        self._anchor = time.time()

    def mark(self):
        if self._start is None:
            raise RuntimeError("DeviceClock.mark before start()")
        e = self.event_cls(enable_timing=True)
        e.record()
        return e

    def seconds(self, marks: list) -> list[float]:
        if not marks:
            return []
        marks[-1].synchronize()  # events complete in stream order: the last one bounds them all
        return [self._anchor + self._start.elapsed_time(e) / 1e3 for e in marks]


def clock_for(device) -> HostClock | DeviceClock:
    """The clock that tells the truth on ``device``: CUDA events on a GPU, host time elsewhere."""
    return DeviceClock() if getattr(device, "type", str(device)) == "cuda" else HostClock()


def _watch_loop(items, clock) -> None:
    """The watcher thread: wait for each work in turn (Work.wait releases the GIL), mark its end."""
    while True:
        item = items.get()
        if item is None:
            return
        ev, work, landed = item
        try:
            work.wait()
        except Exception:  # noqa: BLE001 - the main thread's own wait raises it
            pass
        ev["end"] = clock.mark()
        landed.set()


def _stop_watchers(watchers: dict) -> None:
    for q in watchers.values():
        q.put(None)


COMPUTE = ("F", "B", "W")  # the compute categories; "wait" and "comm" are the others


class Recorder:
    """One rank's timeline of the latest step: compute intervals, waits and collectives.

    Made by ``pm.start_timeline()`` and held by the rank's communicator
    (``DistCommunicator.recorder``); the runtime's call sites test that attribute and call nothing
    when it is None, so recording off costs one attribute check per collective. During a step the
    events hold the clock's marks; :meth:`events` returns them in seconds. :meth:`begin_step` (at
    each ``train_step``'s start) drops the previous step's: the timeline shows the latest step and
    what ran after it until the next one (e.g. ZeRO's parameter all-gathers in the optimizer step).
    """

    def __init__(self, rank: int, clock=None):
        self.rank = rank
        self.clock = clock or HostClock()
        self.clock.start()
        self.steps = 0
        self._events: list[dict] = []
        self._inflight: list[tuple] = []  # (event, work, landed flag) of the asynchronous collectives
        self._watchers: dict[str, queue.SimpleQueue] = {}  # axis -> its watcher thread's queue (launched)
        weakref.finalize(self, _stop_watchers, self._watchers)  # the threads end with the recorder

    def begin_step(self) -> None:
        self._events = []
        self._inflight = []
        self.steps += 1

    def mark(self):
        return self.clock.mark()

    def _add(self, cat: str, name: str, start, end, **extra) -> dict:
        ev = {"rank": self.rank, "name": name, "cat": cat, "start": start, "end": end, **extra}
        self._events.append(ev)
        return ev

    def compute(self, cat: str, t0, mb: int | None = None, stage: int = 0) -> None:
        """A forward (F) / backward (B) / weight (W) call that began at mark ``t0`` and ends now;
        ``mb`` defaults to the number of ``cat`` events of the step before it (the microbatch)."""
        end = self.clock.mark()
        if mb is None:
            mb = sum(e["cat"] == cat for e in self._events)
        self._add(cat, f"{cat}{stage}.{mb}", t0, end, stage=stage, mb=mb)

    def wait(self, name: str, t0) -> None:
        """The host waited from mark ``t0`` until now (for a started collective)."""
        self._add("wait", name, t0, self.clock.mark())

    def collective(self, kind: str, axis: str, nbytes: int, t0, source: str = "program") -> None:
        """A synchronous collective, from mark ``t0`` (its call) until now (its return)."""
        self._add("comm", f"{kind} {axis}", t0, self.clock.mark(), kind=kind, axis=axis, bytes=int(nbytes),
                  **{"async": False}, source=source)

    def launched(self, kind: str, axis: str, nbytes: int, work, t0=None, source: str = "program") -> None:
        """An asynchronous collective launched at mark ``t0`` (default: now, right after the launch
        call returned); its end is marked when it completes (module docstring).

        On the host clock (gloo) a watcher thread per axis waits for the axis's works in launch order
        (``Work.wait`` releases the GIL) and marks each as its wait returns: a Python callback on the
        work's future would run on gloo's own thread, which would then stall every later collective
        of the group until it got the GIL. The mark waits for the GIL (the compute releases it in
        every op); a work that lands before an earlier-launched one of its axis is marked when that
        one lands (an upper bound). On a GPU the future's callback runs at once (NCCL's future
        completes at enqueue) and records a CUDA event that waits for the collective."""
        ev = self._add("comm", f"{kind} {axis}", self.clock.mark() if t0 is None else t0, None, kind=kind,
                       axis=axis, bytes=int(nbytes), **{"async": True}, source=source)
        landed = threading.Event()
        self._inflight.append((ev, work, landed))
        if isinstance(self.clock, DeviceClock):
            def done(_fut, ev=ev, clock=self.clock, landed=landed):
                ev["end"] = clock.mark()
                landed.set()

            try:
                work.get_future().add_done_callback(done)
                return
            except RuntimeError:  # no future (gloo's reduce-scatter): the watcher
                pass
        q = self._watchers.get(axis)
        if q is None:
            q = self._watchers[axis] = queue.SimpleQueue()
            threading.Thread(target=_watch_loop, args=(q, self.clock), daemon=True,
                             name=f"mcompile timeline watcher (rank {self.rank}, {axis})").start()
        q.put((ev, work, landed))

    def events(self) -> list[dict]:
        """The latest step's events, times in seconds (copies; the device is synchronized first on a
        GPU). A collective still in flight gets ``end = start`` and ``"incomplete": True``."""
        for ev, work, landed in self._inflight:  # landed, but its mark may still be on its way
            if ev["end"] is None and work.is_completed():
                landed.wait(1.0)
        sync = getattr(self.clock, "synchronize", None)
        if callable(sync):
            sync()  # completion events live on other streams than the last mark's
        evs = list(self._events)
        marks = []
        for e in evs:
            marks += [e["start"], e["end"] if e["end"] is not None else e["start"]]
        secs = iter(self.clock.seconds(marks))
        out = []
        for e in evs:
            d = dict(e, start=next(secs), end=next(secs))
            if e["end"] is None:
                d["incomplete"] = True
            out.append(d)
        return out


_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "wait": "#C0C0C0", "comm": "#8172B3"}
_ARGS = {"stage": "stage", "mb": "microbatch", "kind": "kind", "axis": "axis", "bytes": "bytes", "async": "async",
         "source": "source", "incomplete": "incomplete"}  # event key -> trace args key


def _lanes(events: list[dict]) -> list[int]:
    """A lane per event (in the given order) such that the events of one lane do not overlap:
    greedy, by start time (interval partitioning: as few lanes as the most events in flight at once)."""
    ends: list[float] = []
    lane = [0] * len(events)
    for i in sorted(range(len(events)), key=lambda i: (events[i]["start"], events[i]["end"])):
        e = events[i]
        free = next((k for k, t in enumerate(ends) if t <= e["start"]), None)
        if free is None:
            free = len(ends)
            ends.append(0.0)
        ends[free] = e["end"]
        lane[i] = free
    return lane


def chrome_trace(events: list[dict], meta: dict | None = None) -> dict:
    """Events (dicts with rank, name, cat, start, end in seconds) -> a Chrome trace: per rank,
    compute (F/B/W) on thread 0, waits on thread 1, collectives on thread 2 + their lane."""
    shown = [e for e in events if e["cat"] in (*COMPUTE, "wait", "comm")]
    t0 = min((e["start"] for e in shown), default=0.0)
    tid = {id(e): 0 if e["cat"] in COMPUTE else 1 for e in shown if e["cat"] != "comm"}
    ranks = sorted({e["rank"] for e in shown})
    for r in ranks:
        comm = [e for e in shown if e["cat"] == "comm" and e["rank"] == r]
        for e, k in zip(comm, _lanes(comm)):
            tid[id(e)] = 2 + k
    trace = []
    for e in shown:
        args = {"stage": e.get("stage", -1), "microbatch": e.get("mb", -1)} if e["cat"] != "comm" else {}
        args.update({_ARGS[k]: e[k] for k in ("kind", "axis", "bytes", "async", "source", "incomplete") if k in e})
        trace.append({"name": e["name"], "cat": e["cat"], "ph": "X", "pid": e["rank"], "tid": tid[id(e)],
                      "ts": (e["start"] - t0) * 1e6, "dur": max(0.0, e["end"] - e["start"]) * 1e6, "args": args})
    for r in ranks:
        trace.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        for t in sorted({x["tid"] for x in trace if x.get("ph") == "X" and x["pid"] == r}):
            name = ("compute", "waits")[t] if t < 2 else "comm" if t == 2 else f"comm {t - 1}"
            trace.append({"name": "thread_name", "ph": "M", "pid": r, "tid": t, "args": {"name": name}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": meta or {}}


def trace_events(trace: dict) -> list[dict]:
    """The events of a Chrome trace (:func:`chrome_trace`) back as event dicts, times in seconds
    (relative to the trace's first event)."""
    back = {v: k for k, v in _ARGS.items()}
    out = []
    for x in trace["traceEvents"]:
        if x.get("ph") != "X":
            continue
        e = {"rank": x["pid"], "name": x["name"], "cat": x["cat"], "start": x["ts"] / 1e6,
             "end": (x["ts"] + x["dur"]) / 1e6}
        e.update({back[k]: v for k, v in x.get("args", {}).items() if k in back})
        out.append(e)
    return out


def save_trace(path, events: list[dict], meta: dict | None = None) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events, meta)))
    return path


def load_trace(path) -> dict:
    return json.loads(Path(path).read_text())


def bubble(trace: dict) -> dict[int, float]:
    """Idle fraction of each rank over the step's span (compute events only)."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("F", "B", "W")]
    if not ev:
        return {}
    start = min(e["ts"] for e in ev)
    end = max(e["ts"] + e["dur"] for e in ev)
    busy: dict[int, float] = {}
    for e in ev:
        busy[e["pid"]] = busy.get(e["pid"], 0.0) + e["dur"]
    return {r: 1.0 - b / (end - start) for r, b in sorted(busy.items())}


def _union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same points as ``intervals`` ((start, end) pairs)."""
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys) -> list[tuple[float, float]]:
    """Intersection of two unions (each sorted and disjoint, as :func:`_union` returns)."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(xs, ys) -> list[tuple[float, float]]:
    """``xs`` minus ``ys`` (both sorted and disjoint)."""
    out = []
    for a, b in xs:
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if b > a:
            out.append((a, b))
    return out


def overlap_stats(events) -> dict[int, dict]:
    """Per rank: how much of its communication time lies under its compute (module docstring).

    ``events``: event dicts (rank, cat, start, end in seconds; comm events with kind, bytes, async:
    :meth:`Recorder.events`, or every rank's as ``pm.save_timeline`` gathers them) or a Chrome trace
    (:func:`chrome_trace`). Returns ``{rank: stats}`` with, in seconds:

    - ``comm_s``: length of the union of the rank's comm intervals; ``hidden_s``: the part of it under
      compute; ``exposed_s = comm_s - hidden_s``; ``hidden_fraction = hidden_s / comm_s`` (0.0 when
      the rank has no communication);
    - ``async_comm_s`` / ``async_hidden_s`` / ``async_hidden_fraction``: the same for the
      asynchronous collectives only (a synchronous one is never hidden: it blocks the host);
    - ``compute_s``: the compute intervals less the blocked time (``blocked_s``: synchronous
      collectives and waits); ``comm_sum_s``: the comm durations summed (concurrent ones counted
      each); ``count``, ``bytes`` and ``by_kind`` (kind -> count, bytes, sum_s).
    """
    if isinstance(events, dict):
        events = trace_events(events)
    out = {}
    for r in sorted({e["rank"] for e in events}):
        mine = [e for e in events if e["rank"] == r]
        comm = [e for e in mine if e["cat"] == "comm"]
        span = lambda es: [(e["start"], e["end"]) for e in es]  # noqa: E731
        blocked = _union(span([e for e in comm if not e.get("async")] + [e for e in mine if e["cat"] == "wait"]))
        compute = _subtract(_union(span(e for e in mine if e["cat"] in COMPUTE)), blocked)
        comm_u = _union(span(comm))
        async_u = _union(span(e for e in comm if e.get("async")))
        comm_s, hidden_s = _length(comm_u), _length(_intersect(comm_u, compute))
        async_s, async_hidden = _length(async_u), _length(_intersect(async_u, compute))
        by_kind: dict[str, dict] = {}
        for e in comm:
            k = by_kind.setdefault(e.get("kind", e["name"]), {"count": 0, "bytes": 0, "sum_s": 0.0})
            k["count"] += 1
            k["bytes"] += int(e.get("bytes", 0))
            k["sum_s"] += e["end"] - e["start"]
        out[r] = {"comm_s": comm_s, "hidden_s": hidden_s, "exposed_s": comm_s - hidden_s,
                  "hidden_fraction": hidden_s / comm_s if comm_s > 0 else 0.0,
                  "async_comm_s": async_s, "async_hidden_s": async_hidden,
                  "async_hidden_fraction": async_hidden / async_s if async_s > 0 else 0.0,
                  "compute_s": _length(compute), "blocked_s": _length(blocked),
                  "comm_sum_s": sum(e["end"] - e["start"] for e in comm), "count": len(comm),
                  "bytes": sum(int(e.get("bytes", 0)) for e in comm), "by_kind": by_kind}
    return out


def draw(trace: dict, out, title: str | None = None) -> Path:
    """A Gantt chart of the trace: one row per rank, F/B/W coloured, labelled stage.microbatch."""
    from mcompile.ir.compat import require

    matplotlib = require("matplotlib", "the timeline chart (mcompile timeline's PNG)")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranks = sorted({e["pid"] for e in ev})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.2))
    for e in ev:
        y = ranks.index(e["pid"])
        if e["cat"] == "comm":  # a strip under the row (collectives in flight at once drawn over each other)
            ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (y + 0.32, 0.16), facecolors=_COLORS["comm"],
                           alpha=0.6, edgecolor="none")
            continue
        h, dy = (0.8, 0.0) if e["cat"] != "wait" else (0.2, -0.45)
        ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (y + dy - h / 2 + (0.45 if e["cat"] == "wait" else 0), h),
                       facecolors=_COLORS.get(e["cat"], "#999999"), edgecolor="white", linewidth=0.5)
        if e["cat"] != "wait" and e["dur"] > 0:
            a = e.get("args", {})
            ax.text((e["ts"] + e["dur"] / 2) / 1e3, y, f"{e['cat']}{a.get('stage', '')}.{a.get('microbatch', '')}",
                    ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    b = bubble(trace)
    meta = trace.get("otherData", {})
    mean = sum(b.values()) / len(b) if b else 0.0
    hidden = ""
    if any(e["cat"] == "comm" for e in ev):
        st = overlap_stats(trace)
        comm = sum(s["comm_s"] for s in st.values())
        hidden = f", communication hidden {sum(s['hidden_s'] for s in st.values()) / comm:.1%}" if comm else ""
    ax.set_title(title or f"{meta.get('schedule', meta.get('layout', 'pipeline'))}: measured bubble {mean:.1%}"
                 + (f" (formula {meta['bubble_formula']:.1%})" if "bubble_formula" in meta else "") + hidden)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, ["forward", "backward (input)", "backward (weight)", "waiting", "communication"],
              loc="upper right", fontsize=7)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
