"""The MoE models of models/moe_lm.py and their presets, single process: dispatch, routing and losses against
independent oracles, DeepSeek-V3's bias balancing, and capture with symbolic batch and sequence.

Oracles: a Python loop over the experts (masks, no sorting, no grouped GEMM) for the dispatch, and
the routing and loss formulas written out again here. Tolerances: fp32 dispatch and routing
1e-6 relative to each tensor's largest entry (:func:`close`: the grouped GEMM and the loop multiply
the same rows, only the summation order differs, e.g. a weight gradient summed over 12 tokens);
the loss formulas are recomputed in float64, so fp32 rounding of softmax/logsumexp is allowed 1e-5.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from mcompile.models.moe_lm import (
    DeepSeekMoE,
    DeepSeekV3,
    DeepSeekV3Config,
    GroupedExperts,
    Mixtral,
    MixtralConfig,
    MixtralMoE,
    grouped_mm_reference,
)

TIGHT = dict(rtol=1e-6, atol=1e-6)


def close(a, b, msg=None):
    """Equal to 1e-6 of the larger of 1 and b's largest magnitude (fp32 sums in another order)."""
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * max(1.0, b.abs().max().item()), msg=msg)

# the configs of the "mixtral-tiny" / "deepseek-tiny" presets (models/presets.py), written out again
MIXTRAL_TINY = dict(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=128, max_seq_len=128,
                    rope_theta=1e6, n_experts=4, top_k=2)
DEEPSEEK_TINY = dict(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=8, ffn_hidden=128, max_seq_len=128,
                     norm_eps=1e-6, rope_theta=10000.0, moe_ffn_hidden=32, n_routed_experts=8, n_shared_experts=1,
                     top_k=2, n_groups=4, topk_groups=2, first_dense_layers=1)


def _tiny(name: str):
    from mcompile.models import PRESETS

    return PRESETS[name].config


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny"])
def test_tiny_presets_match_these_configs(name):
    from mcompile.models import PRESETS, list_presets

    assert name in list_presets()
    assert PRESETS[name].config == (MixtralConfig(**MIXTRAL_TINY) if name == "mixtral-tiny"
                                    else DeepSeekV3Config(**DEEPSEEK_TINY))
    assert PRESETS[name].family == name.split("-")[0]
    model = PRESETS[name].build()
    assert type(model) is (Mixtral if name == "mixtral-tiny" else DeepSeekV3)
    assert model.config == PRESETS[name].config and model.config is not PRESETS[name].config  # its own copy


def _moe_param_count(c) -> int:
    """Closed-form parameter count of models/moe_lm.py's models (untied embeddings), from the config alone."""
    hd = c.dim // c.n_heads
    attn = c.dim * c.n_heads * hd * 2 + c.dim * c.n_kv_heads * hd * 2  # wq, wo; wk, wv
    norms = 2 * c.dim
    if isinstance(c, MixtralConfig):
        ffn = [c.n_experts * 3 * c.dim * c.ffn_hidden + c.n_experts * c.dim] * c.n_layers  # experts + router
    else:
        moe = (c.n_routed_experts * 3 * c.dim * c.moe_ffn_hidden + c.n_routed_experts * c.dim
               + 3 * c.dim * c.n_shared_experts * c.moe_ffn_hidden)
        ffn = [3 * c.dim * c.ffn_hidden if i < c.first_dense_layers else moe for i in range(c.n_layers)]
    return 2 * c.vocab_size * c.dim + c.dim + sum(attn + norms + f for f in ffn)


# the published shapes (Mixtral paper Table 1 / HF Mixtral-8x7B-v0.1; DeepSeek-V3 report §4.2 / HF DeepSeek-V3)
_PUBLISHED = {
    "mixtral-8x7b": (Mixtral, dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                   ffn_hidden=14336, rope_theta=1e6, max_seq_len=32768, n_experts=8, top_k=2)),
    "deepseek-v3": (DeepSeekV3, dict(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                                     ffn_hidden=18432, norm_eps=1e-6, moe_ffn_hidden=2048, n_routed_experts=256,
                                     n_shared_experts=1, top_k=8, n_groups=8, topk_groups=4,
                                     routed_scaling_factor=2.5, first_dense_layers=3)),
}


