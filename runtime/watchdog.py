"""Hangs that name themselves: a record of this rank's collectives and a thread that watches it.

A collective one rank never issues leaves every other rank waiting until the process group gives up
(``Config.collective_timeout_s``, 30 minutes), and each then says only that it timed out. Here every rank
keeps a cheap record of the collectives and messages the runtime issues, and a thread looks at the oldest
one not finished: past the hang timeout (``Config.hang_timeout_s``, else ``$MCOMPILE_HANG_TIMEOUT``, else
300 s; 0: off) every rank says what it is doing, and the ranks that wait say who has not arrived::

    rank 0: all_reduce #2 on tp[0,1] has not completed after 2.0 s (hang timeout 2 s)
      rank 1 has not arrived: it never issued all_reduce #2 on tp[0,1]; it last issued all_reduce #1
        (completed); it is in no collective (its last began 2.3 s ago)

**The record** (:class:`CollectiveLog`, one per process as the process groups are, shared by its
communicators). An entry is (key, seq, op, group, peer, start). The key is what must match across ranks:
for a collective its group's label (``tp[2,3]``: the mesh axis and the group's global ranks), since the
n-th collective a rank issues on a group meets the n-th of every other member (torch's rule); for a
message its direction and peer (``send to 3``, ``recv from 2``), since the n-th send from a to b meets
b's n-th receive from a. ``seq`` numbers the entries of a key from 1. An entry is finished

- for a synchronous call on gloo, when the call returns (gloo blocks the calling thread);
- for a synchronous call on NCCL, when a CUDA event recorded after it on the current stream has passed
  (the call returns once enqueued; the stream waits for the collective);
- for a started one (either backend), when its work's ``is_completed()`` says so;

the thread tests the last two, so a hang on the device is seen as one from the host. The main thread
pays one small object, an uncontended lock, a deque append and pop per call (on NCCL one CUDA event
more): ``bench/watchdog_overhead.py``; nothing goes to the store while nothing hangs.

**The thread** (:class:`_Watchdog`, a daemon, one per process and default group), every
``tick = clamp(timeout / 10, 0.05 s, 5 s)``:

1. the oldest unfinished entry older than the timeout, not reported yet, is an *incident*: the rank
   adds 1 to the store's ``incidents`` counter, publishes its state and waits up to
   ``grace = max(5 ticks, 1 s)`` for the states of the ranks it waits with, then reports;
2. when ``incidents`` has grown since it last looked, the rank publishes its state and reports what it
   is doing, hung or not: every rank dumps.

The store is the default group's (a TCPStore every rank reaches while collectives hang), through a
clone of its client, so that the main thread's use of the store never blocks this one. A state is
JSON: per key the last issued and the last completed (seq, op), the unfinished entries with their ages.
From the states of the members, the waiting rank names each member that issued fewer than ``seq`` on
the key (it has not arrived, and where it is instead), each that issued another op as ``seq`` (the
ranks disagree on the order), and each that did not answer within the grace.

**The report** goes to stderr and is appended to ``<dump dir>/rank<r>.txt`` (``Config.hang_dump_dir``,
else ``$MCOMPILE_HANG_DIR``, else ``mcompile-hangs`` in the system's temporary folder). Where torch's
flight recorder recorded anything (torch 2.13 records gloo's unasked; ``TORCH_FR_BUFFER_SIZE=N`` before the
process group is made, ``TORCH_NCCL_TRACE_BUFFER_SIZE`` on older torch), its trace is written beside it, to
``flight_recorder/rank_<r>``: torch's analyser reads NCCL's (``torchfrtrace <dump dir>/flight_recorder
--prefix rank_``; https://docs.pytorch.org/docs/stable/torch_nccl_flight_recorder.html), gloo's name no
process group in torch 2.13 (read them with ``pickle.load``). With
``hang_abort`` a rank that waits exits with :data:`EXIT_CODE` after its report, its last line
``CollectiveHang: ...``: neither ``ProcessGroup.abort`` nor anything else releases a thread waiting in a
gloo collective, and a launcher (torchrun) then stops the other ranks, restarting them if asked.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["CollectiveHang", "CollectiveLog", "HangSettings", "EXIT_CODE", "process_log", "stop", "watchdog_of",
           "group_label", "diagnose", "check_timeout"]

ENV_TIMEOUT = "MCOMPILE_HANG_TIMEOUT"
ENV_DIR = "MCOMPILE_HANG_DIR"
DEFAULT_TIMEOUT_S = 300.0
EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): the run may be restarted
_STORE_PREFIX = "mcompile/watchdog"


class CollectiveHang(RuntimeError):
    """A collective or message did not finish within the hang timeout; the message is the watchdog's report (who
    has not arrived). Raised from the process group's own error when a reported call fails at last (its
    timeout, a peer gone); with ``hang_abort`` the waiting rank's last line, as it exits."""


