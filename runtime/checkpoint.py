"""Checkpoints of a ParallelModule that load under any other layout (DESIGN §6).

``pm.save_checkpoint(path, opt)`` under one plan, ``pm.load_checkpoint(path, opt)`` under any other:
another mesh (tp, pp, dp sizes), sequence parallelism on or off, another ZeRO level (0/1/2/3), bf16
or fp32 parameters. The files are torch.distributed.checkpoint's (DCP); what goes into them is
layout-independent:

- every tensor is keyed by the original model's names and stored in its global, unpadded shape:
  ``model.<fqn>`` (a parameter, fp32: under bf16 ZeRO its fp32 master), ``buffers.<fqn>``
  (persistent buffers), ``optim.state.<fqn>.<name>`` (``exp_avg``, ``exp_avg_sq``, ...: any state
  tensor of the parameter's shape), ``optim.state.<fqn>.step`` (a scalar, written once),
  ``optim.groups.<fqn>`` (the options of the parameter's group: lr, betas, weight_decay, ...);
- **each rank writes only what it holds**, as boxes of the global tensor: a rank's piece of a
  parameter is the product, over dims, of runs of consecutive global indices (one run for a plain
  ``Shard`` dim, one per block for a ``BlockShard`` one, nothing for vocabulary padding; ZeRO-3 cuts
  dim 0 of the tensor-parallel piece). Under ZeRO-1/2 the optimizer state is a flat segment
  ``[a, b)`` of the flattened local piece; a flat range of a row-major array is a union of at most
  ``2 * ndim - 1`` boxes that are contiguous in memory (a partial first row, whole rows, a partial
  last row, recursively), so every segment is written as boxes too, **without any communication**
  (no dp all-gather). Replicas (over dp, tp for replicated tensors) declare the same boxes and DCP
  keeps one writer per box; a weight tied across pipeline stages is written by its owner stage;
- loading: every rank asks DCP for exactly the boxes of what it holds in its own layout, and DCP
  reads the overlap of each with the saved boxes (its resharding load). Pieces are read into the
  live tensors (parameters, optimizer state created first by one zero-gradient step at lr 0),
  under ZeRO-1/2 into an fp32 copy of each local piece, then cast into the parameter buffer and the
  fp32 masters (a transient fp32 copy of this rank's parameters).

The glue with DCP is a small checkpointable (``_Pieces``: ``__create_write_items__``,
``__create_chunk_list__``) and planners that look its boxes up by offset.

Before anything is loaded, on every rank, with the same error on all of them (failures gathered
with ``all_gather_object``): the folder must be a complete checkpoint (``mcompile_plan.json``
present, DCP metadata readable, every data file present and long enough); every parameter and
buffer of this model must be there in its shape (the first mismatch is named), and nothing else;
the optimizer must be of the class saved, keep the same state names, and group parameters whose
saved options agree. Nothing is written to the model or the optimizer's values before these pass
(the optimizer's state may be created). An I/O error *during* the read (after the checks) can leave
the model partly loaded.

Saving writes into a temporary folder beside ``path``; when every rank has finished, rank 0 writes
``mcompile_plan.json`` into it and renames it to ``path`` (an older checkpoint at ``path`` is moved
away first and deleted after): **a folder with its ``mcompile_plan.json`` is a complete checkpoint**
(:func:`is_complete`). ``async_save=True`` copies this rank's pieces to CPU memory (the training's
stall: one copy of what the rank writes, into buffers kept from the previous async save of the same
layout; pinned where the pieces are on a GPU), and a background thread does the rest (naming the
folder, ``dcp.save``, the meta file and the rename) over a gloo group of its own; the returned
:class:`PendingSave` is done when the checkpoint is complete; the next save or load waits for it.

Speed (``bench/checkpoint_io.py``): DCP's writer is given views with storages of their own size (it
would clone every ZeRO box) and writes without torch.save's CRC32 (nothing reads it back, and it
runs slower than a fast disk); the reader reads each saved box straight into the tensor it loads
(DCP's own path loads it with ``torch.load`` into fresh memory and copies it over), the metadata once.

FP8 delayed scaling's amax histories are per rank and per shard (a tp rank's amaxes of its own
shard, a dp rank's of its data slice): they cannot be resharded. They are saved per rank and loaded
only under the same plan; under another layout loading refuses with a clear message unless
``fp8_state=False`` (histories start empty: the next step scales as a first step does).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import math
import os
import pickle
import shutil
import sys
import threading
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

__all__ = ["save", "load", "verify", "is_complete", "CheckpointError", "CheckpointPlanMismatch", "PendingSave",
           "plan_digest"]

META = "mcompile_plan.json"
FORMAT = 2  # 1: the first format (per-plan DTensors, ZeRO shards per rank), read by weights= only


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded into this model (raised on every rank, before anything is loaded)."""


class CheckpointPlanMismatch(CheckpointError):
    """State that cannot be resharded (FP8 amax histories) was saved under another layout / setting."""


def plan_digest(plan) -> str:
    layout = {"mesh": plan.mesh, "params": {k: [repr(p) for p in v.placements] + [list(v.padded_shape or v.shape)]
                                            for k, v in plan.params.items()}}
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()


