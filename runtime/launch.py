"""Launching: torchrun, a spawn helper for examples, and a pool of live workers for tests.

- Under ``torchrun --nproc-per-node N script.py``, :func:`init_distributed` reads the environment
  and initialises the default process group (NCCL on CUDA, gloo on CPU).
- :func:`spawn` runs ``fn(rank, world, *args)`` on N local CPU processes over gloo and returns the
  results in rank order (examples, the demo).
- :class:`WorkerPool` keeps N such processes alive, their process group initialised once, and runs
  one function after another on all of them (tests: starting 4 processes that import torch costs
  seconds, so it is paid once per session). A failure on any rank closes the pool (its group may
  be stuck in a collective); the next use starts a new one.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import os
import socket
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["init_distributed", "shutdown_distributed", "spawn", "WorkerPool", "free_port", "rank_device",
           "uses_nccl", "device_mesh", "process_group", "subgroups", "splits_world"]

DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)  # the test pools and spawn: a hang fails fast


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str | None = None, timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> None:
    """Initialise the default process group from torchrun's environment (if not done already).

    ``timeout``: how long a collective may wait; planning, the first step and checkpoint I/O run
    between collectives, so the default is long (``Config.collective_timeout_s`` in parallelize)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise RuntimeError(
            "torch.distributed is not initialised and no torchrun environment is set: launch with "
            "`torchrun --nproc-per-node N script.py`, or use mcompile.runtime.launch.spawn"
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not uses_nccl(backend):
        dist.init_process_group(backend, timeout=timeout)
        return
    index = _local_cuda_index(int(os.environ["RANK"]))
    torch.cuda.set_device(index)
    # NCCL alone: bound to the device, the world's communicator is made now (it would be at the first collective)
    # and later groups are split from it (splits_world: a call per kind of group, not per group; DeviceMesh's
    # axes too). A mixed "cpu:gloo,cuda:nccl" stays unbound: splits_world is NCCL's alone, and bound, every group
    # still made by new_group would become a split of the whole world for the ranks outside it.
    bind = {"device_id": torch.device("cuda", index)} if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=timeout, **bind)


# Process groups made once per process and default group, as Megatron makes its groups once at start-up: a
# ParallelModule, a Generator, an eval after training on the same mesh reuse them. Each gloo group holds two
# worker threads and a TCP loop, each NCCL group a communicator; a process that parallelized a few hundred
# times (a test worker, a notebook) held ~650 threads before, and every new group is a rendezvous of all
# ranks. Every rank makes the same calls in the same order (torch.distributed's rule for new_group), so every
# rank hits or misses the cache together. Keyed by the default group object itself: after
# destroy_process_group and a new init the old groups are never handed out.
_GROUPS: dict = {}


