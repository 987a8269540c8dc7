"""Megatron's tensor-parallel layout, or a warning that names what is not (mcompile.quality), and fused
projections of unequal parts sharded part-wise (mcompile.placements.BlockShard with size ratios).

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
from mcompile.mesh import Mesh
from mcompile.placements import BlockShard, Replicate, Shard
from mcompile.quality import PlanQualityWarning


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
    import mcompile.planner as planner

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