# -- a rank's pieces as boxes of the global tensor ---------------------------------------------------
def _runs(pm, fqn: str) -> list[list[tuple[int, int, int]]]:
    """Per dim of ``fqn``: the runs ``(local start, global start, length)`` of consecutive global
    indices in this rank's local piece as held (padding left out). Each dim is computed alone from an
    index vector put through the same cuts as the tensor (:meth:`ParamPlan.local_piece`'s
    ``shard_tensor``, ZeRO-3's dim-0 chunk): every cut acts on one dim only."""
    from mcompile.ir.placements import Partial, is_shard, shard_tensor

    pp = pm.plan.params[fqn]
    nd = len(pp.shape)
    out = []
    for d in range(nd):
        v = torch.arange(1, pp.shape[d] + 1).view([1] * d + [-1] + [1] * (nd - d - 1))  # 0 marks padding
        for ax, p in zip(pm.mesh.axis_names, pp.placements):
            if isinstance(p, Partial):
                raise NotImplementedError(f"checkpoint: {fqn} is a Partial parameter")
            if is_shard(p) and p.dim % nd == d:
                padded = pp.padded_shape[d] if pp.padded_shape else None
                v = shard_tensor(v, p, pm._coords[ax], pm.mesh.size(ax), padded)
        if d == 0 and fqn in pm._zero3:
            v = v.chunk(pm.mesh.size("dp"), dim=0)[pm._coords["dp"]]
        out.append(_index_runs(v.reshape(-1) - 1))
    return out


def _index_runs(g: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(local start, global start, length)`` of the runs of ``g`` (1-D: the global index held at each local
    index, < 0 for padding) along which both indices go up by one; padding is left out."""
    local = torch.nonzero(g >= 0).reshape(-1)
    glob = g[local]
    start = torch.ones(len(local), dtype=torch.bool)  # a run starts where either index is not the previous + 1
    start[1:] = (local[1:] != local[:-1] + 1) | (glob[1:] != glob[:-1] + 1)
    first = torch.nonzero(start).reshape(-1)
    length = torch.diff(first, append=torch.tensor([len(local)]))
    return list(zip(local[first].tolist(), glob[first].tolist(), length.tolist()))


def _flat_boxes(a: int, b: int, shape) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flat range ``[a, b)`` of a row-major array of ``shape`` as boxes ``(starts, sizes)``, each
    contiguous in memory: a partial first row, whole rows, a partial last row (recursively)."""
    if a >= b:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)
    out = []
    if r0:  # the rest of row i0
        end = min(b, (i0 + 1) * inner)
        out += [((i0, *s), (1, *z)) for s, z in _flat_boxes(r0, end - i0 * inner, rest)]
        i0 += 1
        if end == b:
            return out
    if i1 > i0:
        out.append(((i0,) + (0,) * len(rest), (i1 - i0, *rest)))
    if r1:
        out += [((i1, *s), (1, *z)) for s, z in _flat_boxes(0, r1, rest)]
    return out


def _pieces(runs, local_shape, flat: torch.Tensor, a: int, b: int) -> list[tuple[tuple, tuple, torch.Tensor]]:
    """``(global offsets, sizes, view)`` of the elements ``[a, b)`` of the flattened local piece,
    held in ``flat`` (1-D, ``flat[0]`` is element ``a``)."""
    stride = [math.prod(local_shape[d + 1:]) for d in range(len(local_shape))]
    out = []
    for starts, sizes in _flat_boxes(a, b, tuple(local_shape)):
        off = sum(s * st for s, st in zip(starts, stride)) - a
        view = flat[off:off + math.prod(sizes)].view(sizes)
        per_dim = []
        for d, (s, z) in enumerate(zip(starts, sizes)):
            hits = []
            for ls, gs, n in runs[d]:
                lo, hi = max(s, ls), min(s + z, ls + n)
                if lo < hi:
                    hits.append((lo - s, gs + lo - ls, hi - lo))
            per_dim.append(hits)
        for combo in itertools.product(*per_dim):
            index = tuple(slice(r, r + n) for r, _, n in combo)
            out.append((tuple(g for _, g, _ in combo), tuple(n for *_, n in combo), view[index]))
    return out


class _Pieces:
    """A tensor of global ``size`` of which this rank holds ``boxes`` (offsets, sizes, view): DCP's
    checkpointable protocol (write items and chunks per box); the planners below find a box's view
    by its offsets."""

    def __init__(self, size, boxes=()):
        self._size = torch.Size(size)
        self.boxes: dict[tuple, tuple[tuple, torch.Tensor]] = {}
        for off, sizes, view in boxes:
            self.add(off, sizes, view)

    def add(self, off, sizes, view) -> None:
        self.boxes[tuple(off)] = (tuple(sizes), view)

    def size(self) -> torch.Size:
        return self._size

    def __create_write_items__(self, fqn, obj):
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(sizes)),
                                                      properties=TensorProperties(dtype=view.dtype), size=self._size))
                for off, (sizes, view) in self.boxes.items()]

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(torch.Size(off), torch.Size(sizes)) for off, (sizes, _) in self.boxes.items()]

    def shard(self, offsets) -> torch.Tensor:
        return self.boxes[tuple(offsets)][1]

    def layout(self) -> tuple:
        return self._size, tuple((off, sizes, view.dtype) for off, (sizes, view) in self.boxes.items())


