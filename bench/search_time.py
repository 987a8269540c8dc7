"""Time of the cost-driven search (mcompile.search), end to end, and its SC'21 comparison.

    python bench/search_time.py [--no-sc21]

Each timed case runs in a fresh process, timed from outside: interpreter start, ``import mcompile``,
building the model on the meta device, capture (2 layers), planning per tp, enumeration and pricing.
Targets (the issue): GPT-3 175B on 1024 GPUs <= 10 s, a 1T-parameter GPT on 3072 GPUs <= 30 s, on
this 2-core machine. Then, in this process, every row of Narayanan et al. SC'21 Table 1: Megatron's
own layout and the searched best, both priced by the search on the A100 profile with 2021's settings.
Writes bench/results/search_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import _results  # noqa: E402 - bench/_results.py: where the JSON goes (bench/ is the script's folder)

ROOT = Path(__file__).resolve().parents[1]
SC21 = ROOT / "tests" / "data" / "megatron_sc21_a100.json"

# (name, model spec, gpus, hardware, global batch, seq)
CASES = [
    ("gpt3-175b preset", "preset:gpt3-175b", 1024, "a100", 1536, 2048),
    ("gpt3-175b module, all 96 layers built on meta", "module:gpt3-175b", 1024, "a100", 1536, 2048),
    ("gpt-1t (SC'21 1T row) preset", "gpt:128,160,25600", 3072, "a100", 3072, 2048),
    ("gpt2-xl preset (the test suite's case)", "preset:gpt2-xl", 64, "h100", 512, 1024),
]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import mcompile as mc
from mcompile.models import get_preset
from mcompile.models.gpt import GPTConfig
from mcompile.models.presets import Preset
from mcompile.search import SearchWorkload, search
spec, gpus, hw, batch, seq = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
t1 = time.perf_counter()
kind, _, arg = spec.partition(":")
if kind == "preset":
    work = SearchWorkload.of(arg)
elif kind == "module":
    pre = get_preset(arg)
    model = pre.build(device="meta", dtype=torch.bfloat16)
    work = SearchWorkload.of(model, pre.example_inputs(batch=2, seq=16, device="meta"))
else:
    layers, heads, hidden = map(int, arg.split(","))
    work = SearchWorkload.of(Preset("gpt-1t", "gpt", GPTConfig(vocab_size=51200, block_size=seq, n_layer=layers,
                                                                 n_head=heads, n_embd=hidden)))
work.captured
t2 = time.perf_counter()
res = search(work, gpus, hardware=hw, global_batch=batch, seq=seq, top_k=3)
t3 = time.perf_counter()
best = res[0]
print(json.dumps({"import_s": t1 - t0, "build_and_capture_s": t2 - t1, "search_s": t3 - t2,
                  "layouts_in_space": res.stats["space"], "priced": res.stats["priced"],
                  "best": str(best.layout), "best_step_time_s": best.step_time_s,
                  "best_tflops_per_gpu": best.estimate.tflops_per_gpu,
                  "best_memory_gib": best.estimate.memory_bytes / 2**30,
                  "captured_layers": work.trunk.num_layers, "depth": work.depth}))
"""


def timed_cases() -> list[dict]:
    rows = []
    for name, spec, gpus, hw, batch, seq in CASES:
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, spec, str(gpus), hw, str(batch), str(seq)],
                             capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        row = {"case": name, "gpus": gpus, "hardware": hw, "global_batch": batch, "seq": seq,
               "end_to_end_s": time.perf_counter() - t, **json.loads(out.stdout.strip().splitlines()[-1])}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def sc21_rows() -> list[dict]:
    from mcompile.cost.model import Layout
    from mcompile.cost.workload import estimate
    from mcompile.models.gpt import GPTConfig
    from mcompile.models.presets import Preset
    from mcompile.search import SearchWorkload, price, search

    table = json.loads(SC21.read_text())
    s, V = table["common"]["seq_len"], table["common"]["vocab"]
    settings = dict(hardware="a100", precision="bf16", param_dtype="fp16", grad_dtype="fp16",
                    attention_kernel="unfused")
    rows = []
    for row in table["rows"]:
        tp, pp = row["tp"], row["pp"]
        per_stage = row["layers"] // pp
        v = min(d for d in range(2, per_stage + 1) if per_stage % d == 0) if pp > 1 and per_stage > 1 else 1
        meg = Layout(dp=row["gpus"] // (tp * pp), tp=tp, pp=pp, virtual=v, schedule="interleaved" if v > 1 else "1f1b",
                     microbatch_size=1, recompute="full", overlap_grad_reduce=False, overlap=False)
        cfg = GPTConfig(vocab_size=V, block_size=s, n_layer=row["layers"], n_head=row["heads"], n_embd=row["hidden"])
        work = SearchWorkload.of(Preset(f"gpt-{row['params_b']}b", "gpt", cfg))
        kw = dict(global_batch=row["global_batch"], seq=s, **settings)
        t = time.perf_counter()
        res = search(work, row["gpus"], top_k=1, overlap_grad_reduce=False, **kw)
        full = search(work, row["gpus"], top_k=1, overlap_grad_reduce=False, recompute=("full",),
                      sequence_parallel=(False,), zero=(0,), overlap=(False,), schedules=("1f1b", "interleaved"),
                      **kw)
        seconds = time.perf_counter() - t
        theirs = price(meg, work, **kw)
        out = {"params_b": row["params_b"], "gpus": row["gpus"], "global_batch": row["global_batch"],
               "megatron_layout": str(meg), "megatron_step_s": theirs.step_time_s,
               "megatron_step_s_cost_model": estimate(meg, work, **kw).step_time_s,
               "searched_best": str(res[0].layout), "searched_step_s": res[0].step_time_s,
               "searched_tflops_per_gpu": res[0].estimate.tflops_per_gpu,
               "speedup": theirs.step_time_s / res[0].step_time_s,
               "best_in_megatron_2021_space": str(full[0].layout),
               "best_in_megatron_2021_space_step_s": full[0].step_time_s,
               "speedup_in_megatron_2021_space": theirs.step_time_s / full[0].step_time_s,
               "search_s": seconds}
        print(json.dumps(out), flush=True)
        rows.append(out)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-sc21", action="store_true", help="only the timed cases")
    _results.add_arguments(ap, "search_time")
    args = ap.parse_args()
    result = {
        "benchmark": "search_time",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=ROOT).stdout.strip(),
        "targets_s": {"gpt3-175b on 1024": 10, "1T on 3072": 30},
        "timed": timed_cases(),
    }
    if not args.no_sc21:
        result["sc21"] = sc21_rows()
        result["sc21_settings"] = ("A100 profile; fp16 params and gradients, unfused attention, gradient reduction "
                                   "after the backward (Megatron 2021); 'searched' = the whole space (ZeRO 0-3, "
                                   "tp collective matmul and ZeRO-3 prefetch on/off; no FP8 on A100); "
                                   "'megatron_2021_space' = full recompute, no SP, no ZeRO, no tp overlap, 1F1B or "
                                   "interleaved (what Megatron had in 2021)")
    _results.save("search_time", result, args.write, args.out)


if __name__ == "__main__":
    main()