def _cached(key, make):
    world = dist.group.WORLD
    hit = _GROUPS.get(key)
    if hit is not None and hit[0] is world:
        return hit[1]
    value = make()
    _GROUPS[key] = (world, value)
    return value


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)``, made once per process (see ``_GROUPS``)."""
    from torch.distributed.device_mesh import init_device_mesh

    return _cached(("mesh", device_type, tuple(shape), tuple(names)),
                   lambda: init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names)))


def process_group(ranks: list[int] | None = None, backend: str | None = None, tag: str = ""):
    """``dist.new_group(ranks, backend=backend)``, made once per process for the same (ranks, backend, tag);
    ``tag`` tells apart groups of the same ranks that must not share a communicator (the pipeline's
    two directions of a pair of ranks)."""
    key = ("group", tuple(ranks) if ranks is not None else None, backend, tag)
    return _cached(key, lambda: dist.new_group(ranks, backend=backend) if backend else dist.new_group(ranks))


def splits_world() -> bool:
    """Whether new process groups are split from the world's communicator (``dist.split_group``: one NCCL
    ``ncclCommSplit`` makes every group of a partition at once, no store rendezvous): on NCCL alone, with the
    default group bound to a device (:func:`init_distributed` binds it), whose communicator then exists already.
    Otherwise torch cannot split, and every group is a ``new_group`` that every rank of the world calls; a bound
    NCCL group also turns each of those into a world-wide split for the ranks outside it."""
    if not (dist.is_initialized() and hasattr(dist, "split_group")) or dist.get_backend() != "nccl":
        return False
    return getattr(dist.group.WORLD, "bound_device_id", None) is not None


def subgroups(partition: list[tuple[int, ...]], tag: str):
    """One kind of process group: the groups of ``partition`` (disjoint lists of global ranks; ranks of no group
    get None), this rank's group returned, made once per process for the same (partition, tag) (see ``_GROUPS``).
    Every rank of the world calls it with the same arguments in the same order (torch.distributed's rule).

    Split from the world's communicator where it can be (:func:`splits_world`): one world-wide call makes the
    whole kind, so the calls per rank grow with the kinds of groups, not with their number. Otherwise each group
    is a ``new_group`` every rank calls (``new_subgroups_by_enumeration`` loops over them): for a rank outside
    the group only a name is taken, no store access and no communicator (unless ``TORCH_DIST_INIT_BARRIER=1``).
    Not ``use_local_synchronization=True``, which would spare the ranks outside a group even that call: torch
    (2.13 and before) names such a group by a hash salted with how many groups the *calling* rank belongs to,
    and the pipeline's groups leave ranks with different counts (a tied weight's group holds the first and last
    pipeline ranks only), so two members would pick different store prefixes and wait for each other forever.

    ``tag`` tells apart kinds of the same rank sets that must not share a communicator (the pipeline's two
    directions between two ranks)."""
    parts = [tuple(sorted(g)) for g in partition]
    if len({r for g in parts for r in g}) != sum(len(g) for g in parts):
        raise ValueError(f"subgroups {tag!r}: a rank is in two groups of one kind: {parts}")

    def make():
        if splits_world():
            return dist.split_group(split_ranks=[list(g) for g in parts], group_desc=tag)
        mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in parts])
        return mine

    return _cached(("subgroups", tag, tuple(parts)), make)


def uses_nccl(backend: str) -> bool:
    """Whether a process-group backend string runs CUDA tensors over NCCL: ``"nccl"``, or a per-device
    map such as ``"cpu:gloo,cuda:nccl"`` (what ``dist.get_backend()`` returns for one)."""
    parts = [p.strip() for p in backend.lower().split(",")]
    return any(p == "nccl" or p == "cuda:nccl" for p in parts)


def _local_cuda_index(rank: int) -> int:
    """This process's GPU: ``LOCAL_RANK`` (torchrun sets it), else the rank modulo the GPUs here."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return rank % max(1, torch.cuda.device_count())


def rank_device() -> torch.device:
    """The device this rank's programs run on, for an initialised default group. On NCCL it is also
    made the current CUDA device: a user who called ``init_process_group`` without ``set_device``
    would otherwise put every rank's tensors (and NCCL's communicators) on GPU 0."""
    backend = dist.get_backend()
    if backend == "fake":  # a simulated rank (torch's fake process group, runtime/sim.py): shapes, no memory
        return torch.device("meta")
    if not uses_nccl(backend):
        return torch.device("cpu")
    index = _local_cuda_index(dist.get_rank())
    if torch.cuda.current_device() != index:
        torch.cuda.set_device(index)
    return torch.device("cuda", index)


def shutdown_distributed() -> None:
    """Leave torch.distributed cleanly: wait for every rank, then destroy all process groups.

    Call it after the objects that hold process groups (a ParallelModule, its communicator) are
    gone: a gloo group destroyed during interpreter finalisation, with a worker thread still
    joinable, aborts the process ("terminate called without an active exception").
    """
    if not dist.is_initialized():
        return
    from mcompile.runtime import watchdog

    watchdog.stop()  # its thread polls the store, which the first rank to leave takes with it
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def _resolve(ref: tuple[str, str]):
    module, qualname = ref
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _ref(fn) -> tuple[str, str]:
    return fn.__module__, fn.__qualname__


