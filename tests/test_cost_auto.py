"""recompute="auto" in the cost model and the search (mcompile.cost.model.auto_mix, mcompile.search).

auto gets, per pipeline stage, the activation budget the memory model leaves under the memory limit,
and is priced on the lower envelope of the named policies' (bytes per layer, recompute time per layer)
points. What each test isolates:
- the envelope and the mix on synthetic points (no model);
- the end points: none's time where the budget holds none's activations, full's at exactly full's
  bytes; in between, a recompute time between the neighbouring points, monotone in the limit, and
  memory never over the limit;
- pipelines: each stage its own budget (stage 0 holds the most microbatches: the most recompute);
- the search: auto in the space, its pricing equal to the cost model's, the pruned search equal to the
  exhaustive one, and auto chosen where none does not fit and full is slower than needed.
"""

from __future__ import annotations

import pytest

from mcompile.cost.model import Layout, Recompute, auto_mix, recompute_envelope
from mcompile.cost.workload import Workload, estimate
from mcompile.ir.config import Config
from mcompile.models.gpt import GPTConfig
from mcompile.models.presets import Preset
from mcompile.search import SearchWorkload, price, search

KW = dict(global_batch=16, seq=1024, hardware="a100")
CFG = GPTConfig(vocab_size=512, block_size=1024, n_layer=8, n_head=8, n_embd=256, dropout=0.1)


@pytest.fixture(scope="module")
def gpt():
    return Workload.from_preset(Preset("gpt-auto", "gpt", CFG))


@pytest.fixture(scope="module")
def sgpt():
    return SearchWorkload.of(Preset("gpt-auto", "gpt", CFG))


def _est(work, lay, **kw):
    return estimate(lay, work, **{**KW, **kw})


