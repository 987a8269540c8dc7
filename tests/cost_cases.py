"""Functions the gloo worker processes run for tests/test_cost_measured.py: fn(rank, world, *args).

Module-level so the workers can import them by name.
"""

from __future__ import annotations

import torch

import mcompile as mc

from conftest import build


def memory_peak(rank, world, name, mesh, options, batch, steps=2):
    """Train ``steps`` steps (train_step, AdamW step, zero_grad) under the memory tracker; this rank's
    peak of live tensor bytes over the last step — the steady state, where the optimizer state made
    by the first step is held throughout — with the categories at that moment, and what the rank
    holds after it (parameters, optimizer state)."""
    from mcompile.runtime.memory import MemoryTracker

    model, inputs = build(name, batch=batch)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    params = list(pm.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    tracker = MemoryTracker()
    tracker.register(params, "parameters")
    for p in params:  # each gradient is a gradient from the moment it is accumulated
        p.register_post_accumulate_grad_hook(lambda p: tracker.register([p.grad], "gradients"))
    peaks = []
    with tracker:
        for _ in range(steps):
            tracker.reset_peak()
            pm.train_step(*inputs)
            opt.step()
            tracker.register_optimizer(opt)
            opt.zero_grad()
            peaks.append((tracker.peak_total, dict(tracker.peak)))
    return {"peak": peaks[-1][0], "at_peak": peaks[-1][1], "first_step_peak": peaks[0][0],
            "held": {c: tracker.current[c] for c in ("parameters", "optimizer")},
            "local_numel": sum(p.to_local().numel() for p in params)}
