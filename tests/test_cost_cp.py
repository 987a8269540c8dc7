"""Context parallelism in the cost model, the memory model and the search (mcompile.cost.model, memory_model, search).

What each test isolates:
- the three attention variants are priced by their formulas (mcompile.cost.model "Context parallelism"): ring's
  cp−1 p2p steps beside the attention blocks, allgather's gather / re-gather + reduce-scatter, a2a's four
  all-to-alls per phase with kv heads repeated when cp does not divide them; asserted as relations
  between the bytes and calls, not as hard-coded seconds;
- choose_cp_attention picks the cheapest applicable variant, deterministically, from shapes (no capture)
  and agrees with the priced layouts;
- memory: activations per rank fall as 1/cp; the variant's buffers come on top;
- the search explores cp and takes it where a long sequence fits no other way (and not at short
  sequences); its pricing of a cp layout is estimate()'s;
- the planning check: Llama-3-8B at 128K tokens, cp=8 x tp=8, priced in seconds: it fits an H100, cp=1 does not.
"""

from __future__ import annotations

import time

import pytest

from mcompile.cost.hardware import get_hardware
from mcompile.cost.model import (
    CP_VARIANTS,
    DEFAULT_EFFICIENCY,
    Layout,
    axis_link,
    choose_cp_attention,
    collective_time,
    cp_comm,
    section_times,
)
from mcompile.cost.workload import Workload, estimate
from mcompile.ir.config import Config
from mcompile.models.llama import LlamaConfig
from mcompile.models.presets import Preset
from mcompile.search import SearchError, SearchWorkload, enumerate_layouts, price, search

# 8 query heads over 1 kv head (GQA): tp > 1 cannot split the kv head, so on 2 GPUs the search chooses
# between dp, pp and cp alone
GQA = Preset("llama-gqa1", "llama", LlamaConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=8, n_kv_heads=1,
                                                ffn_hidden=512, max_seq_len=65536))
H100 = get_hardware("h100")


@pytest.fixture(scope="module")
def gqa():
    return SearchWorkload.of(GQA)


# --------------------------------------------------------------------------- the variants' formulas


