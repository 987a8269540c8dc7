"""Attention-layer variants in Megatron's tensor-parallel layout (issue 37's zoo: Gemma-4, HY-V4, DiffLlama).

Each test builds a tiny model with one construct, plans it at tp=2, counts the forward tp collectives of every
layer against Megatron's (one all-reduce per sub-block exit) and proves the plan at parity in the thread simulator.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_layout_quality import NormLM, _forward_tp_per_layer, _GemmaRMSNorm, _parity, _plan

from mcompile.ir.placements import BlockShard, Replicate, Shard


class _Attention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.o = torch.nn.Linear(dim, 3 * dim, bias=False), torch.nn.Linear(dim, dim, bias=False)

    def forward(self, h):
        b, s, d = h.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))


# ------------------------------------------------------------ Gemma-4's per-layer input: a gated third sub-block


class PerLayerInputBlock(torch.nn.Module):
    """Attention, an MLP, then Gemma-3n / Gemma-4's per-layer input: ``norm(proj(gelu(gate(x)) * per_layer))``
    added to the stream, ``per_layer`` this layer's slice of an embedding computed before the layers."""

    def __init__(self, dim=32, heads=4, ffn=64, ple=16):
        super().__init__()
        self.norm1, self.norm2 = _GemmaRMSNorm(dim), _GemmaRMSNorm(dim)
        self.attn = _Attention(dim, heads)
        self.up, self.down = torch.nn.Linear(dim, ffn, bias=False), torch.nn.Linear(ffn, dim, bias=False)
        self.gate, self.proj = torch.nn.Linear(dim, ple, bias=False), torch.nn.Linear(ple, dim, bias=False)
        self.norm3 = _GemmaRMSNorm(dim)

    def forward(self, x, per_layer):
        x = x + self.attn(self.norm1(x))
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return x + self.norm3(self.proj(F.gelu(self.gate(x)) * per_layer))


