"""Pipeline timelines: Chrome-trace JSON from the runtime's events, the measured bubble, a PNG.

The runtime records, per rank, the start and end (wall clock, seconds; on a GPU from CUDA events
anchored to the host clock, :class:`DeviceClock`) of every forward (F), backward (B),
weight-gradient (W) action and every wait for a message (``pm.start_timeline()``; all ranks'
events are gathered by ``pm.save_timeline(path)``). The trace opens in ``chrome://tracing`` or
Perfetto: one process per rank, compute on thread 0, waits on thread 1. ``mcompile timeline``
draws it with matplotlib.

The measured bubble of a rank is the part of the step (first action start to last action end
over all ranks) in which it computes nothing: ``1 - busy / span``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["chrome_trace", "save_trace", "load_trace", "bubble", "draw", "HostClock", "DeviceClock", "clock_for"]


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

_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "wait": "#C0C0C0"}


def chrome_trace(events: list[dict], meta: dict | None = None) -> dict:
    """Events (dicts with rank, name, cat, start, end in seconds) -> a Chrome trace."""
    compute = [e for e in events if e["cat"] in ("F", "B", "W", "wait")]
    t0 = min((e["start"] for e in compute), default=0.0)
    trace = []
    for e in compute:
        trace.append({"name": e["name"], "cat": e["cat"], "ph": "X", "pid": e["rank"],
                      "tid": 1 if e["cat"] == "wait" else 0, "ts": (e["start"] - t0) * 1e6,
                      "dur": max(0.0, e["end"] - e["start"]) * 1e6,
                      "args": {"stage": e.get("stage", -1), "microbatch": e.get("mb", -1)}})
    for r in sorted({e["rank"] for e in compute}):
        trace.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": meta or {}}


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


def draw(trace: dict, out, title: str | None = None) -> Path:
    """A Gantt chart of the trace: one row per rank, F/B/W coloured, labelled stage.microbatch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranks = sorted({e["pid"] for e in ev})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.2))
    for e in ev:
        y = ranks.index(e["pid"])
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
    ax.set_title(title or f"{meta.get('schedule', 'pipeline')}: measured bubble {mean:.1%}"
                 + (f" (formula {meta['bubble_formula']:.1%})" if "bubble_formula" in meta else ""))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, ["forward", "backward (input)", "backward (weight)", "waiting"], loc="upper right",
              fontsize=7)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
