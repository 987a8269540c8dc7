"""Start-up at scale: one rank of a simulated 1024-rank cluster, and time to first step against depth.

    python bench/startup_scale.py [--write | --out PATH] [--quick] [--skip-depth] [--skip-simulated]

**Simulated rank** (issue 40). One rank of a dp16 x pp8 x tp8 mesh (1024 ranks) for an unmodified Hugging Face
``LlamaForCausalLM`` of Llama-3-70B's shape (80 layers, hidden 8192, 64 heads, 8 kv heads, vocabulary 128256,
sequence 4096, bf16, 8 microbatches of 1 per data rank), run in one process: torch's fake process group (no
communication) and the meta device as the rank's device (no memory: ``mcompile.runtime.launch.rank_device``
returns meta on the fake backend; parameters are meta pieces, nothing is initialised). The model is built on meta.
Measured: CPU seconds (``time.process_time``) and wall seconds from ``parallelize`` to the end of the first
``train_step`` (the step traces this rank's own pipeline stage, verifies the pipeline group's communication and
runs its programs on meta tensors), split into ``parallelize`` and ``first step``, and the peak RSS. The rank is
in the middle of the pipeline (pp coordinate 3 of 8), where a stage is 10 transformer layers.

What a fake process group cannot do, and what stands in for it: object collectives carry no data, so the capture
is made by this rank itself (what rank 0 does before broadcasting it: the critical path), the ranks' plan digests
are taken to agree, and the pipeline group's other members are taken to run this rank's stage's collectives
(``Pipeline._gather_stage_ops``). Run twice: with an empty capture cache (the first run of a job: capture
included) and with the cache warm (any later start).

**Depth.** Real gloo runs of a narrow HF Llama (hidden 128, 4 microbatches) at 4, 16 and 32 layers, on pp=2 (2
processes: one per core here) and pp=2 x tp=2 (4 processes on 2 cores: their wall clock is mostly waiting for a
core): seconds from ``parallelize`` to the end of the first ``train_step`` (max over ranks), a steady step's
seconds (the best of two more), start-up = the first less the steady step (the first step's programs ready: the
step's own compute grows with depth as every step's does), the most CPU seconds a rank spent (also less a steady
step's), and seconds from the launch (imports and process-group set-up included); with an empty capture cache and
with it warm. The ratios deepest / 4 layers of each. Target: start-up at 32 layers at most 1.5x the 4-layer one.

Targets (issue 40): simulated 70B rank <= 30 s CPU; time to first step at 32 layers <= 1.5x that at 4.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

# bench/kernels.py would shadow the Hub's `kernels` that transformers imports (here and in the spawned workers)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

ROOT = Path(__file__).resolve().parents[1]

SIMULATED = r"""
import json, os, resource, sys, time
t_import = time.perf_counter()
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import mcompile as mc
import mcompile.api as api
bench_file, layers, mesh_s, rank, seq, micro, hidden, inter, heads, kv, vocab = sys.argv[1:12]
layers, rank, seq, micro, hidden, inter, heads, kv, vocab = map(int, (layers, rank, seq, micro, hidden, inter, heads,
                                                                      kv, vocab))
mesh = mc.Mesh.parse(mesh_s)
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=mesh.size())
# object collectives carry nothing on the fake group (module docstring): the stand-ins
api._from_rank0 = lambda produce: produce()
def _all_gather_object(out, obj, group=None):
    for i in range(len(out)):
        out[i] = obj
dist.all_gather_object = _all_gather_object

import importlib.util
spec = importlib.util.spec_from_file_location("startup_scale", bench_file)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
with torch.device("meta"):
    model = bench.hf_llama(layers, hidden, inter, heads, kv, vocab, max(seq, 256))