@dataclass(frozen=True, kw_only=True)
class HangSettings:
    timeout_s: float = DEFAULT_TIMEOUT_S  # 0: no watchdog
    dump_dir: str = ""
    abort: bool = False

    @classmethod
    def resolve(cls, timeout_s: float | None = None, dump_dir: str | None = None, abort: bool = False) -> HangSettings:
        """The settings a run uses: the given values, else ``$MCOMPILE_HANG_TIMEOUT`` / ``$MCOMPILE_HANG_DIR``,
        else 300 s and ``mcompile-hangs`` in the temporary folder."""
        if timeout_s is None:
            env = os.environ.get(ENV_TIMEOUT, "").strip()
            try:
                timeout_s = float(env) if env else DEFAULT_TIMEOUT_S
            except ValueError:
                raise ValueError(f"{ENV_TIMEOUT}={env!r}: use a number of seconds (0: no hang watchdog)") from None
        check_timeout(timeout_s)
        dump_dir = dump_dir or os.environ.get(ENV_DIR) or os.path.join(tempfile.gettempdir(), "mcompile-hangs")
        return cls(timeout_s=float(timeout_s), dump_dir=str(dump_dir), abort=bool(abort))


def check_timeout(value, name: str = "hang_timeout_s") -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{name}={value!r}: use a number of seconds >= 0 (0: no hang watchdog); it should stay "
                         "well below collective_timeout_s")


def group_label(axis: str, ranks: list[int]) -> str:
    """``tp[2,3]``: a mesh axis and its group's global ranks (long groups shortened: ``dp[0,8,...,504](64)``)."""
    if len(ranks) <= 8:
        return f"{axis}[{','.join(map(str, ranks))}]"
    return f"{axis}[{ranks[0]},{ranks[1]},...,{ranks[-1]}]({len(ranks)})"


class _Entry:
    """One collective or message of this rank; a context around its call (``with log.collective(...)``)."""

    __slots__ = ("log", "key", "seq", "op", "group", "peer", "t0", "check", "done", "report")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.log.end(self, failed=exc_type is not None)
        if exc_type is not None:
            _raise_reported(exc, [self])
        return False

    def started(self, work):
        """The call was a launch of ``work``: the entry is finished when the work says it is completed, or when
        the host has waited for it (gloo's reduce-scatter work never says so); returns the work to wait on
        (``work`` wrapped: its ``wait()`` tells the log)."""
        if work is None:
            return None
        self.check = work.is_completed
        return _WatchedWork(work, self)

    def what(self) -> str:
        if self.peer is None:
            return f"{self.op} #{self.seq} on {self.group}"
        return f"{self.op} #{self.seq} {'to' if self.op == 'send' else 'from'} rank {self.peer} ({self.group})"

    def as_dict(self, now: float) -> dict:
        return {"key": self.key, "seq": self.seq, "op": self.op, "group": self.group, "peer": self.peer,
                "age": round(now - self.t0, 3)}


class _WatchedWork:
    """A started collective's work whose ``wait()`` also tells the log (:meth:`CollectiveLog.waited`)."""

    __slots__ = ("work", "entry")

    def __init__(self, work, entry: _Entry):
        self.work, self.entry = work, entry

    def wait(self, *args, **kwargs):
        try:
            out = self.work.wait(*args, **kwargs)
        except Exception as exc:
            _raise_reported(exc, [self.entry])
            raise
        self.entry.log.waited(self.entry)
        return out

    def is_completed(self) -> bool:
        return self.entry.done or self.work.is_completed()

    def __getattr__(self, name):
        return getattr(self.work, name)


