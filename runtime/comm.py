"""The communicator of a real run: mcompile's collective ops on torch.distributed process groups.

One process group per mesh axis, from a torch ``DeviceMesh`` (NCCL on CUDA, gloo on CPU; the same
programs run on both). Bound around each program run with :func:`mcompile.ir.ops.bind`.

``recorder`` (None unless ``pm.start_timeline()``: a :class:`mcompile.ir.timeline.Recorder`) times every
collective: a synchronous one from its call to its return, a started one from its launch to its
completion (the work's future), and the host's wait for it. Off, each collective pays one
attribute check.

``log`` (None when the hang watchdog is off: ``Config.hang_timeout_s=0``): this process's
:class:`mcompile.runtime.watchdog.CollectiveLog`. Every collective and message goes through :meth:`watch`
(or :meth:`watch_messages`): an entry numbered per group (per peer and direction for a message), finished when
the call returns (gloo), when the stream passes it (NCCL) or when a started one's work completes; the
watchdog thread reports an entry that stays unfinished past the hang timeout (runtime/watchdog.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mcompile.ir.ops import Pending
from mcompile.runtime.watchdog import HangSettings, group_label, process_log

__all__ = ["DistCommunicator"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# torch 2.13 renames the single-tensor collectives; torch 2.11 (our GPU machine) has the old names only
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Unwatched:
    """What :meth:`DistCommunicator.watch` gives with the watchdog off: a context that records nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def started(self, *works):
        return works[0] if len(works) == 1 else None


UNWATCHED = _Unwatched()


