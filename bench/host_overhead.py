"""Host time of a training step outside compute, at dp=2 x tp=2 on a tiny Hugging Face Llama.

    python bench/host_overhead.py [--steps 20] [--label after] [--out bench/results/host_overhead.json]

What a step costs the host besides the math: Python, dispatch, DTensor and autograd bookkeeping,
views, per-parameter wrapping. On a GPU this is the time the CPU needs to *launch* the step; when it
exceeds the GPU's compute the GPU idles. Here (CPU, gloo, 4 processes) it is measured as

    host = thread CPU time of ``train_step`` (main thread, unprofiled, median of the steps)
           - self CPU time of the math ops in a profiled ``train_step`` (median of five)

where the math ops are the aten ops that read or write tensor data (matmuls, elementwise, reductions,
copies, softmax, embedding, loss; everything aten except the metadata ops in ``_METADATA``); the
collectives run on gloo's own threads and are not in the main thread's CPU time. The tiny model
(hidden 64) makes the step almost all host time, which is the point: the figure is the per-step
price of the runtime's bookkeeping, the part that does not shrink on a faster device. Also counted
in the profiled step: DTensor dispatches (``DTensor`` in the op's call stack is too costly to record;
instead the number of aten ops, and of ``aten::detach`` / ``aten::alias`` / views) and the number
of Python-level autograd nodes.

The JSON (``--out``) keeps one entry per ``--label`` (run it on the tree before and after a change,
same machine, alternating: the machine's noise is of the size of the effect) with the machine and
commit; ``before``/``after`` give the ratio. The figures of issue 11 (plain leaves and flat fp32
buffers instead of ``to_local`` per parameter and microbatch) were measured with the tree before
exported by ``git archive 8f3bec4`` and run through ``bench/pkg_view.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import _results  # noqa: E402 - bench/_results.py: where the JSON goes (bench/ is the script's folder)
import torch

CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=4)
BATCH, SEQ, MICROBATCHES = 8, 32, 2

_METADATA = {  # aten ops that touch no tensor data (views, allocation, aliasing)
    "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::t", "aten::transpose", "aten::permute",
    "aten::expand", "aten::reshape", "aten::_reshape_alias", "aten::unsqueeze", "aten::squeeze", "aten::slice",
    "aten::select", "aten::detach", "aten::detach_", "aten::alias", "aten::empty", "aten::empty_strided",
    "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg", "aten::split", "aten::split_with_sizes",
    "aten::chunk", "aten::narrow", "aten::lift_fresh", "aten::unbind", "aten::expand_as", "aten::view_as",
    "aten::flatten", "aten::unflatten", "aten::contiguous", "aten::numpy_T", "aten::is_same_size",
    "aten::result_type", "aten::_has_compatible_shallow_copy_type", "aten::set_", "aten::to",
    "aten::lift_fresh_copy", "aten::_local_scalar_dense", "aten::item", "aten::size", "aten::stride",
    "aten::requires_grad_", "aten::new_empty", "aten::new_empty_strided", "aten::_nested_tensor_from_mask",
}


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    from mcompile.models.hf import CausalLMLoss

    logging.set_verbosity_error()
    torch.manual_seed(0)
    return CausalLMLoss(LlamaForCausalLM(LlamaConfig(**CFG)))


def worker(rank, world, steps, zero):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import mcompile as mc

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=g)
    pm = mc.parallelize(_model(), mc.Mesh(dp=2, tp=2), (ids, ids), microbatches=MICROBATCHES, zero=zero)
    if zero:
        from mcompile.runtime.zero import DistributedOptimizer

        opt = DistributedOptimizer(pm, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    else:
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

    def step():
        loss = pm.train_step(ids, ids)
        opt.step()
        opt.zero_grad()
        return loss

    first = step().item()
    for _ in range(2):
        step()
    thread, wall, opt_thread = [], [], []
    for _ in range(steps):
        dist.barrier()
        t, c = time.perf_counter(), time.thread_time()
        pm.train_step(ids, ids)
        thread.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
        c = time.thread_time()
        opt.step()
        opt.zero_grad()
        opt_thread.append(time.thread_time() - c)
    maths, counts = [], None
    for _ in range(5):  # the math's self time of one step is noisy: the median of five profiled steps
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pm.train_step(ids, ids)
        opt.zero_grad()
        math_us, ops, meta_ops = 0.0, 0, 0
        for e in prof.key_averages():
            if not e.key.startswith("aten::"):
                continue
            ops += e.count
            if e.key in _METADATA:
                meta_ops += e.count
            else:
                math_us += e.self_cpu_time_total
        maths.append(math_us)
        counts = (ops, meta_ops)
    math_us = statistics.median(maths)
    ops, meta_ops = counts
    return {"first_loss": first, "thread_s": statistics.median(thread), "wall_s": statistics.median(wall),
            "optimizer_thread_s": statistics.median(opt_thread), "math_s": math_us / 1e6, "aten_ops": ops,
            "metadata_ops": meta_ops, "params": len(list(pm.parameters()))}


def main() -> None:
    from mcompile.runtime.launch import spawn

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--label", default="after")
    _results.add_arguments(ap, "host_overhead")  # with either, the run is merged into that file's runs
    ap.add_argument("--commit", default=None, help="the commit measured, for a tree exported out of git "
                                                   "(git archive REV | tar -x) that the script cannot ask")
    args = ap.parse_args()
    runs = {}
    for zero in (0, 1):
        res = spawn(worker, 4, args.steps, zero)
        runs[f"zero{zero}"] = {
            "per_rank": res,
            "host_s_median_rank": statistics.median(r["thread_s"] - r["math_s"] for r in res),
            "train_step_thread_s_median_rank": statistics.median(r["thread_s"] for r in res),
            "train_step_wall_s_rank0": res[0]["wall_s"],
        }
    path = _results.destination("host_overhead", args.write, args.out)
    out = json.loads(path.read_text()) if path is not None and path.exists() else {"benchmark": "host_overhead"}
    out.setdefault("runs", {})[args.label] = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
        "commit": args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                text=True, cwd=Path(__file__).parent).stdout.strip(),
        "tree_dirty": None if args.commit else bool(subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
            cwd=Path(__file__).parent).stdout.strip()),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {"hf": "LlamaForCausalLM", **CFG, "batch": BATCH, "seq": SEQ, "microbatches": MICROBATCHES},
        "mesh": {"dp": 2, "tp": 2}, "steps": args.steps, **runs,
    }
    if "before" in out["runs"] and "after" in out["runs"]:
        out["host_ratio_after_over_before"] = {
            k: out["runs"]["after"][k]["host_s_median_rank"] / out["runs"]["before"][k]["host_s_median_rank"]
            for k in ("zero0", "zero1")}
    _results.save("host_overhead", out, args.write, args.out)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "per_rank"} if isinstance(v, dict) else v
                      for k, v in out["runs"][args.label].items()}, indent=1))


if __name__ == "__main__":
    main()