def _spawn_entry(rank, world, port, fn_ref, args, paths, results):
    sys.path[:0] = [p for p in paths if p not in sys.path]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=DEFAULT_TIMEOUT)
    try:
        results[rank] = _resolve(fn_ref)(rank, world, *args)
    finally:
        shutdown_distributed()


def spawn(fn, nprocs: int, *args) -> list:
    """Run module-level ``fn(rank, world, *args)`` on ``nprocs`` gloo CPU processes."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_spawn_entry, args=(nprocs, free_port(), _ref(fn), args, list(sys.path), results),
                           nprocs=nprocs, join=True, start_method="spawn")
        return [results[r] for r in range(nprocs)]


def _worker(rank, world, port, paths, tasks, results, safepath=None):
    sys.path[:0] = [p for p in paths if p not in sys.path]
    # the parent's PYTHONSAFEPATH, not the one its forkserver started with (WorkerPool): the processes a task starts
    # (`python script.py`) get their script's folder on their path as the parent's would
    if safepath is None:
        os.environ.pop("PYTHONSAFEPATH", None)
    else:
        os.environ["PYTHONSAFEPATH"] = safepath
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=DEFAULT_TIMEOUT)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn_ref, args = task
        try:
            results.put((rank, True, _resolve(fn_ref)(rank, world, *args)))
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            results.put((rank, False, traceback.format_exc()))
    shutdown_distributed()


class WorkerPool:
    """N live gloo worker processes running one function at a time on all ranks."""

    def __init__(self, nprocs: int, start_method: str = "spawn", preload: tuple[str, ...] = ()):
        """``start_method="forkserver"`` with ``preload`` (module names): the workers fork from one server process
        that imported those modules once, instead of each importing them (``spawn``); the server is started on the
        first such pool of this process and serves every later one (Python's multiprocessing forkserver; it runs
        no torch op before forking, so no thread pool is copied)."""
        self.nprocs = nprocs
        ctx = mp.get_context(start_method)
        if start_method == "forkserver" and preload:
            ctx.set_forkserver_preload(list(preload))
        self.tasks = [ctx.Queue() for _ in range(nprocs)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, nprocs, port, list(sys.path), self.tasks[r], self.results,
                                              os.environ.get("PYTHONSAFEPATH")), daemon=True)
            for r in range(nprocs)
        ]
        # Python < 3.13's forkserver ignores the parent's sys.path: it starts as `python -c`, the working directory
        # first on its path, where a folder named like an installed package (this repository's kernels/, the Hub's
        # `kernels` that transformers imports) shadows it in every preloaded import; PYTHONSAFEPATH leaves it off
        # (the workers then take the parent's path, :func:`_worker`)
        saved = os.environ.get("PYTHONSAFEPATH")
        os.environ["PYTHONSAFEPATH"] = "1"
        try:
            for p in self.procs:
                p.start()
        finally:
            if saved is None:
                del os.environ["PYTHONSAFEPATH"]
            else:
                os.environ["PYTHONSAFEPATH"] = saved

    def run(self, fn, *args, timeout: float = 300) -> list[Any]:
        """``fn(rank, world, *args)`` on every worker; results in rank order; raises on any failure."""
        for q in self.tasks:
            q.put((_ref(fn), args))
        out: list = [None] * self.nprocs
        errors = []
        for _ in range(self.nprocs):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except Exception as e:  # queue.Empty: a rank hung
                self.close()
                raise TimeoutError(f"a worker did not answer within {timeout} s (deadlock?)") from e
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            self.close()
            raise RuntimeError("worker failure\n" + "\n".join(errors))
        return out

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