@pytest.mark.parametrize("name", list(_PUBLISHED))
def test_published_presets_shapes_and_sizes(name):
    """The big presets carry the published numbers, build on meta as their class, and have the parameter
    count of the closed form (checked on the tiny preset too, eagerly); Mixtral 8x7B's is the paper's 46.7B
    (DeepSeek-V3 here has standard attention and no MTP module, so it is not the report's 671B)."""
    from mcompile.models import PRESETS

    cls, fields = _PUBLISHED[name]
    pre = PRESETS[name]
    assert {k: getattr(pre.config, k) for k in fields} == fields
    model = pre.build(device="meta")
    assert type(model) is cls and pre.model_class is cls
    assert model.num_params() == _moe_param_count(pre.config)
    if name == "mixtral-8x7b":
        assert round(model.num_params() / 1e9, 1) == 46.7
    tiny = PRESETS[name.split("-")[0] + "-tiny"]
    assert tiny.build().num_params() == _moe_param_count(tiny.config)


def test_trainer_builds_the_preset_class_with_overrides():
    """mcompile train's build_model goes through the preset's class; an override the config refuses is a
    ConfigError naming model.overrides."""
    from mcompile.apps.train.config import ConfigError, parse_config
    from mcompile.apps.train.loop import build_model

    def tree(preset, **overrides):
        return {"model": {"preset": preset, "overrides": overrides, "init": "eager"},
                "data": {"factory": "train_cases:random_samples"}, "parallel": {"mesh": "dp=1"}}

    for preset, cls in (("mixtral-tiny", Mixtral), ("deepseek-tiny", DeepSeekV3)):
        model, vocab, example = build_model(parse_config(tree(preset, top_k=1), "test"))
        assert type(model) is cls and vocab == 256 and example is None
        assert model.config.top_k == 1 and model.layers[-1].feed_forward.top_k == 1
    with pytest.raises(ConfigError, match=r"model.overrides .* 'mixtral-tiny'.*top_k=9 must be between 1 and "
                                          r"n_experts=4"):
        build_model(parse_config(tree("mixtral-tiny", top_k=9), "test"))


def _swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def loop_experts(x, expert_idx, weights, w1, w2, w3):
    """Oracle: for each expert, the (token, choice) pairs that picked it, weighted and summed."""
    y = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        hit = expert_idx == e  # (T, k)
        rows = hit.any(1).nonzero().flatten()
        if rows.numel() == 0:
            continue
        w = (weights * hit).sum(1)[rows].unsqueeze(1)  # a token picks an expert at most once
        y = y.index_add(0, rows, w * _swiglu(x[rows], w1[e], w2[e], w3[e]))
    return y


def _grads(out, tensors):
    return torch.autograd.grad(out, tensors, torch.randn_like(out))


# --------------------------------------------------------------------------- grouped GEMM, dispatch


@pytest.mark.parametrize("sizes", [[3, 0, 7], [0, 0, 10], [10, 0, 0], [2, 3, 5]])
def test_grouped_mm_reference_matches_loop_and_torch(sizes):
    torch.manual_seed(0)
    x = torch.randn(sum(sizes), 8, requires_grad=True)
    w = torch.randn(len(sizes), 8, 16, requires_grad=True)
    offs = torch.tensor(sizes).cumsum(0)
    out = grouped_mm_reference(x, w, offs)
    starts = [0, *offs.tolist()[:-1]]
    loop = torch.cat([x[a:b] @ w[g] for g, (a, b) in enumerate(zip(starts, offs.tolist()))])
    torch.testing.assert_close(out, loop, **TIGHT)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (x, w), g), torch.autograd.grad(loop, (x, w), g)):
        close(a, b)
    if hasattr(torch, "_grouped_mm"):  # same semantics as torch's op (which runs fp32 eagerly on CPU)
        torch.testing.assert_close(out, torch._grouped_mm(x, w, offs=offs.to(torch.int32)), **TIGHT)


