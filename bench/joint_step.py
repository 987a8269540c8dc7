"""Per-step CPU time of ``ParallelModule.train_step``: the joint path against the autograd fallback.

    python bench/joint_step.py [--steps 20] [--warmup 3] [--out bench/results/joint_step.json]

llama3-tiny (tests/conftest.py ``build``, batch 4, seq 16) at dp=2 x tp=2 with sequence parallelism on
four gloo CPU processes (:class:`mcompile.runtime.launch.WorkerPool`, one intra-op thread each). Every
rank builds three ParallelModules of the same model and inputs, each with its own AdamW:

- ``autograd``: ``Config(execution="autograd")``, forward under autograd, ``loss.backward()``;
- ``joint``: the default, the joint program's forward and backward modules run without autograd
  (runtime/joint_runner.py), ``codegen="eager"`` (fx-generated Python);
- ``inductor``: the joint path with ``codegen="inductor"`` (passes/codegen.py): each module is
  compiled on its first call, so the first step's time is the compile time (a fresh Inductor cache
  directory: cold, unless ``--warm-cache``; the four ranks compile at once).

After ``--warmup`` steps of each, ``--steps`` rounds run the three modes interleaved (one step of
each per round, a barrier before each step, the optimizer step untimed), so a change in the
machine's load hits all three alike. Per rank and mode: the median over the measured steps of the
wall time (``time.perf_counter``) and the process CPU time (``time.process_time``: every thread of
the process, gloo's included) of ``train_step``. The JSON keeps the per-rank figures, their median
over ranks, the ratios joint/autograd, inductor/joint and inductor/autograd, the first-step times,
the losses of every step (joint and autograd must agree to the bit: ``joint_equals_autograd_bitwise``;
inductor reorders float reductions: its largest relative difference is recorded), the machine,
torch, the commit and the load average before and after (the machine may be shared: wall times
stretch with load, CPU times much less).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _results  # noqa: E402 - bench/_results.py: where the JSON goes (bench/ is the script's folder)

ROOT = Path(__file__).resolve().parent.parent
MODEL, MESH, BATCH = "llama3-tiny", "dp=2,tp=2", 4
MODES = {
    "autograd": {"sequence_parallel": True, "execution": "autograd"},
    "joint": {"sequence_parallel": True},
    "inductor": {"sequence_parallel": True, "codegen": "inductor"},
}


def worker(rank, world, steps, warmup, lr=1e-4):
    import torch
    import torch.distributed as dist

    import mcompile as mc

    from conftest import build

    torch.set_num_threads(1)
    pms, opts, inputs = {}, {}, None
    for mode, options in MODES.items():
        model, inputs = build(MODEL, batch=BATCH)  # the same seed: the same weights and batch for every mode
        pms[mode] = mc.parallelize(model, mc.Mesh.parse(MESH), inputs, **options)
        opts[mode] = torch.optim.AdamW(pms[mode].parameters(), lr=lr)
    losses = {m: [] for m in MODES}
    wall = {m: [] for m in MODES}
    cpu = {m: [] for m in MODES}
    first = {}

    def step(mode):
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        loss = pms[mode].train_step(*inputs)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        opts[mode].step()
        opts[mode].zero_grad()
        losses[mode].append(loss.item())
        return dt, dc

    for mode in MODES:
        for i in range(warmup):
            dt, dc = step(mode)
            if i == 0:
                first[mode] = {"wall_s": dt, "cpu_s": dc}
    for _ in range(steps):
        for mode in MODES:
            dt, dc = step(mode)
            wall[mode].append(dt)
            cpu[mode].append(dc)
    return {"first_step": first, "losses": losses,
            "wall_s": {m: statistics.median(v) for m, v in wall.items()},
            "cpu_s": {m: statistics.median(v) for m, v in cpu.items()},
            "wall_s_all": wall, "cpu_s_all": cpu}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    _results.add_arguments(ap, "joint_step")
    ap.add_argument("--commit", default=None, help="the commit measured, for a tree outside git")
    ap.add_argument("--warm-cache", action="store_true", help="use Inductor's usual cache directory (the first "
                    "step then measures a compile whose kernels and graphs may already be cached)")
    args = ap.parse_args()
    # before any worker imports torch._inductor: a cold cache (unless --warm-cache), g++ run by the worker itself
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="mcompile_joint_step_bench_")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    sys.path.insert(0, str(ROOT / "tests"))  # conftest.build, in the workers too (they inherit sys.path)
    import torch

    from mcompile.runtime.launch import WorkerPool

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    pool = WorkerPool(4)
    try:
        res = pool.run(worker, args.steps, args.warmup, timeout=3000)
    finally:
        pool.close()
    wall_s = time.perf_counter() - t0
    load_after = os.getloadavg()

    def over_ranks(key, mode):
        return statistics.median(r[key][mode] for r in res)

    summary = {m: {"wall_s": over_ranks("wall_s", m), "cpu_s": over_ranks("cpu_s", m),
                   "first_step_wall_s": statistics.median(r["first_step"][m]["wall_s"] for r in res),
                   "first_step_cpu_s": statistics.median(r["first_step"][m]["cpu_s"] for r in res)}
               for m in MODES}
    ratios = {}
    for num, den in (("joint", "autograd"), ("inductor", "joint"), ("inductor", "autograd")):
        for k in ("wall_s", "cpu_s"):
            ratios[f"{num}_over_{den}_{k[:-2]}"] = summary[num][k] / summary[den][k]
    losses = {m: res[0]["losses"][m] for m in MODES}
    same_across_ranks = all(r["losses"] == res[0]["losses"] for r in res)
    bitwise = [a.hex() for a in losses["joint"]] == [a.hex() for a in losses["autograd"]]
    ind_rel = max(abs(a - b) / abs(b) for a, b in zip(losses["inductor"], losses["autograd"]))
    git = ["git", "-C", str(ROOT)]
    out = {
        "benchmark": "joint_step",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "threads_per_rank": 1,
                    "inductor_compile_threads": os.environ["TORCHINDUCTOR_COMPILE_THREADS"]},
        "commit": args.commit or subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True,
                                                text=True).stdout.strip(),
        "tree_dirty": None if args.commit else bool(subprocess.run(
            git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
            env=dict(os.environ, GIT_OPTIONAL_LOCKS="0")).stdout.strip()),  # read-only: no index refresh
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": MODEL, "mesh": MESH, "sequence_parallel": True, "batch": BATCH, "seq": 16, "ranks": 4,
        "modes": MODES, "steps": args.steps, "warmup": args.warmup,
        "inductor_cache": "warm (Inductor's usual directory: graphs compiled before may be cached)" if args.warm_cache
        else "cold (a fresh Inductor cache directory)",
        "load_average_before": load_before, "load_average_after": load_after,
        "summary_median_over_ranks": summary,
        "ratios": ratios,
        "losses_rank0": losses,
        "losses_same_on_every_rank": same_across_ranks,
        "joint_equals_autograd_bitwise": bitwise,
        "inductor_max_rel_loss_diff_vs_autograd": ind_rel,
        "per_rank": [{k: r[k] for k in ("first_step", "wall_s", "cpu_s")} for r in res],
        "per_step_rank0": {"wall_s": res[0]["wall_s_all"], "cpu_s": res[0]["cpu_s_all"]},
        "wall_s": wall_s,
    }
    path = _results.save("joint_step", out, args.write, args.out)
    print(json.dumps({k: out[k] for k in ("summary_median_over_ranks", "ratios", "joint_equals_autograd_bitwise",
                                          "inductor_max_rel_loss_diff_vs_autograd", "load_average_before",
                                          "load_average_after", "wall_s")}, indent=1))
    print("->", path)


if __name__ == "__main__":
    main()
