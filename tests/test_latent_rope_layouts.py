"""Megatron's tensor-parallel layout for attention and mixer forms written as Hugging Face writes them:
multi-head latent attention (DeepSeek-V3's form), rotary embeddings interleaved by stack / strided slices
(RoFormer's, DeepSeek's), and LFM's gated short convolution.

What is isolated, per form, on a 4-layer model (block repetition on) at tp=2: the plan raises no
PlanQualityWarning, each layer runs Megatron's 2 forward tp collectives (the all-reduces after attention's
or the mixer's output projection and after the MLP's down projection: nothing is gathered), and the
per-rank programs give the single-device loss and every gradient (in-process thread simulator).

- ``mla``: the query latent ``q_a_proj`` -> norm -> ``q_b_proj``; one projection to the KV latent and the
  shared rope key (``kv_a_proj_with_mqa``), split, the latent normed and up-projected by ``kv_b_proj`` into
  per-head k_nope and v; the rope key rotated once and expanded to every head; the keys written into the
  two halves of ``new_empty`` by ``copy_``. Megatron-Core's MLA: the down projections and their norms whole,
  q_b / kv_b column-parallel by heads, o_proj row-parallel.
- ``interleaved``: RoFormer's rotary: ``stack([-x[..., 1::2], x[..., ::2]], -1).reshape_as(x)``, per head.
- ``short_conv``: ``in_proj(x).transpose(-1, -2).chunk(3, dim=-2)`` into B, C, x, a depthwise causal conv
  of B * x, C times it, ``out_proj``: in_proj sharded part-wise (each rank its channels of B, C and x), the
  conv on its channels, out_proj row-parallel.
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

DIM, HEADS, HD, ROPE, LORA, FFN, VOCAB = 32, 4, 8, 4, 16, 64, 64


def _rope_tables(s: int, d: int):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(s).float(), inv)  # (s, d/2)
    return ang.cos(), ang.sin()


def _rope_strided(x, cos, sin):
    """DeepSeek's interleaved pairs: (x[..., ::2], x[..., 1::2]) rotated, the halves concatenated."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_stacked(x, cos, sin):
    """RoFormer's: each pair (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin), interleaved back by stack."""
    cos2, sin2 = torch.stack([cos, cos], dim=-1).flatten(-2), torch.stack([sin, sin], dim=-1).flatten(-2)
    rot = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape_as(x)
    return x * cos2 + rot * sin2


class LatentAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_a_proj = torch.nn.Linear(DIM, LORA, bias=False)
        self.q_a_layernorm = torch.nn.RMSNorm(LORA)
        self.q_b_proj = torch.nn.Linear(LORA, HEADS * (HD + ROPE), bias=False)
        self.kv_a_proj_with_mqa = torch.nn.Linear(DIM, LORA + ROPE, bias=False)
        self.kv_a_layernorm = torch.nn.RMSNorm(LORA)
        self.kv_b_proj = torch.nn.Linear(LORA, HEADS * 2 * HD, bias=False)
        self.o_proj = torch.nn.Linear(HEADS * HD, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        cos, sin = _rope_tables(s, ROPE)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, s, HEADS, HD + ROPE).transpose(1, 2)
        q_nope, q_pe = q.split([HD, ROPE], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([LORA, ROPE], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, HEADS, 2 * HD).transpose(1, 2)
        k_nope, v = kv.split([HD, HD], dim=-1)
        k_pe = _rope_strided(k_pe.view(b, 1, s, ROPE), cos, sin)  # (b, 1, s, rope): one key for every head
        q = torch.cat((q_nope, _rope_strided(q_pe, cos, sin)), dim=-1)
        k = k_nope.new_empty(b, HEADS, s, HD + ROPE)
        k[..., :HD].copy_(k_nope)
        k[..., HD:].copy_(k_pe.expand(-1, HEADS, -1, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(a.transpose(1, 2).reshape(b, s, HEADS * HD))


class InterleavedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(DIM, HEADS * HD) for _ in range(3))
        self.o = torch.nn.Linear(HEADS * HD, DIM)

    def forward(self, x):
        b, s, _ = x.shape
        cos, sin = _rope_tables(s, HD)
        q, k, v = (p(x).view(b, s, HEADS, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = _rope_stacked(q, cos, sin), _rope_stacked(k, cos, sin)
        probs = torch.softmax(q @ k.transpose(-1, -2) / HD ** 0.5, dim=-1)
        return self.o((probs @ v).permute(0, 2, 1, 3).reshape(b, s, HEADS * HD))


class ShortConv(torch.nn.Module):
    def __init__(self, kernel: int = 3):
        super().__init__()
        self.in_proj = torch.nn.Linear(DIM, 3 * DIM, bias=False)
        self.conv = torch.nn.Conv1d(DIM, DIM, kernel, groups=DIM, padding=kernel - 1, bias=False)
        self.out_proj = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        gate_b, gate_c, h = self.in_proj(x).transpose(-1, -2).chunk(3, dim=-2)  # (b, dim, s) each
        y = gate_c * self.conv(gate_b * h)[..., : x.shape[1]]
        return self.out_proj(y.transpose(-1, -2).contiguous())


class Block(torch.nn.Module):
    def __init__(self, mixer: type):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(DIM), torch.nn.RMSNorm(DIM)
        self.mixer = mixer()
        self.up, self.down = torch.nn.Linear(DIM, FFN, bias=False), torch.nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(torch.nn.Module):
    def __init__(self, mixer: type, layers: int = 4):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(Block(mixer) for _ in range(layers))
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


MIXERS = {"mla": LatentAttention, "interleaved": InterleavedAttention, "short_conv": ShortConv}


def _plan(kind: str):
    torch.manual_seed(0)
    model = LM(MIXERS[kind])
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    return model, c, inputs, [str(w.message) for w in caught if issubclass(w.category, PlanQualityWarning)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_megatron_collectives_and_parity(kind):
    model, c, inputs, quality = _plan(kind)
    assert c.plan.fallbacks == []
    assert not quality and c.quality == [], quality or c.quality
    per_layer: dict[int, Counter] = {}
    for s in c.plan.collectives:
        if s.axis == "tp" and s.layer is not None and s.forward != "none":
            per_layer.setdefault(s.layer, Counter())[s.forward] += 1
    assert per_layer == {i: Counter(all_reduce=2) for i in range(4)}, per_layer
    tp = {fqn: p.placements[0] for fqn, p in c.plan.params.items()}
    m = "layers.3.mixer"
    if kind == "mla":  # Megatron-Core's MLA: the latents whole, the up projections by heads
        for w in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
            assert tp[f"{m}.{w}.weight"] == Replicate(), w
        assert tp[f"{m}.q_b_proj.weight"] == tp[f"{m}.kv_b_proj.weight"] == Shard(0)
        assert tp[f"{m}.o_proj.weight"] == Shard(1)
    elif kind == "short_conv":  # B, C and x: each rank its channels of all three
        assert tp[f"{m}.in_proj.weight"] == BlockShard(0, 3)
        assert tp[f"{m}.conv.weight"] == Shard(0) and tp[f"{m}.out_proj.weight"] == Shard(1)
    assert_sim_parity(c, model, inputs, kind)