@pytest.mark.parametrize("case", ["random", "empty_expert_and_ties", "one_expert"])
def test_dispatch_matches_per_expert_loop(case):
    torch.manual_seed(1)
    T, d, h, E, k = 12, 16, 8, 5, 2
    experts = GroupedExperts(E, d, h)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(T, d, requires_grad=True)
    if case == "random":
        idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
        wts = torch.rand(T, k)
    elif case == "empty_expert_and_ties":  # expert 3 gets nothing; equal weights; tokens sharing both experts
        idx = torch.tensor([[0, 1], [1, 0], [4, 2], [2, 4], [0, 1], [1, 2]] * 2)
        wts = torch.full((T, k), 0.5)
    else:  # every token to expert 2 (top-1): all other groups empty
        idx, wts, k = torch.full((T, 1), 2), torch.rand(T, 1), 1
    wts.requires_grad_(True)
    out = experts(x, idx, wts)
    ref = loop_experts(x, idx, wts, experts.w1, experts.w2, experts.w3)
    torch.testing.assert_close(out, ref, **TIGHT)
    leaves = (x, wts, experts.w1, experts.w2, experts.w3)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves, g)):
        close(a, b)


# --------------------------------------------------------------------------- Mixtral


def mixtral_oracle(layer: MixtralMoE, x):
    logits = x @ layer.router.weight.T
    probs = logits.softmax(-1)
    top_p, top_i = probs.topk(layer.top_k, -1)
    e = layer.experts
    return loop_experts(x, top_i, top_p / top_p.sum(-1, keepdim=True), e.w1, e.w2, e.w3)


@pytest.mark.parametrize("router", ["random", "zero"])  # zero: every probability ties at 1/E
def test_mixtral_layer_matches_oracle(router):
    torch.manual_seed(2)
    layer = MixtralMoE(MixtralConfig(**{**MIXTRAL_TINY, "dim": 16, "ffn_hidden": 8}))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    if router == "zero":
        torch.nn.init.zeros_(layer.router.weight)
    x = torch.randn(2, 9, 16, requires_grad=True)
    y, _, _ = layer(x)
    ref = mixtral_oracle(layer, x.reshape(-1, 16)).reshape(2, 9, 16)
    torch.testing.assert_close(y, ref, **TIGHT)
    leaves = (x, *layer.parameters())
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, leaves, g), torch.autograd.grad(ref, leaves, g)):
        close(a, b)


def test_mixtral_aux_and_z_losses_equal_their_formulas():
    torch.manual_seed(3)
    cfg = MixtralConfig(**{**MIXTRAL_TINY, "aux_loss_coef": 0.5, "z_loss_coef": 0.1})
    model = Mixtral(cfg)
    with torch.no_grad():  # plant a skew: hidden states share the all-ones direction, expert 0 likes it
        model.tok_embeddings.weight += 1.0
        for layer in model.layers:
            torch.nn.init.normal_(layer.feed_forward.router.weight, std=0.3)
            layer.feed_forward.router.weight[0] += 0.05
    idx, tgt = torch.randint(0, 256, (3, 11)), torch.randint(0, 256, (3, 11))
    seen = []
    hooks = [layer.feed_forward.router.register_forward_hook(lambda m, i, o: seen.append(o.detach().double()))
             for layer in model.layers]
    loss = model(idx, tgt)
    logits = model(idx)
    for h in hooks:
        h.remove()
    E, k = cfg.n_experts, cfg.top_k
    auxes, zs = [], []
    for router_logits in seen[: cfg.n_layers]:
        rows = router_logits.tolist()
        T = len(rows)
        picks = [sorted(range(E), key=lambda e, r=r: -r[e])[:k] for r in rows]
        probs = [[math.exp(v - max(r)) / sum(math.exp(u - max(r)) for u in r) for v in r] for r in rows]
        f = [sum(e in p for p in picks) / (T * k) for e in range(E)]  # fraction of routed slots
        P = [sum(p[e] for p in probs) / T for e in range(E)]  # mean router probability
        auxes.append(E * sum(fe * pe for fe, pe in zip(f, P)))
        zs.append(sum((max(r) + math.log(sum(math.exp(v - max(r)) for v in r))) ** 2 for r in rows) / T)
    aux, z = sum(auxes) / len(auxes), sum(zs) / len(zs)
    assert aux > 1.01  # uneven loads (1.0 is perfect balance): the check below is not vacuous
    terms = model.loss_terms(idx, tgt)
    assert terms.aux.item() == pytest.approx(aux, rel=1e-5)
    assert terms.z.item() == pytest.approx(z, rel=1e-5)
    ce = F.cross_entropy(logits.reshape(-1, 256), tgt.reshape(-1)).item()
    assert loss.item() == pytest.approx(ce + 0.5 * aux + 0.1 * z, rel=1e-5)


