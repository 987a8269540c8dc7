"""The cost and memory models against real gloo runs on this machine.

- Step time: ``bench/cost_vs_measured.py --quick`` end to end (calibrate this machine per world size,
  run 4 layouts on live gloo processes, predict them on the calibrated profiles), and the committed
  record of the full run (``bench/results/cost_vs_measured.json``) against the issue's thresholds:
  Spearman ≥ 0.8 and median |relative error| ≤ 25 % over ≥ 6 layouts mixing dp, tp, sp, pp and
  recompute. The record is checked for consistency too: its statistics follow from its rows, and
  its predictions are what the cost model gives today on the profiles it recorded.
- Peak memory: the tracker's peak (``runtime/memory.py``) of a steady-state training step of
  llama3-tiny on 4 gloo processes against ``estimate(...).memory_bytes`` (the largest rank), within
  10 %.

Timing on a shared 2-core machine is noisy (DESIGN §8 keeps timing assertions out of tests in
general); the quick run's bounds are set wide enough for that and the measurement waits for, and
reports, other processes' load.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

from mcompile.cost.hardware import Hardware
from mcompile.cost.model import Layout
from mcompile.cost.workload import Workload, estimate

from conftest import pool

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "cost_vs_measured.json"


def _bench():
    # bench/ on sys.path only for this import: left there, it is inherited by every worker pool started later,
    # whose `import kernels` (transformers probes the Hub's `kernels` package) would find bench/kernels.py
    path = str(ROOT / "bench")
    sys.path.insert(0, path)
    try:
        import cost_vs_measured
    finally:
        sys.path.remove(path)
    return cost_vs_measured


# --------------------------------------------------------------------------- step time


@pytest.mark.bench  # timing (DESIGN §8: no timing assertions in CI); the committed full run is checked below
@pytest.mark.timeout(240)
def test_quick_bench_ranks_layouts_and_predicts_their_step_times(capsys):
    """4 layouts of a 2-layer Llama (dim 256, seq 128, batch 4) on 1 and 2 processes: 1 process with
    and without full recompute, dp=2, tp=2. Bounds (wider than the full run's, which has 3 rounds of
    5 steps and 10 layouts): Spearman ≥ 0.6 — 4 layouts allow at most two adjacent swaps, and tp=2 and
    1 process take about the same time at this size — and median |error| ≤ 35 %: the full run's
    layouts are predicted 3-26 % low; this smaller model spends a larger share in per-call collective
    latency and host overhead, which the model gets least right."""
    bench = _bench()
    lines: list[str] = []
    res = bench.run(quick=True, rounds=2, warmup=1, steps=3, max_wait=20, out=None, log=lines.append)
    with capsys.disabled():
        print("\n" + "\n".join(lines[-8:]))
    loads = [x for r in res["rows"] for x in r["other_load_cores"]]
    if statistics.median(loads) > 0.3:
        pytest.skip(f"the machine was busy with other work during the measurement ({statistics.median(loads):.2f} "
                    "cores on average): step times are not this code's")
    assert [r["layout"] for r in res["rows"]] == [name for name, *_ in bench.QUICK_LAYOUTS]
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in res["rows"])
    assert res["spearman"] >= 0.6, res["rows"]
    assert res["median_abs_relative_error"] <= 0.35, res["rows"]


def test_committed_record_meets_the_issue_thresholds():
    d = json.loads(RESULT.read_text())
    assert d["benchmark"] == "cost_vs_measured" and d["mode"] == "full" and d["commit"]
    assert d["method"]["fitted_to_layouts"] is False
    rows = d["rows"]
    assert len(rows) >= 6
    # a mix of dp, tp, sp, pp and recompute, on 1, 2 and 4 processes
    layouts = [r["cost_layout"] for r in rows]
    for axis in ("dp=", "tp=", "pp="):
        assert any(axis in s for s in layouts), axis
    assert any("sp" in s.split("(")[1] for s in layouts) and any("recompute=full" in s for s in layouts)
    assert {r["world"] for r in rows} >= {1, 2, 4}
    # the statistics follow from the rows
    bench = _bench()
    pred = [r["predicted_s"] for r in rows]
    meas = [r["measured_s"] for r in rows]
    errors = [p / m - 1 for p, m in zip(pred, meas)]
    assert [r["relative_error"] for r in rows] == pytest.approx(errors, abs=1e-3)
    assert d["spearman"] == pytest.approx(bench.spearman(pred, meas), abs=1e-3)
    assert d["median_abs_relative_error"] == pytest.approx(statistics.median(abs(e) for e in errors), abs=1e-3)
    # the issue's thresholds
    assert d["spearman"] >= 0.8
    assert d["median_abs_relative_error"] <= 0.25


@pytest.mark.timeout(120)
def test_committed_predictions_are_the_cost_model_on_the_recorded_profiles():
    """Re-price every recorded layout on the profile the run calibrated: the predictions in the record
    are the cost model's (to the rounding of the record), not numbers written by hand."""
    d = json.loads(RESULT.read_text())
    bench = _bench()
    profiles = {int(w): Hardware.from_json(json.dumps(p)) for w, p in d["profiles"].items()}
    for w, hw in profiles.items():
        assert {"fp32_flops", "hbm_bandwidth", "op_overhead_forward"} <= set(hw.measured), w
    cfg = {k: d["model"][k] for k in bench.FULL}
    by_name = {name: (name, world, mesh, options, fields) for name, world, mesh, options, fields in bench.FULL_LAYOUTS}
    layouts = [by_name[r["layout"]] for r in d["rows"]]
    predicted = bench.predict(cfg, layouts, profiles)
    for r in d["rows"]:
        assert predicted[r["layout"]].step_time_s == pytest.approx(r["predicted_s"], rel=1e-3, abs=1e-5), r["layout"]