class _SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index):
        obj = self.state_dict[index.fqn]
        return _exact(obj.shard(index.offset)) if isinstance(obj, _Pieces) else super().lookup_object(index)


def _exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, over a storage of exactly its bytes where it is a contiguous CPU view into a larger one
    (a box of a ZeRO flat buffer): DCP's writer clones such a view (so that torch.save does not write the
    whole storage), a fresh copy of every byte the rank writes."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() == t.nbytes:
        return t
    start = t.storage_offset() * t.element_size()
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()[start:start + t.nbytes], 0, t.shape, t.stride())


@contextlib.contextmanager
def _no_crc32():
    """``torch.save`` without the CRC32 of its records, restored after. Each saved box is a torch.save record;
    ``torch.load`` never checks the CRC (DCP's reader and ours read through it or past it), and computing it
    runs at about 1.3 GB/s on one core: slower than a fast disk. torch (2.13) keeps the setting per thread,
    so this is the writing thread's alone; where a torch keeps it per process, a ``torch.save`` of the
    user's own during a checkpoint write (an async one: in the background) writes no CRC either."""
    saved = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(saved)


class _Writer(FileSystemWriter):
    """DCP's file writer (one file per rank, fsynced) writing without torch.save's CRC32 (:func:`_no_crc32`)."""

    def write_data(self, plan, planner):
        with _no_crc32():
            return super().write_data(plan, planner)


class _Window(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of an open file as a file of their own (one saved record), its
    first and last ``EDGE`` bytes read once: a record's zip directory is at its end, its pickle and small
    entries at its start, the tensor's bytes between (never read through this)."""

    EDGE = 1 << 12

    def __init__(self, file, offset: int, length: int):
        self._fd, self._start, self._length, self._pos = file.fileno(), offset, length, 0
        if length <= 2 * self.EDGE:
            self._head, self._tail = self._pread(0, length), b""
        else:
            self._head, self._tail = self._pread(0, self.EDGE), self._pread(length - self.EDGE, self.EDGE)

    def _pread(self, at: int, n: int) -> bytes:
        return os.pread(self._fd, n, self._start + at)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._length + pos
        return self._pos

    def readinto(self, b) -> int:
        lo = self._pos
        n = max(0, min(len(b), self._length - lo))
        tail_at = self._length - len(self._tail)
        if lo + n <= len(self._head):
            chunk = self._head[lo:lo + n]
        elif self._tail and lo >= tail_at:
            chunk = self._tail[lo - tail_at:lo - tail_at + n]
        else:
            chunk = self._pread(lo, n)
        memoryview(b)[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


class _Header(tuple):
    """``(dtype, storage key, storage numel, storage offset, size, stride)`` of a saved tensor."""


def _saved_tensor(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    dtype, key, numel = storage
    return _Header((dtype, key, numel, storage_offset, tuple(size), tuple(stride)))


class _TensorHeader(pickle.Unpickler):
    """The pickle of one tensor saved by ``torch.save`` (its record's ``data.pkl``) read for its header alone:
    ``(dtype, storage key, storage numel, storage offset, size, stride)``, no tensor made, no data read.
    Only what torch.save writes for a plain tensor is accepted (the weights-only unpickler's rule: no
    other class can be named); anything else raises, and DCP's own path reads that record."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _saved_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return torch.serialization.StorageType(name)
        raise pickle.UnpicklingError(f"{module}.{name} in a tensor record")

    def load(self) -> _Header:
        out = super().load()
        if not isinstance(out, _Header):
            raise pickle.UnpicklingError(f"a {type(out).__name__} record, not a tensor")
        return out

    def persistent_load(self, pid):
        kind, storage_type, key, _location, numel = pid
        if kind != "storage" or not isinstance(storage_type, torch.serialization.StorageType):
            raise pickle.UnpicklingError(f"persistent id {pid!r} in a tensor record")
        return storage_type.dtype, key, numel


class _Reader(FileSystemReader):
    """DCP's file reader, with the checkpoint's metadata read once (``metadata``, already read by the
    checks) and each saved box read from the file straight into the tensor it loads into wherever that
    is a contiguous CPU tensor of the saved dtype and the part read is contiguous in the saved box:
    DCP's own path loads the whole box with ``torch.load`` into fresh memory and copies it over (two
    more passes over every byte). Everything else takes DCP's path."""

    def __init__(self, path, metadata=None):
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None or kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        from torch.distributed.checkpoint.metadata import StorageMeta

        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        rest = []
        for relative_path, reqs in per_file.items():
            with open(self.fs.concat_path(self.path, relative_path), "rb", buffering=0) as f:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):  # one pass
                    if not self._read_into(f, req, planner):
                        rest.append(req)
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_into(self, f, req, planner) -> bool:
        """Read ``req`` from ``f`` into its tensor; False (nothing read) where DCP's path must do it."""
        info = self.storage_data[req.storage_index]
        if req.type == LoadItemType.BYTE_IO or info.transform_descriptors or sys.byteorder != "little":
            return False
        target = planner.resolve_tensor(req).detach()
        if target.device.type != "cpu" or not target.is_contiguous():
            return False
        try:
            zf = torch._C.PyTorchFileReader(_Window(f, info.offset, info.length))
            if zf.get_record("byteorder") != b"little":
                return False
            dtype, key, numel, offset, size, stride = _TensorHeader(io.BytesIO(zf.get_record("data.pkl"))).load()
            at = zf.get_record_offset(f"data/{key}")
        except Exception:  # noqa: BLE001 - any record this does not understand: DCP's path reads it
            return False
        if dtype != target.dtype or not isinstance(at, int):
            return False
        part = torch.empty_strided(size, stride, dtype=dtype, device="meta")  # no memory: the saved layout
        if math.prod(size) and offset + sum((n - 1) * st for n, st in zip(size, stride)) >= numel:
            return False  # it would reach past its storage: not a record this understands
        for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
            part = part.narrow(d, o, n)
        if part.shape != target.shape or not part.is_contiguous():
            return False
        part_offset = offset + sum(o * st for o, st in zip(req.storage_offsets, stride))
        pos = info.offset + at + part_offset * part.element_size()
        if target.nbytes:
            view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
            done = 0
            while done < len(view):
                got = os.preadv(f.fileno(), [view[done:]], pos + done)
                if got <= 0:
                    raise OSError(f"{f.name}: the data of {req.storage_index.fqn} ends early")
                done += got
        planner.commit_tensor(req, target)
        return True


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # the default one first maps the state through a traversal that knows only tensors (and returns
        # None for any other object, a _Pieces too); nothing here is on the meta device, nothing to map
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index):
        obj = self.state_dict[index.fqn]
        return obj.shard(index.offset) if isinstance(obj, _Pieces) else super().lookup_tensor(index)


