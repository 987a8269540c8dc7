"""Megatron's tensor-parallel layout, or a warning that names what is not (mcompile.sharding.quality), and fused
projections of unequal parts sharded part-wise (mcompile.ir.placements.BlockShard with size ratios).

What is isolated: a fused projection cut into parts along its features — Phi-3's ``qkv_proj`` sliced into 4
query and 2 + 2 key/value heads and its ``gate_up_proj`` chunked in two, a plain PyTorch block whose fused
q/k/v is ``torch.split`` into unequal sizes — plans with each part sharded over tp (a rank holds its query
heads and the key/value heads they attend with), so a layer runs Megatron's 2 forward tp collectives (4 with
sequence parallelism), trains at parity (loss and every gradient, in-process thread simulator), and plans
with no PlanQualityWarning. Without the part-wise layout (the block hints removed, as the plans were
before) the same model trains at parity too — which is why the quality check exists: it must then warn,
naming the layer's extra collectives. Models have 4 layers, so block repetition is on.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from sim_harness import assert_sim_parity

from mcompile.api import compile_plan
from mcompile.ir.mesh import Mesh
from mcompile.ir.placements import BlockShard, Replicate, Shard
from mcompile.sharding.quality import PlanQualityWarning


def phi3(layers: int = 4, kv_heads: int = 2):
    import transformers as hf
    from transformers.utils import logging

    from mcompile.models.hf import CausalLMLoss

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = hf.Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=kv_heads, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    return CausalLMLoss(hf.Phi3ForCausalLM(cfg)).eval()


class FusedBlock(torch.nn.Module):
    """A plain pre-norm block with one fused q/k/v projection split into unequal parts (GQA: 4 query heads,
    1 key/value head... at tp=2 that head cannot split: 2 key/value heads here) and a fused gate/up."""

    def __init__(self, dim=32, heads=4, kv_heads=2, ffn=64):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.hd, bias=True)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.gate_up = torch.nn.Linear(dim, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = torch.split(self.qkv(self.norm1(x)), [self.heads * self.hd, self.kv_heads * self.hd,
                                                        self.kv_heads * self.hd], dim=-1)
        q = q.view(b, s, -1, self.hd).transpose(1, 2)
        k = k.view(b, s, -1, self.hd).transpose(1, 2).repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.view(b, s, -1, self.hd).transpose(1, 2).repeat_interleave(self.heads // self.kv_heads, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.out(a)
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class FusedLM(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, layers=4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(FusedBlock(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


_PHI3: dict = {}


def _phi3_plan(tp: int, sp: bool = False, kv_heads: int = 2):
    """(model, compiled, inputs, quality warnings), cached per layout (capture and plan cost seconds)."""
    key = (tp, sp, kv_heads)
    if key not in _PHI3:
        model = phi3(kv_heads=kv_heads)
        _PHI3[key] = (model, *_plan(model, 128, tp, sp))
    return _PHI3[key]


def _plan(model, vocab: int, tp: int, sp: bool = False):
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, vocab, (2, 16), generator=g), torch.randint(0, vocab, (2, 16), generator=g))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = compile_plan(model, Mesh.fake(tp=tp), inputs, sequence_parallel=sp)
    return c, inputs, [w for w in caught if issubclass(w.category, PlanQualityWarning)]


def _forward_tp_per_layer(c) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for s in c.plan.collectives:
        if s.axis == "tp" and s.layer is not None and s.forward != "none":
            out.setdefault(s.layer, Counter())[s.forward] += 1
    return out


def _parity(model, c, inputs):
    assert_sim_parity(c, model, inputs)


@pytest.mark.timeout(300)
def test_phi3_fused_projections_are_sharded_part_wise_with_megatrons_collectives():
    model, c, inputs, quality = _phi3_plan(tp=2)
    assert not quality and c.quality == []
    for i in range(4):
        pl = {k.rsplit(f"layers.{i}.", 1)[1]: v.placements[0] for k, v in c.plan.params.items() if f"layers.{i}." in k}
        assert pl["self_attn.qkv_proj.weight"] == BlockShard(0, (2, 1, 1))  # [q 4 heads | k 2 | v 2], each by heads
        assert pl["mlp.gate_up_proj.weight"] == BlockShard(0, 2)
        assert pl["self_attn.o_proj.weight"] == Shard(1) and pl["mlp.down_proj.weight"] == Shard(1)
    per_layer = _forward_tp_per_layer(c)
    assert sorted(per_layer) == [0, 1, 2, 3], per_layer
    assert all(cnt == Counter(all_reduce=2) for cnt in per_layer.values()), per_layer
    _parity(model, c, inputs)


@pytest.mark.timeout(300)
def test_phi3_under_sequence_parallelism_keeps_megatrons_four():
    _, c, _, quality = _phi3_plan(tp=2, sp=True)
    assert not quality
    assert all(cnt == Counter(all_gather=2, reduce_scatter=2) for cnt in _forward_tp_per_layer(c).values())


@pytest.mark.timeout(300)
def test_a_plain_fused_block_split_unequally_plans_part_wise_at_parity():
    """Build for the class: a plain PyTorch block (not HF) whose fused q/k/v (with a bias) is ``torch.split``
    into unequal sizes: the weight and the bias are B(0,2:1:1), two forward all-reduces a layer."""
    torch.manual_seed(0)
    model = FusedLM()
    c, inputs, quality = _plan(model, 64, tp=2)
    assert not quality
    assert c.plan.params["layers.0.qkv.weight"].placements[0] == BlockShard(0, (2, 1, 1))
    assert c.plan.params["layers.0.qkv.bias"].placements[0] == BlockShard(0, (2, 1, 1))
    assert all(cnt == Counter(all_reduce=2) for cnt in _forward_tp_per_layer(c).values())
    _parity(model, c, inputs)


@pytest.mark.timeout(300)
def test_the_quality_check_warns_when_fused_parts_are_split_as_plain_rows(monkeypatch):
    """The layout as it was before part-wise sharding (no block hints: the fused weights split as plain rows,
    rank 0 holding all of q): it trains at parity, so only the quality check can see it. It must warn, per layer,
    with the extra collectives and the nodes they move."""
    import mcompile.sharding.planner as planner

    monkeypatch.setattr(planner, "block_hints", lambda cap: {})
    c, _, quality = _plan(phi3(), 128, tp=2)
    assert len(quality) == 1
    text = str(quality[0].message)
    assert "layers 0, 1, 2, 3:" in text and "where Megatron runs 2" in text and "all_gather of linear" in text, text
    assert c.quality[0].kind == "collectives" and c.quality[0].layers == (0, 1, 2, 3), c.quality


@pytest.mark.timeout(300)
def test_the_quality_check_names_an_attention_left_whole_by_key_value_heads_tp_cannot_split():
    """2 key/value heads over tp=4 (Megatron refuses it: its query groups must divide by tp). The fused qkv_proj
    is kept whole (planner.kv_hints), but slicing the queries, keys and values by heads would cost more bytes than
    gathering the attention's output, so the plan runs the attention whole on every rank: 2 collectives a layer,
    yet not Megatron's layout, and the check says so (before kv_hints it named the keys' and values' gathers)."""
    model, c, inputs, quality = _phi3_plan(tp=4)
    assert quality and [f.kind for f in c.quality] == ["whole attention"] and c.quality[0].layers == (0, 1, 2, 3)
    pl = {k.rsplit("layers.0.", 1)[1]: v.placements[0] for k, v in c.plan.params.items() if "layers.0." in k}
    assert pl["self_attn.qkv_proj.weight"] == Replicate()
    _parity(model, c, inputs)


