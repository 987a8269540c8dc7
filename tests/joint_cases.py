"""Worker functions and models for tests/test_joint.py (module level: they run in the gloo pool)."""

from __future__ import annotations

import numpy as np
import torch

import mcompile as mc


@torch.library.custom_op("mctest::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("mctest::twice_backward", mutates_args=())
def twice_backward(g: torch.Tensor) -> torch.Tensor:
    """The backward, computed in numpy: runs eagerly, has no fake implementation, so it cannot be traced."""
    return torch.from_numpy(np.asarray(g.detach().numpy()) * 2)


torch.library.register_autograd("mctest::twice", lambda ctx, g: twice_backward(g))


class TwiceMLP(torch.nn.Module):
    """Two linears around a custom op whose backward cannot be traced."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(torch.ops.mctest.twice(self.a(x))), y)


def twice_case(seed: int = 0):
    torch.manual_seed(seed)
    return TwiceMLP(), (torch.randn(4, 8), torch.randn(4, 8))


def untraceable(rank, world, mesh, options):
    """A train step of TwiceMLP: (error text or None, loss, full gradients)."""
    model, inputs = twice_case()
    try:
        pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
        loss = pm.train_step(*inputs)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}", None, None
    return None, loss.item(), pm.full_grads()