def _cpu_like(t: torch.Tensor) -> torch.Tensor:
    """Empty CPU memory for a copy of ``t``: pinned where ``t`` is on a GPU (its copy runs at the link's speed)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")


def _stage(pm, state: dict) -> dict:
    """This rank's state for an async save, its tensors copied into CPU memory of their own (training goes on
    changing the live ones while the background thread writes). The copies are kept on ``pm`` for the next
    async save, which copies into them if it saves the same boxes (the same layout and optimizer): a fresh
    allocation of that size costs more than the copy (its pages are touched for the first time; pinned
    memory is slow to allocate), and that cost is the training stall. Memory: one copy of what this rank
    writes, held from the first async save on."""
    kept = getattr(pm, "_checkpoint_staging", None) or {}
    staged = {}
    for key, v in state.items():
        old = kept.get(key)
        if isinstance(v, _Pieces):
            if not (isinstance(old, _Pieces) and old.layout() == v.layout()):
                old = _Pieces(v.size(), [(off, sizes, _cpu_like(view)) for off, (sizes, view) in v.boxes.items()])
            for off, (_, view) in v.boxes.items():
                old.shard(off).copy_(view.detach(), non_blocking=True)
            staged[key] = old
        elif isinstance(v, torch.Tensor):
            if not (isinstance(old, torch.Tensor) and old.shape == v.shape and old.dtype == v.dtype):
                old = _cpu_like(v)
            staged[key] = old.copy_(v.detach(), non_blocking=True)
        else:
            staged[key] = v
    if any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in state.values()) or any(
            isinstance(v, _Pieces) and any(view.device.type == "cuda" for _, view in v.boxes.values())
            for v in state.values()):
        torch.cuda.synchronize()  # the non-blocking copies have landed before the writer reads them
    pm._checkpoint_staging = staged
    return staged


# -- what the optimizer holds, per parameter -----------------------------------------------------------
def _sharded(optimizer) -> bool:
    from mcompile.runtime.zero import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer) and optimizer.sharded


def _inner(optimizer) -> torch.optim.Optimizer:
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer


def _entries(pm, optimizer) -> list[tuple[str, torch.Tensor, int, int]]:
    """``(fqn, optimizer parameter, a, b)``: the optimizer's parameter holds elements ``[a, b)`` of the
    flattened local piece of ``fqn`` (ZeRO-1/2: a segment of the master shard; else the whole piece)."""
    if _sharded(optimizer):
        return [(seg.fqn, master, seg.start - seg.offset, seg.stop - seg.offset)
                for seg, _, master in pm._zero.segments]
    names = {id(p): f for f, p in pm._params.items()}
    out = []
    for g in _inner(optimizer).param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise CheckpointError("checkpoint: the optimizer holds a tensor that is not a parameter of this "
                                      "ParallelModule: create it over pm.parameters() (or use DistributedOptimizer)")
            out.append((names[id(p)], p, 0, p.numel() if not isinstance(p, DTensor) else p.to_local().numel()))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _elementwise(v, p) -> bool:
    """A state tensor with one value per element of its parameter (``exp_avg``), not a scalar (``step``)."""
    return isinstance(v, torch.Tensor) and v.ndim > 0 and tuple(v.shape) == tuple(p.shape)


def _group_of(optimizer) -> dict[int, dict]:
    return {id(p): g for g in _inner(optimizer).param_groups for p in g["params"]}


def _options(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _writes(pm, fqn: str) -> bool:
    """Whether this rank writes ``fqn`` (a weight tied across pipeline stages: its owner stage only)."""
    return pm._pipe is None or pm._pipe.owner[fqn] == pm._pipe.pp_rank


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = _local(t).detach()
    if not t.is_contiguous():
        raise NotImplementedError("checkpoint: a non-contiguous local piece")
    return t.view(-1)


def _state(pm, optimizer, *, load: bool) -> tuple[dict, dict]:
    """The DCP state dict of this rank (key -> _Pieces, tensor or object) and, when loading, the fp32
    copies of ZeRO-1/2 parameters to cast into the buffers afterwards (fqn -> tensor)."""
    state: dict = {}
    copies: dict[str, torch.Tensor] = {}
    runs: dict[str, list] = pm.__dict__.setdefault("_checkpoint_runs", {})

    def pieces(key, fqn, flat, a, b, local_shape):
        if fqn not in runs:  # the plan's, fixed for the module's life
            runs[fqn] = _runs(pm, fqn)
        obj = state.setdefault(key, _Pieces(pm.plan.params[fqn].shape))
        for off, sizes, view in _pieces(runs[fqn], local_shape, flat, a, b):
            obj.add(off, sizes, view)

    zero = pm._zero
    in_buckets = set(zero.fqn_order) if zero is not None else set()
    shapes = {f: tuple(p.to_local().shape) for f, p in pm._params.items()}
    for fqn, p in pm._params.items():
        if fqn in in_buckets:
            continue  # below: from the fp32 master segments
        if load or _writes(pm, fqn):
            pieces(f"model.{fqn}", fqn, _flat(p), 0, math.prod(shapes[fqn]), shapes[fqn])
    if zero is not None:
        if load:  # every parameter's whole piece: read into the buffer where it is fp32 (it is the master then),
            # else into an fp32 copy cast into the buffer and the masters afterwards (every element is read)
            for fqn in zero.fqn_order:
                into = pm._params[fqn].to_local()
                if into.dtype != torch.float32:
                    into = copies[fqn] = torch.empty(shapes[fqn], dtype=torch.float32, device=pm._device)
                pieces(f"model.{fqn}", fqn, _flat(into), 0, into.numel(), shapes[fqn])
        else:  # the masters (fp32), each rank its own segments
            for seg, b, _ in zero.segments:
                if _writes(pm, seg.fqn):
                    master = b.master[seg.start - b.lo:seg.stop - b.lo]
                    pieces(f"model.{seg.fqn}", seg.fqn, master, seg.start - seg.offset, seg.stop - seg.offset,
                           shapes[seg.fqn])
    for fqn in pm._persistent_buffers:
        state[f"buffers.{fqn}"] = pm._extra[pm._buffer_ph[fqn]]
    if optimizer is None:
        return state, copies
    inner, groups = _inner(optimizer), _group_of(optimizer)
    for fqn, p, a, b in _entries(pm, optimizer):
        if not fqn or not (load or _writes(pm, fqn)):
            continue
        for name, v in inner.state.get(p, {}).items():
            key = f"optim.state.{fqn}.{name}"
            if _elementwise(v, p):
                pieces(key, fqn, _flat(v), a, b, shapes[fqn])
            elif key not in state:  # a scalar: once (the same in every segment of the parameter)
                state[key] = _local(v) if isinstance(v, torch.Tensor) else v
        if not load:
            state[f"optim.groups.{fqn}"] = _options(groups[id(p)])
    return state, copies


# -- saving -------------------------------------------------------------------------------------------
def _delayed_len(pm) -> int | None:
    """The model's amax history length under ``fp8="delayed"``, else None (no FP8 state)."""
    return pm.config.fp8_amax_history_len if pm.config.fp8 == "delayed" else None


