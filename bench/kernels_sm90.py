"""Compile every Triton kernel of mcompile for an H100/H200 (sm_90) on a machine without a GPU, and
report what each compiled kernel costs in registers, spills and shared memory.

    python bench/kernels_sm90.py            # -> bench/results/kernels_sm90.json
    options: --widths 4096,8192 --arch 90 --out PATH
    --only fp8 --widths 4096,8192,16384 --write: compile one module's launches, and replace only its rows
    of the committed record (the whole run takes longer than 15 minutes on a 2-core machine)

Why. The tests run the kernels in Triton's interpreter, which executes their Python and never
compiles them: a kernel that the real compiler rejects (a type that differs between the branches of
a loop, an int64 loop bound it cannot lower) or that compiles to code spilling registers to local
memory (slow: a memory-bound kernel's time is its memory traffic) passes every CPU test and fails,
or crawls, only on the GPU. Triton's compiler and NVIDIA's ``ptxas`` ship in the triton wheel and
need no GPU, so both are checked here, on the exact launches the kernel benchmark makes.

How. The launches are recorded, not run: each ``kernel[grid](...)`` global of the kernel modules is
swapped for a recorder, the modules are told to take their Triton path for CPU tensors, and
``bench/kernels.py``'s cases (every op, forward and backward, at each width, bf16), its FP8
linear (current and delayed scaling) and a grouped GEMM (MoE experts) run on CPU tensors of the
benchmark's widths (fewer rows: the row count is a runtime argument, not part of the compiled
code). Each distinct launch is then compiled the way ``JITFunction.run`` compiles it — the same
argument specialization (16-byte alignment and divisibility of pointers and integers), constexprs
and options (``num_warps``) — for ``GPUTarget("cuda", arch, 32)``, and ``cuobjdump
--dump-resource-usage`` reads the cubin: registers per thread, stack and local memory (spills) per
thread, shared memory per program.

It uses Triton internals (``create_function_from_signature``, ``JITFunction._pack_args``) of the
installed version (3.9 here; the GPU machine has 3.6, whose code generation differs in detail): a
check of this compiler's output, a proxy for the other's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import _results  # noqa: E402 - bench/_results.py: where the JSON goes (bench/ is the script's folder)

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels: this script never runs one
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default, stated (silences 3.9's notice)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from mcompile.kernels import activations, cross_entropy, fp8, grouped_gemm, norms, rope  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODULES = (norms, activations, rope, cross_entropy, fp8, grouped_gemm)
ROWS = 64  # rows of every case: a runtime argument of the kernels, so any count compiles the same code
EXPERT_COLUMNS = 1024  # grouped GEMM: w (experts, width, 1024); a runtime argument too (divisible by 16)


def _bench_module():
    spec = importlib.util.spec_from_file_location("mcompile_bench_kernels", ROOT / "bench" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch instead of running it."""

    def __init__(self, fn: JITFunction, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def record_launches(widths: list[int]) -> list[tuple[str, str, JITFunction, tuple, dict]]:
    """(case, phase, kernel, args, kwargs) of every launch the benchmark's cases make at ``widths``."""
    bench = _bench_module()
    launches: list = []
    saved = []
    for mod in MODULES:  # every kernel a recorder; the Triton path for CPU tensors
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                saved.append((mod, name, obj))
                setattr(mod, name, _Recorder(obj, launches))
        for flag in ("_INTERPRETED", "_INTERPRETED_LIBRARY"):
            if hasattr(mod, flag):
                saved.append((mod, flag, getattr(mod, flag)))
                setattr(mod, flag, True)
    out = []
    try:
        for width in widths:
            for op in bench.OPS:
                case = bench.make_case(op, ROWS, width, torch.device("cpu"), torch.bfloat16)
                forward, forward_backward = bench._runners(case.fused, case)
                for phase, run in (("fwd", forward), ("fwd_bwd", forward_backward)):
                    launches.clear()
                    run()
                    out += [(f"{op} w={width}", phase, *launch) for launch in launches]
            x = torch.zeros(ROWS, width, dtype=torch.bfloat16).requires_grad_()
            w = torch.zeros(width, width, dtype=torch.bfloat16).requires_grad_()
            launches.clear()
            torch.autograd.grad(fp8.fp8_linear(x, w), (x, w), torch.zeros(ROWS, width, dtype=torch.bfloat16))
            out += [(f"fp8_linear {width}x{width}", "fwd_bwd", *launch) for launch in launches]
            launches.clear()  # delayed scaling: the casts that also return the amax, the gated amax
            hist = fp8.new_amax_history(4)
            torch.autograd.grad(fp8.fp8_linear_delayed(x, w, hist), (x, w), torch.zeros(ROWS, width,
                                                                                          dtype=torch.bfloat16))
            out += [(f"fp8_linear_delayed {width}x{width}", "fwd_bwd", *launch) for launch in launches]
            # 4 experts, one of them empty; forward with w as a transposed view (models/moe_lm.py passes
            # w1.transpose(1, 2)), dx with w's own layout: both stride specializations get compiled
            w = torch.zeros(4, EXPERT_COLUMNS, width, dtype=torch.bfloat16).requires_grad_()
            offs = torch.tensor([ROWS // 4, ROWS // 4, ROWS // 2, ROWS])
            launches.clear()
            y = grouped_gemm.grouped_mm(x, w.transpose(1, 2), offs)
            torch.autograd.grad(y, (x, w), torch.zeros_like(y))
            out += [(f"grouped_mm 4x{width}x{EXPERT_COLUMNS}", "fwd_bwd", *launch) for launch in launches]
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)
    return out


def _resources(cubin: bytes) -> dict:
    """Registers, stack, local (spills) and shared memory of the one function in a cubin."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"mcompile_sm90_{os.getpid()}.cubin"
    path.write_bytes(cubin)
    try:
        text = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                              check=True, timeout=60).stdout
    finally:
        path.unlink(missing_ok=True)
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict, target: GPUTarget) -> dict:
    """Compile one recorded launch as JITFunction.run would for ``target``; its resources."""
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    res = _resources(kernel.asm["cubin"])
    res["num_warps"] = options.num_warps
    res["constexprs"] = {fn.arg_names[path[0]]: value for path, value in constexprs.items()
                         if isinstance(value, (bool, int, float, str))}
    res["key"] = (fn.__name__, str(specialization), options.num_warps)
    return res


def run(widths: list[int], arch: int, only: str | None = None) -> dict:
    target = GPUTarget("cuda", arch, 32)
    t0 = time.perf_counter()
    launches = record_launches(widths)
    if only:
        mine = {n for n, v in vars(getattr(sys.modules[__name__], only)).items() if isinstance(v, JITFunction)}
        launches = [launch for launch in launches if launch[2].__name__ in mine]
    compiled: dict = {}
    rows = []
    for case, phase, fn, args, kwargs in launches:
        res = None
        try:
            res = compile_launch(fn, args, kwargs, target)
            key = res.pop("key")
            first = key not in compiled
            compiled.setdefault(key, res)
            row = {"case": case, "phase": phase, "kernel": fn.__name__, **res, "first_of_its_kind": first}
        except Exception as exc:  # a kernel the real compiler rejects: the finding this script exists for
            row = {"case": case, "phase": phase, "kernel": fn.__name__, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        rows.append(row)
    return {
        "benchmark": "kernels_sm90", "target": f"cuda sm_{arch}", "widths": widths, "rows_per_case": ROWS,
        "dtype": "bfloat16", "versions": {"torch": torch.__version__, "triton": triton.__version__,
                                          "python": platform.python_version()},
        "commit": _commit(), "seconds": round(time.perf_counter() - t0, 1),
        "launches": rows, "distinct_kernels": len(compiled),
        "spilling": sorted({f"{r['kernel']} ({r['case']})" for r in rows if r.get("local") or r.get("stack")}),
        "errors": [f"{r['kernel']} ({r['case']}, {r['phase']}): {r['error']}" for r in rows if "error" in r],
    }


def _merged(result: dict, only: str) -> dict:
    """The committed record with ``only``'s rows replaced by ``result``'s (kept: every other module's rows,
    as compiled at the record's commit, which the record now names beside this one)."""
    import json

    record = json.loads((_results.RESULTS / "kernels_sm90.json").read_text())
    names = {r["kernel"] for r in result["launches"]} | {
        n for n, v in vars(getattr(sys.modules[__name__], only)).items() if isinstance(v, JITFunction)}
    rows = [r for r in record["launches"] if r["kernel"] not in names] + result["launches"]
    return {**record, "launches": rows, "commit": result["commit"],
            "rows_by_commit": {**record.get("rows_by_commit", {"*": record["commit"]}), only: result["commit"]},
            "distinct_kernels": record["distinct_kernels"] - sum(r.get("first_of_its_kind", False) for r in
                                                                   record["launches"] if r["kernel"] in names)
            + result["distinct_kernels"],
            "spilling": sorted({f"{r['kernel']} ({r['case']})" for r in rows if r.get("local") or r.get("stack")}),
            "errors": [e for e in record["errors"] if e.split(" ", 1)[0] not in names] + result["errors"]}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="4096,8192", help="comma-separated row widths (default 4096,8192)")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (default 90: H100/H200)")
    _results.add_arguments(p, "kernels_sm90")
    p.add_argument("--only", default=None, choices=[m.__name__.rsplit(".", 1)[1] for m in MODULES],
                   help="compile this kernel module's launches only; merged into the record's other rows")
    args = p.parse_args(argv)
    result = run([int(w) for w in args.widths.split(",")], args.arch, args.only)
    if args.only:
        result = _merged(result, args.only)
    for r in result["launches"]:
        if r.get("first_of_its_kind") or "error" in r:
            what = r.get("error") or (f"{r['reg']:3d} regs, stack {r['stack']}, local {r['local']}, shared "
                                      f"{r['shared']} B, {r['num_warps']} warps {r['constexprs']}")
            print(f"{r['kernel']:>26} [{r['case']}, {r['phase']}]: {what}")
    _results.save("kernels_sm90", result, args.write, args.out)
    print(f"{result['distinct_kernels']} distinct kernels in {result['seconds']} s; "
          f"spilling: {result['spilling'] or 'none'}; errors: {len(result['errors'])}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
