"""Models for tests/test_capture_checks.py, in a module pytest does not rewrite: their ``assert`` statements
compile as in a user's model (pytest rewrites a test module's asserts into other bytecode)."""

from __future__ import annotations

import torch
import torch.nn as nn

V, D = 16, 8


class Checked(nn.Module):
    """Input validation as Hugging Face models write it: an ``assert`` on ``.item()`` (ProphetNet's label shift),
    ``if ...: raise`` (torch.distributions' argument checks), and an ``assert a and b`` over two reductions."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, ids):
        assert torch.all(ids >= 0).item(), "ids must be non-negative"
        if (ids >= V).any():
            raise ValueError(f"ids out of the vocabulary ({V})")
        h = self.emb(ids)
        assert h.isnan().sum() == 0 and h.isinf().sum() == 0, "NaN in the embeddings"
        return self.fc2(torch.relu(self.fc1(h))).pow(2).mean()


class WindowedMask(nn.Module):
    """Longformer / LED: a size computed as a tensor (``torch.div(size, k, rounding_mode="trunc")``) and used in a
    view, and a default mask built in forward (``ones``, padded, inverted to an additive mask) whose
    ``(mask > 0).any().item()`` picks a branch: values of the shapes and constants alone."""

    def __init__(self, window: int = 2):
        super().__init__()
        self.w = window
        self.emb = nn.Embedding(V, D)
        self.proj = nn.Linear(D, D)

    def forward(self, ids, attention_mask=None):
        h = self.emb(ids)
        if attention_mask is None:
            attention_mask = torch.ones(ids.shape, dtype=torch.long)
        mask = torch.nn.functional.pad(attention_mask, (0, 1), value=0)[:, :-1]
        inverted = 1.0 - mask[:, None, :].to(h.dtype)
        additive = inverted.masked_fill(inverted.bool(), torch.finfo(h.dtype).min) * inverted
        is_global = (additive[:, 0] > 0).flatten().any().item()
        chunks = h.view(h.size(0), torch.div(h.size(1), self.w, rounding_mode="trunc"), self.w, D)
        out = self.proj(chunks).sum(2)
        if is_global:  # global attention tokens: a path the default mask never takes
            out = out * 0
        return out.pow(2).mean()


class ConfigScale(torch.autograd.Function):
    """A Function applied with a configuration dict (YOSO's ``YosoCumulation.apply(..., config)``): forward scales
    by ``config["fwd"]``, backward by ``config["bwd"]`` (not the forward's derivative)."""

    @staticmethod
    def forward(ctx, x, config):
        ctx.config = config
        return x * config["fwd"]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.config["bwd"], None


class Configured(nn.Module):
    def __init__(self, configs):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.configs = configs

    def forward(self, x):
        for cfg in self.configs:
            x = ConfigScale.apply(self.lin(x), cfg)
        return x.pow(2).mean()