def _fp8_meta(pm, names: list, group=None) -> dict:
    """What the checkpoint says of FP8 state: the recipe and, for delayed scaling, the history length
    and the linears (program nodes) whose histories each rank saved (``names``: this rank's, sorted).
    Collective over ``group``."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names, group=group)
    out = {"recipe": pm.config.fp8}
    if _delayed_len(pm) is not None:
        out.update(amax_history_len=_delayed_len(pm), histories={str(r): n for r, n in enumerate(everyone)})
    return out


def _fp8_key(name: str) -> str:
    return f"fp8.rank{dist.get_rank()}.{name}"  # this rank's own: DCP keeps one of equal keys


class PendingSave:
    """An ``async_save`` in flight: :meth:`wait` (or ``result()``) returns the path when the checkpoint is
    complete there (raises what the write raised). The next ``save_checkpoint`` / ``load_checkpoint``
    waits for it; wait for the last one before the program ends (the writer is a daemon thread)."""

    def __init__(self, path: Path):
        self.path = path
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self.path

    result = wait  # as a concurrent.futures.Future


def wait_pending(pm) -> None:
    pending = getattr(pm, "_pending_save", None)
    if pending is not None:
        pm._pending_save = None
        pending.wait()


def _finish(tmp: Path, path: Path, meta: dict, group) -> None:
    """Every rank has written: rank 0 writes the meta file (the mark of a complete checkpoint) and puts
    the folder at ``path``. Collective over ``group``."""
    dist.barrier(group=group)
    if dist.get_rank() == 0:
        (tmp / META).write_text(json.dumps(meta))
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            path.rename(old)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old)
    dist.barrier(group=group)


def save(pm, path: str | Path, optimizer=None, extra: dict | None = None, async_save: bool = False
         ) -> PendingSave | None:
    wait_pending(pm)
    path = Path(path)
    state, _ = _state(pm, optimizer, load=False)
    histories = pm.fp8_histories()
    for name, h in histories.items():
        state[_fp8_key(name)] = h
    inner = _inner(optimizer) if optimizer is not None else None
    meta = {"format": FORMAT, "digest": plan_digest(pm.plan), "mesh": pm.plan.mesh,
            "sequence_parallel": pm.plan.options.sequence_parallel, "zero": pm.config.zero,
            "dtype": str(pm.config.dtype), "extra": extra or {}, "dropout_step": pm.dropout_step,
            "optimizer": type(inner).__name__ if inner is not None else None}
    if getattr(pm, "loss_scaler", None) is not None:  # fp16: the dynamic loss scale and its counters (exact)
        meta["loss_scaler"] = pm.loss_scaler.state_dict()
    if not async_save:
        _write(pm, state, path, meta, sorted(histories), None)
        return None
    if getattr(pm, "_checkpoint_group", None) is None:
        from mcompile.runtime.launch import process_group

        # The background thread's collectives need a group of their own: the training's collectives run on
        # the main thread meanwhile, and two threads' collectives on one gloo group would pair up wrongly.
        # It spans the world, as the synchronous save's do: every rank holds pieces no other rank holds
        # (ZeRO segments, tensor-parallel shards; replicas are spread over their holders by DCP's dedup so
        # that all ranks write), and DCP's save is one collective of every writer: the coordinator gathers
        # every plan (checks that the boxes cover each tensor once), then every rank's write results for the
        # metadata; a rank left out would leave its boxes unwritten. One per process, made on the first
        # async save (DESIGN: docs/architecture.md, "Checkpoints that reshard").
        pm._checkpoint_group = process_group(backend="gloo", tag="async checkpoint")
    group = pm._checkpoint_group
    staged = _stage(pm, state)  # the training stall: the rest runs in the background
    pending = PendingSave(path)

    def write():
        try:
            _write(pm, staged, path, meta, sorted(histories), group)
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            pending._error = e

    pending._thread = threading.Thread(target=write, name=f"mcompile-save-{path.name}", daemon=True)
    pending._thread.start()
    pm._pending_save = pending
    return pending


def _write(pm, state: dict, path: Path, meta: dict, fp8_names: list, group) -> None:
    """Write ``state`` as the checkpoint ``path``: rank 0 names a temporary folder beside it, DCP writes every
    rank's pieces there, then :func:`_finish`. Collective over ``group`` (None: the world's default group)."""
    tmp = [str(path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"))]
    dist.broadcast_object_list(tmp, src=0, group=group)
    meta = dict(meta, fp8=_fp8_meta(pm, fp8_names, group))
    dcp.save(state, storage_writer=_Writer(tmp[0]), planner=_SavePlanner(), process_group=group)
    _finish(Path(tmp[0]), path, meta, group)


# -- checks -------------------------------------------------------------------------------------------
def _read_meta(path: Path) -> tuple[dict, object]:
    """The meta file and the DCP metadata of a complete checkpoint, else CheckpointError."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not (path / META).is_file():
        raise CheckpointError(f"{path} is not a complete mcompile checkpoint: it has no {META} (a save that did "
                              "not finish, or another kind of folder); load the last complete checkpoint")
    try:
        meta = json.loads((path / META).read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: {META} is not readable JSON ({e}): the checkpoint is corrupt") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} was saved by an older mcompile (checkpoint format {meta.get('format', 1)}, this one reads "
            f"{FORMAT}): its model weights still load with parallelize(..., weights='{path}'); its optimizer "
            "state does not")
    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - named
        raise CheckpointError(f"{path}: the torch.distributed.checkpoint metadata (.metadata) cannot be read "
                              f"({type(e).__name__}: {e}): the checkpoint is incomplete or corrupt") from e
    short = short_data(path, md)
    if short:
        raise CheckpointError(f"{path}: {short}: the checkpoint is incomplete or corrupt; load the last complete one")
    return meta, md


