"""Checkpoints of a ParallelModule through torch.distributed.checkpoint (DESIGN §6).

Each rank writes its own shards (DCP); the plan's digest is written beside them. Loading first
compares that digest with the current plan: a checkpoint saved under another plan (another mesh,
other placements) is refused with a clear error before anything is read — resharding across plans
comes with the checkpoint issue. Saving writes into a temporary folder and renames it when every
rank has finished, so an interrupted save leaves no half-written checkpoint at ``path``.

A ZeRO-1 optimizer (:class:`mcompile.runtime.zero.DistributedOptimizer`, dp > 1) saves each rank's
shard (optimizer state of its segments, fp32 master shards) under a key of its own; its layout
signature (dp, buckets, parameter dtype) is written beside and checked before loading.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["save", "load", "CheckpointPlanMismatch", "plan_digest"]

META = "mcompile_plan.json"


class CheckpointPlanMismatch(ValueError):
    pass


def plan_digest(plan) -> str:
    layout = {"mesh": plan.mesh, "params": {k: [repr(p) for p in v.placements] + [list(v.padded_shape or v.shape)]
                                            for k, v in plan.params.items()}}
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()


def _sharded(optimizer) -> bool:
    from mcompile.runtime.zero import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer) and optimizer.sharded


def _states(pm, optimizer, for_load: bool = False):
    if optimizer is None:
        model_sd = {k: v for k, v in pm.state_dict().items()}
        return model_sd, None
    if _sharded(optimizer):  # ZeRO-1: every rank's own shard, under a key of its own
        return dict(pm.state_dict()), optimizer.sharded_state_dict(for_load=for_load)
    if not isinstance(optimizer, torch.optim.Optimizer):  # DistributedOptimizer under zero=0 / dp=1
        optimizer = optimizer.optimizer
    return get_state_dict(pm, optimizer)


def _blockwise(obj):
    """DCP describes a rank's piece of a tensor as one contiguous chunk; a BlockShard parameter (a
    fused QKV: k blocks, each sharded over tp) is k chunks per rank. Save and load it as k tensors
    ``<key>.block<j>``, each a plain Shard over the same axis, whose local pieces are views of the
    parameter (loading writes through them)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(obj, dict):
        return {k: _blockwise(v) for k, v in obj.items()}
    if not (isinstance(obj, DTensor) and any(isinstance(p, _StridedShard) for p in obj.placements)):
        return obj
    (i, sp), = [(i, p) for i, p in enumerate(obj.placements) if isinstance(p, _StridedShard)]
    k, d = sp.split_factor, sp.dim
    shape = list(obj.shape)
    shape[d] //= k
    stride = [1] * len(shape)
    for j in range(len(shape) - 2, -1, -1):
        stride[j] = stride[j + 1] * shape[j + 1]
    placements = list(obj.placements)
    placements[i] = Shard(d)
    return {f"block{j}": DTensor.from_local(piece, obj.device_mesh, placements, run_check=False,
                                            shape=tuple(shape), stride=tuple(stride))
            for j, piece in enumerate(obj.to_local().chunk(k, dim=d))}


def save(pm, path: str | Path, optimizer=None, extra: dict | None = None) -> None:
    path = Path(path)
    tmp = [str(path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"))]
    dist.broadcast_object_list(tmp, src=0)
    tmp_path = Path(tmp[0])
    model_sd, optim_sd = _states(pm, optimizer)
    state = {"model": model_sd, "buffers": pm._buffer_state()}
    if optim_sd is not None:
        state["optimizer"] = optim_sd
    dcp.save(_blockwise(state), checkpoint_id=str(tmp_path))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp_path / META).write_text(json.dumps({
            "digest": plan_digest(pm.plan), "mesh": pm.plan.mesh,
            "sequence_parallel": pm.plan.options.sequence_parallel, "extra": extra or {},
            "zero_layout": optimizer.layout_signature() if _sharded(optimizer) else None,
        }))
        if path.exists():
            shutil.rmtree(path)
        tmp_path.rename(path)
    dist.barrier()


def load(pm, path: str | Path, optimizer=None) -> dict:
    """Restore parameters, persistent buffers and optimizer state; returns the ``extra`` saved."""
    path = Path(path)
    meta_file = path / META
    if not meta_file.exists():
        raise FileNotFoundError(f"{path} is not an mcompile checkpoint (no {META})")
    meta = json.loads(meta_file.read_text())
    if meta["digest"] != plan_digest(pm.plan):
        mesh = ",".join(f"{a}={n}" for a, n in meta["mesh"].items())
        now = ",".join(f"{a}={n}" for a, n in pm.plan.mesh.items())
        raise CheckpointPlanMismatch(
            f"{path} was saved under another plan (mesh {mesh}) than this model runs (mesh {now}): loading it "
            "would need resharding, which is not supported yet; load it with the mesh and options it was "
            "saved with"
        )
    if optimizer is not None and meta.get("zero_layout") != (optimizer.layout_signature() if _sharded(optimizer)
                                                              else None):
        raise CheckpointPlanMismatch(
            f"{path} holds optimizer state in another layout than this optimizer's (ZeRO-1 on/off, dp, bucket_mb "
            "or the parameter dtype differ): load it with the Config it was saved with"
        )
    model_sd, optim_sd = _states(pm, optimizer, for_load=True)
    state = {"model": model_sd, "buffers": pm._buffer_state()}
    if optim_sd is not None:
        state["optimizer"] = optim_sd
    dcp.load(_blockwise(state), checkpoint_id=str(path))  # in place: block views write into ``state``
    if _sharded(optimizer):
        optimizer.load_sharded_state_dict(state["optimizer"])
        pm.load_state_dict(state["model"])
    elif optimizer is not None:
        optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
        set_state_dict(pm, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        pm.load_state_dict(state["model"])
    pm._load_buffer_state(state["buffers"])
    return meta.get("extra", {})
