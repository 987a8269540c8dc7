"""Calibration of the cost model against Narayanan et al. SC'21, Table 1 (Megatron-LM on up to 3072
A100s).

    python bench/cost_sc21.py

A calibration, not a validation: the default efficiency constants (mcompile.cost.model.Efficiency) were
chosen against this table as a whole, and it cannot pin them one by one (−30 % on the NVLink,
InfiniBand or attention constant alone still leaves every row within ±15 %). Each constant is
validated against published figures it was not fitted to in tests/test_cost_published.py
(tests/data/published_perf.json).

Prices Megatron's own layout of every row — tp and pp from the row, dp = gpus / (tp·pp), microbatch
1, full recompute, interleaved 1F1B where pp > 1 with v = the smallest divisor > 1 of the layers per
stage, gradients reduced after the backward in fp16, unfused attention — with the library's default
efficiency constants on the A100 profile, and writes predicted vs published TFLOP/s per GPU with
each row's time breakdown to bench/results/cost_sc21.json. Runs on CPU in seconds: each row's GPT
is captured with 2 layers on the meta device and scaled by its depth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import time
from pathlib import Path

import _results

from mcompile.cost.model import DEFAULT_EFFICIENCY, Layout
from mcompile.cost.workload import Workload, estimate
from mcompile.models.gpt import GPTConfig
from mcompile.models.presets import Preset

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "megatron_sc21_a100.json"
SETTINGS = dict(hardware="a100", precision="bf16", param_dtype="fp16", grad_dtype="fp16", attention_kernel="unfused")


def layout_of(row: dict) -> Layout:
    tp, pp = row["tp"], row["pp"]
    per_stage = row["layers"] // pp
    v = min(d for d in range(2, per_stage + 1) if per_stage % d == 0) if pp > 1 and per_stage > 1 else 1
    return Layout(dp=row["gpus"] // (tp * pp), tp=tp, pp=pp, virtual=v, schedule="interleaved" if v > 1 else "1f1b",
                  microbatch_size=1, recompute="full", overlap_grad_reduce=False, overlap=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _results.add_arguments(ap, "cost_sc21")
    args = ap.parse_args()
    table = json.loads(DATA.read_text())
    seq, vocab = table["common"]["seq_len"], table["common"]["vocab"]
    rows = []
    for row in table["rows"]:
        t0 = time.perf_counter()
        cfg = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=row["layers"], n_head=row["heads"],
                        n_embd=row["hidden"])
        work = Workload.from_preset(Preset(f"gpt-{row['params_b']}b", "gpt", cfg), capture_layers=2)
        layout = layout_of(row)
        est = estimate(layout, work, global_batch=row["global_batch"], seq=seq, **SETTINGS)
        out = {
            "params_b": row["params_b"], "layout": str(layout), "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
            "virtual": layout.virtual, "global_batch": row["global_batch"],
            "predicted_tflops_per_gpu": round(est.tflops_per_gpu, 2), "published_tflops_per_gpu": row["tflops_per_gpu"],
            "error": round(est.tflops_per_gpu / row["tflops_per_gpu"] - 1, 4),
            "step_time_s": est.step_time_s,
            "breakdown_fraction": {k: round(v / est.step_time_s, 4) for k, v in est.breakdown.items()},
            "memory_gib": round(est.memory_bytes / 2**30, 2), "fits": est.fits, "seconds_to_estimate":
            round(time.perf_counter() - t0, 2),
        }
        print(f"{row['params_b']:>7}B {str(layout):58s} {out['predicted_tflops_per_gpu']:7.1f} "
              f"vs {row['tflops_per_gpu']:4}  {out['error']:+.1%}", flush=True)
        rows.append(out)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    result = {
        "benchmark": "cost_sc21",
        "source": table["source"],
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "commit": commit,
        "settings": SETTINGS | {"recompute": "full", "microbatch_size": 1, "overlap_grad_reduce": False,
                                "overlap": False,
                                "virtual": "smallest divisor > 1 of layers per stage (interleaved where pp > 1)"},
        "efficiency": dataclasses.asdict(DEFAULT_EFFICIENCY),
        "max_abs_error": max(abs(r["error"]) for r in rows),
        "rows": rows,
    }
    print(f"max |error| {result['max_abs_error']:.1%}")
    _results.save("cost_sc21", result, args.write, args.out)


if __name__ == "__main__":
    main()
