"""Constructs of real models that once crashed the tp planner, each as a tiny plain PyTorch model of 4 layers
(block repetition on), planned on ``Mesh.fake(tp=2)`` and trained at single-device parity in the in-process
thread simulator (loss and every gradient, fp32: tests/sim_harness.assert_sim_parity).

What is isolated, one construct a test:
- a projection to one output (Qwen2-MoE's ``shared_expert_gate``, a [1, h] weight: a scalar gate) stays whole,
  with no divisibility demand and no layout finding.
- a ``with torch.no_grad():`` region inside forward (CPM-Ant's position buckets, M2M-100's sinusoidal
  positions: export's ``wrap_with_set_grad_enabled``) is inlined, its results detached, and so is a
  ``torch.autocast(enabled=False)`` region; ``expand_as`` (HRM)
  plans as ``expand``;
- a size ``(s*s)//s`` (XLNet's relative shift, a view with -1) is ``s``: view groups compare its products;
- one layer's parameters shared by every layer (ALBERT), the first layer reading a sharded activation and the
  others a replicated one: each shared weight takes one placement every reader can take (Megatron's);
- a data-dependent count of tokens (JetMoe's, DeepSeek-V4's routing: an unbacked size) plans and lowers, and so
  does a slice to a data-dependent length (BLT's patch starts), which makes its size itself, and a sequence
  export refines to a multiple ``4*s`` (DeepSeek-V4's windows of 4), whose ``s`` is the length // 4;
- experts' outputs added back to their tokens in a tensor of zeros with ``index_add`` (JetMoE) stay a partial
  sum: one all-reduce after it;
- a repeated layer whose ops are not one stretch of the program (a node that is not an op among them: export's
  subgraph attribute of a region it keeps) is not repeated: the whole model is captured, with the reason logged.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from sim_harness import assert_sim_parity

from mcompile.api import compile_plan
from mcompile.ir.mesh import Mesh
from mcompile.ir.placements import Partial, Replicate, Shard

VOCAB, DIM, FFN = 64, 32, 64


class Attention(torch.nn.Module):
    def __init__(self, dim=DIM, heads=4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class Mlp(torch.nn.Module):
    def __init__(self, dim=DIM, ffn=FFN):
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, ffn, bias=False), torch.nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class GatedMlpBlock(torch.nn.Module):
    """Qwen2-MoE's shared expert: an MLP scaled by a sigmoid gate of one output feature."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(DIM), torch.nn.RMSNorm(DIM)
        self.attn, self.mlp = Attention(), Mlp()
        self.gate = torch.nn.Linear(DIM, 1, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + torch.sigmoid(self.gate(h)) * self.mlp(h)


class LM(torch.nn.Module):
    def __init__(self, block, layers=4):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(block() for _ in range(layers))
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _plan(model, tp=2):
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no quality warning
        c = compile_plan(model, Mesh.fake(tp=tp), inputs)
    return c, inputs


@pytest.mark.timeout(120)
def test_a_projection_to_one_output_stays_whole():
    torch.manual_seed(0)
    model = LM(GatedMlpBlock)
    c, inputs = _plan(model)
    assert c.plan.params["layers.0.gate.weight"].placements[0] == Replicate()
    assert c.plan.params["layers.0.mlp.up.weight"].placements[0] == Shard(0)
    assert c.plan.fallbacks == [] and c.quality == []
    # the gated MLP's output joins the replicated residual stream, not another partial sum: it is reduced
    # before the scale, so the gate's gradient is whole on every rank (no backward all-reduce, Megatron's f)
    ops = [(s.op, s.origin) for s in c.plan.collectives if s.layer == 1]
    assert [o for o, _ in ops] == ["copy_ar_bwd", "all_reduce"] * 2, ops
    assert_sim_parity(c, model, inputs)


class NoGradBiasBlock(torch.nn.Module):
    """CPM-Ant's relative position buckets: an integer table computed under ``torch.no_grad()`` in every layer,
    here scaling the attention's output per position."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(DIM)
        self.attn, self.mlp = Attention(), Mlp()

    def forward(self, x):
        with torch.no_grad():
            pos = torch.arange(x.shape[1], device=x.device)
            buckets = (pos.float() + 1).log().clamp(max=7).long()  # (s,)
            scale = x.detach().abs().mean() + 1  # a value of the activations, not only of the inputs
        with torch.autocast(x.device.type, enabled=False):  # HF rotary embeddings' region: kept as it is
            h = self.norm(x).float()
        x = x + self.attn(h) * (buckets.float() / 7 + 1)[:, None] / scale
        return x + self.mlp(self.norm(x).expand_as(x))  # HRM's expand_as (here of a value of x's shape)


@pytest.mark.timeout(120)
def test_a_no_grad_region_inside_forward_is_inlined():
    torch.manual_seed(0)
    model = LM(NoGradBiasBlock)
    c, inputs = _plan(model)
    assert c.canonical["inline_grad_regions"] >= 2 and c.canonical["expand_as_to_expand"] >= 1
    assert not any(n.op == "get_attr" for n in c.captured.gm.graph.nodes)
    assert c.plan.fallbacks == [] and c.quality == []
    assert_sim_parity(c, model, inputs)


class ClampedTableBlock(torch.nn.Module):
    """DeepSeek-V3.2's and MiniMax's tables cut to the sequence (``min(2048, s)``: a size ``Min(128, s)`` here)
    and MPT's ALiBi bias sliced from ``max(0, bias.size(1) - s)`` (``Max(0, 1 - s)``): Python's min/max of sizes,
    exported as ``sym_min``/``sym_max``, read as per-rank sizes."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(DIM)
        self.attn, self.mlp = Attention(), Mlp()
        self.register_buffer("table", torch.randn(128, DIM))
        self.register_buffer("bias", torch.rand(1, 128))

    def forward(self, x):
        b, s, _ = x.shape
        pos = self.table[:min(self.table.size(0), s)]  # (Min(128, s), h)
        bias = self.bias[max(0, self.bias.size(0) - s):, max(0, self.bias.size(1) - s):]  # MPT's: (1, s)
        x = x + self.attn(self.norm(x) + pos) * (1 + bias.transpose(0, 1))

        return x + self.mlp(self.norm(x))


@pytest.mark.timeout(120)
def test_sizes_clamped_by_min_and_max_are_rebuilt_per_rank():
    torch.manual_seed(0)
    model = LM(ClampedTableBlock)
    c, inputs = _plan(model)
    assert c.plan.fallbacks == [] and c.quality == []
    assert_sim_parity(c, model, inputs)


def test_a_layer_whose_ops_are_not_one_stretch_is_not_repeated():
    """repeat_graph copies one contiguous stretch of the program: find_block must decline (and the capture passes then
    capture the whole model) rather than assert later."""
    from mcompile.capture.export import capture
    from mcompile.sharding.repeat import find_block, truncate_runs

    torch.manual_seed(0)
    root, runs = truncate_runs(LM(GatedMlpBlock), keep=2)
    g = torch.Generator().manual_seed(1)
    cap = capture(root, (torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g)))
    block, why = find_block(cap, runs[0], 2)
    assert block is not None, why
    nodes = {n.name: n for n in cap.gm.graph.nodes}
    cap.gm.stray = torch.zeros(1)
    with cap.gm.graph.inserting_before(nodes[block.nodes[len(block.nodes) // 2]]):
        cap.gm.graph.get_attr("stray")
    block, why = find_block(cap, runs[0], 2)
    assert block is None and "stray" in why and "not one stretch" in why, why


def test_an_exact_floor_division_of_sizes_is_a_plain_quotient():
    """XLNet's relative shift views (b, 4, s, 2s) as (b, 4, 2s, (s*s)//s): once the floor division is seen to be
    exact the view's dims group (they did not: an IndexError in view_groups)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv

    from mcompile.sharding.rules.base import _exact_floordivs
    from mcompile.sharding.rules.views import view_groups

    b, s = sympy.symbols("b s", positive=True, integer=True)
    assert _exact_floordivs(FloorDiv(s * s, s)) == s
    assert _exact_floordivs(FloorDiv(2 * s, 4)) == FloorDiv(2 * s, 4)  # not exact: kept
    assert view_groups((b, 4, s, 2 * s), (b, 4, 2 * s, _exact_floordivs(FloorDiv(s * s, s)))) == \
        [([0], [0]), ([1], [1]), ([2, 3], [2, 3])]


class RoutedBlock(torch.nn.Module):
    """JetMoe's and DeepSeek-V4's routing: the tokens an expert gets are chosen by value (``nonzero``), so their
    count is a data-dependent size (an unbacked ``u0``), here also read as a value (a mean over the routed)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(DIM)
        self.attn, self.mlp = Attention(), Mlp()

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        flat = self.norm(x).flatten(0, 1)  # (t, h)
        idx = (flat[:, 0] > 0).nonzero().squeeze(1)  # (u0,)
        routed = flat.index_select(0, idx)  # (u0, h)
        return x + self.mlp(self.norm(x)) + routed.sum(0) / (idx.shape[0] + 1)


@pytest.mark.timeout(120)
def test_a_data_dependent_count_of_tokens_plans_and_lowers():
    torch.manual_seed(0)
    model = LM(RoutedBlock)
    c, inputs = _plan(model)
    assert c.plan.fallbacks == [] and c.quality == []
    assert_sim_parity(c, model, inputs)


class CutBlock(torch.nn.Module):
    """BLT's patch starts: positions cut to a data-dependent length (``pos[:, :mask.sum(1).max()]``), so the
    slice itself makes its output's size (an unbacked ``u``), then gathered and averaged over that length."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(DIM)
        self.attn, self.mlp = Attention(), Mlp()

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        h = self.norm(x)
        keep = (h[..., 0] > 0).sum(1).max()  # a data-dependent count
        pos = torch.arange(h.shape[1], device=x.device).expand(h.shape[0], -1)[:, :keep]  # (b, u)
        picked = h.gather(1, pos.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        return x + self.mlp(self.norm(x)) + picked.mean(1, keepdim=True)


@pytest.mark.timeout(120)
def test_a_slice_that_makes_its_own_data_dependent_size_lowers():
    """The slice's output size exists only once the slice runs: its localizer is not asked for it (lowering
    raised "the data-dependent size u.. is read before any node that makes it" on BLT)."""
    torch.manual_seed(0)
    model = LM(CutBlock)
    c, inputs = _plan(model)
    assert c.plan.fallbacks == [] and c.quality == []
    assert_sim_parity(c, model, inputs)


class WindowBlock(torch.nn.Module):
    """DeepSeek-V4's compressor: the sequence viewed as windows of 4 (``view(b, s // 4, 4, h)``), pooled and added
    back to every token of its window. Export then refines the sequence length to ``4*s``, so the program's
    positions (``arange(4*s)``) read a symbol no input dim is alone."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(DIM)
        self.attn, self.mlp = Attention(), Mlp()

    def forward(self, x):
        b, s, h = x.shape
        x = x + self.attn(self.norm(x))
        y = self.mlp(self.norm(x))
        return x + y + y.view(b, s // 4, 4, h).mean(2, keepdim=True).expand(-1, -1, 4, -1).reshape(b, s, h)


class PositionLM(LM):
    def __init__(self, block, layers=4):
        super().__init__(block, layers)
        self.pos = torch.nn.Embedding(32, DIM)

    def forward(self, ids, labels):
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(120)
def test_a_sequence_export_refines_to_a_multiple_lowers():
    """The symbol ``s`` of a dim captured as ``4*s`` is that dim // 4 (lowering raised "the data-dependent size
    s.. is read before any node that makes it" on DeepSeek-V4), and the program runs at another length."""
    torch.manual_seed(0)
    model = PositionLM(WindowBlock)
    c, inputs = _plan(model)
    seq = next(n for n in c.captured.gm.graph.nodes if n.op == "placeholder" and n.name in c.captured.user_inputs)
    assert str(seq.meta["val"].shape[1]).startswith("4*"), seq.meta["val"].shape
    assert c.plan.fallbacks == [] and c.quality == []
    assert_sim_parity(c, model, inputs)
    g = torch.Generator().manual_seed(2)
    longer = (torch.randint(0, VOCAB, (2, 24), generator=g), torch.randint(0, VOCAB, (2, 24), generator=g))
    assert_sim_parity(c, model, longer)


class IndexAddExpertsBlock(torch.nn.Module):
    """JetMoE's experts: the tokens sorted by their expert (a data-dependent order), run through an MLP, and
    added back to their places in a tensor of zeros with ``index_add`` (its rows by the sorted indices)."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(DIM), torch.nn.RMSNorm(DIM)
        self.attn, self.mlp = Attention(), Mlp()
        self.router = torch.nn.Linear(DIM, 4, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        flat = self.norm2(x).flatten(0, 1)  # (t, h)
        order = self.router(flat).topk(1).indices[:, 0].sort(stable=True).indices  # tokens grouped by expert
        out = torch.zeros_like(flat).index_add(0, order, self.mlp(flat[order]))
        return x + out.view_as(x)


@pytest.mark.timeout(120)
def test_experts_outputs_added_into_zeros_by_index_add_reduce_once():
    """``zeros.index_add(0, idx, source)`` of a row-parallel MLP's partial sums is itself a partial sum (adding
    the zeros on every rank adds nothing): the MLP's one all-reduce comes after it, a layer runs Megatron's 2
    forward collectives, and it trains at parity (``index_add`` ran replicated before, reported as a fallback,
    with the MLP's output gathered)."""
    torch.manual_seed(0)
    model = LM(IndexAddExpertsBlock)
    c, inputs = _plan(model)
    assert c.plan.fallbacks == [] and c.quality == []
    assert c.plan.params["layers.0.mlp.down.weight"].placements[0] == Shard(1)
    fwd = [s.origin for s in c.plan.collectives if s.layer == 1 and s.forward != "none"]
    adds = [n.name for n in c.captured.gm.graph.nodes if n.target is torch.ops.aten.index_add.default]
    assert len(fwd) == 2 and adds and all(c.plan.activations[a] == (Partial(),) for a in adds), (fwd, adds)
    assert_sim_parity(c, model, inputs)


class PostNormBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), Mlp()

    def forward(self, x):
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.mlp(x))


class SharedLayerLM(torch.nn.Module):
    """ALBERT: an input projection (column-parallel: its output split on features) into one layer applied 4
    times, its attention reading the residual stream directly (post-norm)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.map_in = torch.nn.Linear(DIM, DIM, bias=False)
        self.layer = PostNormBlock()
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids, labels):
        x = self.map_in(self.emb(ids))
        for _ in range(4):
            x = self.layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.mark.timeout(120)
def test_a_layer_shared_by_every_layer_takes_one_placement_for_all_readers():
    torch.manual_seed(0)
    model = SharedLayerLM()
    c, inputs = _plan(model)
    pl = {k: v.placements[0] for k, v in c.plan.params.items()}
    assert pl["layer.attn.q.weight"] == Shard(0) and pl["layer.attn.o.weight"] == Shard(1), pl
    assert pl["layer.mlp.up.weight"] == Shard(0) and pl["layer.mlp.down.weight"] == Shard(1), pl
    assert c.plan.fallbacks == []
    assert_sim_parity(c, model, inputs)


class ClippedQkvBlock(torch.nn.Module):
    """DBRX's attention: one fused Wqkv projection clamped (``clip_qkv``) before it is split into q, k and v."""

    def __init__(self, heads=4):
        super().__init__()
        self.heads, self.hd = heads, DIM // heads
        self.norm = torch.nn.RMSNorm(DIM)
        self.wqkv = torch.nn.Linear(DIM, 3 * DIM, bias=False)
        self.o = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.wqkv(self.norm(x)).clamp(min=-0.5, max=0.5)
        q, k, v = (t.view(b, s, self.heads, self.hd).transpose(1, 2) for t in qkv.split(DIM, dim=2))
        return x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


@pytest.mark.timeout(120)
def test_a_fused_projection_clamped_before_its_split_keeps_its_blocks():
    """An entrywise op between a fused projection and its split (a clamp) keeps the weight's block layout: each
    rank its heads of q, k and v, no all-gather before the split, one all-reduce per layer."""
    from mcompile.ir.placements import BlockShard

    torch.manual_seed(0)
    model = LM(ClippedQkvBlock, layers=2)
    c, inputs = _plan(model)
    assert c.plan.params["layers.0.wqkv.weight"].placements[0] == BlockShard(0, (DIM, DIM, DIM))
    assert [s.op for s in c.plan.collectives if s.layer == 1 and s.forward != "none"] == ["all_reduce"]
    assert_sim_parity(c, model, inputs)
