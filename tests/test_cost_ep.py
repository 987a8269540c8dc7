"""Expert parallelism (ep) in the cost model, the memory model, the search and `mcompile plan`.

What each test checks, against what:
- the all-to-alls: ``ep_comm`` equals a hand α-β sum from the model's config and the hardware profile
  (E int64 counts forward; the T·k token rows of d elements dispatched and combined, forward and backward;
  (n−1)·α + (n−1)/n·B/β on the ep axis's link, inside a node and across nodes);
- ``moe_imbalance`` scales the token bytes of dispatch/combine and the experts' compute (FLOPs and
  activation traffic, not their weights), nothing else, and does nothing without ep;
- expert FLOPs: T·k·(6·d·f) per MoE layer (k experts a token, not E), counted as matmul FLOPs (MFU);
- memory: parameters, gradients and optimizer state per rank = dense + experts/ep, counted from the
  built model's parameters (ZeRO-1: dense over dp·ep ranks, experts over dp);
- Workload.from_preset on a model of dense then MoE layers (one of each captured, weighted by their
  real counts), on Mixtral-8x7B and (slow tier) DeepSeek-V3: the profile's parameter count is the
  real model's (built on meta and counted);
- the search: ep for Mixtral-8x7B on 64 H100s (its choice printed), never for Llama-3-8B; its pricing
  is mc.estimate's on ep layouts; `mcompile plan` prints experts per rank and the all-to-all formula.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from mcompile.cost.hardware import get_hardware
from mcompile.cost.model import BATCH, DEFAULT_EFFICIENCY, SEQ, Layout
from mcompile.cost.workload import Workload, estimate
from mcompile.models import get_preset
from mcompile.search import SearchWorkload, enumerate_layouts, price, search

H100 = get_hardware("h100")


@pytest.fixture(scope="module")
def tiny():
    """Mixtral-tiny: 2 layers, E=4 experts of f=128, top-2, d=64 (bf16 capture)."""
    return SearchWorkload.of("mixtral-tiny")


def _cfg(name="mixtral-tiny"):
    return get_preset(name).config


def _counted(name: str) -> tuple[int, int]:
    """(dense, expert) parameters of the preset built on meta: the routed experts are the 3-D weights."""
    model = get_preset(name).build("meta")
    dense = experts = 0
    for _, p in model.named_parameters():
        if p.ndim == 3:
            experts += p.numel()
        else:
            dense += p.numel()
    return dense, experts


def _a2a(n: int, nbytes: float, beta: float, alpha: float) -> float:
    return (n - 1) * alpha + (n - 1) / n * nbytes / beta


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,ep,tp", [(2, 4, 1), (1, 4, 4)], ids=["intra-node", "inter-node"])
def test_all_to_all_time_is_alpha_beta(tiny, dp, ep, tp):
    cfg = _cfg()
    b, s, B = 1, 128, 64
    e = estimate(Layout(dp=dp, ep=ep, tp=tp), tiny, hardware=H100, global_batch=B, seq=s)
    eff = DEFAULT_EFFICIENCY
    if ep * tp <= H100.gpus_per_node:  # the ep axis sits inside tp: stride tp
        beta, alpha = H100.intra_node_bandwidth * eff.intra_node, H100.intra_node_latency
    else:  # across nodes: each node holds gpus_per_node / tp of the group, each with its NIC
        per_node = H100.gpus_per_node // tp
        beta = min(H100.intra_node_bandwidth, per_node * H100.inter_node_bandwidth) * eff.inter_node
        alpha = H100.inter_node_latency
    rows = b * s * cfg.top_k * cfg.dim * 2  # bf16 token rows of one direction
    per_layer = _a2a(ep, 8 * cfg.n_experts, beta, alpha) + 4 * _a2a(ep, rows, beta, alpha)
    m = B / (dp * ep * b)
    assert e.breakdown["ep_comm"] == pytest.approx(m * cfg.n_layers * per_layer, rel=1e-9)
    assert e.details["experts_per_rank"] == cfg.n_experts // ep
    assert e.details["microbatches"] == m
    assert e.step_time_s == pytest.approx(sum(e.breakdown.values()), rel=1e-12)


@pytest.mark.timeout(300)
def test_imbalance_scales_dispatch_combine_and_expert_compute(tiny):
    cfg = _cfg()
    b, s, B, ep = 1, 128, 32, 4
    lay = Layout(dp=2, ep=ep)
    one = estimate(lay, tiny, hardware=H100, global_batch=B, seq=s)
    two = estimate(lay, tiny, hardware=H100, global_batch=B, seq=s, moe_imbalance=2.0)
    beta, alpha = H100.intra_node_bandwidth * DEFAULT_EFFICIENCY.intra_node, H100.intra_node_latency
    rows = b * s * cfg.top_k * cfg.dim * 2
    m, L = B / (2 * ep * b), cfg.n_layers
    for e, imb in ((one, 1.0), (two, 2.0)):  # the counts are not scaled, the token bytes are
        hand = _a2a(ep, 8 * cfg.n_experts, beta, alpha) + 4 * _a2a(ep, imb * rows, beta, alpha)
        assert e.breakdown["ep_comm"] == pytest.approx(m * L * hand, rel=1e-9)
    # the experts' roofline with imb x the FLOPs and activation bytes, E/ep of the weights
    prof = tiny.profile(1)
    op = next(o for o in prof.layer.ops if o.category == "moe")
    n_moe = sum(o.category == "moe" for o in prof.layer.ops)
    F, Y = (float(x.subs({BATCH: b, SEQ: s})) for x in (op.flops, op.bytes))
    W = op.expert_weight_bytes

    def t(imb):
        return max(imb * F / (H100.bf16_flops * DEFAULT_EFFICIENCY.gemm),
                   (imb * (Y - W) + W / ep) / (H100.hbm_bandwidth * DEFAULT_EFFICIENCY.memory))

    assert two.details["layer_expert_forward"] == pytest.approx(n_moe * t(2.0), rel=1e-9)
    assert one.details["layer_expert_forward"] == pytest.approx(n_moe * t(1.0), rel=1e-9)
    # forward + backward (2x) of every layer, every microbatch: nothing else moved
    assert two.breakdown["compute"] - one.breakdown["compute"] == pytest.approx(
        m * L * 3 * n_moe * (t(2.0) - t(1.0)), rel=1e-6)
    for k in ("tp_comm", "optimizer", "pp_bubble"):
        assert two.breakdown[k] == one.breakdown[k]
    # the gradient reduction is the same; a longer backward hides more of it
    assert two.details["dp_comm_total"] == one.details["dp_comm_total"]
    assert two.breakdown["dp_comm"] <= one.breakdown["dp_comm"]
    assert two.memory_bytes == one.memory_bytes
    # without ep every rank runs all experts on its own tokens: the imbalance changes nothing
    dp1 = estimate(Layout(dp=8), tiny, hardware=H100, global_batch=B, seq=s)
    dp2 = estimate(Layout(dp=8), tiny, hardware=H100, global_batch=B, seq=s, moe_imbalance=2.0)
    assert dp2.breakdown == dp1.breakdown and dp1.breakdown["ep_comm"] == 0
    with pytest.raises(ValueError, match="moe_imbalance"):
        estimate(lay, tiny, hardware=H100, global_batch=B, seq=s, moe_imbalance=0.5)


@pytest.mark.timeout(300)
def test_expert_flops_count_k_experts_per_token(tiny):
    cfg = _cfg()
    b, s = 2, 64
    prof = tiny.profile(1)
    moe = [o for o in prof.layer.ops if o.category == "moe"]
    assert moe and all(o.op_class == "gemm" for o in moe)  # in the matmul FLOPs: the MFU counts them
    T = b * s
    per_layer = T * cfg.top_k * 6 * cfg.dim * cfg.ffn_hidden  # SwiGLU: gate, up, down
    vals = prof.layer.evaluate(b, s)
    got = sum(float(f) for o, f in zip(prof.layer.ops, vals.flops) if o.category == "moe")
    assert got == pytest.approx(per_layer, rel=1e-12)  # the mean layer (each captured layer weighs 1/2)
    assert prof.moe.slot_flops == 6 * cfg.dim * cfg.ffn_hidden and prof.moe.top_k == cfg.top_k
    assert prof.moe.experts == cfg.n_experts and prof.moe.layers == cfg.n_layers
    e = estimate(Layout(dp=2, ep=2), tiny, hardware=H100, global_batch=8, seq=s, microbatch_size=b)
    dense_mm = float(vals.matmul_flops) - per_layer
    head = float(prof.pre.evaluate(b, s).matmul_flops + prof.post.evaluate(b, s).matmul_flops)
    assert e.model_flops == pytest.approx(8 / b * 3 * (cfg.n_layers * (dense_mm + per_layer) + head), rel=1e-12)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [0, 1])
def test_memory_experts_fall_as_one_over_ep(tiny, zero):
    dense, experts = _counted("mixtral-tiny")
    prof = tiny.profile(1)
    assert prof.layer.expert_params * prof.n_layers == experts
    total = prof.n_layers * prof.layer.params + prof.pre.params + prof.post.params - prof.tied_params
    assert total == dense + experts
    data = 8
    for ep in (1, 2, 4):
        dp = data // ep
        e = estimate(Layout(dp=dp, ep=ep, zero=zero), tiny, hardware=H100, global_batch=8, seq=64)
        mine = experts / ep
        assert e.details["params_per_rank"] == pytest.approx(dense + mine, rel=1e-12)
        mem = e.memory_breakdown
        assert mem["params"] == pytest.approx(2 * (dense + mine), rel=1e-12)  # bf16
        assert mem["grads"] == pytest.approx(4 * (dense + mine), rel=1e-12)  # fp32
        # AdamW moments + fp32 master: ZeRO-1 shards dense state over dp x ep ranks, an expert's over dp
        opt = 12 * (dense / (dp * ep) + mine / dp) if zero else 12 * (dense + mine)
        assert mem["optimizer"] == pytest.approx(opt, rel=1e-12)


def _check_counts(name: str, work) -> None:
    """The profile's parameters (mean layer x depth + embedding + head) are the built model's."""
    p = work.profile(1)
    dense, experts = _counted(name)
    total = p.n_layers * p.layer.params + p.pre.params + p.post.params - p.tied_params
    assert total == pytest.approx(dense + experts, rel=1e-12), name
    assert p.n_layers * p.layer.expert_params == pytest.approx(experts, rel=1e-12), name
    assert p.moe.expert_params == pytest.approx(experts, rel=1e-12), name


@pytest.mark.timeout(300)
def test_dense_and_moe_layers_are_scaled_apart(monkeypatch):
    """A DeepSeek model of 5 layers, the first 2 dense: captured as 1 dense + 1 MoE layer, weighted 2 and 3."""
    from mcompile.models import presets

    base = get_preset("deepseek-tiny")
    deep = dataclasses.replace(base, name="deepseek-tiny-deep",
                               config=dataclasses.replace(base.config, n_layers=5, first_dense_layers=2))
    monkeypatch.setitem(presets.PRESETS, deep.name, deep)
    w = Workload.from_preset(deep)
    assert w.layer_counts == {0: 2, 1: 3}
    _check_counts(deep.name, w)
    assert w.profile(1).moe.layers == 3


@pytest.mark.slow  # ~30 s of capture (256 experts); the CI tier checks the same on deepseek-tiny-deep above
@pytest.mark.timeout(600)
def test_deepseek_v3_counts_its_real_parameters():
    w = Workload.from_preset("deepseek-v3")
    cfg = _cfg("deepseek-v3")
    assert w.layer_counts == {0: cfg.first_dense_layers, 1: cfg.n_layers - cfg.first_dense_layers}
    prof = w.profile(1)
    assert prof.moe.layers == cfg.n_layers - cfg.first_dense_layers and prof.moe.experts == cfg.n_routed_experts
    assert prof.moe.expert_hidden == cfg.moe_ffn_hidden and prof.moe.top_k == cfg.top_k
    _check_counts("deepseek-v3", w)
    e = estimate(Layout(dp=8, ep=64, pp=8), w, global_batch=4096, seq=4096, recompute="full")
    assert e.details["experts_per_rank"] == 4 and e.breakdown["ep_comm"] > 0
    with pytest.raises(ValueError, match="does not divide the 256 experts"):
        estimate(Layout(dp=2, ep=3), w, global_batch=12, seq=4096)


@pytest.mark.timeout(300)
def test_search_prices_ep_as_the_cost_model(tiny):
    layouts = list(enumerate_layouts(tiny, 8, global_batch=16, seq=64))
    assert {lay.ep for lay in layouts} == {1, 2, 4}  # ep divides E=4 and the dp x ep ranks
    assert all(lay.dp * lay.ep * lay.pp * lay.tp == 8 for lay in layouts)
    for lay in [x for x in layouts if x.ep > 1][::97]:
        e = estimate(lay, tiny, global_batch=16, seq=64)
        p = price(lay, tiny, global_batch=16, seq=64, uniform=True)
        assert p.step_time_s == pytest.approx(e.step_time_s, rel=1e-12), lay
        assert p.breakdown == pytest.approx(e.breakdown, rel=1e-12, abs=1e-15), lay
        assert p.memory_bytes == pytest.approx(e.memory_bytes, rel=1e-12), lay
    kw = dict(hardware="h100", global_batch=16, seq=64, top_k=3, schedules=("1f1b",), precision="bf16")
    fast, full = search(tiny, 8, **kw), search(tiny, 8, exhaustive=True, **kw)
    assert fast[0].layout == full[0].layout and fast[0].step_time_s == full[0].step_time_s


@pytest.mark.timeout(600)
def test_search_includes_ep_for_mixtral_not_for_llama(capsys):
    mixtral = SearchWorkload.of("mixtral-8x7b")  # 2 layers (Workload.from_preset)
    _check_counts("mixtral-8x7b", mixtral)
    res = search(mixtral, 64, hardware="h100", global_batch=512, seq=4096)
    eps = {lay.ep for _, _, lay in res.priced}
    assert eps >= {2, 4, 8}
    best = res[0]
    with capsys.disabled():
        print(f"\nmixtral-8x7b on 64 x H100, global batch 512 x seq 4096: {best}\n{res.table()}")
    assert best.estimate.fits and best.mesh(fake=True).size() == 64
    if best.layout.ep > 1:
        assert dict(best.mesh(fake=True).axes)["ep"] == best.layout.ep
        assert best.estimate.details["experts_per_rank"] == 8 // best.layout.ep
    m = best.options()["microbatches"]
    assert m * best.layout.dp * best.layout.ep * best.layout.microbatch_size == 512
    llama = SearchWorkload.of("llama3-8b")
    dense = search(llama, 64, hardware="h100", global_batch=512, seq=4096, top_k=1)
    assert {lay.ep for _, _, lay in dense.priced} == {1}
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        estimate(Layout(dp=32, ep=2), llama, global_batch=512, seq=4096)


@pytest.mark.timeout(300)
def test_cli_plan_prints_experts_per_rank_and_all_to_all(capsys):
    from mcompile.apps.cli import main

    cfg = _cfg()
    assert main(["plan", "mixtral-tiny", "--mesh", "dp=2,ep=2,tp=2", "--batch", "2", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert f"experts per rank: {cfg.n_experts // 2} (E/ep = {cfg.n_experts}/2)" in out
    assert f"each with {cfg.ffn_hidden // 2} of its {cfg.ffn_hidden} hidden units" in out
    row = cfg.dim * 4  # the CLI builds the fp32 model: d fp32 elements per routed slot
    assert f"{row}*batch*k*seq = {row * cfg.top_k}*batch*seq" in out
    layer = 4 * row * cfg.top_k  # dispatch and combine, forward and backward
    assert f"per MoE layer: {layer}*batch*seq + {8 * cfg.n_experts} bytes" in out
    # fp32 parameters, gradients and AdamW moments (16 B) of E/ep experts of f/tp units, + a 4-byte step count
    expert_state = sum(16 * math.prod(s) // 2 // 2 + 4 for s in _expert_shapes("mixtral-tiny"))
    assert f"experts {_gib(expert_state)}" in out


def _expert_shapes(name):
    return [tuple(p.shape) for _, p in get_preset(name).build("meta").named_parameters() if p.ndim == 3]


def _gib(b):
    from mcompile.ir.plan import _gib as g

    return g(b)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_plan_mixtral_8x7b(capsys):
    from mcompile.apps.cli import main

    assert main(["plan", "mixtral-8x7b", "--mesh", "dp=8,ep=8,tp=8"]) == 0
    out = capsys.readouterr().out
    # d=4096 fp32 elements a routed slot
    assert "experts per rank: 1 (E/ep = 8/8)" in out and "16384*batch*k*seq" in out


@pytest.mark.timeout(300)
def test_layout_ep_validation(tiny):
    with pytest.raises(ValueError, match="dp=2 x ep=2"):
        estimate(Layout(dp=2, ep=2), tiny, global_batch=6, seq=64)
    assert Layout(ep=2, zero=2).data_ranks == 2  # ZeRO-2 shards the dense state over the ep ranks too
