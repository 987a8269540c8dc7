"""Functions the gloo worker processes run for tests/test_fsdp.py: fn(rank, world, *args)."""

from __future__ import annotations

import torch

import mcompile as mc

from conftest import build


def memory(rank, world, name, mesh, options):
    """One fp32 AdamW step under the memory tracker (ZeRO-3, or ZeRO-2 through DistributedOptimizer):
    what this rank holds at rest by category, its prediction, the local parameter elements, and the
    largest bytes of gathered parameters live at once in the forward module (passes/dp/fsdp.py)."""
    from mcompile.ir.buckets import bucket_layouts
    from mcompile.runtime.memory import MemoryTracker
    from mcompile.runtime.zero import DistributedOptimizer

    model, inputs = build(name, batch=4)
    full_params = sum(p.numel() for p in model.parameters())
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-3)
    tracker = MemoryTracker()
    with tracker:
        pm.train_step(*inputs)
        opt.step()
        for cat, tensors in opt.memory_tensors().items():
            tracker.register(tensors, cat)
    measured = {c: tracker.current[c] for c in ("parameters", "gradients", "optimizer")}
    limit = int(pm.config.bucket_mb * 2**20)
    if pm.config.zero == 3:  # prediction: fp32 pieces, the leaves' aligned buckets, AdamW's two moments and step
        local = {f: p.to_local().numel() for f, p in pm._params.items()}
        order = list(reversed([f for f, p in pm._params.items() if p.requires_grad]))
        groups: dict[tuple, list[str]] = {}  # the leaves' buckets: one run per set of axes reduced over
        for f in order:
            groups.setdefault(pm._bucket_axes(f), []).append(f)
        padded = sum(lay.padded for group in groups.values()
                     for lay in bucket_layouts([(f, local[f]) for f in group], 1, limit))
        predicted = {"parameters": 4 * sum(local.values()), "gradients": 4 * padded,
                     "optimizer": sum(8 * n + 4 for n in local.values())}
    else:  # ZeRO-2: the owned fp32 shards of the gradient buckets only (the full buffers are released)
        from mcompile.ir.buckets import zero1_memory

        z = pm._zero
        pred = zero1_memory(pm.plan, "float32", pm.config.bucket_mb, pm._coords["dp"])
        predicted = {"parameters": pred.params, "gradients": 4 * sum(b.layout.shard for b in z.buckets),
                     "optimizer": pred.optimizer}
    return {"measured": measured, "predicted": predicted, "full_params": full_params,
            "local_numel": sum(p.to_local().numel() for p in pm.parameters()),
            "tp_local_numel": sum(pp.local_numel for pp in pm.plan.params.values()),  # zero=0's pieces
            "replicated": getattr(pm, "zero3_replicated", [])}