def short_data(path: Path, md, keys=None) -> str | None:
    """What is wrong with the first data file of DCP metadata ``md`` (of the tensors ``keys``; all if None)
    that is missing or shorter than the metadata says, or None."""
    sizes: dict[str, int] = {}  # a file holds many records: one stat each
    for idx, info in md.storage_data.items():
        if keys is not None and idx.fqn not in keys:
            continue
        if info.relative_path not in sizes:
            file = path / info.relative_path
            sizes[info.relative_path] = file.stat().st_size if file.is_file() else -1
        size = sizes[info.relative_path]
        if size < info.offset + info.length:
            return (f"the data of {idx.fqn} lies in {info.relative_path}, which is "
                    f"{'missing' if size < 0 else f'too short ({size} bytes)'}")
    return None


def verify(path: str | Path) -> dict:
    """Check that ``path`` is a complete mcompile checkpoint (meta file, DCP metadata, every data file
    present and long enough) without reading any value; returns its meta (``["extra"]``: what was
    saved with it). Raises :class:`CheckpointError`. Needs no process group."""
    return _read_meta(Path(path))[0]


def is_complete(path: str | Path) -> bool:
    """Whether ``path`` is a complete checkpoint (:func:`verify` passes)."""
    try:
        verify(path)
        return True
    except CheckpointError:
        return False


