"""FP8 training on CPU: does a tiny Llama trained with FP8 linears track the fp32 loss curve?

    python bench/fp8_curve.py [--steps 200] [--seeds 8] [--quick]

llama3-tiny (2 layers, dim 64, ffn 128, kv 32: every linear but the LM head has dims that are
multiples of 16, so 14 of 15 convert) is trained through the public runtime — ``mc.parallelize`` on a
1-process gloo group, Mesh(tp=1) — for ``--steps`` AdamW steps (lr 3e-3, clipping 1.0) on the same
batches (``mcompile.apps.demo.batches``: 8 x 64 bytes of a generated corpus), once per recipe:

- ``fp32``: no FP8;
- ``current``: ``Config(fp8="current")``, per-tensor scales from each tensor's own amax;
- ``delayed``: ``Config(fp8="delayed")``, scales from a 16-step amax history;
- ``unscaled``: a control, *not* a recipe: the current recipe with every scale forced to 1 (weights of
  ~0.02 land on E4M3's subnormal grid of 2^-9). The runtime backpropagates the token *sum* (512 x the
  mean's gradients), which keeps gradients inside E5M2's range even at scale 1, so here the control
  lands within the bound as well (measured: −0.9% over 8 seeds): the final-loss criterion alone
  cannot tell a scaled recipe from an unscaled one on this model. That is why the unit tests check
  the scaling itself (cast and matmul error bounds, the history); in the tests' own setting (mean
  loss, gradients ~1e-5 that underflow E5M2 at scale 1) the control misses the bound (+2.7%).

"Final loss" is the mean training loss of the last 20 steps (the same batches in every run; one
step's loss moves by several % with its batch). Per-seed gaps are noisy — the runs do not share a
trajectory; at lr 3e-3 even a 1e-6 perturbation of fp32 weights moves the last step's loss by ~1% —
so the acceptance figure is the gap of the final loss averaged over ``--seeds`` initialisations
(bound: 2%, justified in tests/test_fp8.py::test_fp8_training_tracks_fp32), with seed 0's single
run reported beside it. Writes bench/results/fp8_curve.json: seed 0's three curves, every seed's
final losses and gaps, the means, timings, what the pass converted and kept, machine and commit.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RECIPES = ("fp32", "current", "delayed", "unscaled")
LR, BATCH, SEQ, TAIL, BOUND = 3e-3, 8, 64, 20, 0.02


def _run(rank, world, steps: int, seeds: list[int], threads: int) -> dict:
    """Worker (one gloo rank): every (seed, recipe) run; curves and timings."""
    import torch

    import mcompile as mc
    from mcompile.apps.demo import batches
    from mcompile.kernels import fp8
    from mcompile.models import get_preset

    torch.set_num_threads(threads)
    data = batches(steps, BATCH, SEQ)
    true_scale = fp8.compute_scale
    out = {"runs": {}, "report": None}
    for seed in seeds:
        for recipe in RECIPES:
            fp8.compute_scale = (lambda a, dtype, margin=0: torch.ones_like(a.float())) if recipe == "unscaled" \
                else true_scale
            torch.manual_seed(seed)
            model = get_preset("llama3-tiny").build()
            option = {"fp32": None, "unscaled": "current"}.get(recipe, recipe)
            pm = mc.parallelize(model, mc.Mesh(tp=1), data[0], fp8=option)
            opt = torch.optim.AdamW(pm.parameters(), lr=LR)
            losses = []
            t0 = time.perf_counter()
            for x, y in data:
                loss = pm.train_step(x, y)
                torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            seconds = time.perf_counter() - t0
            out["runs"][f"{seed}/{recipe}"] = {"losses": losses, "seconds": seconds}
            if pm.fp8 is not None and out["report"] is None:
                out["report"] = pm.fp8.to_dict()
            print(f"seed {seed} {recipe:9s} final {sum(losses[-TAIL:]) / TAIL:.4f}  {seconds:.1f} s", flush=True)
    fp8.compute_scale = true_scale
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=8, help="initialisations 0..N-1 (the gap is averaged over them)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    ap.add_argument("--quick", action="store_true", help="2 seeds")
    sys.path.insert(0, str(Path(__file__).parent))
    import _results

    _results.add_arguments(ap, "fp8_curve")
    args = ap.parse_args()
    seeds = list(range(2 if args.quick else args.seeds))
    sys.path.insert(0, str(Path(__file__).parent))
    from mcompile.runtime.launch import spawn

    t0 = time.perf_counter()
    res = spawn(_run, 1, args.steps, seeds, args.threads)[0]
    final = {r: [sum(res["runs"][f"{s}/{r}"]["losses"][-TAIL:]) / TAIL for s in seeds] for r in RECIPES}
    mean = {r: sum(v) / len(v) for r, v in final.items()}
    gaps = {r: [(a - b) / b for a, b in zip(final[r], final["fp32"])] for r in RECIPES if r != "fp32"}
    mean_gap = {r: (mean[r] - mean["fp32"]) / mean["fp32"] for r in gaps}
    seed0 = {r: res["runs"][f"0/{r}"]["losses"] for r in RECIPES}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "fp8_curve",
        "setup": {"model": "llama3-tiny", "mesh": "tp=1 (mc.parallelize, 1 gloo process)", "steps": args.steps,
                  "batch": BATCH, "seq": SEQ, "lr": LR, "optimizer": "AdamW, clip_grad_norm 1.0",
                  "data": "mcompile.apps.demo.batches(seed=0)", "seeds": seeds, "threads": args.threads,
                  "final_loss": f"mean training loss of the last {TAIL} steps"},
        "fp8_pass": res["report"],
        "curves_seed0": seed0,
        "final_loss": final,
        "final_loss_mean": mean,
        "relative_gap_per_seed": gaps,
        "relative_gap_of_mean": mean_gap,
        "relative_gap_seed0": {r: gaps[r][0] for r in gaps},
        "relative_gap_seed0_last_step": {r: (seed0[r][-1] - seed0["fp32"][-1]) / seed0["fp32"][-1] for r in gaps},
        "bound": BOUND,
        "within_bound": {r: abs(mean_gap[r]) <= BOUND for r in gaps},
        "seconds_per_run": {r: sum(res["runs"][f"{s}/{r}"]["seconds"] for s in seeds) / len(seeds) for r in RECIPES},
        "wall_s": time.perf_counter() - t0,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "commit": commit,
    }
    for r in gaps:
        print(f"{r:9s} final-loss gap: seed 0 {gaps[r][0]:+.4f}, mean over {len(seeds)} seeds {mean_gap[r]:+.4f} "
              f"({'within' if result['within_bound'][r] else 'OUTSIDE'} {BOUND:.0%})")
    _results.save("fp8_curve", result, args.write, args.out)


if __name__ == "__main__":
    main()
