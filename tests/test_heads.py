"""Attention whose heads are merged into the batch dim (passes/tp/heads.py) plans Megatron's layout.

What is isolated: plain PyTorch blocks in the BART/XLM-era form, q/k/v reshaped to (b*h, s, d) and multiplied
with ``torch.bmm`` (the mask added between a view to (b, h, s, s) and one back, softmax and dropout on the
merged value), and Bloom's form (``baddbmm`` of an ALiBi bias (b*h, 1, s) with a scale ``alpha``). Each is
rewritten into 4-D ops so the heads are a dim tp shards. XLM's 4-D attention, its mask ``expand_as`` the scores
and filled in place (``masked_fill_``), plans alike (rule of expand_as, the in-place fill made functional).
A layer runs Megatron's 2 forward tp collectives (the attention's and the MLP's all-reduce), no
PlanQualityWarning and no fallback, and trains at parity (loss and every gradient, in-process thread
simulator). Without the rewrite the same models gather q, k and v each layer (the check below plants it).
Models have 4 layers, so block repetition is on.
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
from mcompile.ir.placements import Replicate, Shard
from mcompile.sharding.quality import PlanQualityWarning

aten = torch.ops.aten


class MergedHeadsBlock(torch.nn.Module):
    """Post-norm block with XGLM/BART's attention on (b*h, s, d) values; ``form``: "alibi", Bloom's baddbmm
    instead; "xlm", XLM's 4-D attention."""

    def __init__(self, dim=32, heads=4, ffn=64, form="bmm"):
        super().__init__()
        self.h, self.hd, self.form = heads, dim // heads, form
        # no key bias: q.b_k is the same for every key of a row, the softmax drops it, its gradient is rounding noise
        self.q, self.v = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim, bias=False)
        self.out = torch.nn.Linear(dim, dim)
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, ffn), torch.nn.Linear(ffn, dim)
        self.slopes = torch.nn.Parameter(torch.linspace(0.5, 0.1, heads), requires_grad=False)

    def forward(self, x, mask):
        b, s, _ = x.shape
        h, d = self.h, self.hd

        def heads(t):  # (b, s, h*d) -> (b*h, s, d)
            return t.view(b, s, h, d).transpose(1, 2).reshape(b * h, s, d)

        q, k, v = heads(self.q(x) * d ** -0.5), heads(self.k(x)), heads(self.v(x))
        if self.form == "xlm":  # XLM's 4-D attention, its mask expand_as the scores and filled in place
            q, k, v = (t.view(b, h, s, d) for t in (q, k, v))
            scores = q @ k.transpose(2, 3)
            scores.masked_fill_((mask < 0).expand_as(scores), torch.finfo(scores.dtype).min)
            a = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, h * d)
            x = self.norm1(x + self.out(a))
            return self.norm2(x + self.fc2(F.gelu(self.fc1(x))))
        if self.form == "alibi":
            pos = torch.arange(s, device=x.device, dtype=x.dtype)
            bias = (self.slopes[:, None] * pos[None, :]).expand(b, h, s).reshape(b * h, 1, s)
            scores = torch.baddbmm(bias, q, k.transpose(-1, -2), beta=1.0, alpha=0.5)
        else:
            scores = torch.bmm(q, k.transpose(1, 2))
        scores = (scores.view(b, h, s, s) + mask).view(b * h, s, s)
        probs = F.dropout(F.softmax(scores, dim=-1), p=0.0, training=self.training)
        a = torch.bmm(probs, v).view(b, h, s, d).transpose(1, 2).reshape(b, s, h * d)
        x = self.norm1(x + self.out(a))
        return self.norm2(x + self.fc2(F.gelu(self.fc1(x))))


class MergedHeadsLM(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, layers=4, form="bmm"):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(MergedHeadsBlock(dim, form=form) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        s = ids.shape[1]
        causal = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None]
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, causal)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _plan(model, tp=2):
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = compile_plan(model, Mesh.fake(tp=tp), inputs)
    return c, inputs, [w for w in caught if issubclass(w.category, PlanQualityWarning)]


def _forward_tp_per_layer(c) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for s in c.plan.collectives:
        if s.axis == "tp" and s.layer is not None and s.forward != "none":
            out.setdefault(s.layer, Counter())[s.forward] += 1
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", ["bmm", "alibi", "xlm"])
def test_merged_heads_attention_plans_megatrons_layout_at_parity(form):
    torch.manual_seed(0)
    model = MergedHeadsLM(form=form)
    c, inputs, quality = _plan(model)
    assert not quality and c.quality == [] and c.plan.fallbacks == [], [str(w.message) for w in quality]
    ops = Counter(n.target for n in c.captured.gm.graph.nodes if n.op == "call_function")
    assert ops[aten.bmm.default] == ops[aten.baddbmm.default] == 0 and ops[aten.matmul.default] == 8, ops
    per_layer = _forward_tp_per_layer(c)
    assert sorted(per_layer) == [0, 1, 2, 3] and all(cnt == Counter(all_reduce=2) for cnt in per_layer.values()), \
        per_layer
    assert all(c.plan.params[f"layers.0.{p}.weight"].placements[0].dim == 0 for p in "qkv")
    assert_sim_parity(c, model, inputs)