# --------------------------------------------------------------------------- DeepSeek-V3


def deepseek_route_oracle(layer: DeepSeekMoE, x):
    """Token by token, in Python: group scores, allowed experts, top-k by score+bias, weights from scores."""
    scores = torch.sigmoid(x @ layer.router.weight.T)
    E = scores.shape[1]
    size = E // layer.n_groups
    idx, wts = [], []
    for s_row in scores:
        c = (s_row + layer.bias).tolist()
        group_score = [sum(sorted(c[g * size:(g + 1) * size])[-2:]) for g in range(layer.n_groups)]
        groups = sorted(range(layer.n_groups), key=lambda g: -group_score[g])[: layer.topk_groups]
        allowed = [e for e in range(E) if e // size in groups]
        chosen = sorted(allowed, key=lambda e: -c[e])[: layer.top_k]
        w = s_row[chosen]
        idx.append(chosen)
        wts.append(w / w.sum() * layer.routed_scaling_factor)
    return torch.tensor(idx), torch.stack(wts)


def _deepseek_layer(seed=4):
    torch.manual_seed(seed)
    layer = DeepSeekMoE(DeepSeekV3Config(**{**DEEPSEEK_TINY, "dim": 16, "moe_ffn_hidden": 8}))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def test_deepseek_layer_matches_oracle():
    layer = _deepseek_layer()
    layer.bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(2, 9, 16, requires_grad=True)
    y, load = layer(x)
    xt = x.reshape(-1, 16)
    idx, wts = deepseek_route_oracle(layer, xt)
    e = layer.experts
    ref = (loop_experts(xt, idx, wts, e.w1, e.w2, e.w3) + layer.shared(xt)).reshape(2, 9, 16)
    torch.testing.assert_close(y, ref, **TIGHT)
    assert load.tolist() == [int((idx == j).sum()) for j in range(8)]
    leaves = (x, *layer.parameters())
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, leaves, g), torch.autograd.grad(ref, leaves, g)):
        close(a, b)


def test_deepseek_bias_steers_choice_not_weights():
    layer = _deepseek_layer()
    xt = torch.randn(18, 16)
    idx0, _ = layer.route(xt)
    target = int(torch.bincount(idx0.flatten(), minlength=8).argmin())  # the least chosen expert
    layer.bias[target] = 10.0
    idx1, w1 = layer.route(xt)
    assert (idx1 == target).any(1).all()  # now every token picks it
    scores = torch.sigmoid(xt @ layer.router.weight.T)
    expected = scores.gather(1, idx1)
    torch.testing.assert_close(w1, expected / expected.sum(1, keepdim=True) * 2.5, **TIGHT)
    assert w1.max() < 2.5  # a weight carrying the +10 bias would exceed the scale


def test_update_bias_rule_and_balance():
    torch.manual_seed(5)
    model = DeepSeekV3(DeepSeekV3Config(**DEEPSEEK_TINY))
    moe = model.moe_layers[0]
    with torch.no_grad():  # diverse affinities, and a skew planted in the bias: expert 0 overloaded
        torch.nn.init.normal_(moe.router.weight, std=0.3)
        moe.bias[0] = 0.5
    idx, tgt = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))

    def imbalance(load):
        return (load.max() / load.mean()).item()

    model.eval()
    with torch.no_grad():
        model(idx, tgt)
    assert model.expert_load.sum() == 0  # eval mode counts nothing
    model.train()
    loads = []
    for _ in range(12):
        with torch.no_grad():
            model(idx, tgt)
        before = moe.bias.clone()
        load = model.update_bias(rate=0.05)
        assert load.sum() == 2 * 32 * 2  # every routed slot counted once
        torch.testing.assert_close(moe.bias - before, 0.05 * torch.sign(load[0].mean() - load[0]), **TIGHT)
        loads.append(load[0])
    assert model.expert_load.sum() == 0  # reset by update_bias
    assert imbalance(loads[0]) >= 1.8  # the planted skew (max/mean load; 1.0 is balanced)
    assert sum(imbalance(x) for x in loads[-4:]) / 4 < 0.75 * imbalance(loads[0])
    assert moe.bias[0] < 0.5 - 0.05 * 3  # the overloaded expert was pushed down
    with pytest.raises(ValueError, match="n_moe_layers, n_routed_experts"):
        model.update_bias(torch.zeros(2, 8))


