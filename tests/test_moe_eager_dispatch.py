"""Mixture-of-experts layers written as eager per-expert code, planned at tp=2 in Megatron's layout (issue 37).

Transformers' Switch Transformers and NLLB-MoE keep each expert as its own ``nn.Linear`` pair in a ModuleList /
ModuleDict and dispatch with the eager loop ``for e in expert_hit: t = torch.where(mask[e]); ... index_add_``
(unrolled by mcompile/loops.py). The routing (``argmax``, ``one_hot``, one-argument ``torch.where``,
``torch.greater``) runs replicated by its own rules, each expert's fc1 column-parallel and fc2 row-parallel over
the tokens it got (a data-dependent count), one tp exit for the whole MoE block (Megatron Core's layout of
experts under tp without ep). Oracle: the single-device model, loss and every gradient, in the thread simulator.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from sim_harness import assert_sim_parity

from mcompile.placements import Shard

D, F_HID, E, VOCAB = 64, 128, 4, 128


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, F_HID), nn.Linear(F_HID, D)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class EagerMoE(nn.Module):
    """Top-1 routing by argmax, experts a ModuleList, the transformers eager dispatch loop."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, h):
        b, s, _ = h.shape
        h = h.reshape(-1, D)
        probs = self.router(h).softmax(-1)
        top = probs.argmax(-1)
        out = torch.zeros_like(h)
        with torch.no_grad():
            mask = F.one_hot(top, E).permute(1, 0)
            hit = torch.greater(mask.sum(-1), 0).nonzero()
        for e in hit:
            (t,) = torch.where(mask[e[0]])
            out.index_add_(0, t, self.experts[e[0]](h[t]) * probs[t, e[0], None])
        return out.reshape(b, s, D)


class Tiny(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(layers))
        self.moes = nn.ModuleList(EagerMoE() for _ in range(layers))
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_per_expert_modules_eager_dispatch_tp2_megatron_layout_and_parity():
    """No op replicated by fallback, every expert's fc1 by its output features and fc2 by its input, no
    layout finding (the MoE block's one exit), single-device parity of loss and every gradient."""
    from mcompile.api import compile_plan
    from mcompile.mesh import Mesh
    from mcompile.propagate import FallbackWarning

    torch.manual_seed(0)
    model = Tiny(layers=1)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    assert c.plan.fallbacks == [] and c.quality == []
    for e in range(E):
        pre = f"moes.0.experts.{e}."
        assert c.plan.params[pre + "fc1.weight"].placements == (Shard(0),), e
        assert c.plan.params[pre + "fc2.weight"].placements == (Shard(1),), e
    assert_sim_parity(c, model, inputs, "eager per-expert MoE tp=2")
