"""Checkpoints of a ParallelModule through torch.distributed.checkpoint (DESIGN §6).

Each rank writes its own shards (DCP); the plan's digest is written beside them. Loading first
compares that digest with the current plan: a checkpoint saved under another plan (another mesh,
other placements) is refused with a clear error before anything is read — resharding across plans
comes with the checkpoint issue. Saving writes into a temporary folder and renames it when every
rank has finished, so an interrupted save leaves no half-written checkpoint at ``path``.

FP8 delayed scaling's amax histories (``Config(fp8="delayed")``) are training state like the
optimizer's: a resumed run without them would scale its next steps as first steps and diverge from
the uninterrupted one. They are saved per rank, under a key of each rank's own: scales are per rank
and per shard with no communication (DESIGN §7, :mod:`mcompile.passes.fp8`), so under tp each rank's
histories hold the amaxes of its own shards, under dp of its own data slice, and under pp each rank
holds only the linears of its stages. The recipe, the history length and every rank's linears are
written beside and checked before anything is read.

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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

__all__ = ["save", "load", "CheckpointPlanMismatch", "plan_digest"]

META = "mcompile_plan.json"
# Optimizer state keyed by parameter FQN (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), not by group
# index: under pp every rank's group 0 holds other parameters, and DCP keeps one rank's copy of an
# equal non-tensor key, so the others lost their groups' options (KeyError 'betas' after loading an
# untied model's pp checkpoint; a weight tied across stages had hidden it).
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


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
    return get_state_dict(pm, optimizer, options=_OPTIONS)


def _delayed_len(pm) -> int | None:
    """The model's amax history length under ``fp8="delayed"``, else None (no FP8 state)."""
    return pm.config.fp8_amax_history_len if pm.config.fp8 == "delayed" else None


def _fp8_meta(pm, histories: dict) -> dict:
    """What the checkpoint says of FP8 state: the recipe and, for delayed scaling, the history length
    and the linears (program nodes) whose histories each rank saved (``histories``: this rank's).
    Collective."""
    names = sorted(histories)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names)
    out = {"recipe": pm.config.fp8}
    if _delayed_len(pm) is not None:
        out.update(amax_history_len=_delayed_len(pm), histories={str(r): n for r, n in enumerate(everyone)})
    return out


def _fp8_mismatch(pm, path, saved: dict) -> str | None:
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
    mine = sorted(pm.fp8_histories())
    theirs = saved.get("histories", {}).get(str(dist.get_rank()))
    if theirs != mine:
        return (f"{path}: rank {dist.get_rank()} saved the FP8 amax histories of the linears {theirs}, but runs "
                f"{mine} (another pipeline partition or pass setting): load it with the Config it was saved with, "
                f"{skip}")
    return None


def _fp8_key() -> str:
    return f"rank{dist.get_rank()}"


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
    histories = pm.fp8_histories()
    if histories:  # this rank's own, under a key of its own (DCP would keep one of equal keys)
        state["fp8"] = {_fp8_key(): histories}
    fp8 = _fp8_meta(pm, histories)
    dcp.save(_blockwise(state), checkpoint_id=str(tmp_path))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp_path / META).write_text(json.dumps({
            "digest": plan_digest(pm.plan), "mesh": pm.plan.mesh,
            "sequence_parallel": pm.plan.options.sequence_parallel, "extra": extra or {},
            "zero_layout": optimizer.layout_signature() if _sharded(optimizer) else None,
            "fp8": fp8,
        }))
        if path.exists():
            shutil.rmtree(path)
        tmp_path.rename(path)
    dist.barrier()


def load(pm, path: str | Path, optimizer=None, fp8_state: bool = True) -> dict:
    """Restore parameters, persistent buffers, optimizer state and (``fp8_state``) the FP8 amax
    histories; returns the ``extra`` saved."""
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
    if fp8_state:  # every rank decides together: one rank raising alone would leave the others in dcp.load
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, _fp8_mismatch(pm, path, meta.get("fp8") or {"recipe": None}))
        if any(everyone):
            raise CheckpointPlanMismatch(next(e for e in everyone if e))
    model_sd, optim_sd = _states(pm, optimizer, for_load=True)
    state = {"model": model_sd, "buffers": pm._buffer_state()}
    if optim_sd is not None:
        state["optimizer"] = optim_sd
    histories = pm.fp8_histories() if fp8_state else {}
    if histories:
        state["fp8"] = {_fp8_key(): dict(histories)}
    dcp.load(_blockwise(state), checkpoint_id=str(path))  # in place: block views write into ``state``
    with torch.no_grad():
        for name, h in histories.items():
            h.copy_(state["fp8"][_fp8_key()][name])
    if _sharded(optimizer):
        optimizer.load_sharded_state_dict(state["optimizer"])
        pm.load_state_dict(state["model"])
    elif optimizer is not None:
        optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
        set_state_dict(pm, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=_OPTIONS)
    else:
        pm.load_state_dict(state["model"])
    pm._load_buffer_state(state["buffers"])
    return meta.get("extra", {})