def _kv(b, s, cp, hkv, d, e=2):
    return 2 * b * (s / cp) * hkv * d * e


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_variants_are_priced_by_their_formulas(cp):
    b, s, hq, hkv, d = 1, 32768, 8, 1, 128
    beta, alpha = 1e11, 5e-6
    hw = H100
    kv = _kv(b, s, cp, hkv, d)
    q = b * (s / cp) * hq * d * 2
    big, none = 1.0, 0.0  # attention seconds per layer: far longer than any transfer / nothing to hide behind
    kw = dict(cp=cp, b=b, seq=s, heads=hq, kv_heads=hkv, head_dim=d, link=(beta, alpha), hw=hw)
    ring = cp_comm("ring", attention_forward=big, **kw)
    step_f, step_b = alpha + kv / beta, alpha + 2 * kv / beta  # one p2p step: its K/V (backward: and dK/dV)
    assert ring["f"] == pytest.approx((cp - 1) * step_f) and ring["b"] == pytest.approx((cp - 1) * step_b)
    kappa = hw.overlap_slowdown
    # every step runs beside a longer block: only the contention (κ − 1) of the overlapped part shows
    assert ring["f_x"] == pytest.approx((kappa - 1) * ring["f"])
    assert ring["b_x"] == pytest.approx((kappa - 1) * ring["b"])
    bare = cp_comm("ring", attention_forward=none, **kw)
    assert bare["f_x"] == pytest.approx(bare["f"]) and bare["b_x"] == pytest.approx(bare["b"])
    ag = cp_comm("allgather", attention_forward=big, **kw)  # exposed, whatever the attention
    assert ag["f"] == pytest.approx(collective_time("all_gather", cp * kv, cp, beta, alpha))
    assert ag["b"] == pytest.approx(ag["f"] + collective_time("reduce_scatter", cp * kv, cp, beta, alpha))
    assert (ag["f_x"], ag["b_x"]) == (ag["f"], ag["b"])
    a2a = cp_comm("a2a", attention_forward=big, **kw)
    # 1 kv head, cp > 1: k and v repeated to the 8 query heads before their all-to-alls
    assert a2a["f"] == pytest.approx(4 * (cp - 1) * alpha + (cp - 1) / cp * (2 * q + 8 * kv) / beta)
    assert a2a["b"] == a2a["f"] and (a2a["f_x"], a2a["b_x"]) == (a2a["f"], a2a["b"])
    # bytes a rank sends: ring and allgather move the same K/V (backward: twice); a2a's q, k, v and output,
    # all at 8 heads, are 16/cp times allgather's K/V in forward (1/8 at cp = 2)
    assert ring["sent_f"] == ag["sent_f"] == pytest.approx((cp - 1) * kv)
    assert ring["sent_b"] == ag["sent_b"] == pytest.approx(2 * (cp - 1) * kv)
    assert ag["sent_f"] / a2a["sent_f"] == pytest.approx(cp / 16)
    # the same model with as many kv heads as query heads moves the same a2a bytes (nothing to repeat)
    mha = cp_comm("a2a", attention_forward=big, **{**kw, "kv_heads": hq})
    assert mha["sent_f"] == pytest.approx(a2a["sent_f"])
    # buffers of one layer: ring 4 K/V blocks, allgather 2·cp (gathered K/V and full dK/dV), a2a the head-split
    # dout, dq, dk, dv
    assert (ring["buffers"], ag["buffers"], a2a["buffers"]) == pytest.approx((4 * kv, 2 * cp * kv, 2 * q + 8 * kv))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_choose_cp_attention_gqa_long_sequence(cp):
    """8 query heads, 1 kv head, 128K tokens on H100s: from shapes alone (no capture). The order follows
    from the bytes: allgather moves the K/V of 1 head where a2a moves q, k, v and the output of 8 (and makes
    more calls), so allgather < a2a; ring moves allgather's bytes in no more calls but beside the attention
    blocks, which at this length are far longer than a step: only the contention shows, ring < allgather."""
    lay = Layout(cp=cp)
    shapes = dict(seq=131072, heads=8, kv_heads=1, head_dim=128)
    best, prices = choose_cp_attention(lay, "h100", **shapes)
    assert set(prices) == set(CP_VARIANTS)  # 8 % cp == 0: a2a applies
    assert prices["allgather"] < prices["a2a"]
    kappa = H100.overlap_slowdown
    assert prices["ring"] < (kappa - 1) * prices["allgather"] * (1 + 1e-9)
    assert best == min(prices, key=prices.get) == "ring"
    assert choose_cp_attention(lay, "h100", **shapes) == (best, prices)  # deterministic
    # on a latency-free link the price ratio is the bytes' ratio: allgather 3(cp−1)·kv (forward + backward),
    # a2a 2·(cp−1)/cp·16·kv
    free = H100.replace(intra_node_latency=0.0, inter_node_latency=0.0)
    _, p0 = choose_cp_attention(lay, free, **shapes)
    assert p0["allgather"] / p0["a2a"] == pytest.approx(3 * cp / 32)
    # nothing overlapped: ring costs allgather's bytes in fewer calls; with no latency they tie, and the tie
    # goes to the first of CP_VARIANTS
    flat = free.replace(comm_overlaps_compute=False)
    best, p1 = choose_cp_attention(lay, flat, **shapes)
    assert p1["ring"] == pytest.approx(p1["allgather"]) and best == "ring"
    # an arbitrary mask: only allgather; a2a where cp does not divide the query heads: not offered
    assert choose_cp_attention(lay, "h100", masked=True, **shapes)[1].keys() == {"allgather"}
    assert "a2a" not in choose_cp_attention(Layout(cp=16), "h100", **shapes)[1]
    with pytest.raises(ValueError, match="cp > 1"):
        choose_cp_attention(Layout(), "h100", **shapes)