def test_fit_collectives_separates_per_call_and_per_step_latency():
    """Synthetic times of all-reduce (2 ring steps at n=2), all-gather and reduce-scatter (1 step each)
    give back L, α, β; times that say "per call only" (a small all-gather as slow as an all-reduce)
    give α = 0 rather than a negative one."""
    from mcompile.cost.hardware import COLLECTIVE_KINDS, _ring_factors, fit_collectives

    sizes = [1 << k for k in range(12, 25, 3)]
    for L, alpha, beta in ((1e-3, 2e-4, 1.5e9), (9e-4, 0.0, 1.3e9)):
        samples = [(k, b, L + _ring_factors(k, 2)[0] * alpha + _ring_factors(k, 2)[1] * b / beta)
                   for k in COLLECTIVE_KINDS for b in sizes]
        got = fit_collectives(samples, 2)
        assert got == pytest.approx((L, alpha, beta), rel=1e-6, abs=1e-12)


def test_peak_bytes_lifetimes():
    """memory_model "Lifetimes": one microbatch on one stage (zero=0) never holds gradients and
    activations together; otherwise they meet, and the reduction's copy comes after the activations."""
    from mcompile.ir.memory_model import peak_bytes

    P, G, Opt, A = 100, 100, 200, 300
    assert peak_bytes(P, G, Opt, A, gradients_meet_activations=True)[0] == P + G + Opt + A
    assert peak_bytes(P, G, Opt, A, gradients_meet_activations=False)[0] == P + Opt + A
    total, d = peak_bytes(P, G, Opt, 50, gradients_meet_activations=False, reduction_buffer=G)
    assert total == P + Opt + 2 * G and d == {"params": P, "grads": G, "optimizer": Opt, "activations": 0,
                                            "reduction_buffer": G}
    assert peak_bytes(P, G, Opt, 50, gradients_meet_activations=True, reduction_buffer=G)[0] == P + Opt + 2 * G


# --------------------------------------------------------------------------- peak memory


@pytest.fixture(scope="module")
def tiny_fp32():
    return Workload.from_preset("llama3-tiny", dtype=torch.float32)  # the runtime computes in fp32


MEMORY_CASES = [  # mesh, Config options, the Layout the cost model prices (global batch 8)
    ("dp=2,tp=2", {}, Layout(dp=2, tp=2, microbatch_size=4)),
    ("dp=2,tp=2", {"sequence_parallel": True}, Layout(dp=2, tp=2, sequence_parallel=True, microbatch_size=4)),
    ("dp=4", {}, Layout(dp=4, microbatch_size=2)),
    pytest.param("pp=2,tp=2", {"microbatches": 4}, Layout(pp=2, tp=2, microbatch_size=2), marks=pytest.mark.xfail(
        strict=True, reason="the model under-predicts the pipelined peak: predicted 628,736 B, measured 712,816 B "
        "(-11.8%); activations 200,704 B predicted vs 399,944 B tracked on the largest rank. Hidden (-8.2%) while "
        "the graph rules over-counted RoPE's products (memory_model._saved_by before needs_grad); the in-flight "
        "count or what the pipeline runtime keeps per microbatch (messages, stage outputs) is not modelled")),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh,options,layout", MEMORY_CASES, ids=["dp2tp2", "dp2tp2-sp", "dp4", "pp2tp2-m4"])
def test_memory_model_predicts_the_measured_peak(tiny_fp32, mesh, options, layout):
    """Peak live bytes of the largest rank over a steady-state step (train_step, AdamW step,
    zero_grad, with the optimizer state of the step before), measured by the tracker on 4 gloo
    processes, within 10 % of the memory model's prediction. The gradients are persistent flat fp32
    buffers reduced in place (runtime/leaves.py), so every layout peaks with them next to the kept
    activations (pp: of the in-flight microbatches) — the model's lifetimes (mcompile.ir.memory_model,
    "Lifetimes"). The rest is backward's working set (a few %)."""
    from cost_cases import memory_peak

    batch = 8
    results = pool(4).run(memory_peak, "llama3-tiny", mesh, options, batch)
    measured = max(r["peak"] for r in results)
    est = estimate(layout, tiny_fp32, hardware="cpu-gloo", global_batch=batch, seq=16, precision="fp32",
                   param_dtype="fp32", grad_dtype="fp32")
    # the state the model counts is exactly what the rank holds: parameters and AdamW's two moments
    largest = max(results, key=lambda r: r["peak"])
    assert est.memory_breakdown["params"] == largest["held"]["parameters"]
    assert abs(largest["held"]["optimizer"] - est.memory_breakdown["optimizer"]) <= 4 * 64  # + AdamW's 0-d steps
    err = est.memory_bytes / measured - 1
    print(f"{mesh} {options}: predicted {est.memory_bytes:,.0f} B, measured {measured:,.0f} B ({err:+.1%})")
    assert abs(err) <= 0.10, (est.memory_bytes, measured, est.memory_breakdown, largest)
