"""Run the per-rank programs of a mesh together in one process, one thread per rank.

A small simulator of mcompile's collective ops (:mod:`mcompile.ir.ops`): each rank's thread binds a
:class:`ThreadedCommunicator`, and every collective exchanges tensors with the other ranks of its
mesh-axis group through a barrier. Used to prove a plan before any process is started (and in
tests); the real runtime binds torch.distributed groups instead.

Started collectives (``mcompile.start_*``) are asynchronous as the real backends are: the start
returns an unwritten output buffer and the exchange runs at the ``wait``, reading the start's input
then — the latest moment NCCL or gloo may read it. A program that writes over a started input before
its wait (a compiler reusing the memory) therefore sends what it wrote, here as on a GPU, and a
reader of the buffer before its wait reads garbage. ``ThreadedWorld(record_sent=True)`` keeps a copy
of what each collective sent (``ThreadedCommunicator.sent``, aligned with ``log``, which lists the
collectives in issue order: a start where it is started).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from mcompile.ir import ops
from mcompile.ir.mesh import Mesh

__all__ = ["ThreadedWorld", "ThreadedCommunicator", "run_threads"]


class _Group:
    def __init__(self, size: int, timeout: float):
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list = [None] * size

    def exchange(self, index: int, value):
        # a copy: a rank that returns first may reuse its input's memory (compiled code does) while the
        # others still read it; the real runtime's collectives do not alias their inputs either
        self.slots[index] = value.clone() if isinstance(value, torch.Tensor) else (
            [v.clone() for v in value] if isinstance(value, list) else value)
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read
        self.slots[index] = None  # the group keeps no tensor alive (memory measured in the simulator)
        return out


class ThreadedWorld:
    def __init__(self, mesh: Mesh, timeout: float = 120.0, record_sent: bool = False):
        self.mesh = mesh
        self.record_sent = record_sent  # each communicator keeps a copy of what it sent (module docstring)
        self.groups: dict[tuple[str, int], _Group] = {}
        self.group_of: dict[tuple[str, int], tuple[int, int]] = {}  # (axis, rank) -> (group id, index)
        for axis in mesh.axis_names:
            for gid, ranks in enumerate(mesh.group_ranks(axis)):
                self.groups[(axis, gid)] = _Group(len(ranks), timeout)
                for i, r in enumerate(ranks):
                    self.group_of[(axis, r)] = (gid, i)

    def communicator(self, rank: int) -> ThreadedCommunicator:
        return ThreadedCommunicator(self, rank)


class ThreadedCommunicator:
    def __init__(self, world: ThreadedWorld, rank: int):
        self.world, self.global_rank = world, rank
        self.log: list[tuple[str, str, tuple]] = []  # (kind, axis, shape) of every collective, in issue order
        # with world.record_sent: per log entry, a copy of the tensor(s) sent, taken when the exchange reads
        # them (a started collective's at its wait); None until then
        self.sent: list = []
        self.pending = ops.Pending()  # started collectives: run at their wait (module docstring)

    def _issue(self, kind: str, axis: str, x: torch.Tensor) -> int:
        self.log.append((kind, axis, tuple(x.shape)))
        self.sent.append(None)
        return len(self.log) - 1

    def _ex(self, axis: str, x, entry: int) -> list:
        if self.world.record_sent:
            self.sent[entry] = [t.detach().clone() for t in x] if isinstance(x, list) else x.detach().clone()
        gid, i = self.world.group_of[(axis, self.global_rank)]
        return self.world.groups[(axis, gid)].exchange(i, x)

    def _size(self, axis: str) -> int:
        gid, _ = self.world.group_of[(axis, self.global_rank)]
        return len(self.world.groups[(axis, gid)].slots)

    def rank(self, axis: str) -> int:
        return self.world.group_of[(axis, self.global_rank)][1]

    def all_reduce(self, x, axis, op, inplace=False):
        out = self._all_reduce(x, axis, op, self._issue(f"all_reduce_{op}", axis, x))
        return x.copy_(out) if inplace else out

    def _all_reduce(self, x, axis, op, entry):
        parts = self._ex(axis, x, entry)  # copies: every rank has read them before anyone writes into its input
        out = parts[0].clone()
        for p in parts[1:]:
            out = torch.maximum(out, p) if op == "max" else out + p
        return out

    def all_gather(self, x, dim, axis):
        return self._all_gather(x, dim, axis, self._issue("all_gather", axis, x))

    def _all_gather(self, x, dim, axis, entry):
        return torch.cat(self._ex(axis, x, entry), dim=dim)

    def reduce_scatter(self, x, dim, axis):
        return self._reduce_scatter(x, dim, axis, self._issue("reduce_scatter", axis, x))

    def _reduce_scatter(self, x, dim, axis, entry):
        parts = self._ex(axis, x, entry)
        total = parts[0].clone()
        for p in parts[1:]:
            total = total + p
        n = len(parts)
        size = total.shape[dim] // n
        return total.narrow(dim, self.rank(axis) * size, size).clone()

    def all_to_all(self, x, out_rows, in_rows, axis):
        entry = self._issue("all_to_all", axis, x)
        parts = self._ex(axis, list(torch.split(x, list(in_rows))), entry)
        me = self.rank(axis)
        out = torch.cat([p[me] for p in parts])
        assert out.shape[0] == sum(out_rows), (out.shape, out_rows)
        return out

    def sendrecv_ring(self, tensors, axis):
        """Each tensor to the next rank of ``axis``, the previous rank's received (the ring attention's step)."""
        entries = [self._issue("sendrecv", axis, t) for t in tensors]
        if self.world.record_sent:
            for e, t in zip(entries, tensors):
                self.sent[e] = t.detach().clone()
        gid, i = self.world.group_of[(axis, self.global_rank)]
        parts = self.world.groups[(axis, gid)].exchange(i, list(tensors))
        return parts[(self.rank(axis) - 1) % len(parts)]

    def start_sendrecv_ring(self, tensors, axis):
        """:meth:`sendrecv_ring`, run at once; the handle's ``wait()`` returns the received tensors."""
        return _Received(self.sendrecv_ring(tensors, axis))

    def start(self, kind, x, axis):
        """An unwritten output buffer now; the exchange, reading ``x``, at :meth:`wait`."""
        n = self._size(axis)
        if kind == "all_gather":
            out, run = x.new_empty((n * x.shape[0], *x.shape[1:])), lambda e: self._all_gather(x, 0, axis, e)
        elif kind == "reduce_scatter":
            out, run = x.new_empty((x.shape[0] // n, *x.shape[1:])), lambda e: self._reduce_scatter(x, 0, axis, e)
        elif kind == "all_reduce":
            out, run = torch.empty_like(x), lambda e: self._all_reduce(x, axis, "sum", e)
        else:
            raise ValueError(f"start: unknown collective {kind!r}")
        entry = self._issue("all_reduce_sum" if kind == "all_reduce" else kind, axis, x)  # the sync op's name
        return self.pending.put(out, (run, entry), x)

    def wait(self, buf):
        run, entry = self.pending.pop(buf)
        buf.copy_(run(entry))


class _Received:
    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        return self.tensors


def run_threads(world: ThreadedWorld, fn: Callable[[int], object]) -> list:
    """Run ``fn(rank)`` for every rank of the world's mesh, each in its own thread with its
    communicator bound; returns the results in rank order, re-raising the first failure."""
    n = world.mesh.size()
    results: list = [None] * n
    errors: list = [None] * n

    def body(r):
        try:
            with ops.bind(world.communicator(r)):
                results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errors[r] = e
            for g in world.groups.values():
                g.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"mcompile-rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    return results