@pytest.mark.timeout(300)
def test_without_the_rewrite_merged_heads_gather_and_the_check_says_so(monkeypatch):
    """The rewrite is what makes the layout: planted out, q, k and v are gathered every layer (as before)."""
    import mcompile.passes.tp.heads as heads

    monkeypatch.setattr(heads, "unmerge_heads", lambda gm: 0)
    torch.manual_seed(0)
    c, _, quality = _plan(MergedHeadsLM())
    assert quality and c.quality[0].kind == "collectives" and "all_gather of transpose" in str(c.quality[0])


def test_unmerge_heads_keeps_the_value_and_leaves_other_merges():
    """The rewritten graph computes the exported one's value (the attention of one block); a region whose
    merged value reaches an op the pass does not know (a sum over the merged dim) is left as it is."""
    from mcompile.passes.tp.heads import unmerge_heads

    class Odd(torch.nn.Module):
        def forward(self, q, k):
            b, h, s, d = q.shape
            scores = torch.bmm(q.reshape(b * h, s, d), k.reshape(b * h, s, d).transpose(1, 2))
            return scores.sum(0)  # over the merged dim

    torch.manual_seed(0)
    block = MergedHeadsBlock(form="alibi").eval()
    x, mask = torch.randn(2, 8, 32), torch.full((8, 8), -1e9).triu(1)[None, None]
    gm = torch.export.export(block, (x, mask)).module()
    assert unmerge_heads(gm) == 2  # q.kᵀ with the mask's view pair; probs.v
    assert not any(n.target in (aten.bmm.default, aten.baddbmm.default) for n in gm.graph.nodes)
    # the same math; fp32 rounding differs (baddbmm fuses its alpha, the 4-D matmul blocks its batch otherwise)
    torch.testing.assert_close(gm(x, mask), block(x, mask), rtol=1e-5, atol=1e-6)
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    odd = torch.export.export(Odd(), (q, k)).module()
    assert unmerge_heads(odd) == 0 and any(n.target is aten.bmm.default for n in odd.graph.nodes)


class MQABlock(torch.nn.Module):
    """GPTBigCode's multi-query attention: one key/value head in a projection fused with the queries, repeated
    to the query heads as transformers' repeat_kv does (unsqueeze, expand, reshape)."""

    def __init__(self, dim=32, heads=4, ffn=64):
        super().__init__()
        self.h, self.hd = heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, dim + 2 * self.hd)
        self.out, self.fc1, self.fc2 = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, ffn), torch.nn.Linear(ffn, dim)

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([dim, self.hd, self.hd], dim=-1)
        q = q.view(b, s, self.h, self.hd).transpose(1, 2)
        k, v = (t.view(b, s, 1, self.hd).transpose(1, 2)[:, :, None].expand(b, 1, self.h, s, self.hd)
                .reshape(b, self.h, s, self.hd) for t in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, dim)
        x = x + self.out(a)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class MQALM(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, layers=4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(MQABlock(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(300)
def test_one_key_value_head_fused_with_the_queries_keeps_megatrons_exits():
    """1 key/value head at tp=2: the fused q/k/v weight stays whole on every rank (the check accepts it, for that
    reason), each rank slices its query heads from it and attends them with the whole key/value head: 2 forward
    all-reduces a layer, at parity. (Before, the weight was split by blocks and the head gathered each layer.)"""
    from mcompile.sharding.planner import kv_hints

    torch.manual_seed(0)
    model = MQALM()
    c, inputs, quality = _plan(model)
    assert not quality and c.quality == [] and c.plan.fallbacks == [], [str(w.message) for w in quality]
    assert isinstance(c.plan.params["layers.0.qkv.weight"].placements[0], Replicate)
    assert set(kv_hints(c.captured, 2)) == {n for n, f in c.captured.params.items() if ".qkv." in f}
    assert c.plan.params["layers.0.out.weight"].placements[0] == Shard(1)
    per_layer = _forward_tp_per_layer(c)
    assert sorted(per_layer) == [0, 1, 2, 3] and all(cnt == Counter(all_reduce=2) for cnt in per_layer.values()), \
        per_layer
    assert_sim_parity(c, model, inputs)
