"""bench/startup_scale.py's simulated rank: one rank of a pipelined mesh on torch's fake process group, on the
meta device, from ``parallelize`` through its first step; it traces only the pipeline stages it owns."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(monkeypatch):
    monkeypatch.setattr(sys, "path", sys.path[:])  # the script edits sys.path: undone
    spec = importlib.util.spec_from_file_location("startup_scale_bench", ROOT / "bench" / "startup_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(240)  # 4 layers (block repetition on) at dp x pp x tp: ~12-20 s, most of it importing transformers
def test_a_simulated_rank_runs_its_first_step_tracing_only_its_own_stage(tmp_path, monkeypatch):
    bench = _bench(monkeypatch)
    shape = {"layers": 4, "hidden": 64, "inter": 128, "heads": 4, "kv": 2, "vocab": 128, "seq": 16}
    # rank 5 of dp=2 x pp=2 x tp=2: dp 1, pp 0, tp 1 — it owns stage 0 of 2
    row = bench.simulated(str(tmp_path), shape, "dp=2,pp=2,tp=2", 5, 2)
    assert row["device"] == "meta"  # no memory: the parameters are meta pieces
    assert row["own_stages"] == [0] and row["stages_traced"] == [0], row
    assert row["total_cpu_s"] > 0 and row["rss_mb"] > 0