@pytest.mark.parametrize("cls, change, match", [
    (MixtralConfig, {"top_k": 5}, "top_k=5 must be between 1 and n_experts=4: lower top_k or add experts"),
    (MixtralConfig, {"top_k": 0}, "top_k=0 must be between 1 and n_experts=4"),
    (MixtralConfig, {"n_experts": 0}, "n_experts must be >= 1, got 0"),
    (MixtralConfig, {"aux_loss_coef": -0.1}, "must be >= 0"),
    (MixtralConfig, {"n_heads": 6}, r"dim \(64\) must be divisible by n_heads \(6\)"),
    (DeepSeekV3Config, {"n_groups": 3}, "valid n_groups: 1, 2, 4, 8"),
    (DeepSeekV3Config, {"n_groups": 8}, "leaves 1 expert per group: use fewer groups"),
    (DeepSeekV3Config, {"topk_groups": 5}, "topk_groups=5 must be between 1 and n_groups=4"),
    (DeepSeekV3Config, {"top_k": 5}, "top_k=5 must be between 1 and the 4 experts"),  # 2 groups of 2 reachable
    (DeepSeekV3Config, {"top_k": 5, "n_groups": 1, "topk_groups": 1, "n_routed_experts": 4},
     "top_k=5 must be between 1 and the 4 experts"),  # top_k > n_routed_experts, no grouping
    (DeepSeekV3Config, {"n_routed_experts": 0}, "n_routed_experts and moe_ffn_hidden must be >= 1"),
    (DeepSeekV3Config, {"bias_update_rate": -1.0}, "bias_update_rate must be >= 0"),
    (DeepSeekV3Config, {"first_dense_layers": 2}, "first_dense_layers=2 leaves no MoE layer of the n_layers=2"),
    (DeepSeekV3Config, {"routed_scaling_factor": 0.0}, "routed_scaling_factor must be > 0"),
])
def test_config_errors_say_what_to_do(cls, change, match):
    base = MIXTRAL_TINY if cls is MixtralConfig else DEEPSEEK_TINY
    cls(**base)  # the unchanged config is valid: the change alone is refused
    with pytest.raises(ValueError, match=match):
        cls(**{**base, **change})


def test_model_and_preset_refuse_the_other_config():
    from mcompile.models import Preset

    with pytest.raises(TypeError, match="Mixtral needs a MixtralConfig, got DeepSeekV3Config"):
        Mixtral(DeepSeekV3Config(**DEEPSEEK_TINY))
    with pytest.raises(TypeError, match="DeepSeekV3 needs a DeepSeekV3Config, got MixtralConfig"):
        DeepSeekV3(MixtralConfig(**MIXTRAL_TINY))
    with pytest.raises(TypeError, match=r"family 'deepseek' \(DeepSeekV3\) needs a DeepSeekV3Config, got a "
                                        "MixtralConfig"):
        Preset("x", "deepseek", MixtralConfig(**MIXTRAL_TINY))
    with pytest.raises(ValueError, match="unknown family 'moe'; families: gpt, llama, mixtral, deepseek"):
        Preset("x", "moe", MixtralConfig(**MIXTRAL_TINY))
    assert type(Preset("x", "llama", MixtralConfig(**MIXTRAL_TINY), model_class=Mixtral).build()) is Mixtral