class _Batch:
    """The entries of one batch of messages, in one context (:meth:`CollectiveLog.messages`); each finished when
    every work of the batch says it is completed (point-to-point works do, on gloo and NCCL)."""

    __slots__ = ("entries",)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        for e in self.entries:
            e.log.end(e, failed=exc_type is not None)
        if exc_type is not None:
            _raise_reported(exc, self.entries)
        return False

    def started(self, *works) -> None:
        works = [w for w in works if w is not None]
        check = (lambda: all(w.is_completed() for w in works)) if len(works) > 1 else \
            works[0].is_completed if works else None
        for e in self.entries:
            e.check = check
            if check is None:
                e.done = True


def _raise_reported(exc: BaseException, entries: list[_Entry]) -> None:
    """A reported call failed (the process group's timeout, a peer gone): CollectiveHang with the report, from it."""
    reported = [e.report for e in entries if e.report is not None]
    if reported and isinstance(exc, Exception) and not isinstance(exc, CollectiveHang):
        raise CollectiveHang(reported[0]) from exc


class CollectiveLog:
    """This process's record of its collectives and messages (module docstring).

    ``device_events``: calls return before they complete (NCCL), so a synchronous one is finished when a
    CUDA event recorded after it has passed."""

    def __init__(self, rank: int, device_events: bool = False):
        self.rank = rank
        self.device_events = device_events
        self.settings = HangSettings.resolve()
        self.groups: dict[str, list[int]] = {}  # label -> the group's global ranks
        self._lock = threading.Lock()
        self._open: collections.deque[_Entry] = collections.deque()  # not yet retired, in issue order
        self._last: dict[str, _Entry] = {}  # key -> its last issued entry
        self._completed: dict[str, _Entry] = {}  # key -> its last retired entry
        self._latest: _Entry | None = None

    # -- the main thread ------------------------------------------------------------------------
    def collective(self, op: str, group: str) -> _Entry:
        """A collective ``op`` on the group labelled ``group`` (:func:`group_label`), issued now."""
        return self._issue(group, op, group, None)

    def message(self, op: str, peer: int, group: str) -> _Entry:
        """A ``"send"`` to / ``"recv"`` from global rank ``peer`` (over the group labelled ``group``), issued now."""
        return self._issue(f"{op} {'to' if op == 'send' else 'from'} {peer}", op, group, peer)

    def messages(self, ops: list[tuple[str, int]], group: str) -> _Batch:
        """One batch of messages (``batch_isend_irecv``), ``ops`` as ("send" | "recv", global peer rank): an
        entry each, in one context."""
        batch = _Batch()
        batch.entries = [self.message(op, peer, group) for op, peer in ops]
        return batch

    def _issue(self, key: str, op: str, group: str, peer: int | None) -> _Entry:
        e = _Entry()
        e.log, e.key, e.op, e.group, e.peer, e.check, e.done, e.report = self, key, op, group, peer, None, False, None
        with self._lock:
            last = self._last.get(key)
            e.seq = 1 if last is None else last.seq + 1
            self._last[key] = self._latest = e
            e.t0 = time.monotonic()
            self._open.append(e)
        return e

    def end(self, e: _Entry, failed: bool = False) -> None:
        """``e``'s call returned (or raised: ``failed``, never waited for again)."""
        if e.check is None:
            if self.device_events and not failed and not torch.cuda.is_current_stream_capturing():
                event = torch.cuda.Event()
                event.record()
                e.check = event.query
            else:  # gloo; or a CUDA graph's capture, whose events pass only when the graph is replayed
                e.done = True
        self._retire()

    def waited(self, e: _Entry) -> None:
        """The host waited for ``e``'s work: finished on gloo; on NCCL when the stream passes an event recorded
        after the wait (the wait made it wait for the collective)."""
        if self.device_events and not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event()
            event.record()
            e.check = event.query
        else:
            e.done = True
        self._retire()

    def _retire(self) -> None:
        q = self._open
        with self._lock:
            while q:
                e = q[0]
                if not e.done:
                    if e.check is None or not e.check():
                        return
                    e.done = True
                e.check = None  # the work or event is not held longer
                q.popleft()
                self._completed[e.key] = e

    # -- the watchdog thread --------------------------------------------------------------------
    def oldest_unfinished(self) -> _Entry | None:
        self._retire()  # the finished ones in front let go of their works now, not at the next collective's end
        with self._lock:
            entries = list(self._open)
        for e in entries:
            check = e.check
            if e.done or (check is not None and check()):
                e.done = True
                continue
            return e
        return None

    def state(self) -> dict:
        """This rank's state as JSON-able data: what it issued and completed per key, what is unfinished."""
        now = time.monotonic()
        with self._lock:
            entries, last, completed, latest = list(self._open), dict(self._last), dict(self._completed), self._latest
        unfinished = []
        for e in entries:
            check = e.check
            if e.done or (check is not None and check()):
                if e.key not in completed or completed[e.key].seq < e.seq:
                    completed[e.key] = e
            else:
                unfinished.append(e.as_dict(now))
        keys = {k: {"issued": [e.seq, e.op], "group": e.group,
                    "completed": [completed[k].seq, completed[k].op] if k in completed else [0, ""]}
                for k, e in last.items()}
        return {"rank": self.rank, "keys": keys, "unfinished": unfinished,
                "latest": latest.as_dict(now) if latest is not None else None}


