"""Expert forms the MoE recognition (passes/ep/find_moe.py) finds beyond SwiGLU over 3-D weights (issue 37): each is
replaced by the one ``moe_ffn`` node, so tp (expert-TP) and ep plan it unchanged.

* gpt-oss (``GptOssForCausalLM``, unmodified, tiny): gate/up fused with *interleaved* output features
  (gate = ``h[..., 0::2]``), per-expert biases on both projections, the clamped SwiGLU
  ``(clamp(up) + 1) * g * sigmoid(1.702 g)``, weights (E, in, out), run by transformers' grouped-mm experts
  (``torch.ops.transformers.grouped_mm_fallback`` under export);
* a non-gated expert with a squared ReLU (NemotronH's and Ergo's experts) in transformers' grouped-mm form.

Oracles: the single-device model (loss and every gradient through the thread simulator, tests/sim_harness.py)
at tp=2 and at ep=2, and for the new forms the loop over experts (``moe_reference``) against the grouped path.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from sim_harness import assert_sim_parity, run_sim_token_weighted

from mcompile.ir.moe import ExpertForm, moe_layers_of, moe_local, moe_reference
from mcompile.ir.placements import BlockShard, Replicate, Shard
from mcompile.models.hf import CausalLMLoss

OAI = "oai:1.702:7.0/fused_il/io+b"


@pytest.mark.parametrize("form", [OAI, "relu2/plain/oi", "silu/fused_il/oi+b", "gelu/sep/io+b", "relu2/plain/io+b"])
def test_new_forms_grouped_equal_the_loop_over_experts(form):
    """moe_local (slots sorted, one grouped GEMM per projection, biases read per row) against the oracle,
    forward and backward, with expert 3 receiving no token (an empty group)."""
    f = ExpertForm.parse(form)
    assert f.text() == form
    g = torch.Generator().manual_seed(0)
    E, T, d, h, k = 4, 10, 8, 6, 2
    x = torch.randn(T, d, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.rand(T, E - 1, generator=g).argsort(1)[:, :k]
    w = torch.rand(T, k, generator=g, dtype=torch.float64, requires_grad=True)
    # (in, out) per projection; stored (E, out, in) unless transposed
    shapes = {"sep": [(d, h), (d, h), (h, d)], "plain": [(d, h), (h, d)]}.get(f.kind, [(d, 2 * h), (h, d)])
    ws = [torch.randn(E, *(s if f.transposed else s[::-1]), generator=g, dtype=torch.float64) for s in shapes]
    if f.bias:
        ws += [torch.randn(E, s[1], generator=g, dtype=torch.float64) for s in shapes[:-1]]
    ws = [t.requires_grad_(True) for t in ws]

    def grouped_rows(xs, wt, offs):  # a loop over the groups: the oracle of the grouped GEMM itself
        out, start = [], 0
        for e, end in enumerate(offs.tolist()):
            out.append(xs[start:end] @ wt[e])
            start = end
        return torch.cat(out)

    import mcompile.kernels.grouped_gemm as gg
    orig = gg.experts_mm
    gg.experts_mm = grouped_rows
    try:
        got = moe_local(x, idx, w, ws, f)
    finally:
        gg.experts_mm = orig
    want = moe_reference(x, idx, w, ws, f)
    torch.testing.assert_close(got, want)
    gy = torch.randn(T, d, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, [x, w, *ws], gy), torch.autograd.grad(want, [x, w, *ws], gy)):
        torch.testing.assert_close(a, b)


def _ep_parity(c, model, inputs):
    """The plan ``c`` at ep=2 in the thread simulator (tokens split over dp x ep as the runtime splits them):
    the loss and every parameter's gradient equal the single-device model's, 1e-5 relative."""
    model.zero_grad()
    ref = model(*inputs)
    ref.backward()
    loss, grads = run_sim_token_weighted(c, inputs)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=0)
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-5 * float(p.grad.abs().max()),
                                   msg=lambda m, fqn=fqn: f"{fqn}: {m}")


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (4, 8), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def gpt_oss(seed: int = 0):
    """Unmodified HF gpt-oss, tiny: hidden 64, 2 layers, 4 heads (2 kv), 4 experts, top-2."""
    import transformers as hf
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = hf.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                          attention_dropout=0.0)
    torch.manual_seed(seed)
    model = CausalLMLoss(hf.GptOssForCausalLM(cfg)).train()
    with torch.no_grad():  # biases off zero (HF initialises them to 0): a wrong bias placement shows in parity
        for name, p in model.named_parameters():
            if "experts" in name and "bias" in name:
                p.normal_(0, 0.5)
    return model, _inputs()


def _plan(model, inputs, **mesh):
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh
    from mcompile.sharding.propagate import FallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # no op left replicated
        return compile_plan(model, Mesh.fake(**mesh), inputs, token_weighted_loss="ep" in mesh)


@pytest.mark.slow
def test_gpt_oss_experts_at_tp2_megatron_layout_and_parity():
    """Every MoE layer is one moe_ffn of the clamped-SwiGLU form; at tp=2 the experts are expert-TP (gate/up
    and their bias by hidden units, interleaved pairs kept together; down by its input; the down bias's per-slot
    sum added beside the node), no op replicated, Megatron's collectives, single-device parity."""
    model, inputs = gpt_oss()
    c = _plan(model, inputs, tp=2)
    layers = moe_layers_of(c.captured.gm)
    assert len(layers) == 2 and {n.kwargs["form"] for n in layers} == {OAI}
    assert c.plan.fallbacks == [] and c.quality == []
    pre = "m.model.layers.{}.mlp.experts."
    for i in range(2):
        want = {"gate_up_proj": Shard(2), "gate_up_proj_bias": Shard(1), "down_proj": Shard(1)}
        for name, pl in want.items():
            assert c.plan.params[pre.format(i) + name].placements == (pl,), (i, name)
    assert_sim_parity(c, model, inputs, "gpt-oss tp=2")


