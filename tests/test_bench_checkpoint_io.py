"""bench/checkpoint_io.py at a tiny size (a 0.2 M-parameter Llama, dp=2 x tp=2, ZeRO-1) on the session's 4 gloo
workers: every operation is measured on every rank, the record has its fields, and its summaries and ratios
are what its own per-rank figures say. No timing is asserted (DESIGN §8: the committed record is the figure).
What the bytes must be follows from the layout: each rank's DCP file is what the disk baseline wrote; a ZeRO-1
rank loads its whole tensor-parallel piece of the parameters but wrote only its dp segment, so it reads more
than it wrote; a torch.save file holds the rank's pieces (its bytes and a record's headers)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from checkpoint_io_cases import bench, measure

from conftest import pool


@pytest.mark.timeout(300)
def test_checkpoint_io_bench_smoke(tmp_path):
    mod = bench()
    record = mod.run(0.2, repeats=2, folder=tmp_path, launch=lambda fn, n, *a: pool(n).run(measure, *a))
    out = tmp_path / "checkpoint_io.json"
    mod._results.save("checkpoint_io", record, False, out)
    rec = json.loads(out.read_text())
    for key in ("benchmark", "model", "layout", "targets", "figures", "ratios", "meets_targets", "per_rank",
                "machine", "commit", "filesystem", "date"):
        assert key in rec, key
    assert rec["layout"] == {"mesh": "dp=2,tp=2", "zero": 1, "ranks": 4} and len(rec["per_rank"]) == 4
    f = rec["figures"]
    for op, (skey, bkey) in mod.OPS.items():
        rounds = f[op]["rounds"]
        assert len(rounds) == 2
        for i, rnd in enumerate(rounds):
            rows = [r["rounds"][i] for r in rec["per_rank"]]
            assert rnd["seconds"] == max(row[skey] for row in rows) > 0
            assert rnd["bytes"] == sum(row[bkey] for row in rows) > 0
            assert rnd["gb_s"] == pytest.approx(rnd["bytes"] / rnd["seconds"] / 1e9)
        assert f[op]["gb_s"] == pytest.approx(statistics.median(r["gb_s"] for r in rounds))
    for r in rec["per_rank"]:
        for row in r["rounds"]:
            assert row["disk_write_bytes"] == r["rounds"][0]["save_bytes"] == row["save_bytes"]
            assert row["disk_read_cold_bytes"] == row["disk_read_warm_bytes"] == row["save_bytes"]
            assert row["load_cold_bytes"] == row["load_warm_bytes"] > row["save_bytes"] / 2
            assert row["torch_save_bytes"] > row["torch_pieces_bytes"] == row["torch_load_cold_bytes"]
            assert 0 < row["async_stall_s"] <= row["async_total_s"]
    # ZeRO-1 at dp=2: a rank loads its tensor-parallel piece (half the parameters), writes half of that
    assert sum(row["load_cold_bytes"] for row in (r["rounds"][0] for r in rec["per_rank"])) > sum(
        row["save_bytes"] for row in (r["rounds"][0] for r in rec["per_rank"])) * 1.1
    s, r = f, rec["ratios"]
    assert r["save_over_disk_write"] == pytest.approx(s["mcompile_save"]["gb_s"] / s["disk_write"]["gb_s"])
    assert r["load_over_disk_read"] == pytest.approx(s["mcompile_load_cold"]["gb_s"] / s["disk_read_cold"]["gb_s"])
    assert r["async_stall_over_sync_save"] == pytest.approx(s["async_stall_s"] / s["mcompile_save"]["seconds"])
    assert s["async_stall_first_s"] == max(p["rounds"][0]["async_stall_s"] for p in rec["per_rank"])
    assert rec["meets_targets"]["save"] == (r["save_over_disk_write"] >= 0.7)


RECORD = Path(__file__).resolve().parents[1] / "bench" / "results" / "checkpoint_io.json"


@pytest.mark.timeout(30)
def test_committed_record_is_what_its_figures_say():
    """bench/results/checkpoint_io.json (``--write``, 255 M parameters): its ratios are its figures' ratios, and
    the bytes are what the layout says: all ranks' files hold the 12 bytes per parameter (fp32 weights and two
    AdamW moments, once each) plus records' headers; a ZeRO-1 rank at dp=2 x tp=2 loads its tensor-parallel
    half of the weights (2 bytes per parameter) and its quarter of the moments (2 bytes per parameter)."""
    rec = json.loads(RECORD.read_text())
    assert rec["benchmark"] == "checkpoint_io" and rec["commit"] and rec["commit"] != "unknown"
    assert rec["layout"] == {"mesh": "dp=2,tp=2", "zero": 1, "ranks": 4} and rec["repeats"] >= 2
    n = rec["model"]["parameters"]
    f, r = rec["figures"], rec["ratios"]
    written = f["mcompile_save"]["bytes_all_ranks"]
    assert 12 * n <= written <= 12 * n * 1.01
    assert f["disk_write"]["bytes_all_ranks"] == written == f["disk_read_cold"]["bytes_all_ranks"]
    assert 16 * n <= f["mcompile_load_cold"]["bytes_all_ranks"] <= 16 * n * 1.01
    assert r["save_over_disk_write"] == pytest.approx(f["mcompile_save"]["gb_s"] / f["disk_write"]["gb_s"])
    assert r["load_over_disk_read"] == pytest.approx(f["mcompile_load_cold"]["gb_s"] / f["disk_read_cold"]["gb_s"])
    assert r["async_stall_over_sync_save"] == pytest.approx(f["async_stall_s"] / f["mcompile_save"]["seconds"])
    assert rec["meets_targets"] == {"save": r["save_over_disk_write"] >= 0.7, "load": r["load_over_disk_read"] >= 0.7,
                                    "async_stall": r["async_stall_over_sync_save"] <= 0.1}