def _fp8_mismatch(pm, path, meta: dict) -> str | None:
    saved = meta.get("fp8") or {"recipe": None}
    cfg = lambda n: f"Config(fp8='delayed', fp8_amax_history_len={n})"  # noqa: E731
    skip = "or pass load_checkpoint(..., fp8_state=False) to load everything else and start this model's " \
           "histories empty (its next step then scales as a first step does)"
    had = saved.get("amax_history_len") if saved.get("recipe") == "delayed" else None
    have = _delayed_len(pm)
    if had is None and have is None:
        return None
    if had is None:
        return (f"{path} holds no FP8 amax histories (saved with fp8={saved.get('recipe')!r}), but this model runs "
                f"{cfg(have)}: build it with the fp8 setting the checkpoint was saved with, {skip}")
    if have is None:
        return (f"{path} holds FP8 delayed-scaling amax histories (saved with {cfg(had)}), but this model runs "
                f"fp8={pm.config.fp8!r}: build it with {cfg(had)} to resume that run, {skip}")
    if had != have:
        return (f"{path} holds FP8 amax histories of {had} steps (saved with {cfg(had)}), but this model keeps "
                f"{have}: build it with {cfg(had)} to resume that run, {skip}")
    if meta.get("digest") != plan_digest(pm.plan):
        return (f"{path} holds FP8 amax histories saved under mesh {_mesh(meta['mesh'])}; this model runs mesh "
                f"{_mesh(pm.plan.mesh)} (or other placements): histories are per rank and per shard and cannot be "
                f"resharded; load it under the layout it was saved with, {skip}")
    mine = sorted(pm.fp8_histories())
    theirs = saved.get("histories", {}).get(str(dist.get_rank()))
    if theirs != mine:
        return (f"{path}: rank {dist.get_rank()} saved the FP8 amax histories of the linears {theirs}, but runs "
                f"{mine} (another pipeline partition or pass setting): load it with the Config it was saved with, "
                f"{skip}")
    return None


def _mesh(mesh: dict) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.items()) or "(one device)"


def _shape(md) -> tuple | None:
    return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None


def _check_model(pm, path, md) -> str | None:
    """The first tensor of this model missing from the checkpoint or of another shape there, or the
    first tensor there that this model lacks (every rank checks every tensor, all stages)."""
    have = md.state_dict_metadata
    wanted = {f"model.{f}": tuple(pp.shape) for f, pp in pm.plan.params.items()}
    wanted.update({f"buffers.{f}": tuple(pm._extra[pm._buffer_ph[f]].shape) for f in pm._persistent_buffers})
    fix = "load a checkpoint of this model (the same config), or build the model the checkpoint was saved from"
    for key, shape in wanted.items():
        if key not in have:
            return f"{path}: {key.partition('.')[2]} of this model is not in the checkpoint: {fix}"
        if _shape(have[key]) != shape:
            return (f"{path}: {key.partition('.')[2]} is {list(_shape(have[key]) or ())} in the checkpoint and "
                    f"{list(shape)} in this model: {fix}")
    extra = [k for k in have if k.split(".")[0] in ("model", "buffers") and k not in wanted]
    if extra:
        return f"{path}: the checkpoint holds {extra[0].partition('.')[2]}, which this model does not have: {fix}"
    return None


def _check_optimizer(pm, path, md, meta, optimizer, state) -> str | None:
    """This optimizer against the checkpoint's: the class, every state tensor of every parameter this
    rank holds (its shape), and no state the checkpoint has that this optimizer would not keep."""
    saved = meta.get("optimizer")
    inner = _inner(optimizer)
    if saved is None:
        return (f"{path} holds no optimizer state (saved without an optimizer): call load_checkpoint(path) "
                "without one to load the model")
    if saved != type(inner).__name__:
        return (f"{path} holds the state of a torch.optim.{saved} optimizer, and this one is torch.optim."
                f"{type(inner).__name__}: create the optimizer the checkpoint was saved with")
    have = md.state_dict_metadata
    mine = {k for k in state if k.startswith("optim.")}
    for key in sorted(mine):
        fqn = key[len("optim.state."):].rsplit(".", 1)[0]
        want = tuple(state[key].size()) if isinstance(state[key], (torch.Tensor, _Pieces)) else None
        if key not in have:
            return (f"{path}: the optimizer state {key[len('optim.state.'):]} is not in the checkpoint (saved by "
                    f"another {saved} configuration?): create the optimizer with the options it was saved with")
        if want is not None and _shape(have[key]) != want:
            return (f"{path}: the optimizer state {key[len('optim.state.'):]} is {list(_shape(have[key]) or ())} in "
                    f"the checkpoint and {list(want)} here ({fqn})")
    held = {fqn for fqn, *_ in _entries(pm, optimizer) if fqn}
    theirs = sorted(k for k in have if k.startswith("optim.state.")
                    and k[len("optim.state."):].rsplit(".", 1)[0] in held and k not in mine)
    if theirs:
        return (f"{path}: the checkpoint holds optimizer state {theirs[0][len('optim.state.'):]} that this optimizer "
                "does not keep: create the optimizer with the options it was saved with (e.g. amsgrad)")
    return None