# ------------------------------------------------------------------ norm weights read through pointwise ops


class _GemmaRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm: the weight stored as an offset from 1, the scale ``1 + w`` computed in fp32."""

    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim) * 0.1)

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y * (1.0 + self.weight.float())).type_as(x)


class _CohereLayerNorm(torch.nn.Module):
    """Cohere's bias-free LayerNorm: ``self.weight.to(float32) * normalised``, then cast back."""

    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + torch.randn(dim) * 0.1)

    def forward(self, x):
        h = x.to(torch.float32)
        h = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, keepdim=True, correction=0) + 1e-5)
        return (self.weight.to(torch.float32) * h).to(x.dtype)


class _LayerNorm1P(torch.nn.LayerNorm):
    """Nemotron's layernorm1p: ``F.layer_norm`` with the weight ``w + 1``."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class NormBlock(torch.nn.Module):
    """A pre-norm block whose norms read their weights through pointwise ops first (no activation yet), whose
    fused q/k/v projection is viewed to [b, s, 3, heads, head_dim] and unbound (ModernBERT's ``Wqkv``), and
    whose fused gate/up projection is viewed to [b, s, 2, ffn] and read part by part (Moshi's MLP)."""

    def __init__(self, dim=32, heads=4, ffn=64):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = _GemmaRMSNorm(dim), _CohereLayerNorm(dim)
        self.qkv, self.o = torch.nn.Linear(dim, 3 * dim, bias=False), torch.nn.Linear(dim, dim, bias=False)
        self.up, self.down = torch.nn.Linear(dim, 2 * ffn, bias=False), torch.nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (p.transpose(1, 2) for p in self.qkv(h).view(b, s, 3, self.heads, -1).unbind(dim=2))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        gate_up = self.up(self.norm2(x)).view(b, s, 2, -1)  # Moshi's fused gate/up, viewed apart
        return x + self.down(F.gelu(gate_up[..., 0, :]) * gate_up[..., 1, :])


class NormLM(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, layers=4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(NormBlock(dim) for _ in range(layers))
        self.norm = _LayerNorm1P(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(300)
def test_norm_weights_read_through_pointwise_ops_stay_whole():
    """Gemma's ``1 + w``, Cohere's ``w.to(float32) * x`` and Nemotron's ``layer_norm(x, w + 1)``: the op reading
    the weight first reads no activation, so every placement of it ties at no cost; the weight must still be
    whole (placed by the op that meets the residual stream), not split over features with the norm's output
    gathered twice a layer. The gate/up and the q/k/v viewed apart are fused projections: B(0, 2) and B(0, 3), each
    rank its share of each part (a view of the cut dim into (parts, heads, head_dim) included)."""
    torch.manual_seed(0)
    model = NormLM()
    c, inputs, quality = _plan(model, 64, tp=2)
    assert not quality and c.quality == []
    pl = {k: v.placements[0] for k, v in c.plan.params.items()}
    assert all(pl[f"layers.{i}.norm{j}.weight"] == Replicate() for i in range(4) for j in (1, 2))
    assert pl["norm.weight"] == Replicate() and pl["norm.bias"] == Replicate()
    assert pl["layers.0.up.weight"] == BlockShard(0, 2) and pl["layers.0.down.weight"] == Shard(1)
    assert pl["layers.0.qkv.weight"] == BlockShard(0, 3) and pl["layers.0.o.weight"] == Shard(1)
    assert all(cnt == Counter(all_reduce=2) for cnt in _forward_tp_per_layer(c).values()), _forward_tp_per_layer(c)
    _parity(model, c, inputs)


# ------------------------------------------------------------------ MoE: a router in its own class, shared expert


class _GroupLimitedRouter(torch.nn.Module):
    """DeepSeek-style routing in its own module: a bare weight read by ``F.linear`` through casts, sigmoid
    scores, a correction bias that steers the choice only, group-limited top-k (masked_fill), normalised
    weights."""

    def __init__(self, dim, experts, top_k=2, groups=4, topk_groups=2):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, dim) / dim ** 0.5)
        self.register_buffer("e_score_correction_bias", torch.randn(experts) * 0.05)
        self.top_k, self.groups, self.topk_groups = top_k, groups, topk_groups

    def forward(self, xt):
        scores = F.linear(xt.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        t, e = choice.shape
        grouped = choice.view(t, self.groups, e // self.groups)
        keep = torch.zeros(t, self.groups).scatter(1, grouped.topk(2, -1)[0].sum(-1).topk(self.topk_groups)[1], 1.0)
        mask = keep.unsqueeze(-1).expand(-1, -1, e // self.groups).reshape(t, e)
        idx = choice.masked_fill(~mask.bool(), float("-inf")).topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, idx)
        return idx, w / w.sum(-1, keepdim=True)


class MoEBlock(torch.nn.Module):
    """Attention, then routed experts (more of them than half the hidden width, so the router is no narrow
    linear) plus a shared expert, summed after the routed output is viewed back to [b, s, h]."""

    def __init__(self, dim=32, heads=4, experts=32, hidden=16, gated=False):
        from mcompile.models.moe_lm import GroupedExperts

        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate = _GroupLimitedRouter(dim, experts)
        self.experts = GroupedExperts(experts, dim, hidden)
        for p in self.experts.parameters():
            torch.nn.init.normal_(p, std=dim ** -0.5)
        self.shared_up = torch.nn.Linear(dim, 2 * hidden, bias=False)
        self.shared_down = torch.nn.Linear(2 * hidden, dim, bias=False)
        # Qwen2-MoE's shared-expert gate: a scalar a token, the sigmoid of a [1, dim] linear
        self.shared_gate = torch.nn.Linear(dim, 1, bias=False) if gated else None

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        xt = h.view(-1, d)
        idx, w = self.gate(xt)
        routed = self.experts(xt, idx, w).view(b, s, d)
        shared = self.shared_down(F.silu(self.shared_up(h)))
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(h)) * shared
        return x + (routed + shared)


class MoELM(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, layers=4, gated=False):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(MoEBlock(dim, gated=gated) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class _WideQKNormLM(torch.nn.Module):
    """ESM-C's attention: LayerNorms over the whole query and key projections (all heads at once), then
    heads (a bias on the query norm: written out too); a plain MLP."""

    def __init__(self, vocab=64, dim=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(vocab, dim)
        lin = lambda i, o: torch.nn.ModuleList(torch.nn.Linear(i, o) for _ in range(layers))  # noqa: E731
        self.q, self.k, self.v, self.o, self.up, self.down = (lin(dim, dim), lin(dim, dim), lin(dim, dim),
                                                                lin(dim, dim), lin(dim, 2 * dim), lin(2 * dim, dim))
        self.qn = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(layers))
        self.kn = torch.nn.ModuleList(torch.nn.LayerNorm(dim, bias=False) for _ in range(layers))  # key bias: no grad
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        b, s, d = x.shape
        for i in range(len(self.q)):
            q, k = self.qn[i](self.q[i](x)), self.kn[i](self.k[i](x))
            q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, self.v[i](x)))
            x = x + self.o[i](F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))
            x = x + self.down[i](F.gelu(self.up[i](x)))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(300)
def test_a_layer_norm_over_all_heads_reduces_its_statistics_and_attention_keeps_its_heads():
    """A LayerNorm over a projection's whole output (ESM-C's q/k norm across heads) is written out as its
    statistics (passes/canonicalize.projection_norm_statistics), whose mean over the tp-split heads all-reduces
    a [b, s, 1] (as OLMo-2's RMSNorm over all heads): attention keeps its heads split and the layer leaves tp
    twice, Megatron's count. Before, the one layer_norm op gathered q and k and ran the attention whole: 5
    forward tp collectives a layer (ESM-C in the zoo)."""
    from mcompile.sharding.quality import _STATISTICS

    torch.manual_seed(0)
    model = _WideQKNormLM()
    c, inputs, quality = _plan(model, 64, tp=2)
    assert not quality and c.quality == []
    nodes = {n.name: n for n in c.captured.gm.graph.nodes}
    for layer in range(2):
        specs = [sp for sp in c.plan.collectives if sp.axis == "tp" and sp.layer == layer and sp.forward != "none"
                 and nodes[sp.origin].target not in _STATISTICS]
        assert [sp.forward for sp in specs] == ["all_reduce"] * 2, specs
    _parity(model, c, inputs)


class _RowAdapterLM(torch.nn.Module):
    """X-MOD's language adapters: after each MLP, the rows of the batch whose language is the adapter's
    (``h[mask]``: a data-dependent number of rows) go through a bottleneck MLP and are written back."""

    def __init__(self, vocab=64, dim=32, layers=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.up = torch.nn.ModuleList(torch.nn.Linear(dim, 2 * dim) for _ in range(layers))
        self.down = torch.nn.ModuleList(torch.nn.Linear(2 * dim, dim) for _ in range(layers))
        self.a1 = torch.nn.ModuleList(torch.nn.Linear(dim, dim // 2) for _ in range(layers))
        self.a2 = torch.nn.ModuleList(torch.nn.Linear(dim // 2, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        mask = ids[:, 0] >= 0  # every row "speaks the language", but the count is the data's
        for up, down, a1, a2 in zip(self.up, self.down, self.a1, self.a2):
            x = x + down(F.gelu(up(x)))
            new = torch.zeros_like(x)
            new[mask] = a2(F.gelu(a1(x[mask])))
            x = x + new
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(300)
def test_rows_picked_by_a_mask_are_tokens_not_features():
    """A dim whose size is data-dependent (rows of the batch picked by a boolean mask: X-MOD's adapters) is a token
    dim, which tp does not split without sequence parallelism: the adapter's row-parallel exit all-reduces once, as
    Megatron's would. Before, the planner took the row count for a feature dim and left the exit as a reduce-scatter
    over the rows and an all-gather: 3 forward tp collectives a layer where Megatron runs 2."""
    torch.manual_seed(0)
    model = _RowAdapterLM()
    c, inputs, quality = _plan(model, 64, tp=2)
    assert all(cnt == Counter(all_reduce=2) for cnt in _forward_tp_per_layer(c).values()), _forward_tp_per_layer(c)
    assert not quality and c.quality == []
    _parity(model, c, inputs)


class _SkipClassRouter(torch.nn.Module):
    """Zaya's routing: softmax scores over the experts plus one skip class (no compute), so the router has
    experts + 1 outputs, which tp=2 does not divide; a token routed to the skip class gets weight 0."""

    def __init__(self, dim, experts, top_k=2):
        super().__init__()
        self.proj = torch.nn.Linear(dim, experts + 1, bias=False)
        self.experts, self.top_k = experts, top_k

    def forward(self, xt):
        scores = self.proj(xt).softmax(-1)
        w, idx = scores.topk(self.top_k, dim=-1)
        skip = idx == self.experts
        return idx.masked_fill(skip, 0), w.masked_fill(skip, 0.0)


@pytest.mark.timeout(300)
def test_a_router_whose_outputs_tp_does_not_divide_is_kept_whole_not_refused():
    """A router stays whole on every tp rank (router_hints), so tp need not divide its outputs: the divisibility
    check skips it as it skips a low-rank latent. Before, 4 experts + a skip class refused tp=2 ("tp=2 does not
    divide the size 5 of ...proj.weight"), as Zaya did in the Hugging Face zoo."""
    from mcompile.models.moe_lm import GroupedExperts

    torch.manual_seed(0)
    model = MoELM(layers=2)
    for layer in model.layers:
        layer.gate = _SkipClassRouter(32, 4)
        layer.experts = GroupedExperts(4, 32, 16)
        for p in layer.experts.parameters():
            torch.nn.init.normal_(p, std=32 ** -0.5)
    c, inputs, _ = _plan(model, 64, tp=2)
    assert c.plan.params["layers.0.gate.proj.weight"].placements[0] == Replicate()
    _parity(model, c, inputs)


@pytest.mark.timeout(300)
def test_a_router_in_its_own_class_stays_whole_and_shared_and_routed_experts_reduce_once():
    """Megatron's MoE layer: the router weight whole on every tp rank (each routes its tokens from the full
    hidden state: no gather of scores, group masks or sigmoids), and the routed experts' and the shared
    expert's row-parallel partial sums added before one all-reduce: 2 forward collectives a layer
    (attention's exit, the MoE layer's), and the quality check holds the plan to those 2."""
    from mcompile.sharding.quality import tp_exits

    torch.manual_seed(0)
    model = MoELM()
    c, inputs, quality = _plan(model, 64, tp=2)
    assert not quality and c.quality == []
    assert c.plan.params["layers.0.gate.weight"].placements[0] == Replicate()
    assert c.plan.params["layers.0.shared_down.weight"].placements[0] == Shard(1)
    exits = tp_exits(c.captured.gm)  # per layer: attention's, and the MoE layer's (routed + shared, summed)
    assert all(len(e) == 2 and "moe_ffn" in e[1] and "+" in e[1] for e in exits.values()), exits
    assert all(cnt == Counter(all_reduce=2) for cnt in _forward_tp_per_layer(c).values()), _forward_tp_per_layer(c)
    _parity(model, c, inputs)


# ------------------------------------------------------------------ a dynamic attention mask computed from the values


class DynamicMaskBlock(torch.nn.Module):
    """Doge's attention: a projection of the values to one score per head (``dt_proj``), ``exp(A * softplus(.))``,
    broadcast over the queries into the attention's additive mask [b, heads, q, k]."""

    def __init__(self, dim=32, heads=4, ffn=64):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.dt = torch.nn.Linear(dim, heads, bias=False)
        self.A = torch.nn.Parameter(torch.randn(heads) * 0.1)
        self.up, self.down = torch.nn.Linear(dim, ffn, bias=False), torch.nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        dt = torch.exp(self.A * F.softplus(self.dt(v.transpose(1, 2).reshape(b, s, d)))).transpose(-1, -2)
        mask = dt[:, :, None, :].expand(-1, -1, s, -1)  # [b, heads, q, k]: a bias per key and head
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class DynamicMaskLM(NormLM):
    def __init__(self, vocab=64, dim=32, layers=4):
        super().__init__(vocab, dim, layers)
        self.layers = torch.nn.ModuleList(DynamicMaskBlock(dim) for _ in range(layers))


@pytest.mark.timeout(300)
def test_a_mask_computed_from_the_values_is_split_by_heads():
    """The mask's projection reads every head's values (row-parallel: its own exit), then its partial sum is
    reduce-scattered over the heads and the mask stays split with the heads, so the attention runs on each rank's
    heads: 3 forward tp collectives a layer (Megatron's attention and MLP exits plus the mask projection's), not the
    whole attention on every rank with q, k, v and the output gathered (6). Parity at tp=2."""
    torch.manual_seed(0)
    model = DynamicMaskLM()
    c, inputs, quality = _plan(model, 64, tp=2)
    assert not quality and c.quality == [], [str(f) for f in c.quality]
    pl = {k: v.placements[0] for k, v in c.plan.params.items()}
    assert pl["layers.0.dt.weight"] == Shard(1) and pl["layers.0.A"] == Shard(0)
    assert all(sum(cnt.values()) == 3 and "all_gather" not in cnt for cnt in _forward_tp_per_layer(c).values()), \
        _forward_tp_per_layer(c)
    _parity(model, c, inputs)


@pytest.mark.timeout(300)
def test_a_gated_shared_expert_is_scaled_while_partial_and_reduced_once_with_the_routed_experts():
    """Qwen2-MoE's shared expert is scaled by the sigmoid of a [1, h] gate before the routed experts' sum is
    added. The gate's weight stays whole (its one output row cannot split, and need not: tp need not divide
    1), and its replicated scale multiplies the shared expert's row-parallel partial sum (linear in it), so
    routed + gated shared still reduce in one all-reduce: Megatron's 2 forward collectives a layer (the
    scaled partial was reduced on its own before: 3, and the quality check, counting 3 exits, let it pass).
    The scale's gradient is a partial sum on each rank, so it enters the tp region with Megatron's f
    (backward all-reduce): parity holds the gate's gradient."""
    torch.manual_seed(0)
    from mcompile.sharding.quality import tp_exits

    model = MoELM(gated=True)
    c, inputs, quality = _plan(model, 64, tp=2)
    assert not quality and c.quality == []
    exits = tp_exits(c.captured.gm)  # the quality check's bar: the gated shared expert's exit merges too
    assert all(len(e) == 2 and "moe_ffn" in e[1] and "+" in e[1] for e in exits.values()), exits
    assert c.plan.params["layers.0.shared_gate.weight"].placements[0] == Replicate()
    assert c.plan.params["layers.0.shared_down.weight"].placements[0] == Shard(1)
    assert all(cnt == Counter(all_reduce=2) for cnt in _forward_tp_per_layer(c).values()), _forward_tp_per_layer(c)
    _parity(model, c, inputs)


class EinsumBlock(torch.nn.Module):
    """XLNet's attention: projections by [h, heads, d] weights written as einsums ("ibh,hnd->ibnd" in,
    "ibnd,hnd->ibh" out, the sequence first), then a post-norm MLP."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Parameter(torch.randn(dim, heads, dim // heads) * dim ** -0.5)
                                          for _ in range(4))
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):  # x: [s, b, h]
        q, k, v = (torch.einsum("ibh,hnd->ibnd", x, w) for w in (self.q, self.k, self.v))
        p = torch.einsum("ibnd,jbnd->bnij", q, k).mul(q.shape[-1] ** -0.5).softmax(-1)
        x = self.norm1(x + torch.einsum("ibnd,hnd->ibh", torch.einsum("bnij,jbnd->ibnd", p, v), self.o))
        return self.norm2(x + self.down(F.gelu(self.up(x))))


class EinsumLM(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, layers=4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(EinsumBlock(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids).transpose(0, 1)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x.transpose(0, 1)).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(300)
def test_an_einsum_output_projection_is_a_tp_region_exit():
    """An attention whose output projection is an einsum by a [h, heads, d] weight (XLNet) leaves a tp region
    as attention's ``linear`` does: the quality check counts 2 exits a layer (attention's, the MLP's) and the
    plan's 2 forward all-reduces pass it (the check counted 1 exit before and warned on Megatron's layout)."""
    from mcompile.sharding.quality import tp_exits

    torch.manual_seed(0)
    c, _, quality = _plan(EinsumLM(), 64, tp=2)
    exits = tp_exits(c.captured.gm)
    assert sorted(exits) == [0, 1, 2, 3] and all(len(e) == 2 for e in exits.values()), exits
    assert not quality and c.quality == []
    assert c.plan.params["layers.0.o"].placements[0] == Shard(1)  # by heads, as q, k and v
    assert all(cnt == Counter(all_reduce=2) for cnt in _forward_tp_per_layer(c).values()), _forward_tp_per_layer(c)


class TwoPartAttentionBlock(torch.nn.Module):
    """An attention whose output is the sum of two probability-times-value products (PegasusX's block-local
    attention: the scores against a few global tokens and against the rest, one softmax, each part times its
    own values), then out_proj and a pre-norm MLP."""

    def __init__(self, dim=32, heads=4, n_global=4):
        super().__init__()
        self.heads, self.g = heads, n_global
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        kg, kl, vg, vl = k[:, :, :self.g], k[:, :, self.g:], v[:, :, :self.g], v[:, :, self.g:]
        p = torch.cat([q @ kg.transpose(-1, -2), q @ kl.transpose(-1, -2)], -1).softmax(-1)
        a = p[..., :self.g] @ vg + p[..., self.g:] @ vl
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TwoPartAttentionLM(NormLM):
    def __init__(self, vocab=64, dim=32, layers=2):
        super().__init__(vocab, dim, layers)
        self.layers = torch.nn.ModuleList(TwoPartAttentionBlock(dim) for _ in range(layers))


@pytest.mark.timeout(300)
def test_an_attention_summed_from_two_products_is_one_tp_region_exit():
    """An attention output added from two probability-times-value products is the attention's output, not a
    residual sum: its out_proj is an exit (2 a layer with the MLP's), and Megatron's layout (2 all-reduces a
    layer) passes the check (it counted 1 exit and warned before)."""
    from mcompile.sharding.quality import tp_exits

    torch.manual_seed(0)
    model = TwoPartAttentionLM()
    c, inputs, quality = _plan(model, 64, tp=2)
    exits = tp_exits(c.captured.gm)
    assert sorted(exits) == [0, 1] and all(len(e) == 2 for e in exits.values()), exits
    assert not quality and c.quality == []
    assert all(cnt == Counter(all_reduce=2) for cnt in _forward_tp_per_layer(c).values()), _forward_tp_per_layer(c)


class ValueConvBlock(torch.nn.Module):
    """An attention whose output adds a depthwise convolution of its values along the sequence, per head
    (Nyströmformer's ``context + conv(value)``), then out_proj and a pre-norm MLP."""

    def __init__(self, dim=32, heads=4, kernel=3):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.conv = torch.nn.Conv2d(heads, heads, (kernel, 1), padding=(kernel // 2, 0), groups=heads, bias=False)
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = (q @ k.transpose(-1, -2)).softmax(-1) @ v + self.conv(v)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ValueConvLM(NormLM):
    def __init__(self, vocab=64, dim=32, layers=2):
        super().__init__(vocab, dim, layers)
        self.layers = torch.nn.ModuleList(ValueConvBlock(dim) for _ in range(layers))


@pytest.mark.timeout(300)
def test_an_attention_plus_a_per_head_conv_of_its_values_is_one_tp_region_exit():
    """Attention's output plus a per-head term of its shape (a depthwise conv of the values, as Nyströmformer) is
    the attention's output, not a residual sum: out_proj is an exit (2 a layer with the MLP's) and Megatron's
    layout (2 all-reduces a layer, the conv split by heads) passes the check (it counted 1 exit and warned)."""
    from mcompile.sharding.quality import tp_exits

    torch.manual_seed(0)
    c, inputs, quality = _plan(ValueConvLM(), 64, tp=2)
    exits = tp_exits(c.captured.gm)
    assert sorted(exits) == [0, 1] and all(len(e) == 2 for e in exits.values()), exits
    assert not quality and c.quality == []
    assert all(cnt == Counter(all_reduce=2) for cnt in _forward_tp_per_layer(c).values()), _forward_tp_per_layer(c)


class MaskedInPlaceBlock(torch.nn.Module):
    """Funnel's relative attention in small: scores cut from a wider tensor (a slice, a view of it) are masked in
    place (``positional_attn *= cls_mask``, a write into a view that functional_inplace keeps), and the MLP's
    activation max-pooled over the sequence by a (3, 1) window of [b, 1, s, f] (Funnel's pool_tensor's form; its
    (2, 1) stride halves the sequence, a size this test's lowering would read as data-dependent)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = torch.cat([q @ k.transpose(-1, -2), q[..., :1]], -1)[..., :s]  # a view of the cat
        scores *= torch.ones(s, s, device=x.device).tril()
        scores += torch.arange(s, device=x.device).float()  # add_, sub_, div_: the other in-place forms ruled alike
        scores -= torch.ones(s, device=x.device)
        scores /= torch.full((s, 1), 2.0, device=x.device)
        x = x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d))
        u = F.gelu(self.up(self.norm2(x)))  # column-parallel: split by features
        u = F.max_pool2d(u[:, None], (3, 1), stride=(1, 1), padding=(1, 0))[:, 0]  # a max over 3 tokens
        return x + self.down(u)


class MaskedInPlaceLM(NormLM):
    def __init__(self, vocab=64, dim=32, layers=2):
        super().__init__(vocab, dim, layers)
        self.layers = torch.nn.ModuleList(MaskedInPlaceBlock(dim) for _ in range(layers))

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels[:, :logits.shape[1]].flatten())


@pytest.mark.timeout(300)
def test_an_in_place_mask_of_a_view_and_a_max_pool_over_the_sequence_keep_their_split():
    """A score tensor masked in place (mul_ into a view) keeps its heads split and a max pool over the sequence
    keeps the MLP's features split: no op runs replicated (both fell back before: no rule for
    aten.mul_.Tensor nor aten.max_pool2d.default), and the ranks compute the model's loss and gradients."""
    torch.manual_seed(0)
    model = MaskedInPlaceLM()
    c, inputs, quality = _plan(model, 64, tp=2)
    assert c.plan.fallbacks == [], c.plan.fallbacks
    nodes = {n.name: n for n in c.captured.gm.graph.nodes}
    inplace = (torch.ops.aten.mul_.Tensor, torch.ops.aten.add_.Tensor, torch.ops.aten.sub_.Tensor,
               torch.ops.aten.div_.Tensor)
    muls = [k for k, n in nodes.items() if n.op == "call_function" and n.target in inplace]
    pools = [k for k, n in nodes.items() if n.op == "call_function" and n.target is torch.ops.aten.max_pool2d.default]
    assert len(muls) == 4 * 2 and all(c.plan.activations[k] == (Shard(1),) for k in muls), muls
    assert pools and all(c.plan.activations[k] == (Shard(3),) for k in pools), pools
    _parity(model, c, inputs)


class GatedExitBlock(torch.nn.Module):
    """RWKV's channel mix after a plain attention: ``sigmoid(receptance(x)) * value(relu(key(x)) ** 2)``, the
    gate applied to the MLP's output after its row-parallel projection."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.o = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.key, self.value = torch.nn.Linear(dim, 2 * dim, bias=False), torch.nn.Linear(2 * dim, dim, bias=False)
        self.receptance = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + torch.sigmoid(self.receptance(h)) * self.value(torch.relu(self.key(h)).square())


class GatedExitLM(NormLM):
    def __init__(self, vocab=64, dim=32, layers=2):
        super().__init__(vocab, dim, layers)
        self.layers = torch.nn.ModuleList(GatedExitBlock(dim) for _ in range(layers))


@pytest.mark.timeout(300)
def test_a_gate_projected_from_the_stream_onto_an_exit_is_one_more_exit():
    """A projection of the stream gating an MLP's output elementwise (RWKV's receptance) is a tp region of its
    own, sharded like every weight: it leaves at the product (all-gathered), so the check counts 3 exits a layer
    and every weight is sharded (it counted 2 and warned before)."""
    from mcompile.sharding.quality import tp_exits

    torch.manual_seed(0)
    c, inputs, quality = _plan(GatedExitLM(), 64, tp=2)
    exits = tp_exits(c.captured.gm)
    assert sorted(exits) == [0, 1] and all(len(e) == 3 for e in exits.values()), exits
    assert not quality and c.quality == []
    assert c.plan.params["layers.0.receptance.weight"].placements[0] == Shard(0)
    assert all(sum(cnt.values()) == 3 for cnt in _forward_tp_per_layer(c).values()), _forward_tp_per_layer(c)


class ConcatConvBlock(torch.nn.Module):
    """Separate q, k, v projections concatenated along their features for one depthwise causal conv over the
    channels, cut apart after it (BailingHybrid's linear attention), then attention, out_proj and an MLP."""

    def __init__(self, dim=32, heads=4, kernel=3):
        super().__init__()
        self.heads, self.kernel = heads, kernel
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.conv = torch.nn.Conv1d(3 * dim, 3 * dim, kernel, groups=3 * dim, padding=kernel - 1, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        qkv = torch.cat([self.q(h), self.k(h), self.v(h)], -1)
        qkv = F.silu(self.conv(qkv.transpose(1, 2))[..., :s]).transpose(1, 2)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in qkv.split([d, d, d], -1))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ConcatConvLM(NormLM):
    def __init__(self, vocab=64, dim=32, layers=2):
        super().__init__(vocab, dim, layers)
        self.layers = torch.nn.ModuleList(ConcatConvBlock(dim) for _ in range(layers))


@pytest.mark.timeout(300)
def test_projections_concatenated_for_a_depthwise_conv_stay_split_by_parts():
    """The cat of separately projected, column-parallel parts along their features is each rank's share of
    every part (the blocks of a fused projection): the depthwise conv takes the same blocks and the split after
    it hands each rank its heads of q, k and v. Megatron's 2 all-reduces a layer at parity (the cat was
    gathered whole before: 5 more all-gathers a layer, attention run whole on every rank)."""
    torch.manual_seed(0)
    model = ConcatConvLM()
    c, inputs, quality = _plan(model, 64, tp=2)
    assert not quality and c.quality == []
    assert c.plan.params["layers.0.conv.weight"].placements[0] == BlockShard(0, 3)
    assert all(cnt == Counter(all_reduce=2) for cnt in _forward_tp_per_layer(c).values()), _forward_tp_per_layer(c)
    _parity(model, c, inputs)


class ConcatReadBlock(torch.nn.Module):
    """Two column-parallel projections concatenated and read whole by a linear (AXK2's gate over a cat): no
    cut follows, so the cat must not be held as blocks (no rule gathers blocks for the linear)."""

    def __init__(self, dim=32):
        super().__init__()
        self.a, self.b = torch.nn.Linear(dim, dim, bias=False), torch.nn.Linear(dim, dim, bias=False)
        self.g = torch.nn.Linear(2 * dim, dim, bias=False)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        h = self.norm(x)
        return x + self.g(torch.cat([torch.relu(self.a(h)), self.b(h)], -1))


class ConcatReadLM(NormLM):
    def __init__(self, vocab=64, dim=32, layers=2):
        super().__init__(vocab, dim, layers)
        self.layers = torch.nn.ModuleList(ConcatReadBlock(dim) for _ in range(layers))


@pytest.mark.timeout(300)
def test_a_concatenation_read_whole_by_a_linear_is_not_held_as_blocks():
    """Without a cut into the same parts after it, a cat of column-parallel parts is no block layout: the plan
    exists (a PlanError on the linear before: its input held as blocks nothing could gather) and is at parity."""
    torch.manual_seed(0)
    model = ConcatReadLM()
    c, inputs, _ = _plan(model, 64, tp=2)
    _parity(model, c, inputs)


class ScaledParallelBlock(torch.nn.Module):
    """Falcon-H1's block: attention and a second mixer read the same normed input in parallel, each output scaled
    by its own multiplier (``attn_out * attention_out_multiplier + mixer_out * ssm_out_multiplier``) before
    the sum joins the residual stream; then a pre-norm MLP."""

    def __init__(self, dim=32, heads=4, ffn=64):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.o = torch.nn.Linear(dim, 3 * dim, bias=False), torch.nn.Linear(dim, dim, bias=False)
        self.mix_in, self.mix_out = torch.nn.Linear(dim, ffn, bias=False), torch.nn.Linear(ffn, dim, bias=False)
        self.up, self.down = torch.nn.Linear(dim, ffn, bias=False), torch.nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (p.transpose(1, 2) for p in self.qkv(h).view(b, s, 3, self.heads, -1).unbind(dim=2))
        attn = self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        mixer = self.mix_out(F.silu(self.mix_in(h)))
        x = x + (attn * 0.5 + mixer * 2.0)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ScaledParallelLM(NormLM):
    def __init__(self, vocab=64, dim=32, layers=4):
        super().__init__(vocab, dim, layers)
        self.layers = torch.nn.ModuleList(ScaledParallelBlock(dim) for _ in range(layers))


@pytest.mark.timeout(300)
def test_parallel_branches_scaled_by_multipliers_reduce_once():
    """Two parallel branches each scaled by a constant multiplier before they are summed (Falcon-H1's attention
    and Mamba mixer) are still one tp region exit: both scaled partial sums wait for the add and reduce in one
    all-reduce, so a layer runs Megatron's 2 forward collectives (each scaled partial was reduced on its own
    before: 3, where the quality check counts 2 exits and warned). Parity at tp=2."""
    torch.manual_seed(0)
    model = ScaledParallelLM()
    c, inputs, quality = _plan(model, 64, tp=2)
    assert not quality and c.quality == [], [str(f) for f in c.quality]
    assert all(cnt == Counter(all_reduce=2) for cnt in _forward_tp_per_layer(c).values()), _forward_tp_per_layer(c)
    _parity(model, c, inputs)


class RelBiasAttention(torch.nn.Module):
    """Inkling's relative logits: per-head states ``r_proj(x)`` [b, s, heads, d] mix a bank of bias-vs-distance
    profiles ``proj`` [d, extent], gathered per (query, key) distance and added to the scores."""

    def __init__(self, dim=32, heads=4, d_rel=4, extent=8):
        super().__init__()
        self.h, self.hd = heads, dim // heads
        self.q_proj = torch.nn.Linear(dim, dim, bias=False)
        self.k_proj = torch.nn.Linear(dim, dim, bias=False)
        self.v_proj = torch.nn.Linear(dim, dim, bias=False)
        self.r_proj = torch.nn.Linear(dim, heads * d_rel, bias=False)
        self.o_proj = torch.nn.Linear(dim, dim, bias=False)
        self.proj = torch.nn.Parameter(torch.randn(d_rel, extent) * 0.1)
        self.extent = extent

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.h, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        rel = (self.r_proj(x).view(b, s, self.h, -1) @ self.proj).transpose(1, 2)  # [b, h, s, extent]
        pos = torch.arange(s, device=x.device)
        dist = (pos[:, None] - pos[None, :])[None, None]
        bias = rel.gather(-1, dist.clamp(0, self.extent - 1).expand(b, self.h, -1, -1))
        bias = bias.masked_fill((dist < 0) | (dist >= self.extent), 0.0)
        scores = q @ k.transpose(2, 3) / self.hd ** 0.5 + bias
        scores = scores.masked_fill(dist < 0, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class RelBiasNet(torch.nn.Module):
    def __init__(self, layers=2, dim=32, vocab=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(dim) for _ in range(layers))
        self.attn = torch.nn.ModuleList(RelBiasAttention(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        h = self.emb(ids)
        for norm, attn in zip(self.norms, self.attn):
            h = h + attn(norm(h))
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(300)
def test_bias_bank_mixed_per_head_is_kept_whole():
    """Inkling's relative-logit bank ([d, extent], mixed by every head's states and added to the scores) is kept
    whole with the heads split: the attention's one exit a layer (a bank sharded like a linear's weight
    all-gathered the heads' states and its profiles: 3 forward collectives a layer), no finding, parity."""
    torch.manual_seed(0)
    model = RelBiasNet()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    assert c.plan.fallbacks == [] and c.quality == [], c.quality
    for i in range(2):
        assert c.plan.params[f"attn.{i}.proj"].placements == (Replicate(),)
        assert c.plan.params[f"attn.{i}.r_proj.weight"].placements == (Shard(0),)
        fwd = [s.forward for s in c.plan.collectives if s.axis == "tp" and s.layer == i and s.forward != "none"]
        assert fwd == ["all_reduce"], fwd
    assert_sim_parity(c, model, inputs, "relative logits bank")


class LookedUpBiasAttention(torch.nn.Module):
    """ProphetNet's n-gram self-attention in miniature: a linear of the hidden states gives each token a row of
    ``buckets x heads`` score biases (buckets outer), flattened to rows over (batch, head, query) -- or, with
    ``reread``, over (batch, query, head) and re-read as (batch, head, query) rows, as the predict streams do --
    and looked up per (query, key) bucket by ``gather``, then added to the heads' scores."""

    def __init__(self, dim=32, heads=4, buckets=8, reread=False):
        super().__init__()
        self.heads, self.buckets, self.reread = heads, buckets, reread
        # (no key bias: the softmax is blind to it, its gradient is rounding noise)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.rel = torch.nn.Linear(dim, buckets * heads)

    def forward(self, h):
        b, s, d = h.shape
        hd = d // self.heads

        def split(x):
            return x.view(b, s, self.heads, hd).transpose(1, 2)

        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        scores = torch.einsum("bntc,bnsc->bnts", q, k) / hd ** 0.5
        rel = self.rel(h).view(b, s, self.buckets, self.heads)
        rel = rel.permute(0, 1, 3, 2) if self.reread else rel.permute(0, 3, 1, 2)
        rel = rel.reshape(-1, self.buckets)
        pos = torch.arange(s, device=h.device)
        bucket = (pos[None, :] - pos[:, None]).clamp(-(self.buckets // 2), self.buckets // 2 - 1) + self.buckets // 2
        idx = bucket.unsqueeze(0).repeat(b * self.heads, 1, 1).view(-1, s)
        bias = torch.gather(rel, 1, idx).view(b, self.heads, s, s)
        probs = torch.softmax(scores + bias, dim=-1)
        out = torch.einsum("bnts,bnsc->bntc", probs, v).transpose(1, 2).reshape(b, s, d)
        return self.o(out)


class LookedUpBiasNet(RelBiasNet):
    def __init__(self, layers=2, dim=32, vocab=32):
        super().__init__(layers, dim, vocab)
        self.attn = torch.nn.ModuleList(LookedUpBiasAttention(dim, reread=i % 2 == 1) for i in range(layers))


@pytest.mark.timeout(300)
def test_a_relative_bias_table_looked_up_by_gather_is_kept_whole_and_sliced_by_heads():
    """ProphetNet's relative-position projection (``[buckets x heads]`` per token, buckets outer, looked up per
    (query, key) pair by ``gather``; the predict streams re-read its rows in another order) is kept whole with a
    recorded reason and each rank takes its heads of the looked-up bias: the attention's one exit a layer (split
    by columns it gave ranks buckets: the table, the scores, the values and the output projection's input were
    gathered, 4 forward collectives a layer), no finding, parity."""
    torch.manual_seed(0)
    model = LookedUpBiasNet()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    assert c.plan.fallbacks == [] and c.quality == [], c.quality
    for i in range(2):
        assert c.plan.params[f"attn.{i}.rel.weight"].placements == (Replicate(),)
        assert c.plan.params[f"attn.{i}.rel.bias"].placements == (Replicate(),)
        assert c.plan.params[f"attn.{i}.q.weight"].placements == (Shard(0),)
        assert c.plan.params[f"attn.{i}.o.weight"].placements == (Shard(1),)
        fwd = [s.forward for s in c.plan.collectives if s.axis == "tp" and s.layer == i and s.forward != "none"]
        assert fwd == ["all_reduce"], fwd
    assert_sim_parity(c, model, inputs, "looked-up relative bias")


class BlockLocalBiasAttention(torch.nn.Module):
    """LongT5's local attention in miniature: the tokens in blocks (one block here, as the zoo's short sequences
    give: a block count tied to the sequence would let the residual stream split on a provably even sequence),
    scores per block by an einsum with the heads third from last (``...qhd,...khd->...hqk``: [b, blocks, heads,
    q, k]) plus a T5 relative-position bias table ([buckets, heads], looked up per (query, key) offset) broadcast
    over the batch and the blocks."""

    def __init__(self, dim=32, heads=4, buckets=8):
        super().__init__()
        self.heads, self.buckets = heads, buckets
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.bias = torch.nn.Embedding(buckets, heads)

    def forward(self, h):
        b, s, d = h.shape
        hd = d // self.heads

        def blocks(x):
            return x.view(b, 1, s, self.heads, hd)

        q, k, v = blocks(self.q(h)), blocks(self.k(h)), blocks(self.v(h))
        scores = torch.einsum("...qhd,...khd->...hqk", q, k)
        pos = torch.arange(s, device=h.device)
        bucket = (pos[None, :] - pos[:, None]).clamp(-(self.buckets // 2), self.buckets // 2 - 1) + self.buckets // 2
        bias = self.bias(bucket).permute(2, 0, 1)[None, None]
        probs = torch.softmax(scores + bias, dim=-1)
        return self.o(torch.einsum("...hqk,...khd->...qhd", probs, v).reshape(b, s, d))


class BlockLocalBiasNet(RelBiasNet):
    def __init__(self, layers=2, dim=32, vocab=32):
        super().__init__(layers, dim, vocab)
        self.attn = torch.nn.ModuleList(BlockLocalBiasAttention(dim) for _ in range(layers))


@pytest.mark.timeout(300)
def test_a_position_bias_table_added_to_block_local_einsum_scores_is_split_by_heads():
    """LongT5's local attention: the relative-position bias table ([buckets, heads]) meets scores an einsum makes
    over blocks ([b, blocks, heads, q, k]); it is recognised as a per-head score bias (planner.position_bias_hints)
    and split by heads with them: the attention's one exit a layer (taken for a vocabulary, the table was split
    by buckets and all-reduced, the scores, the values and the output projection's input gathered: 4 forward
    collectives a layer), no finding, parity."""
    torch.manual_seed(0)
    model = BlockLocalBiasNet()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    assert c.plan.fallbacks == [] and c.quality == [], c.quality
    for i in range(2):
        assert c.plan.params[f"attn.{i}.bias.weight"].placements == (Shard(1),)
        assert c.plan.params[f"attn.{i}.o.weight"].placements == (Shard(1),)
        fwd = [s.forward for s in c.plan.collectives if s.axis == "tp" and s.layer == i and s.forward != "none"]
        assert fwd == ["all_reduce"], fwd
    assert_sim_parity(c, model, inputs, "block-local einsum scores with a position bias table")
