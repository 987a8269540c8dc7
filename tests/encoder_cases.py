"""Gloo worker functions for the encoder parity test (tests/test_op_args.py): fn(rank, world, *args)."""

from __future__ import annotations

import torch

import mcompile as mc

from conftest import build

LR = 1e-4  # DESIGN §10: parity after AdamW steps at 1e-5 needs lr <= 1e-3 (tests/test_runtime.py)


def _steps(model_step, params, grads_of, steps):
    """Per step: loss, the unclipped full gradients, the clip norm; then an AdamW step."""
    opt = torch.optim.AdamW(params, lr=LR)
    out = []
    for _ in range(steps):
        loss = model_step()
        grads = grads_of()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        out.append((loss.item(), grads, float(norm)))
        opt.step()
        opt.zero_grad()
    return out


def train(rank, world, name, mesh, steps=3):
    model, inputs = build(name, batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs)
    out = _steps(lambda: pm.train_step(*inputs), list(pm.parameters()), pm.full_grads, steps)
    return out if rank == 0 else [(loss, None, norm) for loss, _, norm in out]


def reference(name, steps=3):
    model, inputs = build(name, batch=4)

    def step():
        loss = model(*inputs)
        loss.backward()
        return loss

    grads = lambda: {k: p.grad.clone() for k, p in model.named_parameters()}  # noqa: E731
    return _steps(step, list(model.parameters()), grads, steps)
