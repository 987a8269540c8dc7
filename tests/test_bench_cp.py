"""The causal load-balance benchmark of context parallelism (``bench/cp_balance.py``): run small, and its
committed record (``bench/results/cp_balance.json``, written by ``--write``).

What is checked, against numbers derived here, not taken from the script: the per-rank counts come from
the kernel (``mcompile.passes.cp.ops.CPStats``, cp_attention run on the threaded simulator). Balanced (rank r holds
chunks r and 2n-1-r of 2n): every rank's FLOPs equal (spread <= 1 %; in fact exactly equal). Contiguous
(chunks of L = s/n tokens): rank i computes i·L² + L(L+1)/2 pairs (i whole blocks before its diagonal
one), so max/min = ((n-1)·L² + L(L+1)/2) / (L(L+1)/2). Both layouts sum to the causal total s(s+1)/2
pairs per (batch, head): the kernel's diagonal chunks count the triangle exactly. FLOPs = 4·head_dim·
pairs·batch·heads (QKᵀ and PV, forward).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "bench" / "results" / "cp_balance.json"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_cp_balance", ROOT / "bench" / "cp_balance.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _contiguous_pairs(s: int, n: int) -> list[int]:
    L = s // n
    return [i * L * L + L * (L + 1) // 2 for i in range(n)]


def _check_row(row: dict, batch: int, heads: int, head_dim: int) -> None:
    s, n = row["seq"], row["cp"]
    total = s * (s + 1) // 2
    flops = lambda pairs: 4 * head_dim * pairs * batch * heads  # noqa: E731
    bal, con = row["balanced"], row["contiguous"]
    # balanced: equal per rank, within 1 % (the layout makes them exactly equal: s(s+1)/(2n) each)
    assert len(bal["flops_per_rank"]) == n
    assert bal["spread"] <= 0.01, (s, n, bal["flops_per_rank"])
    assert bal["max_over_min"] <= 1.01
    assert bal["pairs_per_rank"] == [total // n] * n and total % n == 0
    assert bal["flops_per_rank"] == [flops(total // n)] * n
    # contiguous: the naive imbalance, exactly
    want = _contiguous_pairs(s, n)
    assert con["pairs_per_rank"] == want
    assert con["flops_per_rank"] == [flops(p) for p in want]
    L = s // n
    ratio = ((n - 1) * L * L + L * (L + 1) / 2) / (L * (L + 1) / 2)
    assert con["max_over_min"] == pytest.approx(ratio, rel=1e-12)
    assert con["max_over_min"] == pytest.approx(2 * n - 1, rel=2 * n / L)  # ≈ 2n - 1 for long chunks
    mean = sum(con["flops_per_rank"]) / n
    assert con["spread"] == pytest.approx((max(con["flops_per_rank"]) - min(con["flops_per_rank"])) / mean)
    # both layouts: every causal pair once
    for lay in (bal, con):
        assert sum(lay["pairs_per_rank"]) == total
        assert sum(lay["flops_per_rank"]) == flops(total) == row["causal_flops_total"]
    assert all(row["checks"].values()), row["checks"]


@pytest.mark.timeout(300)
def test_bench_runs_small_and_balances(tmp_path):
    bench = _bench()
    out = tmp_path / "cp_balance.json"
    res = bench.main(["--cp", "2", "4", "--seq", "256", "--variants", "ring", "allgather", "--heads", "2",
                      "--head-dim", "8", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(res["rows"]))  # what was returned was written
    assert saved["benchmark"] == "cp_balance" and saved["commit"] and saved["machine"]["cpus"] >= 1
    assert saved["all_checks_pass"] is True
    assert {(r["variant"], r["seq"], r["cp"]) for r in saved["rows"]} == {
        (v, 256, n) for v in ("ring", "allgather") for n in (2, 4)}
    for row in saved["rows"]:
        _check_row(row, batch=1, heads=2, head_dim=8)
    # ring and allgather visit the same tiles
    by = {(r["variant"], r["cp"]): r for r in saved["rows"]}
    for n in (2, 4):
        for lay in ("balanced", "contiguous"):
            assert by[("ring", n)][lay]["pairs_per_rank"] == by[("allgather", n)][lay]["pairs_per_rank"]


@pytest.mark.timeout(300)
def test_bench_prints_both_layouts_side_by_side(tmp_path, capsys):
    _bench().main(["--cp", "2", "--seq", "64", "--variants", "ring", "--out", str(tmp_path / "x.json")])
    text = capsys.readouterr().out
    assert "balanced GFLOP" in text and "contiguous GFLOP" in text and "max/min" in text and "spread" in text


@pytest.mark.timeout(300)
def test_committed_record():
    """bench/results/cp_balance.json (``--write``): cp 2, 4, 8, both variants, every row as derived above."""
    rec = json.loads(RECORD.read_text())
    st = rec["settings"]
    assert rec["benchmark"] == "cp_balance" and rec["commit"] and rec["commit"] != "unknown"
    assert set(st["cp"]) == {2, 4, 8} and st["causal"] is True and "ring" in st["variants"]
    assert "4 * head_dim" in rec["method"]["flops"]
    assert {(r["variant"], r["seq"], r["cp"]) for r in rec["rows"]} == {
        (v, s, n) for v in st["variants"] for s in st["seq"] for n in st["cp"]}
    for row in rec["rows"]:
        _check_row(row, batch=st["batch"], heads=st["heads"], head_dim=st["head_dim"])
    assert rec["all_checks_pass"] is True
