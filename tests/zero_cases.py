"""Functions the gloo worker processes run for tests/test_zero.py: fn(rank, world, *args).

Module-level so the workers can import them by name.
"""

from __future__ import annotations

import warnings

import torch
from runtime_cases import LR, train_steps

import mcompile as mc
from mcompile.runtime.zero import DistributedOptimizer

from conftest import build


def build_model(name, seed=0, batch=4):
    """conftest.build, plus "odd-llama": a one-layer Llama whose sizes (hidden 18, vocabulary 103)
    do not divide by 4, so that dp=4 buffers need padding."""
    if name != "odd-llama":
        return build(name, seed=seed, batch=batch)
    from mcompile.models.llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    model = Llama(LlamaConfig(vocab_size=103, dim=18, n_layers=1, n_heads=1, n_kv_heads=1, ffn_hidden=30,
                              max_seq_len=64)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, 103, (batch, 16), generator=g)
    targets = torch.randint(0, 103, (batch, 16), generator=g)
    targets[0, :5] = -100
    return model, (tokens, targets)


def train(rank, world, name, mesh, options, steps=3, batch=4):
    """AdamW through DistributedOptimizer with its gradient clipping: per-step losses and clipping
    norms, and the full gradients of the last step *before* clipping on rank 0 (clipped gradients
    would hide a uniform scale error: tests/test_runtime.py)."""
    model, inputs = build_model(name, batch=batch)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=LR)
    losses, norms, grads = [], [], None
    for step in range(steps):
        losses.append(pm.train_step(*inputs).item())
        if step == steps - 1:
            grads = pm.full_grads()  # copies: clipping leaves them as they are
        norms.append(opt.clip_grad_norm_(1.0).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, grads if rank == 0 else None


def reference(name, steps=3, batch=4):
    model, inputs = build_model(name, batch=batch)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, grads = [], [], None
    for step in range(steps):
        loss = model(*inputs)
        loss.backward()
        if step == steps - 1:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, grads


def curve(rank, world, name, mesh, options, steps=5, lr=3e-3):
    """Losses of a short AdamW run (no clipping) through DistributedOptimizer."""
    model, inputs = build_model(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=lr)
    return train_steps(pm, opt, inputs, steps)


def accumulate(rank, world, name, mesh, options):
    """Two train_steps without zero_grad add up, as loss.backward() twice does; zero_grad clears;
    the 1-, 2- and inf-norms over the shards equal those of the gathered gradients."""
    model, inputs = build_model(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=LR)
    pm.train_step(*inputs)
    once = pm.full_grads()
    pm.train_step(*inputs)
    twice = pm.full_grads()
    opt.zero_grad()
    pm.train_step(*inputs)
    again = pm.full_grads()
    # the sharded norms against the gathered gradients (each parameter once), summed in float64;
    # max_norm large: nothing is clipped
    norms = {p: opt.clip_grad_norm_(1e9, p).item() for p in (1.0, 2.0, float("inf"))}
    flat = torch.cat([g.reshape(-1) for g in again.values()]).double()
    norm_err = max(abs(norms[p] - torch.linalg.vector_norm(flat, p).item()) / norms[p] for p in norms)
    return (max(((twice[k] - 2 * once[k]).norm() / (2 * once[k]).norm()).item() for k in once),
            max(((again[k] - once[k]).norm() / once[k].norm()).item() for k in once), norm_err)


def memory(rank, world, name, mesh, options, bucket_mb):
    """One bf16 AdamW step under the memory tracker: what this rank holds, by category, measured two
    ways (tracker; summing tensors); the exact prediction for this rank's layout
    (mcompile.ir.buckets.zero1_memory) and the per-tensor table (mcompile.apps.report.memory_per_rank)."""
    from mcompile.apps.report import memory_per_rank
    from mcompile.ir.buckets import zero1_memory
    from mcompile.runtime.memory import MemoryTracker

    model, inputs = build_model(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, zero=1, dtype=torch.bfloat16, bucket_mb=bucket_mb,
                        **options)
    opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-3)
    tracker = MemoryTracker()
    with tracker:
        pm.train_step(*inputs)
        opt.clip_grad_norm_(1.0)
        opt.step()
        for cat, tensors in opt.memory_tensors().items():
            tracker.register(tensors, cat)
    z = pm._zero
    summed = {
        "parameters": sum(b.param_buf.nbytes for b in z.buckets),
        "gradients": sum(b.grad_buf.nbytes for b in z.buckets),
        "optimizer": sum(m.nbytes for m in z.masters())
        + sum(v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
    }
    dp_rank = pm.mesh.coords(rank)["dp"]
    pred = zero1_memory(pm.plan, "bfloat16", bucket_mb, dp_rank)
    table = memory_per_rank(pm.plan, "bfloat16", zero=1)  # per parameter tensor, no layout
    layout = [(b.layout.numel, b.layout.padded, len(b.layout.segments(dp_rank))) for b in z.buckets]
    return {"measured": {c: tracker.current[c] for c in ("parameters", "gradients", "optimizer")},
            "summed": summed, "predicted": {"parameters": pred.params, "gradients": pred.grads,
                                            "optimizer": pred.optimizer},
            "table": {"parameters": table.params, "gradients": table.grads, "optimizer": table.optimizer},
            "layout": layout, "dtypes": sorted({str(p.dtype) for p in pm.parameters()}),
            "local_numel": sum(p.to_local().numel() for p in pm.parameters())}


def train_and_save(rank, world, name, mesh, options, path, steps=6, save_at=3):
    model, inputs = build_model(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-3)
    losses = []
    for step in range(1, steps + 1):
        losses.append(pm.train_step(*inputs).item())
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if step == save_at:
            pm.save_checkpoint(path, opt, extra={"step": step})
    return losses


def resume(rank, world, name, mesh, options, path, steps=6):
    """Another seed (the checkpoint must overwrite everything), load, train on to ``steps``."""
    model, _ = build_model(name, seed=123, batch=4)
    _, inputs = build_model(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-3)
    start = pm.load_checkpoint(path, opt)["step"]
    return train_steps(pm, opt, inputs, steps - start, lambda: opt.clip_grad_norm_(1.0))


def load_error(rank, world, name, mesh, options, path):
    model, inputs = build_model(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    try:
        pm.load_checkpoint(path, DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-3))
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    return "loaded"


def misuse(rank, world, name):
    """What a user gets wrong: a plain torch optimizer under zero=1; zero=1 without dp; a
    non-element-wise optimizer; load_full_state_dict keeps the bf16 masters in step."""
    model, inputs = build_model(name, batch=4)
    out = {}
    pm = mc.parallelize(model, mc.Mesh.parse("dp=2"), inputs, zero=1, dtype=torch.bfloat16)
    try:
        pm.train_step(*inputs)
        out["plain"] = "no error"
    except RuntimeError as e:
        out["plain"] = str(e)
    try:
        DistributedOptimizer(pm, torch.optim.Adafactor, lr=1e-3)
        out["adafactor"] = "no error"
    except ValueError as e:
        out["adafactor"] = str(e)
    grouped = DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-3, weight_decay=0.1,
                                   options_for=lambda fqn: {"weight_decay": 0.0} if "norm" in fqn else {})
    out["groups"] = [(g["weight_decay"], len(g["params"])) for g in grouped.param_groups]
    opt = DistributedOptimizer(pm, torch.optim.SGD, lr=0.0)
    sd = {k: v + 0.25 for k, v in model.state_dict().items()}
    pm.load_full_state_dict(sd)
    pm.train_step(*inputs)
    opt.step()  # lr 0: the parameters become their masters again, which must be the loaded values
    full = pm.full_state_dict()
    out["masters_follow"] = max((full[k].float() - sd[k].to(torch.bfloat16).float()).abs().max().item()
                                for k in full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp_only = mc.parallelize(model, mc.Mesh.parse("tp=2"), inputs, zero=1)
    out["warning"] = [str(w.message) for w in caught if "zero=1" in str(w.message)]
    out["tp_only_sharded"] = DistributedOptimizer(tp_only, torch.optim.AdamW).sharded
    return out