@pytest.mark.timeout(60)
def test_estimate_prices_the_layouts_variant(gqa):
    """cp_comm in the step = microbatches x layers x the variant's exposed seconds per layer (what
    choose_cp_attention compares); ring hides part of it, the others none; a full recompute repeats the
    forward's; the choice from the captured profile is the cheapest priced layout."""
    kw = dict(global_batch=2, seq=16384, hardware="h100")
    prof = gqa.profile(1, False)
    best, prices = choose_cp_attention(Layout(cp=4), "h100", model=prof, seq=16384)
    assert choose_cp_attention(Layout(cp=4), "h100", model=gqa, seq=16384) == (best, prices)
    steps = {}
    for v in CP_VARIANTS:
        e = estimate(Layout(cp=4, cp_attention=v), gqa, **kw)
        m, L = e.details["microbatches"], e.details["layers_per_stage"]
        assert e.breakdown["cp_comm"] == pytest.approx(m * L * prices[v], rel=1e-9)
        hidden = e.details["cp_comm_hidden"]
        assert hidden > 0 if v == "ring" else hidden == pytest.approx(0, abs=1e-15)
        full = estimate(Layout(cp=4, cp_attention=v, recompute="full"), gqa, **kw)
        fwd = cp_comm(v, cp=4, b=1, seq=16384, heads=8, kv_heads=1, head_dim=32, link=_link(Layout(cp=4)), hw=H100,
                      attention_forward=_attn(gqa, 4, 16384, "f"), attention_backward=_attn(gqa, 4, 16384, "b"))["f_x"]
        assert full.breakdown["cp_comm"] - e.breakdown["cp_comm"] == pytest.approx(m * L * fwd, rel=1e-9)
        steps[v] = e.step_time_s
        p = price(Layout(cp=4, cp_attention=v), gqa, uniform=True, **kw)  # the search prices it alike
        assert p.step_time_s == pytest.approx(e.step_time_s, rel=1e-12)
        assert p.memory_bytes == pytest.approx(e.memory_bytes, rel=1e-12)
    assert min(steps, key=steps.get) == best
    with pytest.raises(ValueError, match=r"valid cp sizes for a2a: 2, 4, 8"):
        estimate(Layout(cp=16, cp_attention="a2a"), gqa, **kw)
    with pytest.raises(ValueError, match="does not divide by 6"):
        estimate(Layout(cp=3), gqa, global_batch=2, seq=16384)
    with pytest.raises(ValueError, match="cp_attention='ulysses'"):
        Layout(cp=2, cp_attention="ulysses")


def _link(layout):
    return axis_link(layout, "cp", H100, DEFAULT_EFFICIENCY.for_hardware(H100))


def _attn(work, cp, seq, phase):
    """One layer's attention core time on a rank (forward or backward): what ring attention hides behind."""
    prof = work.profile(1, False)
    t = section_times(prof.layer, 1, seq / cp, Layout(cp=cp), H100, DEFAULT_EFFICIENCY.for_hardware(H100), "bf16",
                       head_dim=prof.hidden / prof.heads)
    return t["attn" if phase == "f" else "attn_b"]


# --------------------------------------------------------------------------- memory


@pytest.mark.timeout(60)
def test_activations_per_rank_fall_as_one_over_cp(gqa):
    """Activations (what the graph saves for backward, at a rank's seq/cp positions) at cp = 1, 2, 4 are in
    ratio 1 : 1/2 : 1/4; the variant's buffers of one layer (not counted as activations) come on top."""
    kw = dict(global_batch=1, seq=4096, hardware="h100")
    est = {cp: estimate(Layout(cp=cp), gqa, **kw) for cp in (1, 2, 4)}
    a1 = est[1].memory_breakdown["activations"]
    for cp in (2, 4):
        assert est[cp].memory_breakdown["activations"] / a1 == pytest.approx(1 / cp, rel=0.02)
        kv = _kv(1, 4096, cp, 1, 32)
        assert est[cp].memory_breakdown["cp_buffers"] == pytest.approx(4 * kv)  # ring
        assert est[cp].memory_breakdown["params"] == est[1].memory_breakdown["params"]  # replicated over cp
    assert "cp_buffers" not in est[1].memory_breakdown
    ag = estimate(Layout(cp=4, cp_attention="allgather"), gqa, **kw)
    assert ag.memory_bytes - est[4].memory_bytes == pytest.approx((2 * 4 - 4) * _kv(1, 4096, 4, 1, 32))
    # ZeRO shards over dp x cp: ZeRO-1 with dp = 1, cp = 4 divides the optimizer state by 4
    z = estimate(Layout(cp=4, zero=1), gqa, **kw)
    assert z.memory_breakdown["optimizer"] == pytest.approx(est[4].memory_breakdown["optimizer"] / 4)


# --------------------------------------------------------------------------- the search


