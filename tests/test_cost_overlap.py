"""Overlap priced as overlap, ZeRO-2/3, FP8 in the search, and `mcompile explain`'s choices (issue 14).

What each test isolates:
- ``overlapped``: the region formula max(c, t) + (κ − 1)·min(c, t) on random times (hypothesis): never
  more than running both in turn, never less than the longer of the two;
- the cost model: overlap on is never slower than off (same memory) over a sweep of layouts, and is
  strictly faster where there is splittable tp communication (tp=8 with SP) or ZeRO-3 gathers; the
  exposed communication in ``breakdown`` plus the hidden part in ``details`` is the total, per kind;
- ZeRO-2/3 memory: bytes per parameter per the ZeRO table, and a rank's peak recomputed here from the
  model's own parameter counts (not the cost model's profile) plus the buffers in flight;
- the search: memory limits that only ZeRO-2, or only ZeRO-3, fits under make it pick them, and FP8
  where the hardware has it;
- `mcompile explain`: each of the best layout's overlap / ZeRO / precision choices, with a number;
- the GPU profiles' effective NCCL bandwidths against published nccl-tests figures (hardware.py).
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcompile.cost.hardware import GPU_OVERLAP_SLOWDOWN, HARDWARE, NCCL_PUBLISHED, get_hardware
from mcompile.cost.model import Layout, axis_link, collective_time, overlapped
from mcompile.cost.workload import Workload, estimate
from mcompile.ir.memory_model import ZERO_BUCKET_BYTES, model_state_bytes_per_param
from mcompile.models.gpt import GPTConfig
from mcompile.models.presets import Preset
from mcompile.search import SearchError, SearchWorkload, price, search

GPT_WIDE = GPTConfig(vocab_size=512, block_size=2048, n_layer=8, n_head=16, n_embd=2048, dropout=0.0)
# 5 heads: no tp > 1 divides them on 8 GPUs, so a search over 8 GPUs is data- (and pipeline-) parallel only
GPT_FSDP = GPTConfig(vocab_size=512, block_size=512, n_layer=16, n_head=5, n_embd=1280, dropout=0.0)


@pytest.fixture(scope="module")
def wide():
    return Workload.from_preset(Preset("gpt-wide", "gpt", GPT_WIDE))


@pytest.fixture(scope="module")
def fsdp():
    return SearchWorkload.from_preset(Preset("gpt-fsdp", "gpt", GPT_FSDP))


# --------------------------------------------------------------------------- the region formula


@settings(max_examples=200, deadline=None)
@given(c=st.floats(0, 10), t=st.floats(0, 10), kappa=st.floats(1, 2))
def test_overlapped_region_is_between_max_and_sum(c, t, kappa):
    x = overlapped(c, t, kappa)
    assert -1e-12 <= x <= t + 1e-12  # never worse than no overlap
    assert c + x >= max(c, t) - 1e-12  # never better than perfect overlap
    assert overlapped(c, t, 1.0) == pytest.approx(max(0.0, t - c))  # κ = 1: the classic max(c, t)


def test_overlap_slowdown_is_a_cited_hardware_constant():
    h100 = get_hardware("h100")
    assert h100.overlap_slowdown == GPU_OVERLAP_SLOWDOWN == 1.19
    assert "2507.03114" in h100.sources["overlap_slowdown"]
    with pytest.raises(ValueError, match=r"overlap_slowdown=2.5 must be in \[1, 2\]"):
        h100.replace(overlap_slowdown=2.5)


# --------------------------------------------------------------------------- overlap in the cost model

KW = dict(global_batch=64, seq=2048, hardware="h100")
SWEEP = [dict(dp=8, tp=8, sequence_parallel=True), dict(dp=8, tp=8), dict(dp=2, tp=8, pp=4, sequence_parallel=True),
         dict(dp=4, tp=4, pp=2, sequence_parallel=True, recompute="full"), dict(dp=64, zero=3),
         dict(dp=16, tp=4, zero=3, sequence_parallel=True, recompute="selective"), dict(dp=64, zero=2),
         dict(dp=8, cp=2, tp=4, sequence_parallel=True), dict(dp=16, tp=4, sequence_parallel=True, recompute="auto")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fields", SWEEP, ids=[str(Layout(**f)) for f in SWEEP])
def test_overlap_is_never_slower_and_exposed_plus_hidden_is_total(wide, fields):
    on = estimate(Layout(**fields), wide, **KW)
    off = estimate(Layout(**fields, overlap=False), wide, **KW)
    assert on.step_time_s <= off.step_time_s * (1 + 1e-12)
    assert on.memory_bytes == off.memory_bytes  # overlap moves time, not bytes
    for e in (on, off):
        assert e.step_time_s == pytest.approx(sum(e.breakdown.values()), rel=1e-12)
        for kind in ("tp", "dp", "cp"):
            exposed, hidden = e.breakdown[f"{kind}_comm"], e.details[f"{kind}_comm_hidden"]
            assert exposed >= 0 and hidden >= -1e-15
            assert exposed + hidden == pytest.approx(e.details[f"{kind}_comm_total"], rel=1e-9, abs=1e-15), kind
    # overlap off: no tp communication hides (collective matmul off); the totals are the same
    assert off.details["tp_comm_hidden"] == pytest.approx(0, abs=1e-15)
    assert on.details["tp_comm_total"] == pytest.approx(off.details["tp_comm_total"], rel=1e-12)


def test_overlap_is_strictly_faster_with_large_tp_comm(wide):
    """tp=8 with SP: every tp collective is an all-gather or reduce-scatter next to a GEMM, so collective
    matmul hides part of it — strictly faster, by at most the whole tp communication; without SP the
    all-reduces cannot be split and nothing of tp hides."""
    lay = Layout(dp=8, tp=8, sequence_parallel=True)
    on, off = estimate(lay, wide, **KW), estimate(Layout(dp=8, tp=8, sequence_parallel=True, overlap=False), wide,
                                                  **KW)
    assert off.breakdown["tp_comm"] > 0.3 * off.step_time_s  # large tp communication
    saved = off.step_time_s - on.step_time_s
    assert saved > 0.05 * off.step_time_s
    assert on.details["tp_comm_hidden"] > 0 and saved <= off.breakdown["tp_comm"]
    nosp = estimate(Layout(dp=8, tp=8), wide, **KW)
    assert nosp.details["tp_comm_hidden"] == pytest.approx(0, abs=1e-15)
    # the hidden part is priced with the contention factor: κ = 1 hides more
    ideal = estimate(lay, wide, **{**KW, "hardware": get_hardware("h100").replace(overlap_slowdown=1.0)})
    assert ideal.details["tp_comm_hidden"] > on.details["tp_comm_hidden"]


def test_zero3_prefetch_hides_gathers(wide):
    on = estimate(Layout(dp=64, zero=3), wide, **KW)
    off = estimate(Layout(dp=64, zero=3, overlap=False), wide, **KW)
    assert on.step_time_s < off.step_time_s and on.details["dp_comm_hidden"] > 0
    # per microbatch each layer is gathered twice and reduce-scattered once: ZeRO-3 moves more than ZeRO-2
    z2 = estimate(Layout(dp=64, zero=2), wide, **KW)
    assert on.details["dp_comm_total"] > z2.details["dp_comm_total"]


def test_no_overlap_where_collectives_cannot_run_beside_compute(wide):
    """cpu-gloo (2 processes on 2 cores): nothing hides, whatever the layout asks."""
    e = estimate(Layout(dp=2, tp=2, sequence_parallel=True), wide, hardware="cpu-gloo", global_batch=2, seq=256)
    for kind in ("tp", "dp"):
        assert e.details[f"{kind}_comm_hidden"] == pytest.approx(0, abs=1e-15)


def test_zero2_reduces_every_microbatch(wide):
    """ZeRO-2: a reduce-scatter of the gradients after every microbatch, one all-gather of the parameters
    after the optimizer (the per-microbatch ones inside the backward when overlap_grad_reduce)."""
    hw = get_hardware("h100")
    from mcompile.cost.model import DEFAULT_EFFICIENCY

    eff = DEFAULT_EFFICIENCY.for_hardware(hw)
    lay = Layout(dp=8, zero=2, microbatch_size=2, overlap_grad_reduce=False)
    e = estimate(lay, wide, **KW)
    m, P = e.details["microbatches"], e.details["params_per_rank"]
    beta, alpha = axis_link(lay, "dp", hw, eff)
    rs = collective_time("reduce_scatter", P * 4, 8, beta, alpha)
    ag = collective_time("all_gather", P * 2, 8, beta, alpha)
    assert m == 4
    assert e.details["dp_comm_total"] == pytest.approx(m * rs + ag, rel=1e-9)
    assert e.breakdown["dp_comm"] == pytest.approx(m * rs + ag, rel=1e-9)  # nothing overlapped


# --------------------------------------------------------------------------- ZeRO-2/3 memory


@pytest.mark.parametrize("d", [2, 8, 64])
def test_zero_bytes_per_parameter_table(d):
    """Rajbhandari et al. 2020 / Megatron: bf16 params 2, fp32 grads 4, fp32 master + Adam m, v 12."""
    z = {k: model_state_bytes_per_param("bf16", "fp32", zero=k, dp=d) for k in range(4)}
    assert z[0].total == 18 and z[1].total == pytest.approx(6 + 12 / d)
    assert (z[2].params, z[2].grads, z[2].optimizer) == pytest.approx((2, 4 / d, 12 / d))
    assert (z[3].params, z[3].grads, z[3].optimizer) == pytest.approx((2 / d, 4 / d, 12 / d))
    assert model_state_bytes_per_param("fp32", "fp32", zero=3, dp=d).total == pytest.approx(16 / d)
    with pytest.raises(ValueError, match="ZeRO levels 0, 1, 2 and 3"):
        model_state_bytes_per_param(zero=4)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_memory_per_rank_follows_the_table(zero):
    """A rank's peak under ZeRO-2/3, recomputed from the model's own parameter counts: the sharded state,
    2 gradient buckets of 25 MiB in flight, and under ZeRO-3 2 gathered units in bf16 (the largest of a
    layer, the embedding with the position table, and the head with the final norm: the head is the
    tied embedding), plus the activations of one microbatch."""
    cfg = GPTConfig(vocab_size=512, block_size=1024, n_layer=4, n_head=8, n_embd=512, dropout=0.0)
    pre = Preset("gpt-zero", "gpt", cfg)
    work = Workload.from_preset(pre)
    model = pre.build("meta")
    n = sum(p.numel() for p in model.parameters())  # tied embedding/head once
    layer = sum(p.numel() for p in model.transformer.h[0].parameters())
    emb = model.transformer.wte.weight.numel()
    unit = max(layer, emb + model.transformer.wpe.weight.numel(), emb + sum(
        p.numel() for p in model.transformer.ln_f.parameters()))
    d = 8
    e = estimate(Layout(dp=d, zero=zero), work, global_batch=16, seq=1024, hardware="h100")
    mb = e.memory_breakdown
    params = 2 * n / d if zero == 3 else 2 * n
    assert mb["params"] == pytest.approx(params)
    assert mb["grads"] == pytest.approx(4 * n / d)
    assert mb["optimizer"] == pytest.approx(12 * n / d)
    buffers = min(2 * ZERO_BUCKET_BYTES, 4 * n) + (2 * unit * 2 if zero == 3 else 0)
    assert mb["zero_buffers"] == pytest.approx(buffers)
    assert e.memory_bytes == pytest.approx(params + 4 * n / d + 12 * n / d + buffers + mb["activations"])
    one = estimate(Layout(dp=d, zero=1), work, global_batch=16, seq=1024, hardware="h100")
    assert one.memory_breakdown["activations"] == mb["activations"] and "zero_buffers" not in one.memory_breakdown


def test_zero_needs_data_parallelism():
    for z in (2, 3):
        with pytest.raises(ValueError, match=rf"zero={z} shards over the data-parallel ranks and needs dp > 1"):
            Layout(zero=z, tp=8)
    with pytest.raises(ValueError, match="zero=4"):
        Layout(dp=2, zero=4)
    Layout(dp=2, zero=3)  # fine


# --------------------------------------------------------------------------- the search


@pytest.mark.timeout(600)
def test_search_takes_zero2_zero3_and_fp8_when_they_pay(fsdp):
    """Pipeline parallelism off (schedules=()) and 5 heads: 8 GPUs can only be dp=8. Under a limit between
    the ZeRO-3 and ZeRO-2 footprints only ZeRO-3 fits (and without it nothing does); between ZeRO-2 and
    ZeRO-1 the best is ZeRO-2; with FP8 allowed on an H100 the best runs FP8 matmuls, on an A100 bf16."""
    kw = dict(hardware="h100", global_batch=8, seq=512, schedules=(), top_k=3)
    foot = {z: price(Layout(dp=8, zero=z, recompute="full"), fsdp, hardware="h100", global_batch=8,
                     seq=512).memory_bytes for z in range(4)}
    assert foot[3] < foot[2] < foot[1] < foot[0]
    res = search(fsdp, 8, memory_limit=(foot[2] + foot[3]) / 2, **kw)
    assert res[0].layout.zero == 3 and res[0].layout.dp == 8
    assert all(c.layout.zero == 3 and c.estimate.fits for c in res)
    with pytest.raises(SearchError, match="allow ZeRO-3"):
        search(fsdp, 8, memory_limit=(foot[2] + foot[3]) / 2, zero=(0, 1, 2), **kw)
    res = search(fsdp, 8, memory_limit=(foot[1] + foot[2]) / 2, **kw)
    assert res[0].layout.zero == 2
    assert res[0].layout.precision == "fp8" and res[0].options()["fp8"] == "current"
    bf16 = search(fsdp, 8, memory_limit=(foot[1] + foot[2]) / 2, precision="bf16", **kw)
    assert bf16[0].layout.precision == "bf16" and bf16[0].step_time_s > res[0].step_time_s
    a100 = search(fsdp, 8, **{**kw, "hardware": "a100"})
    assert a100[0].layout.precision == "bf16"  # no FP8 tensor cores: left out of the space
    # the exhaustive search prices the dominated choices too (overlap off, bf16) and agrees on the best
    ex = search(fsdp, 8, memory_limit=(foot[1] + foot[2]) / 2, exhaustive=True, **kw)
    assert ex[0].layout == res[0].layout and ex[0].step_time_s == res[0].step_time_s
    assert {lay.precision for _, _, lay in ex.priced} == {"bf16", "fp8"}
    assert {lay.zero for _, _, lay in ex.priced} == {2, 3}  # ZeRO-0/1 do not fit: never priced
    assert {lay.overlap for _, _, lay in ex.priced} == {True, False}


@pytest.mark.timeout(600)
def test_explain_says_what_each_choice_saves(fsdp, capsys):
    kw = dict(hardware="h100", global_batch=8, seq=512, schedules=(), top_k=2)
    foot2 = price(Layout(dp=8, zero=2, recompute="full"), fsdp, hardware="h100", global_batch=8, seq=512)
    foot3 = price(Layout(dp=8, zero=3, recompute="full"), fsdp, hardware="h100", global_batch=8, seq=512)
    res = search(fsdp, 8, memory_limit=(foot2.memory_bytes + foot3.memory_bytes) / 2, **kw)
    text = res.explain()
    with capsys.disabled():
        print("\n" + text)
    best = res[0]
    assert best.layout.zero == 3 and best.layout.precision == "fp8"
    num = r"[+-][0-9.]+(e[+-]?\d+)? s per step \([+-][0-9.]+% of [0-9.]+(e[+-]?\d+)? s\) and [+-][0-9.]+ [KMG]?i?B"
    assert re.search(r"communication overlap \(tp collective matmul, ZeRO-3 prefetch\): on instead of off saves "
                     + num, text)
    assert re.search(r"ZeRO stage: 3 instead of 2 saves " + num + r" per GPU \(and would not fit\)", text)
    assert re.search(r"matmul precision: fp8 instead of bf16 saves " + num, text)
    ch = {c["choice"]: c for c in res.choices(0)}
    assert ch["overlap"]["saves_s"] > 0 and ch["overlap"]["saves_bytes"] == 0  # prefetch hides gathers
    assert ch["zero"]["saves_bytes"] > 0 and not ch["zero"]["alternative_fits"]
    assert ch["precision"]["saves_s"] > 0
    # the counterfactual is the same layout priced alone, one choice flipped
    again = price(Layout(**{**best.layout.__dict__, "zero": 2}), fsdp, hardware="h100", global_batch=8, seq=512,
                  memory_limit=res.memory_limit)
    assert ch["zero"]["alternative_step_time_s"] == pytest.approx(again.step_time_s, rel=1e-12)


@pytest.mark.timeout(600)
def test_cli_explain_prints_the_choices(capsys):
    from mcompile.apps.cli import main

    args = ["gpt2-medium", "--gpus", "16", "--gpu", "h100", "--global-batch", "32", "--seq", "1024", "--top", "2"]
    assert main(["explain", *args]) == 0
    out = capsys.readouterr().out
    assert "choices of " in out and re.search(r"matmul precision: fp8 instead of bf16 saves \+[0-9.]", out)
    assert re.search(r"ZeRO stage: \d instead of \d saves [+-][0-9.]", out)
    assert main(["search", *args, "--precision", "bf16", "--zero", "0,1", "--overlap", "off"]) == 0
    out = capsys.readouterr().out
    assert "fp8" not in out.split("run it:")[0].split("matmul")[1]
    assert main(["search", *args, "--zero", "5"]) == 2


# --------------------------------------------------------------------------- NCCL bandwidths


MARGIN = 0.15  # as tests/test_cost_published.py: one efficiency constant per link type for every GPU generation


@pytest.mark.parametrize("fig", NCCL_PUBLISHED, ids=[f"{f.profile}-{f.link}" for f in NCCL_PUBLISHED])
def test_profile_bandwidth_within_band_of_published_nccl(fig):
    """Each GPU profile's effective bandwidth as the cost model prices a ring (line rate x efficiency:
    the bus bandwidth of a large all-reduce) lies within ±15 % of the published nccl-tests figure cited
    next to the profiles (mcompile/cost/hardware.py)."""
    from mcompile.cost.model import DEFAULT_EFFICIENCY

    hw = HARDWARE[fig.profile]
    eff = DEFAULT_EFFICIENCY.for_hardware(hw)
    # intra: a ring over the 8 GPUs of a node; inter: one GPU (one NIC) per node
    lay, axis, n = (Layout(tp=8), "tp", 8) if fig.link == "intra_node" else (Layout(dp=2, tp=8), "dp", 2)
    B = 8 * 2**30
    t = collective_time("all_reduce", B, n, *axis_link(lay, axis, hw, eff))
    busbw = 2 * (n - 1) / n * B / t / 1e9
    assert abs(busbw / fig.busbw_gb_s - 1) <= MARGIN, (fig, busbw)
    assert fig.source.strip()
