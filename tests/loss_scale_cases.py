"""Functions the gloo worker processes run for tests/test_loss_scale.py: fn(rank, world, *args)."""

from __future__ import annotations

import torch

import mcompile as mc

HIDDEN = 64


class Mlp(torch.nn.Module):
    """Two MLP blocks (hidden 64) and a mean-square loss, computed in the parameters' dtype."""

    def __init__(self, layers: int = 2, loss_factor: float = 1.0):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU(),
                                torch.nn.Linear(4 * HIDDEN, HIDDEN)) for _ in range(layers))
        self.loss_factor = loss_factor

    def forward(self, x):
        x = x.to(self.layers[0][0].weight.dtype)
        for layer in self.layers:
            x = x + layer(x)
        # the loss in fp32, then scaled: with a small factor its gradient underflows once cast to fp16
        return x.float().pow(2).mean() * self.loss_factor


def _model(seed: int = 0, **kw) -> Mlp:
    torch.manual_seed(seed)
    return Mlp(**kw)


def _inputs(rows: int = 8) -> torch.Tensor:
    return torch.randn(rows, 4, HIDDEN, generator=torch.Generator().manual_seed(1))


def _local_params(pm) -> dict[str, torch.Tensor]:
    return {f: p.detach().to_local().clone() for f, p in pm.named_parameters()}


def overflow_on_one_rank(rank, world, mesh, options, plant_rank, ckpt_dir):
    """fp16 training with an inf planted in ONE rank's gradient buffer on the first step (after that rank's own
    reductions, so no collective of the step carries it to the others), then clean steps. Per rank: whether
    each step was skipped, the scale after it, whether the parameters moved, and the scaler state across a
    checkpoint round trip."""
    from mcompile.runtime.zero import DistributedOptimizer

    x = _inputs()
    pm = mc.parallelize(_model(), mc.Mesh.parse(mesh), (x,), dtype=torch.float16, **options)
    opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-2) if options.get("zero") else \
        torch.optim.AdamW(pm.parameters(), lr=1e-2)
    finish = pm._leaves.finish

    def planted(*a, **k):  # the inf lands in this rank's reduced gradients only
        finish(*a, **k)
        if pm._zero is not None:
            b = next(b for b in pm._zero.buckets if b.valid and b.owned_grad.numel())
            b.owned_grad[0] = float("inf")
        else:
            pm._leaves.buckets[0].buf[0] = float("inf")

    out = {"skipped": [], "scale": [], "moved": [], "loss": []}
    for step in range(4):
        if step == 0 and rank == plant_rank:
            pm._leaves.finish = planted
        before = _local_params(pm)
        loss = pm.train_step(x)
        pm._leaves.finish = finish
        opt.step()  # the user's ordinary loop: nothing special to call on a skipped step
        opt.zero_grad()
        after = _local_params(pm)
        out["skipped"].append(pm.step_skipped)
        out["scale"].append(pm.loss_scaler.scale)
        out["moved"].append(any(not torch.equal(before[f], after[f]) for f in before))
        out["loss"].append(float(loss))
    saved = pm.loss_scaler.state_dict()
    pm.save_checkpoint(ckpt_dir, opt)
    pm.loss_scaler.load_state_dict({"scale": 1.0, "clean_steps": 0, "hysteresis_left": 1, "skipped_steps": 0})
    pm.load_checkpoint(ckpt_dir, opt)
    out["saved_state"], out["loaded_state"] = saved, pm.loss_scaler.state_dict()
    return out


def underflow(rank, world, mesh, options, loss_factor):
    """A model whose every gradient flushes to zero in a plain fp16 backward (the loss times ``loss_factor``):
    the fp32 reference gradients, the plain fp16 model's (single device, no scaling), and the parallel fp16
    model's with dynamic loss scaling, on rank 0; and whether one SGD step moved every parameter."""
    x = _inputs()
    ref = _model(loss_factor=loss_factor)
    ref(x).backward()
    ref_grads = {f: p.grad.clone() for f, p in ref.named_parameters()}
    half = _model(loss_factor=loss_factor).half()
    half(x).backward()
    half_grads = {f: p.grad.float() for f, p in half.named_parameters()}
    pm = mc.parallelize(_model(loss_factor=loss_factor), mc.Mesh.parse(mesh), (x,), dtype=torch.float16, **options)
    opt = torch.optim.SGD(pm.parameters(), lr=1e3)
    before = _local_params(pm)
    pm.train_step(x)
    grads = pm.full_grads()
    skipped, scale = pm.step_skipped, pm.loss_scaler.scale
    opt.step()
    after = _local_params(pm)
    moved = {f: bool((before[f] != after[f]).any()) for f in before}
    if rank:
        return {"moved": moved}
    return {"ref": ref_grads, "half": half_grads, "scaled": {f: g.float() for f, g in grads.items()},
            "skipped": skipped, "scale": scale, "moved": moved}