@pytest.mark.slow
def test_gpt_oss_experts_at_ep2_parity():
    """ep=2: each rank holds 2 of the 4 experts (their weights and input biases), tokens dispatched by
    all-to-all; the loss and every gradient equal the single-device model's."""
    model, inputs = gpt_oss()
    c = _plan(model, inputs, ep=2)
    pre = "m.model.layers.0.mlp.experts."
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj"):
        assert c.plan.params[pre + name].placements == (Shard(0),), name
    model.zero_grad()
    ref = model(*inputs)
    ref.backward()
    loss, grads = run_sim_token_weighted(c, inputs)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=0)
    for fqn, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-5, atol=1e-5 * float(p.grad.abs().max()),
                                       msg=lambda m, fqn=fqn: f"{fqn}: {m}")


class SquaredReluMoE(torch.nn.Module):
    """Embedding, one MoE layer with NemotronH's experts (non-gated, squared ReLU, (E, out, in)) run by
    transformers' grouped-mm experts implementation, a head and the mean cross-entropy."""

    def __init__(self):
        import transformers as hf
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

        super().__init__()
        cfg = hf.NemotronHConfig(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4)
        cfg._experts_implementation = "grouped_mm"  # what a PreTrainedModel sets
        self.emb = torch.nn.Embedding(128, 64)
        self.router = torch.nn.Linear(64, 4, bias=False)
        self.experts = NemotronHExperts(cfg)
        with torch.no_grad():
            for p in (self.experts.up_proj, self.experts.down_proj):
                p.normal_(0, 0.2)
        self.head = torch.nn.Linear(64, 128)

    def forward(self, ids, labels):
        x = self.emb(ids).reshape(-1, 64)
        w, idx = self.router(x).softmax(-1).topk(2)
        y = x + self.experts(x, idx, w)
        return torch.nn.functional.cross_entropy(self.head(y), labels.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("mesh", ["tp", "ep"])
def test_squared_relu_experts_parity(mesh):
    torch.manual_seed(0)
    model, inputs = SquaredReluMoE(), _inputs()
    c = _plan(model, inputs, **{mesh: 2})
    assert [n.kwargs["form"] for n in moe_layers_of(c.captured.gm)] == ["relu2/plain/oi"]
    want = {"tp": (Shard(1), Shard(2)), "ep": (Shard(0), Shard(0))}[mesh]
    assert (c.plan.params["experts.up_proj"].placements[0], c.plan.params["experts.down_proj"].placements[0]) == want
    if mesh == "tp":
        assert_sim_parity(c, model, inputs, "relu2 tp=2")
        return
    _ep_parity(c, model, inputs)


class SkipClassMoE(torch.nn.Module):
    """ZAYA's routing (transformers' ``ZayaRouter``, our code): a router over E + 1 classes on (batch, seq, d),
    top-k kept as (batch, seq, k), the extra "skip" class's slots given weight 0 on expert 0; then ZAYA's experts
    (SwiGLU, [gate; up] fused, (E, out, in)) run by transformers' grouped-mm implementation."""

    def __init__(self):
        from types import SimpleNamespace

        from transformers.models.zaya.modeling_zaya import ZayaExperts

        super().__init__()
        cfg = SimpleNamespace(num_experts=4, hidden_size=64, moe_intermediate_size=32, hidden_act="silu",
                              _experts_implementation="grouped_mm")
        self.emb = torch.nn.Embedding(128, 64)
        self.router = torch.nn.Linear(64, 5, bias=False)
        self.register_buffer("balance", torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1]))  # the skip class is chosen often
        self.experts = ZayaExperts(cfg)
        with torch.no_grad():
            for p in (self.experts.gate_up_proj, self.experts.down_proj):
                p.normal_(0, 0.2)
        self.head = torch.nn.Linear(64, 128)

    def forward(self, ids, labels):
        h = self.emb(ids)
        probs = self.router(h).softmax(-1)
        _, idx = torch.topk(probs.detach() + self.balance, 2, dim=-1)
        w = torch.gather(probs, 2, idx)
        skip = idx == 4
        w, idx = w.masked_fill(skip, 0).reshape(-1, 2), idx.masked_fill(skip, 0).reshape(-1, 2)
        x = h.reshape(-1, 64)
        y = x + self.experts(x, idx, w)
        return torch.nn.functional.cross_entropy(self.head(y), labels.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("mesh", ["tp", "ep"])
def test_router_over_more_classes_than_experts_parity(mesh):
    """A router scoring a class no expert computes (ZAYA's skip class),
    its top-k kept with the batch dims: one moe_ffn, parity at tp=2 and ep=2."""
    torch.manual_seed(0)
    model, inputs = SkipClassMoE(), _inputs()
    assert (model.router(model.emb(inputs[0])) + model.balance).topk(2).indices.eq(4).any()  # some slots skip
    c = _plan(model, inputs, **{mesh: 2})
    assert [n.kwargs["form"] for n in moe_layers_of(c.captured.gm)] == ["silu/fused_gu/oi"]
    if mesh == "tp":
        assert_sim_parity(c, model, inputs, "skip class tp=2")
        return
    _ep_parity(c, model, inputs)


class GptOssExpertsMoE(torch.nn.Module):
    """Embedding, gpt-oss's router (linear with bias, top-k, softmax over the chosen) and gpt-oss's experts
    (transformers' ``GptOssExperts``: interleaved gate/up, biases, clamped SwiGLU) in their grouped-mm
    form, a head and the mean cross-entropy: the CI-sized cover of the whole model's tests above."""

    def __init__(self):
        from types import SimpleNamespace

        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        super().__init__()
        cfg = SimpleNamespace(intermediate_size=32, num_local_experts=4, hidden_size=64, swiglu_alpha=1.702,
                              swiglu_limit=7.0, _experts_implementation="grouped_mm")
        self.emb = torch.nn.Embedding(128, 64)
        self.router = torch.nn.Linear(64, 4)
        self.experts = GptOssExperts(cfg)
        with torch.no_grad():
            for name, p in self.experts.named_parameters():
                p.normal_(0, 0.5 if "bias" in name else 0.2)
        self.head = torch.nn.Linear(64, 128)

    def forward(self, ids, labels):
        x = self.emb(ids).reshape(-1, 64)
        top, idx = self.router(x).topk(2, dim=-1)
        y = x + self.experts(x, idx, top.softmax(-1))
        return torch.nn.functional.cross_entropy(self.head(y), labels.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("mesh", ["tp", "ep"])
def test_gpt_oss_experts_parity(mesh):
    """gpt-oss's experts: one moe_ffn of the clamped-SwiGLU form; tp=2 expert-TP (gate/up and its bias by hidden
    units, interleaved pairs together; down by its input), ep=2 (2 experts a rank, their input biases with
    them); the down bias's per-slot sum beside the node; single-device parity."""
    torch.manual_seed(0)
    model, inputs = GptOssExpertsMoE(), _inputs()
    c = _plan(model, inputs, **{mesh: 2})
    assert [n.kwargs["form"] for n in moe_layers_of(c.captured.gm)] == [OAI]
    want = {"tp": {"gate_up_proj": Shard(2), "gate_up_proj_bias": Shard(1), "down_proj": Shard(1)},
            "ep": {"gate_up_proj": Shard(0), "gate_up_proj_bias": Shard(0), "down_proj": Shard(0)}}[mesh]
    for name, pl in want.items():
        assert c.plan.params["experts." + name].placements == (pl,), name
    from mcompile.apps.report import moe_summary

    facts = moe_summary(c)  # the expert width is read from the down projection, not from a bias after it
    assert (facts["expert_hidden"], facts["expert_hidden_per_rank"]) == ((32, 16) if mesh == "tp" else (32, 32))
    if mesh == "tp":
        # the down bias whole: its per-slot sum joins the experts' output after their one all-reduce (sharded
        # over d it would be all-gathered: a second token-sized collective per layer)
        assert c.plan.params["experts.down_proj_bias"].placements == (Replicate(),)
        assert not [s for s in c.plan.collectives if s.forward == "all_gather"], c.plan.collectives
        assert_sim_parity(c, model, inputs, "gpt-oss experts tp=2")
        return
    _ep_parity(c, model, inputs)


class CappedExpertsAndDecayBuffer(torch.nn.Module):
    """Two MoE layers run by transformers' grouped-mm experts (``grouped_mm_fallback`` under export): Inkling2's
    experts (SwiGLU with soft-capped gate and up factors, [gate; up] fused, (E, out, in)), then MiniMax's (plain
    SwiGLU). Between them a 3-D buffer [E, 16, 1] (E == 4, as MiniMax's lightning-attention decay buffers
    [heads, ., 1] with 4 heads and 4 experts) scales the tokens per 16-wide group: the first layer's output
    meets it, the second layer's routing reads it."""

    def __init__(self):
        from types import SimpleNamespace

        from transformers.models.inkling2.modeling_inkling2 import Inkling2Experts
        from transformers.models.minimax.modeling_minimax import MiniMaxExperts

        super().__init__()
        cfg = SimpleNamespace(n_routed_experts=4, num_local_experts=4, hidden_size=64, moe_intermediate_size=32,
                              intermediate_size=32, hidden_act="silu", mlp_gate_softcap=1.5, mlp_up_softcap=2.0,
                              _experts_implementation="grouped_mm")
        self.emb = torch.nn.Embedding(128, 64)
        self.routers = torch.nn.ModuleList(torch.nn.Linear(64, 4, bias=False) for _ in range(2))
        self.experts = torch.nn.ModuleList([Inkling2Experts(cfg), MiniMaxExperts(cfg)])
        self.register_buffer("decay", torch.linspace(0.5, 1.5, 4).reshape(4, 1, 1).expand(4, 16, 1).contiguous())
        with torch.no_grad():  # gate and up well past the caps (1.5, 2): a wrong cap shows in parity
            for p in self.experts.parameters():
                p.normal_(0, 0.5)
        self.head = torch.nn.Linear(64, 128)

    def forward(self, ids, labels):
        x = self.emb(ids).reshape(-1, 64)
        for i in range(2):
            w, idx = self.routers[i](x).softmax(-1).topk(2)
            x = x + self.experts[i](x, idx, w)
            if i == 0:
                x = (x.reshape(-1, 4, 16) * self.decay.squeeze(-1)).reshape(-1, 64)
        return torch.nn.functional.cross_entropy(self.head(x), labels.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("mesh", ["tp", "ep"])
def test_softcapped_experts_beside_expert_sized_buffer_parity(mesh):
    """Both layers are one moe_ffn each (the soft-capped SwiGLU identified with its caps read from the graph; the
    buffer of leading size E taken for neither layer's experts), no op replicated, tp=2 expert-TP (each expert's
    [gate; up] column-parallel, down row-parallel) or ep=2; single-device parity."""
    torch.manual_seed(0)
    model, inputs = CappedExpertsAndDecayBuffer(), _inputs()
    c = _plan(model, inputs, **{mesh: 2})
    assert [n.kwargs["form"] for n in moe_layers_of(c.captured.gm)] == ["softcap:1.5:2.0/fused_gu/oi",
                                                                         "silu/fused_gu/oi"]
    # tp: [gate; up] (E, 2f, d) in two blocks on the hidden units (each of gate and up split), down (E, d, f) by f
    want = {"tp": (BlockShard(1, 2), Shard(2)), "ep": (Shard(0), Shard(0))}[mesh]
    for i in range(2):
        got = tuple(c.plan.params[f"experts.{i}.{n}"].placements[0] for n in ("gate_up_proj", "down_proj"))
        assert got == want, (i, got)
    if mesh == "tp":
        assert c.quality == []
        assert_sim_parity(c, model, inputs, "soft-capped experts tp=2")
        return
    _ep_parity(c, model, inputs)


def test_a_sampling_router_without_topk_is_recognised_and_trains_at_tp2():
    """Phi-MoE's sparsemixer routes without ``topk``: each slot's expert is the argmax of the (Gumbel-perturbed,
    in training) masked scores, the two slots concatenated. Those indices are a routing too: every layer of an
    unmodified tiny PhimoeForCausalLM becomes one ``moe_ffn`` (its experts were left as captured, replicated,
    before), the experts are expert-TP at tp=2 and the loss and every gradient are the single-device model's
    (router jitter 0: the sampling picks the argmax, as eager does)."""
    import transformers as hf
    from transformers.utils import logging

    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    logging.set_verbosity_error()
    cfg = hf.PhimoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          router_jitter_noise=0.0, input_jitter_noise=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = CausalLMLoss(hf.PhimoeForCausalLM(cfg)).train()
    inputs = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the router's PhimoeMultiplier (a custom Function) still runs replicated
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    assert len(moe_layers_of(c.captured.gm)) == 2
    assert "transformers.grouped_mm_fallback.default" not in c.plan.fallbacks
    assert c.plan.params["m.model.layers.0.mlp.experts.down_proj"].placements != (Replicate(),)
    assert_sim_parity(c, model, inputs, "phimoe tp=2")


def test_experts_with_a_norm_each_run_expert_tp_without_moe_recognition():
    """Ergo normalises each expert's output with that expert's own RMSNorm scale (``weight[expert_ids]``) before
    the weighted sum, so the recognition leaves its experts as captured: transformers' grouped GEMMs
    (``grouped_mm_fallback``, a custom op) between a ``repeat_interleave`` of the tokens and the norm. They run
    expert-TP by their own rule (up's features split, down a partial sum: no op replicated), the norm scales
    stay whole (their rows looked up were gathered back before), and the fused q/k/v, viewed into 4 + 2 + 2
    heads and cut along the heads, is block-sharded (each rank 2 + 1 + 1 heads). A dense layer runs Megatron's 2
    forward tp collectives; an MoE layer 3: attention, the experts (reduced before their norm) and the shared
    expert (reduced before its own). Unmodified tiny ErgoForCausalLM (4 layers: one dense, three MoE) at tp=2;
    the loss and every gradient are the single-device model's."""
    import transformers as hf
    from transformers.utils import logging

    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh

    logging.set_verbosity_error()
    cfg = hf.ErgoConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                        first_dense_intermediate_size=128, shared_intermediate_size=128,
                        layer_types=["sliding_attention"] * 3 + ["full_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    torch.manual_seed(0)
    model = CausalLMLoss(hf.ErgoForCausalLM(cfg)).train()
    inputs = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no layout finding
        c = compile_plan(model, Mesh.fake(tp=2), inputs)
    assert moe_layers_of(c.captured.gm) == []
    p = {k: v.placements[0] for k, v in c.plan.params.items()}
    layer = "m.model.layers.1."
    assert (p[layer + "mlp.experts.up_proj"], p[layer + "mlp.experts.down_proj"]) == (Shard(2), Shard(1))
    assert p[layer + "mlp.experts.post_expert_norm.weight"] == Replicate()
    assert p[layer + "self_attn.qkv_proj.weight"] == BlockShard(0, (2, 1, 1))
    fwd = [s.layer for s in c.plan.collectives if s.layer is not None and s.forward != "none"]
    assert [fwd.count(i) for i in range(4)] == [2, 3, 3, 3], c.plan.collectives
    assert_sim_parity(c, model, inputs, "ergo tp=2")
