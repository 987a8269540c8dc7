"""Functions the gloo worker processes run for tests/test_search.py: fn(rank, world, *args).

Module-level so the workers can import them by name.
"""

from __future__ import annotations

import torch
from runtime_cases import LR, norm_value

import mcompile as mc
from mcompile.runtime.zero import DistributedOptimizer

from conftest import build


def train_auto(rank, world, name, steps=3, batch=4, hardware=None):
    """``parallelize(plan="auto")``, then AdamW steps as tests/runtime_cases.py ``train`` does, with the
    optimizer and clipping the chosen layout needs (ZeRO-1: DistributedOptimizer; pp: the module's
    clip_grad_norm_). Per-step losses, the last step's full gradients taken before clipping (rank 0),
    the choice, and the total norm each clipping returned."""
    model, inputs = build(name, batch=batch)
    pm = mc.parallelize(model, example_inputs=inputs, plan="auto", hardware=hardware)
    zero = pm.config.zero and pm.mesh.size("dp") > 1
    opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=LR) if zero else torch.optim.AdamW(pm.parameters(), lr=LR)
    losses, grads, norms = [], None, []
    for step in range(steps):
        losses.append(pm.train_step(*inputs).item())
        if step == steps - 1:
            grads = pm.full_grads()  # copies: clipping leaves them as they are
        if zero:
            norm = opt.clip_grad_norm_(1.0)
        elif pm.mesh.size("pp") > 1:  # a rank's parameters() are its stages' only
            norm = pm.clip_grad_norm_(1.0)
        else:
            norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)
        norms.append(norm_value(norm))
        opt.step()
        opt.zero_grad()
    chosen = {k: getattr(pm.config, k) for k in ("sequence_parallel", "microbatches", "recompute", "zero", "schedule",
                                                  "virtual_stages")}
    return losses, grads if rank == 0 else None, dict(pm.mesh.axes), chosen, norms