class DistCommunicator:
    log = None  # the hang watchdog's record (runtime/watchdog.py), None when off

    def __init__(self, mesh: DeviceMesh, hang: HangSettings | None = None):
        self.mesh = mesh
        self.groups = {name: mesh.get_group(name) for name in mesh.mesh_dim_names}
        self.ranks = {name: mesh.get_local_rank(name) for name in mesh.mesh_dim_names}
        self.sizes = {name: mesh.size(i) for i, name in enumerate(mesh.mesh_dim_names)}
        self.pending = Pending()  # started collectives (mcompile.ir.ops start_* / wait)
        self.recorder = None  # a mcompile.ir.timeline.Recorder while a timeline is recorded
        self._kinds: dict[int, tuple[str, str]] = {}  # started buffer -> (kind, axis), while recording
        self.log = process_log(hang, device_events=mesh.device_type == "cuda") if hang is not None else None
        self._labels: dict[str, str] = {}  # axis (or group name) -> its group's label in the log
        if self.log is not None:
            for name, group in self.groups.items():
                self._label(name, group)

    def rank(self, axis: str) -> int:
        return self.ranks[axis]

    def add_group(self, name: str, group) -> None:
        """A process group under a name of its own (the runtime's "data": dp x ep flattened)."""
        self.groups[name] = group
        self.ranks[name] = dist.get_rank(group)
        self.sizes[name] = dist.get_world_size(group)
        if self.log is not None:
            self._label(name, group)

    # -- the hang watchdog's record ---------------------------------------------------------------
    def _label(self, name: str, group=None) -> str:
        """The log's label of ``group`` (default: the one named ``name`` here, or the default group for "world"):
        one per process group, so that two names of one group ("dp" and "data" without cp or ep) count its
        collectives in one sequence."""
        if group is None:
            group = self.groups.get(name) or dist.group.WORLD
        key = name if self.groups.get(name) is group else f"{name}#{id(group)}"
        for other, g in self.groups.items():
            if g is group and other in self._labels:
                self._labels[key] = self._labels[other]
                break
        if key not in self._labels:
            ranks = dist.get_process_group_ranks(group)
            self._labels[key] = label = group_label(name, ranks)
            self.log.groups[label] = ranks
        return self._labels[key]

    def watch(self, kind: str, axis: str, group=None):
        """A context around one collective ``kind`` over ``axis`` (or over the process group ``group``, named
        ``axis`` in reports; ``"world"``: the default group): its entry in the hang watchdog's record, whose
        ``started(work)`` says the call only launched it. A no-op context when the watchdog is off."""
        log = self.log
        if log is None:
            return UNWATCHED
        label = self._labels.get(axis) if group is None else None
        return log.collective(kind, label or self._label(axis, group))

    def watch_messages(self, ops: list[tuple[str, int]], axis: str):
        """A context around one batch of point-to-point messages, ``ops`` as ("send" | "recv", global peer rank),
        over ``axis`` (a name for reports): one entry per message."""
        log = self.log
        if log is None:
            return UNWATCHED
        return log.messages(ops, self._labels.get(axis, axis))

    def all_reduce(self, x: torch.Tensor, axis: str, op: str, inplace: bool = False) -> torch.Tensor:
        """``x`` summed (or max) over ``axis``: a new tensor, or ``x`` itself reduced in place when ``inplace``
        (``mcompile::all_reduce_`` — the caller's program reads ``x`` nowhere else: ``passes/dp/overlap.py
        inplace_all_reduces``), which saves the copy."""
        out = x if inplace else x.clone()
        rec = self.recorder
        t0 = rec.mark() if rec is not None else None
        with self.watch("all_reduce" if op == "sum" else f"all_reduce_{op}", axis):
            dist.all_reduce(out, op=_OPS[op], group=self.groups[axis])
        if rec is not None:
            rec.collective("all_reduce" if op == "sum" else f"all_reduce_{op}", axis, out.nbytes, t0)
        return out

    def all_gather(self, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
        """The dim-0 gather of ``x`` as it is (each rank's piece whole: ``[n, *x.shape]``), then its pieces
        moved to ``dim`` by one copy — none when every dim before ``dim`` has size 1 (batch 1 under SP)."""
        n, src = self.sizes[axis], x.contiguous()
        dim %= max(src.ndim, 1)
        buf = src.new_empty((n * src.shape[0], *src.shape[1:]))
        rec = self.recorder
        t0 = rec.mark() if rec is not None else None
        with self.watch("all_gather", axis):
            _ALL_GATHER(buf, src, group=self.groups[axis])
        if rec is not None:
            rec.collective("all_gather", axis, buf.nbytes, t0)
        if dim == 0:
            return buf
        full = (*src.shape[:dim], n * src.shape[dim], *src.shape[dim + 1:])
        # a view when every dim before dim has size 1, else the one copy
        return buf.view(n, *src.shape).movedim(0, dim).reshape(full)

    def reduce_scatter(self, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
        """Each rank's block of ``dim`` moved to the front by one copy (none when every dim before ``dim``
        has size 1), reduce-scattered straight into this rank's block, which needs no copy back."""
        n = self.sizes[axis]
        dim %= max(x.ndim, 1)
        blocks = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()  # [n, .., s/n, ..]
        out = blocks.new_empty(blocks.shape[1:])
        rec = self.recorder
        t0 = rec.mark() if rec is not None else None
        with self.watch("reduce_scatter", axis):
            _REDUCE_SCATTER(out, blocks.flatten(0, 1), group=self.groups[axis])
        if rec is not None:
            rec.collective("reduce_scatter", axis, blocks.nbytes, t0)
        return out

    def all_to_all(self, x: torch.Tensor, out_rows: list[int], in_rows: list[int], axis: str) -> torch.Tensor:
        """Rows ``in_rows[j]`` of ``x`` (in order) to rank j of ``axis``; ``out_rows[j]`` rows from each
        j, concatenated (variable split sizes: the MoE token dispatch)."""
        out = x.new_empty((sum(out_rows), *x.shape[1:]))
        rec = self.recorder
        t0 = rec.mark() if rec is not None else None
        with self.watch("all_to_all", axis):
            dist.all_to_all_single(out, x, output_split_sizes=out_rows, input_split_sizes=in_rows,
                                   group=self.groups[axis])
        if rec is not None:
            rec.collective("all_to_all", axis, out.nbytes, t0)
        return out

    def start(self, kind: str, x: torch.Tensor, axis: str) -> torch.Tensor:
        """Launch ``kind`` on dim 0 of ``x`` over ``axis`` asynchronously; the output buffer, to be
        read after :meth:`wait`. ``x`` is kept alive until then (NCCL reads it on its stream)."""
        n, group = self.sizes[axis], self.groups[axis]
        rec = self.recorder
        t0 = rec.mark() if rec is not None else None
        if kind not in ("all_gather", "reduce_scatter", "all_reduce"):
            raise ValueError(f"start: unknown collective {kind!r}")
        with self.watch(kind, axis) as watched:
            if kind == "all_gather":
                out = x.new_empty((n * x.shape[0], *x.shape[1:]))
                work = _ALL_GATHER(out, x, group=group, async_op=True)
            elif kind == "reduce_scatter":
                out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
                work = _REDUCE_SCATTER(out, x, group=group, async_op=True)
            else:
                out = x.clone()
                work = dist.all_reduce(out, group=group, async_op=True)
            watched_work = watched.started(work)
        if rec is not None:
            rec.launched(kind, axis, max(out.nbytes, x.nbytes), work, t0)
            self._kinds[out.data_ptr()] = (kind, axis)
        return self.pending.put(out, watched_work, x)

    def wait(self, buf: torch.Tensor) -> None:
        rec = self.recorder
        if rec is None:
            self.pending.pop(buf).wait()
            return
        t0 = rec.mark()
        self.pending.pop(buf).wait()
        kind, axis = self._kinds.pop(buf.data_ptr(), ("collective", "?"))
        rec.wait(f"wait {kind} {axis}", t0)

    def _ring_p2p(self, tensors: list[torch.Tensor], axis: str):
        """The P2POps of one ring step over ``axis``: each tensor to the next rank, a buffer of its shape
        from the previous (global peer ranks); sends and receives go in one batch, since on NCCL a send
        blocks until its receive is posted."""
        group, n, r = self.groups[axis], self.sizes[axis], self.ranks[axis]
        nxt, prv = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
        sends = [t.contiguous() for t in tensors]
        outs = [torch.empty_like(t) for t in sends]
        p2p = [dist.P2POp(dist.isend, t, nxt, group) for t in sends] + [
            dist.P2POp(dist.irecv, o, prv, group) for o in outs]
        watched = self.watch_messages([("send", nxt)] * len(sends) + [("recv", prv)] * len(outs), axis)
        return sends, outs, p2p, watched

    def sendrecv_ring(self, tensors: list[torch.Tensor], axis: str) -> list[torch.Tensor]:
        """Send each tensor to rank (r + 1) % n of ``axis`` and receive the same shapes from (r - 1) % n
        (one ``batch_isend_irecv``); returns the received tensors."""
        if self.sizes[axis] == 1:
            return [t.clone() for t in tensors]
        _, outs, p2p, watched = self._ring_p2p(tensors, axis)
        rec = self.recorder
        t0 = rec.mark() if rec is not None else None
        with watched:
            for work in dist.batch_isend_irecv(p2p):
                work.wait()
        if rec is not None:
            rec.collective("sendrecv", axis, sum(o.nbytes for o in outs), t0)
        return outs

    def start_sendrecv_ring(self, tensors: list[torch.Tensor], axis: str) -> _RingRecv:
        """:meth:`sendrecv_ring` launched asynchronously: a handle whose ``wait()`` returns the received
        tensors (on NCCL: orders the compute stream after the transfer). The sent tensors are kept alive
        until then."""
        if self.sizes[axis] == 1:
            return _RingRecv([], [t.clone() for t in tensors], [], None, axis)
        sends, outs, p2p, watched = self._ring_p2p(tensors, axis)
        rec = self.recorder
        t0 = rec.mark() if rec is not None else None
        with watched:
            works = dist.batch_isend_irecv(p2p)
            watched.started(*works)
        if rec is not None and works:
            rec.launched("sendrecv", axis, sum(o.nbytes for o in outs), works[-1], t0)
        return _RingRecv(works, outs, sends, rec, axis)

    def timed(self, kind: str, axis: str, x: torch.Tensor, source: str = "step", group=None):
        """A context for a synchronous collective the runtime calls on ``x`` itself (not through this
        communicator): in the hang watchdog's record (over ``group`` when given, else ``axis``'s), and on the
        timeline while one is recorded."""
        watched = self.watch(kind, axis, group)
        rec = self.recorder
        if rec is None:
            return watched
        return _Timed(rec, kind, axis, x.nbytes, source, watched)

    def launched(self, kind: str, axis: str, x: torch.Tensor, work, source: str = "bucket", group=None):
        """Record an asynchronous collective on ``x`` that the runtime launched itself (a dp bucket): in
        the hang watchdog's record (over ``group`` when given, else ``axis``'s), finished when ``work`` is, and on
        the timeline if one is on; its launch is marked now, right after the launch call returned. Returns the
        work to wait on (``work`` itself, or wrapped so that its ``wait()`` tells the watchdog)."""
        if work is None:
            return None
        rec = self.recorder
        if rec is not None:
            rec.launched(kind, axis, x.nbytes, work, source=source)
        if self.log is not None:
            with self.watch(kind, axis, group) as watched:
                work = watched.started(work)
        return work


class _RingRecv:
    """A started ring step (:meth:`DistCommunicator.start_sendrecv_ring`)."""

    def __init__(self, works, outs, sends, rec, axis):
        self.works, self.outs, self.sends, self.rec, self.axis = works, outs, sends, rec, axis

    def wait(self) -> list[torch.Tensor]:
        t0 = self.rec.mark() if self.rec is not None else None
        for work in self.works:
            work.wait()
        if self.rec is not None:
            self.rec.wait(f"wait sendrecv {self.axis}", t0)
        self.works, self.sends = [], []
        return self.outs


class _Timed:
    __slots__ = ("rec", "kind", "axis", "nbytes", "source", "t0", "watched")

    def __init__(self, rec, kind, axis, nbytes, source, watched):
        self.rec, self.kind, self.axis, self.nbytes, self.source = rec, kind, axis, nbytes, source
        self.watched = watched

    def __enter__(self):
        self.watched.__enter__()
        self.t0 = self.rec.mark()

    def __exit__(self, *exc):
        self.rec.collective(self.kind, self.axis, self.nbytes, self.t0, self.source)
        self.watched.__exit__(*exc)
        return False