# ------------------------------------------------------------------------------------ diagnosis
def _where(state: dict) -> str:
    """Where a rank is, from its state: the collective it waits in, or none."""
    if state["unfinished"]:
        u = state["unfinished"][0]
        return f"it waits in {_what(u)} for {u['age']:.1f} s"
    latest = state.get("latest")
    if latest is None:
        return "it has issued no collective"
    return f"it is in no collective (its last, {_what(latest)}, began {latest['age']:.1f} s ago)"


def _what(d: dict) -> str:
    if d.get("peer") is None:
        return f"{d['op']} #{d['seq']} on {d['group']}"
    return f"{d['op']} #{d['seq']} {'to' if d['op'] == 'send' else 'from'} rank {d['peer']} ({d['group']})"


def diagnose(hung: dict, members: list[int], states: dict[int, dict]) -> list[str]:
    """Lines naming, for the unfinished entry ``hung`` of rank ``hung["rank"]`` (``_Entry.as_dict``), each member
    of its group (or its peer) that has not arrived, that issued something else as that seq, or that did not
    answer; ``states``: the members' published states (:meth:`CollectiveLog.state`) by rank."""
    lines, arrived = [], []
    seq, op, peer, me = hung["seq"], hung["op"], hung.get("peer"), hung["rank"]
    if peer is None:
        key, want, what = hung["key"], op, f"{op} #{seq} on {hung['group']}"
    else:  # the n-th send from a to b meets b's n-th receive from a
        want = "recv" if op == "send" else "send"
        key = f"{want} {'to' if want == 'send' else 'from'} {me}"
        what = f"{want} #{seq} {'to' if want == 'send' else 'from'} rank {me} ({hung['group']})"
    for m in members:
        s = states.get(m)
        if s is None:
            lines.append(f"rank {m} did not answer (no watchdog there, its process is gone, or it holds the GIL)")
            continue
        k = s["keys"].get(key)
        issued, issued_op = k["issued"] if k else (0, "")
        done = k["completed"][0] if k else 0
        if issued < seq:
            last = (f"it last issued {issued_op} #{issued}" + (" (completed)" if done == issued else "")) if issued \
                else "it issued none there before"
            lines.append(f"rank {m} has not arrived: it never issued {what}; {last}; {_where(s)}")
            continue
        same = [u for u in s["unfinished"] if u["key"] == key and u["seq"] == seq]
        if same and same[0]["op"] != want:
            lines.append(f"rank {m} issued {same[0]['op']} as #{seq} on {hung['group']} where rank {me} issued {op}: "
                         "the ranks issue their collectives in different orders")
        elif not same and done >= seq:  # it arrived since (late), or its #seq met another rank's
            lines.append(f"rank {m} has completed {what} by now ({_where(s)})")
        else:
            arrived.append(m)
    if arrived:
        lines.append(f"arrived and waiting too: rank{'s' if len(arrived) > 1 else ''} {', '.join(map(str, arrived))}")
    return lines


