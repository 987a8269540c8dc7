"""Mixture-of-experts layers written as eager per-expert code, planned at tp=2 in Megatron's layout (issue 37).

Transformers' Switch Transformers and NLLB-MoE keep each expert as its own ``nn.Linear`` pair in a ModuleList /
ModuleDict and dispatch with the eager loop ``for e in expert_hit: t = torch.where(mask[e]); ... index_add_``
(unrolled by mcompile/capture/loops.py); DBRX keeps its experts stacked in 2-D parameters ``[E * f, d]`` read as
``w.view(E, f, d)[e]`` in the same loop. The routing (``argmax``, ``one_hot``, one-argument ``torch.where``,
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

from mcompile.ir.placements import BlockShard, Shard

D, F_HID, E, VOCAB = 64, 128, 4, 128


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        # (no bias on fc2, as Switch Transformers' experts: a down-projection bias added to each expert's partial
        # sum is not yet moved past the reduction, docs/architecture.md section 11)
        self.fc1, self.fc2 = nn.Linear(D, F_HID), nn.Linear(F_HID, D, bias=False)

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


class StackedMoE(nn.Module):
    """DBRX's experts: one [E * f, d] parameter per projection, each expert's slice viewed out in the loop;
    top-2 routing."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E * F_HID, D) * D ** -0.5)
        self.v1 = nn.Parameter(torch.randn(E * F_HID, D) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E * F_HID, D) * F_HID ** -0.5)

    def forward(self, h):
        b, s, _ = h.shape
        h = h.reshape(-1, D)
        w, top = self.router(h).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(h)
        with torch.no_grad():
            mask = F.one_hot(top, E).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            k, t = torch.where(mask[e])
            w1, v1, w2 = (p.view(-1, F_HID, D)[e] for p in (self.w1, self.v1, self.w2))
            y = (F.silu(h[t] @ w1.T) * (h[t] @ v1.T)) @ w2
            out.index_add_(0, t, y * w[t, k, None])
        return out.reshape(b, s, D)


class Tiny(nn.Module):
    def __init__(self, layers: int = 4, moe=EagerMoE):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(layers))
        self.moes = nn.ModuleList(moe() for _ in range(layers))
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _plan(model):
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh
    from mcompile.sharding.propagate import FallbackWarning

    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    assert c.plan.fallbacks == [] and c.quality == []
    # the MoE block is the layer's one tp region: its experts' partial sums reduced once
    # (the embedding's and the vocab-parallel loss's, outside any layer, aside)
    fwd = [s.forward for s in c.plan.collectives if s.axis == "tp" and s.forward != "none" and s.layer is not None]
    assert fwd == ["all_reduce"], fwd
    # and the quality check's bar is that one exit: the experts' down projections summed into one running sum
    # count once, their input projections (reading x[token_idx], rows chosen by the router) are no exit
    from mcompile.sharding.planner import latent_hints, router_hints
    from mcompile.sharding.quality import tp_exits

    exits = tp_exits(c.captured.gm, frozenset(latent_hints(c.captured)) | frozenset(router_hints(c.captured)))
    assert len(exits[0]) == 1, exits
    return c, inputs


def test_per_expert_modules_eager_dispatch_tp2_megatron_layout_and_parity():
    """No op replicated by fallback, every expert's fc1 by its output features and fc2 by its input, one forward
    tp collective for the MoE block, single-device parity of loss and every gradient."""
    torch.manual_seed(0)
    model = Tiny(layers=1)
    c, inputs = _plan(model)
    for e in range(E):
        pre = f"moes.0.experts.{e}."
        assert c.plan.params[pre + "fc1.weight"].placements == (Shard(0),), e
        assert c.plan.params[pre + "fc2.weight"].placements == (Shard(1),), e
    assert_sim_parity(c, model, inputs, "eager per-expert MoE tp=2")


def test_stacked_2d_expert_weights_tp2_megatron_layout_and_parity():
    """Experts stacked in [E * f, d] parameters: each split by blocks of its experts' rows (every expert's hidden
    units halved, ``BlockShard(0, E)``), one forward tp collective for the MoE block, single-device parity."""
    torch.manual_seed(0)
    model = Tiny(layers=1, moe=StackedMoE)
    c, inputs = _plan(model)
    for name in ("w1", "v1", "w2"):
        assert c.plan.params[f"moes.0.{name}"].placements == (BlockShard(0, E),), name
    assert_sim_parity(c, model, inputs, "stacked 2-D experts tp=2")


class ZeroExpertMoE(nn.Module):
    """LongCat-Flash's zero experts: the router scores E real and Z identity experts; a slot routed to an identity
    expert gets weight 0 and a dummy index in [0, E) (the experts see derived indices, not top-k's), and the
    identity experts' weight times the input is added after the experts. 3-D expert weights gathered per slot
    (transformers' batched-mm experts)."""

    Z, F = 4, 16

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E + self.Z, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, 2 * self.F, D) * D ** -0.5)
        self.down = nn.Parameter(torch.randn(E, D, self.F) * self.F ** -0.5)

    def forward(self, h):
        b, s, _ = h.shape
        h = h.reshape(-1, D)
        scores = self.router(h).softmax(-1)
        idx = scores.topk(2, dim=-1)[1].detach()
        w = scores.gather(1, idx)
        zero = idx >= E
        identity = w.masked_fill(~zero, 0.0).sum(-1, keepdim=True)
        idx = torch.where(zero, (idx - E) * E // self.Z, idx)
        w = w.masked_fill(zero, 0.0)
        gate, up = torch.einsum("td,tkfd->tkf", h, self.gate_up[idx]).chunk(2, dim=-1)
        y = torch.einsum("tkf,tkdf->tkd", F.silu(gate) * up, self.down[idx])
        out = (y * w.unsqueeze(-1)).sum(1)
        return (out + h * identity).reshape(b, s, D)


def test_zero_experts_dispatched_on_derived_indices_tp2_parity():
    """The experts' region reads indices derived from top-k's (identity slots remapped): it is still found as one
    ``moe_ffn`` (on the derived indices), expert-TP at tp=2 (gate/up by blocks, down by its input), the identity
    term beside it, one forward tp collective for the layer, single-device parity."""
    from mcompile.ir.moe import moe_layers_of

    torch.manual_seed(0)
    model = Tiny(layers=1, moe=ZeroExpertMoE)
    c, inputs = _plan(model)
    assert [n.kwargs["form"] for n in moe_layers_of(c.captured.gm)] == ["silu/fused_gu/oi"]
    assert c.plan.params["moes.0.down"].placements == (Shard(2),)
    assert_sim_parity(c, model, inputs, "zero experts tp=2")