def _group_options(pm, path, md, optimizer) -> tuple[dict[int, dict], str | None]:
    """The saved options of each parameter group of this optimizer (group index -> options), read by
    every rank alone; or a message if parameters that share a group here were saved with other options."""
    entries = [(f, p) for f, p, *_ in _entries(pm, optimizer) if f]
    keys = sorted({f"optim.groups.{f}" for f, _ in entries})
    missing = [k for k in keys if k not in md.state_dict_metadata]
    if missing:
        return {}, f"{path}: the options of {missing[0][len('optim.groups.'):]} are not in the checkpoint"
    state = dict.fromkeys(keys)
    if keys:
        import warnings

        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=_Reader(path, md), planner=DefaultLoadPlanner(
                flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
    index = {id(p): i for i, g in enumerate(_inner(optimizer).param_groups) for p in g["params"]}
    out: dict[int, tuple[str, dict]] = {}
    for fqn, p in entries:
        i, opts = index[id(p)], state[f"optim.groups.{fqn}"]
        if i in out and out[i][1] != opts:
            first = out[i][0]
            diff = sorted(k for k in set(opts) | set(out[i][1]) if opts.get(k) != out[i][1].get(k))
            return {}, (f"{path}: {first} and {fqn} share a parameter group of this optimizer but were saved with "
                        f"other options ({', '.join(diff)}): create the optimizer with the parameter groups it was "
                        "saved with (DistributedOptimizer's options_for)")
        out.setdefault(i, (fqn, opts))
    return {i: opts for i, (_, opts) in out.items()}, None


def _agree(message: str | None, error=CheckpointError) -> None:
    """Every rank raises the first rank's message if any rank has one (collective)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, message)
    bad = [m for m in everyone if m]
    if bad:
        raise error(bad[0])


# -- loading ------------------------------------------------------------------------------------------
def load(pm, path: str | Path, optimizer=None, fp8_state: bool = True) -> dict:
    """Restore parameters, persistent buffers, optimizer state and (``fp8_state``, same plan only) the
    FP8 amax histories, under any layout; returns the ``extra`` saved. Collective."""
    wait_pending(pm)
    path = Path(path)
    meta, md, message = None, None, None
    try:
        meta, md = _read_meta(path)
        message = _check_model(pm, path, md)
    except CheckpointError as e:
        message = str(e)
    _agree(message)
    if fp8_state:
        _agree(_fp8_mismatch(pm, path, meta), CheckpointPlanMismatch)
    options: dict[int, dict] = {}
    created = []
    if optimizer is not None:  # DCP reads into existing tensors: the optimizer's state is created first
        inner = _inner(optimizer)
        created = [p for g in inner.param_groups for p in g["params"] if not inner.state.get(p)]
        _materialize(optimizer)
        saved = {k[len("optim.state."):].rsplit(".", 1)[0] for k in md.state_dict_metadata
                 if k.startswith("optim.state.")}
        for fqn, p, *_ in _entries(pm, optimizer):
            if fqn not in saved:  # no state saved (not stepped in that run): it starts fresh here too
                inner.state.pop(p, None)
    state, copies = _state(pm, optimizer, load=True)
    if optimizer is not None:
        message = _check_optimizer(pm, path, md, meta, optimizer, state)
        if message is None:
            options, message = _group_options(pm, path, md, optimizer)
        try:
            _agree(message)
        except CheckpointError:
            for p in created:  # the optimizer as it was: no state created by this failed load
                inner.state.pop(p, None)
            raise
    histories = pm.fp8_histories() if fp8_state else {}
    for name, h in histories.items():
        state[_fp8_key(name)] = h
    dcp.load(state, storage_reader=_Reader(path, md), planner=_LoadPlanner())
    with torch.no_grad():
        for fqn, full in copies.items():  # ZeRO-1/2: the parameter buffer (compute dtype) and the fp32 masters
            pm._params[fqn].to_local().copy_(full)
            pm._zero.set_master(fqn, full)
        if optimizer is not None:
            inner = _inner(optimizer)
            for i, opts in options.items():
                inner.param_groups[i].update(opts)
            seen = {}
            for fqn, p, *_ in _entries(pm, optimizer):  # a scalar read once per parameter: into every segment
                for name, v in inner.state.get(p, {}).items():
                    key = f"optim.state.{fqn}.{name}"
                    if isinstance(v, torch.Tensor) and not _elementwise(v, p):
                        if key in seen and seen[key] is not v:
                            _local(v).copy_(_local(seen[key]))
                        seen.setdefault(key, v)
                    elif not isinstance(v, torch.Tensor) and key in state:
                        inner.state[p][name] = state[key]
    pm.dropout_step = int(meta.get("dropout_step", 0))  # the masks go on where the saved run was
    if getattr(pm, "loss_scaler", None) is not None and "loss_scaler" in meta:
        # fp16: the scale goes on where the saved run's was (a checkpoint of a bf16/fp32 run has none: the
        # scaler starts at Config.initial_loss_scale)
        pm.loss_scaler.load_state_dict(meta["loss_scaler"])
    return meta.get("extra", {})


@torch.no_grad()
def _materialize(optimizer) -> None:
    """Create the optimizer's state (one step at lr 0 with zero gradients), leaving the parameters,
    their gradients and the options as they were: DCP reads into existing tensors."""
    import warnings

    inner = _inner(optimizer)
    params = [p for g in inner.param_groups for p in g["params"] if p.requires_grad]
    if not params or all(inner.state.get(p) for p in params):
        return
    values = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in inner.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in inner.param_groups:
        if "lr" in g:
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inner.step()
    for g, lr in zip(inner.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    for p, v, gr in zip(params, values, grads):
        p.copy_(v)
        p.grad = gr
