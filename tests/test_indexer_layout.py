"""DeepSeek sparse attention's lightning indexer under tp (issue 37: DeepseekV32, Dots3Note, GlmMoeDsa, HYV4 in
the Hugging Face zoo). The indexer scores every key per query with its own small heads, sums the heads' scores
with per-head weights and keeps the top-k keys for the main attention (Liu et al. 2025, "DeepSeek-V3.2").
:func:`mcompile.sharding.planner.selector_hints` keeps its projections whole on every tp rank, as DeepSeek's own
tensor-parallel inference does: its inputs are whole there already, so the selection costs no collective and
the layer keeps Megatron's two exits. Before, the propagator split the shared key's features and gathered them
back: 5 forward tp collectives a layer where Megatron runs 2."""

from __future__ import annotations

import warnings
from collections import Counter

import torch
import torch.nn.functional as F
from sim_harness import assert_sim_parity

from mcompile.api import compile_plan
from mcompile.capture.export import capture
from mcompile.ir.mesh import Mesh
from mcompile.ir.placements import Replicate, Shard
from mcompile.passes import canonicalize
from mcompile.sharding.planner import selector_hints
from mcompile.sharding.quality import PlanQualityWarning

D, HEADS, IDX_HEADS, IDX_DIM, TOPK, VOCAB = 64, 4, 4, 16, 4, 64


class Indexer(torch.nn.Module):
    """Per query, the top-k keys by ``sum_h w[s, h] * relu(q[s, h] . k[t])`` (causal): small query heads, one
    shared normalised key, a per-head weight projection, as Hugging Face's DeepseekV32Indexer."""

    def __init__(self, own_key: bool = True):
        super().__init__()
        self.own_key = own_key
        self.wq = torch.nn.Linear(D, IDX_HEADS * IDX_DIM, bias=False)
        self.wk = torch.nn.Linear(D, IDX_DIM, bias=False)
        self.k_norm = torch.nn.LayerNorm(IDX_DIM)
        self.weights_proj = torch.nn.Linear(D, IDX_HEADS, bias=False)

    @torch.no_grad()
    def forward(self, x, causal):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, IDX_HEADS, IDX_DIM)
        k = self.k_norm(self.wk(x) if self.own_key else x[..., :IDX_DIM])  # else: the residual stream's features
        scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)))  # [b, s, heads, t]
        # HF's cast to the weights' dtype: a no-op that returns x itself, which eager's caller keeps reading
        # with its gradient (grad_regions: not detached when the region is inlined)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)) * IDX_HEADS ** -0.5
        index = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # the heads summed: [b, s, t]
        index = index.masked_fill(~causal, float("-inf"))
        return index.topk(TOPK, dim=-1).indices


class Layer(torch.nn.Module):
    def __init__(self, per_head_topk: bool = False, own_key: bool = True):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(D), torch.nn.RMSNorm(D)
        self.q, self.k, self.v = (torch.nn.Linear(D, D, bias=False) for _ in range(3))
        self.o = torch.nn.Linear(D, D, bias=False)
        self.up, self.down = torch.nn.Linear(D, 2 * D, bias=False), torch.nn.Linear(2 * D, D, bias=False)
        self.indexer = None if per_head_topk else Indexer(own_key)
        self.g = torch.nn.Linear(D, HEADS, bias=False)  # Dots3Note's per-head output gate, read after the indexer

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        q, k, v = (p(h).view(b, s, HEADS, D // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) * (D // HEADS) ** -0.5  # [b, heads, s, t]
        if self.indexer is not None:  # the indexer's keys, the same for every head
            idx = self.indexer(h, causal)
            keep = torch.zeros(b, s, s, dtype=torch.bool, device=x.device).scatter(-1, idx, True) & causal
            keep = keep.unsqueeze(1)
        else:  # a top-k over each head's own scores: nothing summed over the heads, no selector
            top = scores.masked_fill(~causal, float("-inf")).topk(TOPK, dim=-1).indices
            keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top, True) & causal
        att = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v
        att = att * self.g(h).transpose(1, 2).unsqueeze(-1).sigmoid()
        x = x + self.o(att.transpose(1, 2).reshape(b, s, D))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class SparseLM(torch.nn.Module):
    def __init__(self, layers: int = 4, per_head_topk: bool = False, own_key: bool = True):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.layers = torch.nn.ModuleList(Layer(per_head_topk, own_key) for _ in range(layers))
        self.head = torch.nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g)


def test_the_indexers_projections_stay_whole_and_each_layer_keeps_megatrons_two_exits():
    """The indexer's wq, wk and weights_proj whole over tp (the reason recorded: no finding), the attention's
    and MLP's weights Megatron's, 2 forward all-reduces a layer, and the single-device loss and gradients (the
    gate reads the normalised input after the no-grad indexer's no-op cast of it: before grad_regions kept
    that tensor the caller's, its gradient through the gate was cut, 1e-1 off as Dots3Note in the zoo)."""
    torch.manual_seed(0)
    model = SparseLM()
    inputs = _inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    assert not [w for w in caught if issubclass(w.category, PlanQualityWarning)] and c.quality == []
    pl = {k: v.placements[0] for k, v in c.plan.params.items()}
    for i in range(4):
        for name in ("wq", "wk", "weights_proj"):
            assert pl[f"layers.{i}.indexer.{name}.weight"] == Replicate(), (name, pl)
        assert pl[f"layers.{i}.q.weight"] == Shard(0) and pl[f"layers.{i}.o.weight"] == Shard(1)
    per_layer: dict[int, Counter] = {}
    for s in c.plan.collectives:
        if s.axis == "tp" and s.layer is not None and s.forward != "none":
            per_layer.setdefault(s.layer, Counter())[s.forward] += 1
    assert per_layer == {i: Counter(all_reduce=2) for i in range(4)}, per_layer
    assert_sim_parity(c, model, inputs)


def test_a_top_k_over_each_heads_own_scores_is_no_selector():
    """Only a top-k over scores summed over heads marks a selector: a top-k of each head's own q.k scores (the
    main attention's projections, split by heads with no communication) keeps its projections free to shard.
    Nor is a projection whose output goes on elsewhere a selector's: a key read from the residual stream
    reaches the previous layer's output projections, which stay Megatron's row-parallel exits."""
    def captured(model):
        cap = capture(model, _inputs())
        canonicalize(cap.gm)  # as compile_plan: the indexer's no-grad region inlined
        return cap

    torch.manual_seed(0)
    assert selector_hints(captured(SparseLM(layers=1, per_head_topk=True))) == {}
    cap = captured(SparseLM(layers=1))
    assert sorted(cap.params[n] for n in selector_hints(cap)) == [
        "layers.0.indexer.weights_proj.weight", "layers.0.indexer.wk.weight", "layers.0.indexer.wq.weight"]
    cap = captured(SparseLM(layers=2, own_key=False))
    assert sorted(cap.params[n] for n in selector_hints(cap)) == [
        f"layers.{i}.indexer.{w}.weight" for i in (0, 1) for w in ("weights_proj", "wq")]
