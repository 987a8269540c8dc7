"""Compile time and per-call time of ``codegen="inductor"`` against eager, on per-rank forward and backward graphs.

    python bench/codegen.py [--calls 20] [--mesh tp=2] [--models llama3-tiny,llama-small] [--out ...]

For each model: plan it on the mesh (sequence parallel), trace every rank's program into its joint
forward and backward modules (passes/joint.py through ``JointRunner``, recompute "none": the modules
the runtime runs on the joint path; tests/test_codegen.py ``capture_fw_bw``) and record their inputs
in one real training step in the thread simulator, then for rank 0:

- compile time of each graph (``mcompile.passes.codegen.compile_graph``; wall ``compile_s``, CPU
  ``compile_cpu_s`` of this process and its g++ children), in a fresh Inductor cache directory
  (unless ``--warm-cache``), after a trivial graph has paid Inductor's one-time start (imports, the
  C++ prefix header): ``startup_s`` is that, ``compile_s`` the graph's own; then the
  same graph of rank 1 (same kernels: Inductor's kernel cache hits) and a second call for rank 0's
  (the in-memory cache);
- per-call time, eager GraphModule vs the compiled one, each the median of ``--calls`` calls after
  three warm-up calls, interleaved; the collectives run on a one-rank loopback communicator (right
  shapes, no peers), so the figure is the graph's compute and Python overhead, not the simulator's
  barriers; ``max_abs_diff`` compares both outputs on these calls;
- the same graphs of every rank in the simulator, eager vs inductor: ``sim_max_abs_diff``.

Intra-op threads are set to ``--threads`` (default 1: the machine is shared; Inductor's C++ kernels
and eager's aten both use it). The JSON keeps the machine, torch, the commit and the ratios
(``inductor_over_eager`` < 1: inductor faster). Differences are recorded, not asserted (the loopback
run's values are not a real step's; tests/test_codegen.py asserts the simulator's).
"""

from __future__ import annotations

import argparse
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

MODELS = {  # name -> (LlamaConfig kwargs or a preset name, batch, seq)
    "llama3-tiny": ("llama3-tiny", 2, 16),
    "llama-small": (dict(vocab_size=1024, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=768,
                         max_seq_len=128), 4, 64),
}


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--mesh", default="tp=2")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warm-cache", action="store_true", help="use Inductor's usual cache directory")
    _results.add_arguments(ap, "codegen")
    ap.add_argument("--commit", default=None, help="the commit measured, for a tree outside git")
    return ap.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None:  # before torch._inductor reads them
    if not ARGS.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="mcompile_codegen_bench_")
    # g++ runs as this process's child (no worker pool), so its CPU time is counted in compile_cpu_s
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))


