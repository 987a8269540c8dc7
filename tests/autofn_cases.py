"""Custom torch.autograd.Functions whose backward is not their forward's derivative, a model that applies
them, and the gloo worker of tests/test_autograd_fn.py (module level: the pool's processes import them, and a
rank that loads rank 0's capture finds each Function by its module and name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

import mcompile as mc


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: round in forward, identity in backward (round's derivative is 0)."""

    @staticmethod
    def forward(ctx, a):
        return torch.round(a)

    @staticmethod
    def backward(ctx, g):
        return g


class ScaleGrad(torch.autograd.Function):
    """Squares in forward; backward scales the true derivative by ``s`` (a non-tensor ctx attribute) from a
    saved tensor."""

    @staticmethod
    def forward(ctx, a, s):
        ctx.s = s
        ctx.save_for_backward(a)
        return a * a

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g * 2 * a * ctx.s, None


class ProductAndMax(torch.autograd.Function):
    """Two outputs, the second marked non-differentiable; a tuple argument; ``needs_input_grad`` read;
    the gradient of ``a`` halved."""

    @staticmethod
    def forward(ctx, a, b, dims):
        m = a.amax(dim=dims, keepdim=True)
        ctx.mark_non_differentiable(m)
        ctx.save_for_backward(a, b)
        return a * b, m

    @staticmethod
    def backward(ctx, g, g_max):
        a, b = ctx.saved_tensors
        return (g * b * 0.5 if ctx.needs_input_grad[0] else None,
                g * a if ctx.needs_input_grad[1] else None, None)


class Recomputed(torch.autograd.Function):
    """A hand-written recompute: backward runs the forward again under autograd and differentiates it
    (torch.autograd.grad inside backward), then triples the result."""

    @staticmethod
    def forward(ctx, a, w):
        ctx.save_for_backward(a, w)
        return F.gelu(a) * w

    @staticmethod
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        with torch.enable_grad():
            a2, w2 = a.detach().requires_grad_(), w.detach().requires_grad_()
            out = F.gelu(a2) * w2
        return torch.autograd.grad(out, (a2, w2), g * 3.0)


class Shift(torch.autograd.Function):
    """The newer form: forward without ctx, setup_context, a default argument; backward scales by it."""

    @staticmethod
    def forward(a, shift=0.5):
        return a + shift

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.shift = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.shift, None


FUNCTIONS = (RoundSTE, ScaleGrad, ProductAndMax, Recomputed, Shift)


class QuantNet(torch.nn.Module):
    """An embedding, a residual MLP whose hidden activation passes through the Functions, a head, cross-entropy."""

    def __init__(self, vocab: int = 32, d: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, 2 * d))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids, labels):
        h = self.emb(ids)
        u = RoundSTE.apply(self.up(h) * 4) / 4
        u = ScaleGrad.apply(u, 0.25)
        u, m = ProductAndMax.apply(u, torch.sigmoid(u), (-1,))
        u = Shift.apply(Recomputed.apply(u - m, self.gain))
        h = h + self.down(u)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def quant_case(seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    return QuantNet(), (torch.randint(0, 32, (4, 6), generator=g), torch.randint(0, 32, (4, 6), generator=g))


def forward_differentiated(model, inputs):
    """The gradients autograd would give if each Function's forward were differentiated (what capturing its
    forward's ops, as torch.export does, would train with)."""
    from torch.autograd.function import Function, _is_setup_context_defined

    def through_forward(cls, *args):
        if _is_setup_context_defined(cls.setup_context):
            return cls.forward(*args)
        return cls.forward(FunctionCtx(), *args)

    model.zero_grad()
    saved = Function.__dict__["apply"]
    Function.apply = classmethod(through_forward)
    try:
        model(*inputs).backward()
    finally:
        Function.apply = saved
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def train_step(rank, world, mesh, options):
    """One parallelized training step of QuantNet: (loss, full gradients) on every rank."""
    model, inputs = quant_case()
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    loss = pm.train_step(*inputs)
    return loss.item(), pm.full_grads()