ids = torch.zeros(mesh.size("dp") * micro, seq, dtype=torch.long, device="meta")
c0, w0 = time.process_time(), time.perf_counter()
pm = mc.parallelize(model, mesh, (ids, ids), microbatches=micro, dtype=torch.bfloat16)
c1, w1 = time.process_time(), time.perf_counter()
pm.train_step(ids, ids)
c2, w2 = time.process_time(), time.perf_counter()
print(json.dumps({"parallelize_cpu_s": c1 - c0, "parallelize_wall_s": w1 - w0, "first_step_cpu_s": c2 - c1,
                  "first_step_wall_s": w2 - w1, "total_cpu_s": c2 - c0, "total_wall_s": w2 - w0,
                  "device": str(pm._device), "stage_layers": layers // mesh.size("pp"),
                  "own_stages": pm._pipe.own, "stages_traced": sorted(pm._pipe.runners),
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

def hf_llama(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int, positions: int):
    """An unmodified Hugging Face ``LlamaForCausalLM`` of this shape, called as training code calls it (a loss)."""
    import torch
    import transformers as T
    from transformers.utils import logging

    logging.set_verbosity_error()

    class Loss(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, labels):
            return self.m(input_ids=ids, labels=labels, use_cache=False).loss

    cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=positions)
    return Loss(T.LlamaForCausalLM(cfg))


LLAMA_70B = {"layers": 80, "hidden": 8192, "inter": 28672, "heads": 64, "kv": 8, "vocab": 128256, "seq": 4096}


def simulated(cache: str, shape: dict, mesh: str, rank: int, micro: int) -> dict:
    env = dict(os.environ, MCOMPILE_CACHE=cache)
    args = [str(shape[k]) for k in ("layers",)] + [mesh, str(rank), str(shape["seq"]), str(micro)] + \
        [str(shape[k]) for k in ("hidden", "inter", "heads", "kv", "vocab")]
    script = Path(cache) / "simulated_rank.py"  # a file: the capture cache keys the model's classes by their source
    script.write_text(SIMULATED)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, str(script), __file__, *args], capture_output=True, text=True, env=env,
                         cwd=tempfile.gettempdir())  # not the checkout: its kernels/ would shadow the Hub's
    if out.returncode != 0:
        raise RuntimeError(f"simulated rank failed:\n{out.stderr[-4000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process_wall_s": time.perf_counter() - t}


def depth_worker(rank, world, layers, cache, launched, mesh="pp=2,tp=2"):
    import time

    import torch

    import mcompile as mc

    os.environ["MCOMPILE_CACHE"] = cache
    torch.manual_seed(0)
    model = hf_llama(layers, 128, 256, 4, 2, 256, 256)
    ids = torch.randint(0, 256, (4, 32))
    parallelize, mesh = mc.parallelize, mc.Mesh.parse(mesh)
    c0, t0 = time.process_time(), time.perf_counter()
    pm = parallelize(model, mesh, (ids, ids), microbatches=4)
    t1 = time.perf_counter()
    loss = float(pm.train_step(ids, ids))
    c2, t2 = time.process_time(), time.perf_counter()
    launch = time.time() - launched
    steps = []
    for _ in range(2):  # the steady step: what the first one costs without start-up
        c, t = time.process_time(), time.perf_counter()
        pm.train_step(ids, ids)
        steps.append((time.perf_counter() - t, time.process_time() - c))
    return {"parallelize_s": t1 - t0, "first_step_s": t2 - t1, "total_s": t2 - t0, "cpu_s": c2 - c0,
            "from_launch_s": launch, "loss": loss, "steady_step_s": min(w for w, _ in steps),
            "steady_step_cpu_s": min(c for _, c in steps)}


def depth(layers: int, cache: str, mesh: str = "pp=2,tp=2") -> dict:
    from mcompile.ir.mesh import Mesh
    from mcompile.runtime.launch import spawn

    out = spawn(depth_worker, Mesh.parse(mesh).size(), layers, cache, time.time(), mesh)
    worst = max(out, key=lambda r: r["total_s"])
    steady = max(r["steady_step_s"] for r in out)
    return {"layers": layers, "time_to_first_step_s": worst["total_s"], "parallelize_s": worst["parallelize_s"],
            "first_step_s": worst["first_step_s"], "max_rank_cpu_s": max(r["cpu_s"] for r in out),
            "from_launch_s": max(r["from_launch_s"] for r in out), "steady_step_s": steady,
            "start_up_s": worst["total_s"] - steady,
            "start_up_max_rank_cpu_s": max(r["cpu_s"] - r["steady_step_cpu_s"] for r in out), "loss": out[0]["loss"]}