@pytest.mark.timeout(120)
def test_search_takes_cp_where_a_long_sequence_fits_no_other_way(gqa):
    """2 GPUs, 2 sequences of 64K tokens, 1 kv head (no tp): dp keeps a whole sequence per rank and pp the
    whole logits on its last rank; cp halves every activation. Under a limit between the smallest cp = 1
    footprint and the smallest cp = 2 one, the best layout has cp = 2 — and cp = 1 alone fits nothing. At
    4K tokens without a limit, cp is in the space but dp is faster (same work per rank, no cp traffic)."""
    S = 65536
    kw = dict(hardware="h100", global_batch=2, seq=S)
    layouts = list(enumerate_layouts(gqa, 2, **kw))
    assert {lay.cp for lay in layouts} == {1, 2}
    assert all(lay.microbatch_size == 1 and lay.dp * lay.pp * lay.cp == 2 for lay in layouts if lay.cp > 1)
    smallest = {cp: min(price(lay, gqa, **kw).memory_bytes for lay in layouts if lay.cp == cp and
                        lay.recompute.value == "full") for cp in (1, 2)}
    assert smallest[2] < smallest[1]
    limit = (smallest[1] + smallest[2]) / 2
    res = search(gqa, 2, memory_limit=limit, **kw)
    best = res[0]
    assert best.layout.cp == 2 and best.estimate.fits and best.estimate.memory_bytes <= limit
    assert best.layout.cp_attention == choose_cp_attention(best.layout, "h100", model=gqa, seq=S)[0]
    assert dict(best.mesh(fake=True).axes) == {"cp": 2}
    opts = best.options()
    assert opts["cp_attention"] == best.layout.cp_attention
    Config(**opts)  # the runtime accepts the options
    assert best.step_time_s == pytest.approx(price(best.layout, gqa, memory_limit=limit, **kw).step_time_s,
                                             rel=1e-12)
    with pytest.raises(SearchError, match="no layout of llama-gqa1 on 2 GPUs fits"):
        search(gqa, 2, memory_limit=limit, cp=(1,), **kw)
    # the pruned search finds the exhaustive one's best (bf16 only: at this width fp8 and bf16 GEMMs tie, both
    # memory-bound, and the exhaustive ranking would keep whichever it priced first)
    fast = search(gqa, 2, memory_limit=limit, precision="bf16", **kw)
    full = search(gqa, 2, memory_limit=limit, precision="bf16", exhaustive=True, **kw)
    assert full[0].layout == fast[0].layout and full[0].step_time_s == fast[0].step_time_s
    assert full.stats["priced"] > fast.stats["priced"] and fast[0].layout.cp == 2
    short = search(gqa, 2, hardware="h100", global_batch=2, seq=4096)
    assert any(lay.cp == 2 for _, _, lay in short.priced)
    assert short[0].layout.cp == 1 and short[0].layout.dp == 2


# --------------------------------------------------------------------------- planning check: 128K tokens


@pytest.mark.timeout(120)
def test_llama3_8b_at_128k_tokens_on_cp8_tp8(capsys):
    """mcompile plan's check for a 128K-token Llama-3-8B plan at cp=8 x tp=8 (a fake mesh of 64 GPUs): the
    memory model's per-rank figure, in seconds; it fits an H100's 80 GB, and cp=1 (tp=8) at that sequence
    does not (without recompute, as the cp layout)."""
    t = time.perf_counter()
    work = Workload.from_preset("llama3-8b")  # 2 layers captured on meta, scaled to 32
    kw = dict(global_batch=1, seq=131072, hardware="h100")
    cp8 = estimate(Layout(cp=8, tp=8, sequence_parallel=True), work, **kw)
    seconds = time.perf_counter() - t
    cp1 = estimate(Layout(tp=8, sequence_parallel=True), work, **kw)
    with capsys.disabled():
        print(f"\nllama3-8b, 131072 tokens: {cp8.layout} {cp8.memory_bytes / 1e9:.1f} GB per rank "
              f"(activations {cp8.memory_breakdown['activations'] / 1e9:.1f} GB), {cp8.step_time_s:.3f} s/step; "
              f"{cp1.layout} {cp1.memory_bytes / 1e9:.1f} GB; priced in {seconds:.1f} s (capture included)")
    assert seconds < 30
    assert cp8.memory_bytes < 80e9 and cp8.fits
    assert not cp1.fits and cp1.memory_bytes > 80e9
    assert cp8.memory_breakdown["activations"] == pytest.approx(cp1.memory_breakdown["activations"] / 8, rel=0.02)
    # 4 query heads per tp rank: Ulysses cannot split them over 8 ranks; ring is the pick
    best, prices = choose_cp_attention(cp8.layout, "h100", model=work, seq=131072)
    assert "a2a" not in prices and best == cp8.layout.cp_attention == "ring"
