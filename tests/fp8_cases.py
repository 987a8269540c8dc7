"""Worker functions for the FP8 runtime tests (module level: they run in the gloo worker pool).

They run the FP8 casts on their PyTorch reference instead of the Triton kernel in its interpreter
(``fp8._INTERPRETED = False`` while they run): the kernel is bit-identical to it
(tests/test_fp8.py::test_triton_cast_amax_matches_torch, and the same losses to the bit here,
measured), and the interpreter takes 30x longer per step. What these workers test is the runtime
around the FP8 linears: pipeline stages, schedules, checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch
from kernel_paths import reference_kernels
from runtime_cases import train_steps

import mcompile as mc
from mcompile.kernels import fp8

from conftest import build


def _module(mesh, recipe, options, seed=0):
    model, inputs = build("llama3-tiny", seed=seed, batch=4)
    _, inputs = build("llama3-tiny", batch=4)  # the same batch whatever the initial weights
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, fp8=recipe, **options)
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3), inputs


def _stage_buffers(pm) -> dict:
    """Under pp: for each of this rank's stages, the report's nodes whose history buffer the stage
    program holds, and whether every one is the report's own tensor (so the stage updates it)."""
    if pm._pipe is None:
        return {}
    by_id = {id(h): n for n, h in pm.fp8.histories.items()} if pm.fp8 else {}
    out = {}
    for s in pm._pipe.own:
        bufs = list(pm._pipe.stages[s].gm.buffers())
        out[s] = (sorted(by_id.get(id(b), "?") for b in bufs), all(id(b) in by_id for b in bufs))
    return out


def _fp8_nodes(pm) -> int:
    """The FP8 linears in the programs this rank runs (its stages' under pp)."""
    ops = (torch.ops.mcompile.fp8_linear.default, torch.ops.mcompile.fp8_linear_delayed.default)
    gms = [pm._pipe.stages[s].gm for s in pm._pipe.own] if pm._pipe is not None else [pm._program]
    return sum(n.op == "call_function" and n.target in ops for gm in gms for n in gm.graph.nodes)


def fp8_runs(rank, world, mesh, runs, steps=3):
    """For each (recipe, options): a fresh llama3-tiny ParallelModule, ``steps`` AdamW steps; its
    losses, the histories this rank runs (node -> (3, L)), the stage programs' buffers (pp) and,
    for delayed scaling, the linears whose histories stayed empty."""
    out = []
    with reference_kernels("fp8"):
        for recipe, options in runs:
            pm, opt, inputs = _module(mesh, recipe, options)
            grads = []  # every step's unclipped full gradients (a scale error leaves losses nearly alone)
            casts = fp8.stats["weight_casts"]
            losses = train_steps(pm, opt, inputs, steps, lambda pm=pm, grads=grads: grads.append(pm.full_grads()))
            casts = fp8.stats["weight_casts"] - casts
            mine = pm.fp8_histories()
            out.append({"losses": losses, "histories": {n: h.clone() for n, h in mine.items()},
                        "grads": grads if rank == 0 else None,
                        "stages": _stage_buffers(pm),
                        "idle": sorted(n for n, h in (pm.fp8.histories.items() if pm.fp8 else ()) if n not in mine
                                       and h.any()),
                        "converted": len(pm.fp8.converted) if pm.fp8 else 0,
                        "weight_casts": casts, "fp8_nodes": _fp8_nodes(pm)})
    return out


def fp8_checkpoint(rank, world, mesh, path, options, steps=4, save_at=2):
    """FP8 delayed scaling through a checkpoint: ``steps`` steps saving at ``save_at``; a fresh
    module from other initial weights loads it and trains on. Then what loading refuses: the
    checkpoint into a model without delayed scaling or with another history length, and a checkpoint
    without histories into a delayed model; and ``fp8_state=False``, which loads the rest."""
    from mcompile.runtime.checkpoint import CheckpointPlanMismatch

    path = Path(path)
    out = {}
    with reference_kernels("fp8"):
        pm, opt, inputs = _module(mesh, "delayed", options)
        out["continued"] = train_steps(pm, opt, inputs, save_at)
        pm.save_checkpoint(path / "delayed", opt, extra={"step": save_at})
        out["saved"] = {n: h.clone() for n, h in pm.fp8_histories().items()}
        weights = {k: v.clone() for k, v in pm.full_state_dict().items()}
        out["continued"] += train_steps(pm, opt, inputs, steps - save_at)
        out["final"] = {n: h.clone() for n, h in pm.fp8_histories().items()}

        pm2, opt2, _ = _module(mesh, "delayed", options, seed=1)
        out["fresh_empty"] = not any(h.any() for h in pm2.fp8_histories().values())
        out["extra"] = pm2.load_checkpoint(path / "delayed", opt2)
        out["loaded"] = {n: h.clone() for n, h in pm2.fp8_histories().items()}
        out["resumed"] = train_steps(pm2, opt2, inputs, steps - save_at)
        out["resumed_final"] = {n: h.clone() for n, h in pm2.fp8_histories().items()}

        errors = {}
        current, opt3, _ = _module(mesh, "current", options)
        short, opt4, _ = _module(mesh, "delayed", {**options, "fp8_amax_history_len": 8})
        current.save_checkpoint(path / "current", opt3)
        for name, (model, o, ckpt) in {"into_current": (current, opt3, "delayed"),
                                       "into_len8": (short, opt4, "delayed"),
                                       "current_into_delayed": (pm2, opt2, "current")}.items():
            try:
                model.load_checkpoint(path / ckpt, o)
                errors[name] = None
            except CheckpointPlanMismatch as e:
                errors[name] = str(e)
        before = {n: h.clone() for n, h in short.fp8_histories().items()}
        short.load_checkpoint(path / "delayed", opt4, fp8_state=False)  # the rest loads; histories untouched
        out["skip_kept"] = all(torch.equal(before[n], h) for n, h in short.fp8_histories().items())
        out["skip_loaded"] = all(torch.equal(v, weights[k]) for k, v in short.full_state_dict().items())
        out["errors"] = errors
    return out