def depth_series(mesh: str, quick: bool = False) -> dict:
    """4, 16 and 32 layers on ``mesh``, each with an empty capture cache and then warm; the ratios deepest / 4
    layers. ``start_up_s`` (the issue's measure: time until the first step's programs are ready) is the time to
    the end of the first step less a steady step's (the first step's own compute grows with depth, as every
    step's does)."""
    from mcompile.ir.mesh import Mesh

    rows = []
    for layers in ((4, 16) if quick else (4, 16, 32)):
        cache = tempfile.mkdtemp(prefix="mcompile-startup-depth-")
        for run in ("empty cache", "warm cache"):  # the same folder: the second run reads the first's capture
            row = {"run": run, **depth(layers, cache, mesh)}
            print(mesh, row, flush=True)
            rows.append(row)
    ratio = {}
    for what in ("start_up_s", "start_up_max_rank_cpu_s", "time_to_first_step_s", "max_rank_cpu_s", "from_launch_s"):
        for run in ("empty cache", "warm cache"):
            by = {r["layers"]: r[what] for r in rows if r["run"] == run}
            ratio[f"{what} {run}"] = by[max(by)] / by[4]
    return {"model": "HF LlamaForCausalLM, hidden 128", "mesh": mesh, "processes": Mesh.parse(mesh).size(),
            "microbatches": 4, "rows": rows, "ratio_deepest_to_4": ratio, "target_ratio": 1.5,
            "met": {run: ratio[f"start_up_s {run}"] <= 1.5 for run in ("empty cache", "warm cache")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    _results.add_arguments(ap, "startup_scale")
    ap.add_argument("--quick", action="store_true", help="a 16-layer, narrow simulated model; depths 4 and 16")
    ap.add_argument("--skip-depth", action="store_true")
    ap.add_argument("--skip-simulated", action="store_true")
    ap.add_argument("--depth-mesh", nargs="+", default=["pp=2", "pp=2,tp=2"],
                    help="meshes of the depth runs (pp=2: a process per core of a 2-core machine; pp=2,tp=2: 4 "
                         "processes on 2 cores, whose wall clock is mostly waiting for a core)")
    args = ap.parse_args()
    sys.path.append(str(ROOT))  # the workers import this file's module by path (spawn)
    result: dict = {"benchmark": "startup_scale"}
    mesh, micro = "dp=16,pp=8,tp=8", 8
    rank = 7 * 64 + 3 * 8 + 5  # dp 7, pp 3, tp 5: a middle stage
    if not args.skip_simulated:
        shape = LLAMA_70B if not args.quick else {**LLAMA_70B, "layers": 16, "hidden": 1024, "inter": 2048,
                                                  "heads": 16, "kv": 8, "vocab": 1024, "seq": 512}
        cache = tempfile.mkdtemp(prefix="mcompile-startup-scale-")
        rows = []
        for run in ("empty cache", "warm cache"):
            row = {"run": run, **simulated(cache, shape, mesh, rank, micro)}
            print(row, flush=True)
            rows.append(row)
        result["simulated"] = {"model": "HF LlamaForCausalLM, Llama-3-70B shape" if not args.quick else "quick",
                               "shape": shape, "mesh": mesh, "world": 1024, "rank": rank, "microbatches": micro,
                               "dtype": "bfloat16", "rows": rows, "target_cpu_s": 30.0,
                               "met": {r["run"]: r["total_cpu_s"] <= 30.0 for r in rows}}
    if not args.skip_depth:
        result["depth"] = [depth_series(mesh, args.quick) for mesh in args.depth_mesh]
    _results.save("startup_scale", result, args.write, args.out)


if __name__ == "__main__":
    main()