class Loopback:
    """A one-rank stand-in for the communicator: every collective returns a tensor of the right shape."""

    def __init__(self, n: int):
        self.n = n

    def rank(self, axis):
        return 0

    def all_reduce(self, x, axis, op, inplace=False):
        return x if inplace else x.clone()

    def all_gather(self, x, dim, axis):
        return torch.cat([x] * self.n, dim=dim)

    def reduce_scatter(self, x, dim, axis):
        return x.narrow(dim, 0, x.shape[dim] // self.n).clone()


def _model(name):
    from mcompile.models.llama import LlamaConfig
    from mcompile.models.presets import Preset, get_preset

    spec, batch, seq = MODELS[name]
    torch.manual_seed(0)
    pre = get_preset(spec) if isinstance(spec, str) else Preset(name, "llama", LlamaConfig(**spec))
    model = pre.build().eval()
    g = torch.Generator().manual_seed(1)
    vocab = pre.config.vocab_size
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    cfg = {k: v for k, v in vars(pre.config).items() if isinstance(v, (int, float))}
    return model, (tokens, targets), {**cfg, "batch": batch, "seq": seq}


def _cpu() -> float:
    """CPU seconds of this process and its reaped children (g++): compile work, whatever the machine's load."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _median_times(fn_a, fn_b, args, calls):
    from test_codegen import _clone

    ta, tb = [], []
    for i in range(calls + 3):
        for fn, acc in ((fn_a, ta), (fn_b, tb)):
            a = _clone(args)
            t = time.perf_counter()
            fn(*a)
            if i >= 3:
                acc.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


def bench_model(name, mesh_spec, calls, sp=True):
    from test_codegen import _clone, capture_fw_bw

    from mcompile.api import compile_plan
    from mcompile.ir import ops
    from mcompile.ir.mesh import Mesh
    from mcompile.passes.codegen import clear_cache, compile_graph
    from mcompile.runtime.sim import ThreadedWorld, run_threads

    model, inputs, cfg = _model(name)
    c = compile_plan(model, Mesh.parse(mesh_spec), inputs, sequence_parallel=sp)
    t = time.perf_counter()
    rec = capture_fw_bw(c, inputs, ThreadedWorld(c.mesh))
    capture_s = time.perf_counter() - t
    n_tp = c.mesh.size("tp")
    row = {"model": name, "config": cfg, "mesh": mesh_spec, "sequence_parallel": sp, "capture_s": capture_s}
    fns = {}
    for kind in ("fw", "bw"):
        g, args = rec[0][kind], rec[0][kind + "_in"]
        t, cpu = time.perf_counter(), _cpu()
        fns[0, kind] = fn = compile_graph(g, args, "inductor", name=f"{name} {kind}[rank 0]")
        compile_s, compile_cpu_s = time.perf_counter() - t, _cpu() - cpu
        t = time.perf_counter()
        compile_graph(g, args, "inductor")
        cached_s = time.perf_counter() - t
        with ops.bind(Loopback(n_tp)):
            eager_s, ind_s = _median_times(g, fn, args, calls)
            diff, close = _diff(g(*_clone(args)), fn(*_clone(args)))
        row[kind] = {"nodes": len(g.graph.nodes), "compile_s": compile_s, "compile_cpu_s": compile_cpu_s,
                     "cached_compile_s": cached_s,
                     "eager_call_s": eager_s, "inductor_call_s": ind_s, "inductor_over_eager": ind_s / eager_s,
                     "max_abs_diff": diff, "allclose": close,
                     "kernels": fn.source_code.count("async_compile.cpp_pybinding("),
                     "extern_calls": sorted(set(_externs(fn.source_code)))}
    for r in range(1, c.mesh.size()):
        for kind in ("fw", "bw"):
            t = time.perf_counter()
            fns[r, kind] = compile_graph(rec[r][kind], rec[r][kind + "_in"], "inductor", name=f"{kind}[rank {r}]")
            if r == 1:
                row[kind]["rank1_compile_s"] = time.perf_counter() - t

    def rank(r):
        out = {}
        for kind in ("fw", "bw"):
            g, args = rec[r][kind], rec[r][kind + "_in"]
            out[kind] = _diff(g(*_clone(args)), fns[r, kind](*_clone(args)))
        return out

    per_rank = run_threads(ThreadedWorld(c.mesh), rank)
    for kind in ("fw", "bw"):
        row[kind]["sim_max_abs_diff"] = max(d[kind][0] for d in per_rank)
        row[kind]["sim_allclose"] = all(d[kind][1] for d in per_rank)
    step_e = row["fw"]["eager_call_s"] + row["bw"]["eager_call_s"]
    step_i = row["fw"]["inductor_call_s"] + row["bw"]["inductor_call_s"]
    row["step_eager_s"], row["step_inductor_s"], row["step_inductor_over_eager"] = step_e, step_i, step_i / step_e
    clear_cache()
    return row


def _diff(eager, compiled) -> tuple[float, bool]:
    """(max abs difference, allclose at the tests' tolerance) over the floating outputs; not asserted."""
    import torch.utils._pytree as pytree
    from test_codegen import ATOL, RTOL

    worst, close = 0.0, True
    for e, c in zip(pytree.tree_leaves(eager), pytree.tree_leaves(compiled)):  # a saved SDPA value is a tuple
        if isinstance(e, torch.Tensor) and e.is_floating_point() and e.numel():
            worst = max(worst, (c.double() - e.double()).abs().max().item())
            close = close and torch.allclose(c, e, rtol=RTOL, atol=ATOL, equal_nan=True)
    return worst, close


def _externs(src):
    import re

    return re.findall(r"(torch\.ops\.\w+\.\w+|extern_kernels\.\w+)", src)


def _startup_s():
    from torch.fx.experimental.proxy_tensor import make_fx

    from mcompile.passes.codegen import compile_graph

    x = torch.randn(8)
    t, cpu = time.perf_counter(), _cpu()
    compile_graph(make_fx(lambda a: (a * 2 + 1,))(x), [x], "inductor", name="warm-up")
    return time.perf_counter() - t, _cpu() - cpu


def main():
    args = ARGS
    torch.set_num_threads(args.threads)
    import torch._inductor.config as icfg

    t0 = time.perf_counter()
    startup, startup_cpu = _startup_s()
    rows = [bench_model(m, args.mesh, args.calls) for m in args.models.split(",")]
    git = ["git", "-C", str(ROOT)]
    out = {
        "benchmark": "codegen",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "inductor_compile_threads": icfg.compile_threads},
        "commit": args.commit or subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True,
                                                text=True).stdout.strip(),
        "tree_dirty": None if args.commit else bool(subprocess.run(
            git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
            env=dict(os.environ, GIT_OPTIONAL_LOCKS="0")).stdout.strip()),  # read-only: no index refresh
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cache": "warm (Inductor's usual directory)" if args.warm_cache else "cold (a fresh Inductor cache directory)",
        "calls": args.calls,
        "startup_s": startup,
        "startup_cpu_s": startup_cpu,
        "load_average_1m": os.getloadavg()[0],  # the machine is shared: wall-clock compile times stretch with load
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }
    path = _results.save("codegen", out, args.write, args.out)
    for r in rows:
        print(r["model"], {k: {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in r[k].items()
                               if kk != "extern_calls"} for k in ("fw", "bw")},
              "step ratio", round(r["step_inductor_over_eager"], 3))
    print("startup_s", round(startup, 1), "wall_s", round(out["wall_s"], 1), "->", path)


if __name__ == "__main__":
    main()