class PerLayerInputLM(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, layers=2, ple=16):
        super().__init__()
        self.ple = ple
        self.emb, self.emb_ple = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(vocab, layers * ple)
        self.layers = torch.nn.ModuleList(PerLayerInputBlock(dim, ple=ple) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        per_layer = self.emb_ple(ids).view(*ids.shape, len(self.layers), self.ple)
        for i, layer in enumerate(self.layers):
            x = layer(x, per_layer[:, :, i])
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(300)
def test_a_per_layer_input_gate_is_column_then_row_parallel_with_one_all_reduce():
    """The per-layer input (replicated, computed before the layers) multiplies the column-parallel gate: each rank
    slices its features of it (``planner.gate_sliced``), so the product stays sharded and ``proj`` is row-parallel,
    one all-reduce at its exit -- 3 a layer. Before, the gate was all-gathered, ``proj`` ran column-parallel from
    the whole product and its output was all-gathered too (4 a layer, plus an all-reduce backward)."""
    torch.manual_seed(0)
    model = PerLayerInputLM()
    c, inputs, quality = _plan(model, 64, tp=2)
    assert not quality and c.quality == []
    pl = {k: v.placements[0] for k, v in c.plan.params.items()}
    assert pl["layers.0.gate.weight"] == Shard(0) and pl["layers.0.proj.weight"] == Shard(1)
    assert pl["layers.0.norm3.weight"] == Replicate()
    per_layer = _forward_tp_per_layer(c)
    assert sorted(per_layer) == [0, 1] and all(cnt == {"all_reduce": 3} for cnt in per_layer.values()), per_layer
    _parity(model, c, inputs)


# ------------------------------------------------------------ hyper-connections: n residual streams, mixed


class HyperBlock(torch.nn.Module):
    """HY-V4 / DeepSeek-V4's hyper-connections (Zhu et al. 2024): n residual streams [b, s, n, d]; before each
    sub-block a projection of the flattened streams (``fn``: [2n, n * d]) gives the weights that mix them into
    the sub-block's input (``pre``) and spread its output back over them (``post``)."""

    def __init__(self, dim=32, heads=4, ffn=64, n=4):
        super().__init__()
        self.n = n
        self.fn_attn, self.fn_ffn = (torch.nn.Parameter(torch.randn(2 * n, n * dim) * 0.05) for _ in range(2))
        self.base_attn, self.base_ffn = (torch.nn.Parameter(torch.randn(2 * n) * 0.1) for _ in range(2))
        self.norm1, self.norm2 = _GemmaRMSNorm(dim), _GemmaRMSNorm(dim)
        self.attn = _Attention(dim, heads)
        self.up, self.down = torch.nn.Linear(dim, ffn, bias=False), torch.nn.Linear(ffn, dim, bias=False)

    def mix(self, streams, fn, base):
        flat = streams.flatten(2).float()
        mixes = F.linear(flat, fn.float()) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
        pre, post = torch.sigmoid(mixes + base).split(self.n, dim=-1)
        return post, (pre.unsqueeze(-1) * streams).sum(2)

    def forward(self, streams):
        post, h = self.mix(streams, self.fn_attn, self.base_attn)
        streams = streams + post.unsqueeze(-1) * self.attn(self.norm1(h)).unsqueeze(2)
        post, h = self.mix(streams, self.fn_ffn, self.base_ffn)
        return streams + post.unsqueeze(-1) * self.down(F.gelu(self.up(self.norm2(h)))).unsqueeze(2)


class HyperLM(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, layers=2, n=4):
        super().__init__()
        self.n = n
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(HyperBlock(dim, n=n) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        streams = self.emb(ids).unsqueeze(2).expand(-1, -1, self.n, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams)
        return F.cross_entropy(self.head(streams.mean(2)).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(300)
def test_hyper_connection_mixing_projections_stay_whole_like_the_streams():
    """The streams are the residual stream (replicated); their mixing projection ``fn`` (2n outputs) is kept whole
    (``planner.stream_mix_hints``, a reason the quality check records), so the mixing weights cost no collective
    and each layer runs Megatron's 2 all-reduces. Before, ``fn`` was split over its 8 outputs and its output
    all-gathered before each mix (4 a layer)."""
    torch.manual_seed(0)
    model = HyperLM()
    c, inputs, quality = _plan(model, 64, tp=2)
    assert not quality and c.quality == []
    pl = {k: v.placements[0] for k, v in c.plan.params.items()}
    assert pl["layers.0.fn_attn"] == Replicate() and pl["layers.0.fn_ffn"] == Replicate()
    assert pl["layers.0.attn.o.weight"] == Shard(1) and pl["layers.0.down.weight"] == Shard(1)
    per_layer = _forward_tp_per_layer(c)
    assert sorted(per_layer) == [0, 1] and all(cnt == {"all_reduce": 2} for cnt in per_layer.values()), per_layer
    _parity(model, c, inputs)


# ------------------------------------------------------------ DiffLlama's differential attention: head pairs


class DiffAttentionBlock(torch.nn.Module):
    """DiffLlama's attention (Ye et al. 2024, "Differential Transformer", as transformers writes it): the values'
    key/value heads halved and each half repeated, two attentions sharing q and k, their outputs joined along
    head_dim and cut in two along the heads (head i paired with head i + heads / 2), the second half scaled by a
    learned lambda and subtracted, a norm per head pair, then o_proj."""

    def __init__(self, dim=32, heads=4, kv_heads=2, ffn=64):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.k, self.v = (torch.nn.Linear(dim, kv_heads * self.hd, bias=False) for _ in range(2))
        self.o = torch.nn.Linear(dim, dim, bias=False)
        self.lambdas = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(self.hd) * 0.1) for _ in range(4))
        self.norm1, self.norm2 = _GemmaRMSNorm(dim), _GemmaRMSNorm(dim)
        self.up, self.down = torch.nn.Linear(dim, ffn, bias=False), torch.nn.Linear(ffn, dim, bias=False)

    def attention(self, h):
        b, s, _ = h.shape
        q = self.q(h).view(b, s, -1, self.hd).transpose(1, 2)
        k, v = (p(h).view(b, s, -1, self.hd).transpose(1, 2) for p in (self.k, self.v))
        v1, v2 = (t.repeat(1, 2, 1, 1) for t in torch.chunk(v, 2, dim=1))
        g = self.heads // self.kv

        def rep(t):  # transformers' repeat_kv
            return t[:, :, None].expand(b, self.kv, g, s, self.hd).reshape(b, self.heads, s, self.hd)

        o = torch.cat([F.scaled_dot_product_attention(q, rep(k), rep(x), is_causal=True).transpose(1, 2)
                       for x in (v1, v2)], dim=-1)
        a1, a2 = torch.chunk(o, 2, dim=2)
        lq1, lk1, lq2, lk2 = self.lambdas
        lam = torch.exp(torch.sum(lq1 * lk1)) - torch.exp(torch.sum(lq2 * lk2)) + 0.2
        return self.o((F.rms_norm(a1 - lam * a2, [2 * self.hd], eps=1e-5) * 0.8).reshape(b, s, -1))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class DiffAttentionLM(NormLM):
    def __init__(self, vocab=64, dim=32, layers=2):
        super().__init__(vocab, dim, layers)
        self.layers = torch.nn.ModuleList(DiffAttentionBlock(dim) for _ in range(layers))


@pytest.mark.timeout(300)
def test_differential_attention_keeps_head_pairs_on_one_rank():
    """The attention output cut in two along its heads pairs head i with head i + heads / 2: q_proj is held in two
    blocks of heads (``planner.head_blocks``: ``BlockShard(0, 2)``), so each rank attends whole pairs, the cut, the
    lambda and the per-pair norm stay local and o_proj is row-parallel. The key/value heads (2, one a block) are
    kept whole, each rank slicing its share of every block. Megatron's 2 all-reduces a layer; before, the values
    were gathered for their cut, the whole attention ran on every rank and o_proj ran column-parallel (6)."""
    torch.manual_seed(0)
    model = DiffAttentionLM()
    c, inputs, quality = _plan(model, 64, tp=2)
    assert not quality and c.quality == []
    pl = {k: v.placements[0] for k, v in c.plan.params.items()}
    assert pl["layers.0.q.weight"] == BlockShard(0, 2) and pl["layers.0.o.weight"] == Shard(1)
    assert pl["layers.0.k.weight"] == Replicate() and pl["layers.0.v.weight"] == Replicate()
    per_layer = _forward_tp_per_layer(c)
    assert sorted(per_layer) == [0, 1] and all(cnt == {"all_reduce": 2} for cnt in per_layer.values()), per_layer
    _parity(model, c, inputs)


# ------------------------------------------------------------ exits summed through a cast (HY-V4's shared expert)


class CastSumBlock(torch.nn.Module):
    """Two MLPs read the same normed stream and are summed before the residual add, one cast first (HY-V4's
    ``moe_ffn(x).to(float32) + shared_experts(x)``: export checks the dtype before the cast, a second user)."""

    def __init__(self, dim=32, heads=4, ffn=64):
        super().__init__()
        self.norm1, self.norm2 = _GemmaRMSNorm(dim), _GemmaRMSNorm(dim)
        self.attn = _Attention(dim, heads)
        self.up_a, self.down_a = torch.nn.Linear(dim, ffn, bias=False), torch.nn.Linear(ffn, dim, bias=False)
        self.up_b, self.down_b = torch.nn.Linear(dim, ffn, bias=False), torch.nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + (self.down_a(F.gelu(self.up_a(h))).to(torch.float32) + self.down_b(F.gelu(self.up_b(h))))


class CastSumLM(NormLM):
    def __init__(self, vocab=64, dim=32, layers=2):
        super().__init__(vocab, dim, layers)
        self.layers = torch.nn.ModuleList(CastSumBlock(dim) for _ in range(layers))


@pytest.mark.timeout(300)
def test_exits_summed_through_a_cast_count_once():
    """Megatron adds the two partial sums and reduces once, as the plan does: the quality check counts one exit for
    both (2 a layer). It counted 3 when a dtype check (``_assert_tensor_metadata``) also read one exit's output."""
    from mcompile.sharding.quality import tp_exits

    torch.manual_seed(0)
    c, _, quality = _plan(CastSumLM(), 64, tp=2)
    exits = tp_exits(c.captured.gm)
    assert sorted(exits) == [0, 1] and all(len(e) == 2 and "+" in e[1] for e in exits.values()), exits
    assert not quality and c.quality == []
    per_layer = _forward_tp_per_layer(c)
    assert all(cnt == {"all_reduce": 2} for cnt in per_layer.values()), per_layer