@pytest.mark.timeout(60)
def test_envelope_and_mix_on_synthetic_points():
    acts = {"none": 100.0, "selective": 60.0, "full": 10.0}
    # selective below the chord from full to none: on the envelope
    env = recompute_envelope(acts, {"none": 0.0, "selective": 1.0, "full": 10.0})
    assert [m for *_, m in env] == ["full", "selective", "none"]
    assert auto_mix(100.0, env) == {"none": 1.0} and auto_mix(1e9, env) == {"none": 1.0}
    assert auto_mix(60.0, env) == {"selective": 1.0}
    assert auto_mix(10.0, env) == {"full": 1.0}
    assert auto_mix(9.0, env) is None
    w = auto_mix(80.0, env)
    assert w == pytest.approx({"selective": 0.5, "none": 0.5})
    w = auto_mix(35.0, env)
    assert w == pytest.approx({"full": 0.5, "selective": 0.5})
    # selective above the chord: a mix of full and none beats it, it drops out
    env = recompute_envelope(acts, {"none": 0.0, "selective": 8.0, "full": 10.0})
    assert [m for *_, m in env] == ["full", "none"]
    assert auto_mix(60.0, env) == pytest.approx({"full": 4 / 9, "none": 5 / 9})
    # selective keeping as much as none: never useful
    env = recompute_envelope({"none": 100.0, "selective": 100.0, "full": 10.0},
                             {"none": 0.0, "selective": 1.0, "full": 10.0})
    assert [m for *_, m in env] == ["full", "none"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("activations", ["graph", "formula"])
def test_auto_end_points(gpt, activations):
    """Under the hardware's memory auto keeps everything (= none); at exactly full's footprint it is full."""
    lay = Layout(dp=2, tp=2)
    kw = dict(activations=activations)
    none = _est(gpt, lay, **kw)
    full = _est(gpt, Layout(dp=2, tp=2, recompute="full"), **kw)
    auto = _est(gpt, Layout(dp=2, tp=2, recompute="auto"), **kw)
    assert none.fits and auto.details["auto_mix"] == {0: {"none": 1.0}}
    assert auto.step_time_s == none.step_time_s and auto.breakdown == none.breakdown
    assert auto.memory_bytes == none.memory_bytes and auto.hardware_flops == none.hardware_flops
    at = _est(gpt, Layout(dp=2, tp=2, recompute="auto"), memory_limit=full.memory_bytes, **kw)
    assert at.fits and at.details["auto_mix"] == {0: {"full": 1.0}}
    assert at.breakdown["recompute"] == pytest.approx(full.breakdown["recompute"], rel=1e-12)
    assert at.breakdown["tp_comm"] == pytest.approx(full.breakdown["tp_comm"], rel=1e-12)
    assert at.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
    assert at.memory_bytes == pytest.approx(full.memory_bytes, rel=1e-12)
    assert at.hardware_flops == pytest.approx(full.hardware_flops, rel=1e-12)
    below = _est(gpt, Layout(dp=2, tp=2, recompute="auto"), memory_limit=0.99 * full.memory_bytes, **kw)
    assert not below.fits  # under full's footprint nothing fits


@pytest.mark.timeout(300)
@pytest.mark.parametrize("activations", ["graph", "formula"])
def test_auto_between_points_and_monotone(gpt, activations):
    """From full's footprint to none's: the recompute time falls monotonically, lies between the
    neighbouring envelope points, never above a named policy that fits the same limit, and the memory
    stays within the limit."""
    kw = dict(activations=activations)
    named = {m: _est(gpt, Layout(dp=1, recompute=m), **kw) for m in ("none", "selective", "full")}
    lo, hi = named["full"].memory_bytes, named["none"].memory_bytes
    assert lo < hi
    prev = None
    for k in range(21):
        limit = lo + (hi - lo) * k / 20
        a = _est(gpt, Layout(dp=1, recompute="auto"), memory_limit=limit, **kw)
        r = a.breakdown["recompute"]
        assert a.fits and a.memory_bytes <= limit
        assert 0 <= r <= named["full"].breakdown["recompute"] * (1 + 1e-12)
        fitting = [e for e in named.values() if e.memory_bytes <= limit]
        assert r <= min(e.breakdown["recompute"] for e in fitting) * (1 + 1e-12)
        assert a.step_time_s <= min(e.step_time_s for e in fitting) * (1 + 1e-12)
        if prev is not None:
            assert r <= prev * (1 + 1e-12)
        prev = r
        mix = a.details["auto_mix"][0]
        assert sum(mix.values()) == pytest.approx(1.0) and len(mix) <= 2
    assert prev == 0.0
    if activations == "formula":  # Korthikanti's bytes: selective saves the s×s terms, on the envelope
        sel = named["selective"]
        a = _est(gpt, Layout(dp=1, recompute="auto"), memory_limit=sel.memory_bytes, **kw)
        assert a.details["auto_mix"][0] == pytest.approx({"selective": 1.0})
        assert a.breakdown["recompute"] == pytest.approx(sel.breakdown["recompute"], rel=1e-9)
        mid = _est(gpt, Layout(dp=1, recompute="auto"), memory_limit=(sel.memory_bytes + hi) / 2, **kw)
        assert 0 < mid.breakdown["recompute"] < sel.breakdown["recompute"]
        assert set(mid.details["auto_mix"][0]) == {"selective", "none"}


@pytest.mark.timeout(300)
def test_auto_per_pipeline_stage(gpt):
    """1F1B: stage 0 holds p microbatches, the last one: each its own budget, the first recomputes more."""
    kw = dict(global_batch=16, seq=1024, hardware="a100")
    full = estimate(Layout(pp=4, recompute="full"), gpt, **kw)
    none = estimate(Layout(pp=4), gpt, **kw)
    limit = (full.memory_bytes + none.memory_bytes) / 2
    a = estimate(Layout(pp=4, recompute="auto"), gpt, memory_limit=limit, **kw)
    mix = a.details["auto_mix"]
    assert set(mix) == {0, 3} and a.fits and a.memory_bytes <= limit
    share = {i: w.get("full", 0) + w.get("selective", 0) for i, w in mix.items()}
    assert share[0] > share[3] >= 0
    assert a.step_time_s <= full.step_time_s
    assert a.details["activation_budget"] > 0
    with pytest.raises(ValueError, match="auto"):
        from mcompile.cost.workload import step_time_expr

        step_time_expr(Layout(recompute="auto"), gpt)


@pytest.mark.timeout(300)
def test_search_prices_auto_as_the_cost_model(sgpt):
    kw = dict(global_batch=16, seq=1024, hardware="a100")
    for lay in (Layout(dp=2, tp=2, recompute="auto"), Layout(pp=4, dp=1, recompute="auto"),
                Layout(pp=2, dp=2, virtual=2, schedule="interleaved", recompute="auto")):
        full = estimate(Layout(**{**lay.__dict__, "recompute": Recompute.FULL}), sgpt, **kw)
        for limit in (full.memory_bytes * 1.05, full.memory_bytes * 1.3, None):
            e = estimate(lay, sgpt, memory_limit=limit, **kw)
            p = price(lay, sgpt, uniform=True, memory_limit=limit, **kw)
            assert p.step_time_s == pytest.approx(e.step_time_s, rel=1e-12), (lay, limit)
            assert p.breakdown == pytest.approx(e.breakdown, rel=1e-12, abs=1e-15), (lay, limit)
            assert p.memory_bytes == pytest.approx(e.memory_bytes, rel=1e-12), (lay, limit)
            assert p.fits and p.memory_bytes <= (limit or float("inf")) * (1 + 1e-12)


@pytest.mark.timeout(600)
def test_search_picks_auto_where_none_does_not_fit(sgpt):
    """On one GPU, under a limit between full's and none's footprint: none does not fit, full recomputes
    more than needed, and auto (the budget left) is the best; the pruned search equals the exhaustive
    one, and auto never loses to a named mode of the same layout."""
    kw = dict(global_batch=16, seq=1024, hardware="a100")
    none = estimate(Layout(), sgpt, **kw)
    full = estimate(Layout(recompute="full"), sgpt, **kw)
    limit = (none.memory_bytes + full.memory_bytes) / 2
    res = search(sgpt, 1, memory_limit=limit, top_k=3, **kw)
    named = search(sgpt, 1, memory_limit=limit, top_k=3, recompute=("none", "selective", "full"), **kw)
    best = res[0]
    assert best.layout.recompute == Recompute.AUTO
    assert best.estimate.memory_bytes <= limit and best.step_time_s < named[0].step_time_s
    opts = best.options()
    assert opts["recompute"] == "auto" and opts["activation_budget"] > 0
    Config(**opts)  # the runtime accepts it
    ex = search(sgpt, 1, memory_limit=limit, top_k=3, exhaustive=True, **kw)
    assert [c.layout for c in ex] == [c.layout for c in res]
    assert [c.step_time_s for c in ex] == [c.step_time_s for c in res]
    t = {lay: s for s, _, lay in ex.priced}
    for lay, s in t.items():
        if lay.recompute != Recompute.AUTO:
            a = Layout(**{**lay.__dict__, "recompute": Recompute.AUTO})
            assert a in t and t[a] <= s * (1 + 1e-12), lay


@pytest.mark.timeout(600)
def test_auto_reducing_to_none_is_not_ranked_twice(sgpt):
    res = search(sgpt, 2, top_k=6, global_batch=16, seq=1024, hardware="a100")
    assert all(c.layout.recompute == Recompute.NONE for c in res)  # plenty of memory: none fits everywhere
    assert any(lay.recompute == Recompute.AUTO for _, _, lay in res.priced)
    assert len({c.layout for c in res}) == len(res)