# ------------------------------------------------------------------------------------ the thread
class _Watchdog(threading.Thread):
    def __init__(self, log: CollectiveLog, world, store):
        super().__init__(name="mcompile-hang-watchdog", daemon=True)
        self.log = log
        self.world = world
        self.store = store
        self.seen = 0  # the incidents counter when this rank last published
        self.reported: _Entry | None = None
        self.ticks = 0
        self.wake = threading.Event()  # set when the settings change: the next tick comes at once
        self.stopping = threading.Event()
        self.told: tuple = ()  # what this rank's last bystander report said (its latest and oldest unfinished entry)

    def tick_s(self) -> float:
        return min(max(self.log.settings.timeout_s / 10, 0.05), 5.0)

    def run(self) -> None:
        while not self.stopping.is_set():
            if self.wake.wait(self.tick_s()):
                self.wake.clear()
            # stopped (launch.shutdown_distributed, the interpreter's exit), or the default group destroyed
            if self.stopping.is_set() or dist.group.WORLD is not self.world:
                return
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the store is gone (its rank exited): this watch is over
                if not self.stopping.is_set() and self.reported is not None:
                    print(f"[mcompile hang watchdog] rank {self.log.rank} stopped: {type(e).__name__}: {e}",
                          file=sys.stderr, flush=True)
                return

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        if threading.current_thread() is not self:
            self.join(timeout=2 * self.tick_s() + 1.0)

    def tick(self) -> None:
        self.ticks += 1
        settings = self.log.settings
        if settings.timeout_s > 0:
            e = self.log.oldest_unfinished()
            if e is not None and e is not self.reported and time.monotonic() - e.t0 > settings.timeout_s:
                self.reported = e
                self.incident(e, settings)
        if self.store is not None:
            n = int(self.store.add("incidents", 0))
            if n > self.seen:
                self.seen = n
                self.publish(n)
                told = (self.log._latest, self.log.oldest_unfinished())
                if told != self.told:  # several ranks' incidents of one hang: this rank says it once
                    self.told = told
                    self.emit(self.bystander_report(), settings)

    def publish(self, n: int) -> None:
        state = self.log.state()
        state["incident"] = n
        self.store.set(f"state/{self.log.rank}", json.dumps(state))

    def incident(self, e: _Entry, settings: HangSettings) -> None:
        rank, now = self.log.rank, time.monotonic()
        hung = {**e.as_dict(now), "rank": rank}
        head = (f"rank {rank}: {e.what()} has not completed after {now - e.t0:.1f} s "
                f"(hang timeout {settings.timeout_s:g} s)")
        members = [e.peer] if e.peer is not None else [m for m in self.log.groups.get(e.group, []) if m != rank]
        lines = []
        if self.store is not None:
            n = int(self.store.add("incidents", 1))
            self.seen = max(self.seen, n)
            self.publish(n)
            lines = diagnose(hung, members, self.gather(members, n))
        else:
            lines = ["(no store to ask the other ranks: their states are unknown)"]
        if e.done or (e.check is not None and e.check()):
            head += f"; it completed meanwhile, after {time.monotonic() - e.t0:.1f} s: a rank came late"
        text = "\n  ".join([head, *lines])
        e.report = text
        path = self.emit(text, settings)
        if settings.abort:
            summary = "; ".join(x for x in lines if "has not arrived" in x or "did not answer" in x)
            err = CollectiveHang(f"{head}{': ' + summary if summary else ''} (report: {path})")
            print(f"{type(err).__name__}: {err}; exiting with code {EXIT_CODE}", file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)

    def gather(self, members: list[int], n: int) -> dict[int, dict]:
        """The members' states published for incident ``n`` or later, waiting up to the grace period."""
        deadline = time.monotonic() + max(5 * self.tick_s(), 1.0)
        got: dict[int, dict] = {}
        while True:
            latest = int(self.store.add("incidents", 0))
            if latest > self.seen:  # another rank's incident meanwhile: it waits for this rank's state too
                self.seen = latest
                self.publish(latest)
            for m in members:
                if m in got:
                    continue
                key = f"state/{m}"
                if self.store.check([key]):
                    s = json.loads(self.store.get(key))
                    if s.get("incident", 0) >= n:
                        got[m] = s
            if len(got) == len(members) or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def bystander_report(self) -> str:
        s = self.log.state()
        return (f"rank {self.log.rank}: a hang was reported (store incident {self.seen}); "
                f"{_where(s).replace('it ', 'this rank ', 1)}; last issued per group: "
                + ", ".join(f"{k} {v['issued'][1]} #{v['issued'][0]}" for k, v in sorted(s["keys"].items())))

    def emit(self, text: str, settings: HangSettings) -> Path | None:
        """``text`` to stderr and appended to this rank's file in the dump folder (its path); the flight
        recorder's trace beside it where torch records one."""
        print(f"[mcompile hang watchdog] {text}", file=sys.stderr, flush=True)
        try:
            folder = Path(settings.dump_dir)
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"rank{self.log.rank}.txt"
            with open(path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
            fr = _dump_flight_recorder(folder / "flight_recorder", self.log.rank, self.log.device_events)
            if fr is not None:
                with open(path, "a") as f:
                    f.write(f"  torch's flight recorder trace: {fr}\n")
            return path
        except OSError as err:
            print(f"[mcompile hang watchdog] rank {self.log.rank}: could not write to {settings.dump_dir}: {err}",
                  file=sys.stderr, flush=True)
            return None


def _dump_flight_recorder(folder: Path, rank: int, nccl: bool) -> Path | None:
    """torch's flight recorder trace (a pickle) written to ``folder/rank_<rank>``, where it recorded anything."""
    import torch._C._distributed_c10d as c10d

    names = ("_dump_nccl_trace", "_dump_fr_trace") if nccl else ("_dump_fr_trace",)
    for name in names:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:  # no stack traces: symbolising them waits for the thread blocked in the collective
            data = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
        except Exception:  # noqa: BLE001 - not recording, or not this backend
            continue
        import pickle

        if pickle.loads(data).get("entries"):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank_{rank}").write_bytes(data)
            return folder / f"rank_{rank}"
    return None


# ------------------------------------------------------------------------------------ one per process
_PROCESS: dict = {}  # "log" -> (the default group it watches, CollectiveLog, _Watchdog)


def process_log(settings: HangSettings | None = None, device_events: bool = False) -> CollectiveLog | None:
    """This process's record, its watchdog started on first use for the current default group, with
    ``settings`` applied (the latest call's apply: one watchdog per process, as its groups are; None: as they
    are, or from the environment on first use); None when the timeout is 0 (the caller records nothing; a
    watchdog already running goes on for the others). ``device_events``: the collectives run on CUDA (NCCL),
    where a call returns before it completes (:class:`CollectiveLog`)."""
    world = dist.group.WORLD
    if settings is None:
        held = _PROCESS.get("log")
        settings = held[1].settings if held is not None and held[0] is world else HangSettings.resolve()
    held = _PROCESS.get("log")
    if held is None or held[0] is not world:
        if settings.timeout_s == 0:
            return None
        log = CollectiveLog(dist.get_rank(), device_events=device_events)
        stop()  # the watchdog of a destroyed default group, if its thread has not noticed yet
        store = _watch_store()
        dog = _Watchdog(log, world, store)
        log.settings = settings
        dog.start()
        _PROCESS["log"] = held = (world, log, dog)
        if not _PROCESS.get("atexit"):
            atexit.register(stop)  # no store polls while the interpreter finalises
            _PROCESS["atexit"] = True
    if settings.timeout_s == 0:
        return None
    if held[1].settings != settings:
        held[1].settings = settings
        held[2].wake.set()
    return held[1]


def stop() -> None:
    """End this process's watchdog (before its ranks leave: :func:`mcompile.runtime.launch.shutdown_distributed`
    calls it ahead of its barrier, so that no rank asks the store of a rank that has exited)."""
    held = _PROCESS.pop("log", None)
    if held is not None:
        held[2].stop()


def watchdog_of(log: CollectiveLog):
    """The thread watching ``log`` (tests: its tick count)."""
    held = _PROCESS.get("log")
    return held[2] if held is not None and held[1] is log else None


def _watch_store():
    """A client of the default group's store of the watchdog's own (``Store.clone``), under a prefix of
    its own; None where there is none (a fake process group)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return None
    clone = getattr(store, "clone", None)
    if clone is not None:
        try:
            store = clone()
        except Exception:  # noqa: BLE001 - a store that cannot clone: shared with the main thread
            pass
    return dist.PrefixStore(_STORE_PREFIX, store)
