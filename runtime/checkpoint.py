"""Checkpoints of a ParallelModule through torch.distributed.checkpoint (DESIGN §6).

Each rank writes its own shards (DCP); the plan's digest is written beside them. Loading first
compares that digest with the current plan: a checkpoint saved under another plan (another mesh,
other placements) is refused with a clear error before anything is read — resharding across plans
comes with the checkpoint issue. Saving writes into a temporary folder and renames it when every
rank has finished, so an interrupted save leaves no half-written checkpoint at ``path``.
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


def _states(pm, optimizer):
    if optimizer is None:
        model_sd = {k: v for k, v in pm.state_dict().items()}
        return model_sd, None
    return get_state_dict(pm, optimizer)


def save(pm, path: str | Path, optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None) -> None:
    path = Path(path)
    tmp = [str(path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"))]
    dist.broadcast_object_list(tmp, src=0)
    tmp_path = Path(tmp[0])
    model_sd, optim_sd = _states(pm, optimizer)
    state = {"model": model_sd, "buffers": pm._buffer_state()}
    if optim_sd is not None:
        state["optimizer"] = optim_sd
    dcp.save(state, checkpoint_id=str(tmp_path))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp_path / META).write_text(json.dumps({
            "digest": plan_digest(pm.plan), "mesh": pm.plan.mesh,
            "sequence_parallel": pm.plan.options.sequence_parallel, "extra": extra or {},
        }))
        if path.exists():
            shutil.rmtree(path)
        tmp_path.rename(path)
    dist.barrier()


def load(pm, path: str | Path, optimizer: torch.optim.Optimizer | None = None) -> dict:
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
    model_sd, optim_sd = _states(pm, optimizer)
    state = {"model": model_sd, "buffers": pm._buffer_state()}
    if optim_sd is not None:
        state["optimizer"] = optim_sd
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is not None:
        set_state_dict(pm, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        pm.load_state_dict(state["model"])
    pm._load_buffer_state(state["buffers"])
    return meta.get("extra", {})
