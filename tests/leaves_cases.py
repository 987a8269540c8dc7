"""Functions the gloo worker processes run for tests/test_leaves.py: fn(rank, world, *args)."""

from __future__ import annotations

import torch

import mcompile as mc


class Accumulate(torch.nn.Module):
    """Two identity linears (exact in bf16) and a sum: every weight gradient is the sum over the
    rows of the input, so it is a sum of integers that bf16 cannot hold (256 + 1 rounds to 256)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4, bias=False) for _ in range(2)])
        for layer in self.layers:
            torch.nn.init.eye_(layer.weight)

    def forward(self, x):
        x = x.to(self.layers[0].weight.dtype)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def accumulate_rows(rows: int = 16) -> torch.Tensor:
    """Row 0 holds 256, every other row 1: the first dp rank's microbatch 0 carries 256 and its
    seven others 1 each. fp32 sums them to 263 (+8 from the other dp rank); bf16 stays at 256."""
    x = torch.ones(rows, 4)
    x[0] = 256.0
    return x


def accumulate_grads(rank, world, mesh, options):
    """The full gradients after one train_step of ``Accumulate`` (lr 0: nothing moves)."""
    from mcompile.runtime.zero import DistributedOptimizer

    x = accumulate_rows()
    pm = mc.parallelize(Accumulate(), mc.Mesh.parse(mesh), (x,), **options)
    DistributedOptimizer(pm, torch.optim.SGD, lr=0.0)
    pm.train_step(x)
    grads = pm.full_grads()  # collective: every rank
    return {k: v.tolist() for k, v in grads.items()} if rank == 0 else None


def leaves_are_plain(rank, world, name, mesh, options):
    """What the programs run on, and where the gradients land: every parameter input of the
    program is a plain tensor (no DTensor); each ``.grad`` after the step is a DTensor over a view
    of one of the flat fp32 buffers (zero=0); bf16 compute copies follow the optimizer's update."""
    from torch.distributed.tensor import DTensor

    from conftest import build

    model, inputs = build(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    local = pm._local_inputs()
    dtensors = [ph for ph in pm._param_of_ph if isinstance(local[ph], DTensor)]
    pm.train_step(*inputs)
    buffers = pm._leaves.flat_buffers()
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]
    outside = [f for f, p in pm.named_parameters() if p.grad is not None
               and not any(lo <= p.grad.to_local().data_ptr() < hi for lo, hi in spans)]
    with_grad = sum(p.grad is not None for p in pm.parameters())
    opt.step()
    stale = [f for f, p in pm.named_parameters()
             if not torch.equal(pm._leaves.compute[f].detach().float(),
                                p.detach().to_local().to(pm.config.dtype).float())]
    opt.zero_grad()
    pm.train_step(*inputs)  # the next run sees the updated parameters
    stale_after = [f for f, p in pm.named_parameters()
                   if not torch.equal(pm._leaves.compute[f].detach(), p.detach().to_local().to(pm.config.dtype))]
    return {"dtensors": dtensors, "outside": outside, "with_grad": with_grad,
            "params": len(list(pm.parameters())), "stale_before_refresh": len(stale), "stale_after": stale_after}


def launches(rank, world, name, mesh, options):
    """After one train_step: how many dp buckets were reduced before its end, how many of them were
    launched from inside a backward, the dp buckets, and those holding a weight tied across stages."""
    from mcompile.runtime.zero import DistributedOptimizer

    from conftest import build

    model, inputs = build(name, batch=8)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    DistributedOptimizer(pm, torch.optim.SGD, lr=0.0)
    pm.train_step(*inputs)
    leaves = pm._leaves
    if leaves.zero is not None:
        buckets = [b.layout.fqns for b in leaves.zero.buckets]
    else:
        buckets = [b.fqns for b in leaves.buckets if b.reduce_dp]
    return {"launched": len(leaves.launches), "in_backward": sum(leaves.launches), "buckets": len(buckets),
            "tied": sum(any(f in leaves.deferred for f in b) for b in buckets)}