def test_meta_build_initialises_every_tensor():
    """A preset built on meta (mcompile train's default model.init = "meta") gets every parameter and buffer
    from the model's own initialisers, with an eager build's shapes and dtypes; the deterministic ones
    (RoPE inv_freq, DeepSeek's routing bias and expert_load, all-ones norms) equal the eager build's."""
    from mcompile.models import PRESETS
    from mcompile.runtime.init import init_tensors

    for name in ("mixtral-tiny", "deepseek-tiny"):
        eager = PRESETS[name].build()
        ref = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
        meta = PRESETS[name].build(device="meta")
        names = [n for n, _ in meta.named_parameters()] + [n for n, _ in meta.named_buffers()]
        assert set(names) == set(ref)
        for fqn, value in init_tensors(meta, names, seed=0):
            assert value.shape == ref[fqn].shape and value.dtype == ref[fqn].dtype, fqn
            if fqn.endswith(("norm.weight", "inv_freq", "expert_load", "feed_forward.bias")):
                torch.testing.assert_close(value, ref[fqn], rtol=0, atol=0, msg=fqn)


# --------------------------------------------------------------------------- capture


@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny"])
def test_capture_with_symbolic_batch_and_seq(name):
    """mcompile's capture (torch.export, symbolic batch and seq) runs at other sizes with eager's loss and
    gradients; DeepSeek's load count (training mode) is an in-place buffer update the program carries."""
    from mcompile.capture.export import capture

    torch.manual_seed(6)
    cfg = _tiny(name)
    model = (Mixtral if isinstance(cfg, MixtralConfig) else DeepSeekV3)(cfg).train()
    cap = capture(model, (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))))
    assert set(cap.symbols) == {"batch", "seq"}
    run = cap.ep.module()
    idx, tgt = torch.randint(0, 256, (3, 24)), torch.randint(0, 256, (3, 24))  # not the capture's sizes
    ref = model(idx, tgt)
    counted = model.expert_load.clone() if isinstance(model, DeepSeekV3) else None
    if counted is not None:
        model.expert_load.zero_()  # (the exported program may share the model's buffer)
    got = run(idx, tgt)
    torch.testing.assert_close(got, ref, **TIGHT)
    names = [n for n, _ in model.named_parameters()]
    g_ref = torch.autograd.grad(ref, list(model.parameters()))
    params = dict(run.named_parameters())
    g_cap = torch.autograd.grad(got, [params[n] for n in names])
    for n, a, b in zip(names, g_cap, g_ref):
        close(a, b, msg=n)
    if isinstance(model, DeepSeekV3):
        load_ph = next(ph for ph, fqn in cap.buffers.items() if fqn == "expert_load")
        assert torch.ops.aten.add_.Tensor in [u.target for u in cap.placeholder(load_ph).users]
        assert counted.sum() == 3 * 24 * cfg.top_k  # every routed slot of the eager call
        torch.testing.assert_close(run.get_buffer("expert_load"), counted, rtol=0, atol=0)


# --------------------------------------------------------------------------- the planner today (issue 15)

_PLANNED = [("mixtral-tiny", "tp=2"), ("deepseek-tiny", "tp=2"), ("deepseek-tiny", "dp=2"), ("mixtral-tiny", "dp=2")]


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh", _PLANNED)
def test_planner_today_forward_parity(name, mesh):
    """The MoE models planned without ep: each MoE region is one moe_ffn node (passes/ep/find_moe.py), every op
    without a sharding rule runs replicated and is reported in plan.fallbacks; the forward loss equals
    eager (threads, fp32) — under dp too, where the load-balancing loss's batch statistics are reduced."""
    from mcompile.api import compile_plan
    from mcompile.ir.mesh import Mesh
    from mcompile.runtime.sim import ThreadedWorld, run_threads

    torch.manual_seed(7)
    cfg = _tiny(name)
    model = (Mixtral if isinstance(cfg, MixtralConfig) else DeepSeekV3)(cfg).eval()
    idx, tgt = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = compile_plan(model, Mesh.parse(mesh), (idx, tgt))
    warned = {str(w.message).split()[4].rstrip(":") for w in caught if "no sharding rule" in str(w.message)}
    assert warned == set(c.plan.fallbacks)  # nothing replicated silently
    assert not {"aten.argsort.stable", "aten.index_add.default"} & warned  # the dispatch is one moe_ffn node
    ref = model(idx, tgt)
    state = c.captured.state_values()
    out = run_threads(ThreadedWorld(c.mesh), lambda r: c.run_local(r, c.local_state(r, state), (idx, tgt))[0])
    for loss in out:
        torch.testing.assert_close(loss, ref, **TIGHT)
