"""mcompile's fused kernels against PyTorch eager and torch.compile, and an FP8-vs-BF16 GEMM.

    python bench/kernels.py          # CUDA, bf16, 8192 tokens x width 4096 and 8192 -> bench/results/kernels.json
    python bench/kernels.py --smoke  # CPU, tiny shapes, Triton's interpreter -> bench/results/kernels_smoke.json
    options: --tokens N --widths 4096,8192 --only rms_norm,rope --no-compile --repeats R --out PATH

For each op (rms_norm, layer_norm, add_rms_norm, swiglu, gelu_bias, rope, cross_entropy), forward
alone (no_grad) and forward + backward (torch.autograd.grad of the outputs): the fused op (through
its public function, so dispatch and autograd are included), the plain PyTorch code the fusion pass
replaces run eagerly ("eager"), and the same code under torch.compile ("compiled"). Each op's rows
are ``tokens`` long and ``width`` wide: the hidden size for the norms, the MLP width for swiglu and
gelu_bias, heads x head_dim (128) for rope over one sequence of ``tokens`` positions, the vocabulary
(shard) for cross_entropy.

Bandwidth. These ops are memory-bound, so each is scored by the bytes it must move at least — every
input read once, every output written once (the op's saved statistics included; for forward +
backward, the forward's bytes plus the backward op's) — divided by the time: GB/s, and that as a
percentage of the device's copy bandwidth measured in the same run (a large device-to-device
``copy_``, read + write). The same byte count scores eager and compiled, so GB/s ratios are time ratios.

Timing (CUDA): CUDA events around each repeat; before each, the L2 cache is flushed (a 256 MiB
memset, as Triton's ``do_bench``) and the GPU is given a backlog (``torch.cuda._sleep``) so that the
host's launch and dispatch overhead is hidden: device time, median of the repeats after warmup.
CPU (``--smoke``): wall time, median — a check that the script and its figures work, not a measurement.

GEMM: ``torch._scaled_mm`` of float8_e4m3fn operands (per-tensor scales, bf16 output) against bf16
``torch.mm``, square n x n x n, TFLOP/s = 2 n³ / time; skipped, with the reason, where the device
or build has no FP8 GEMM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = ("rms_norm", "layer_norm", "add_rms_norm", "swiglu", "gelu_bias", "rope", "cross_entropy")
HEAD_DIM = 128
EPS = 1e-5


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter, no torch.compile")
    p.add_argument("--tokens", type=int, default=None, help="rows per op (default 8192; --smoke 32)")
    p.add_argument("--widths", default=None, help="comma-separated row widths (default 4096,8192; --smoke 128,256)")
    p.add_argument("--gemm", default=None, help="comma-separated GEMM sizes n (default 4096,8192; --smoke 64)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/kernels[_smoke].json)")
    return p.parse_args(argv)


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:
    # before anything imports triton (torch does): the kernels run on CPU tensors in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mcompile.kernels import activations, cross_entropy, norms, rope  # noqa: E402


# ---- timing -------------------------------------------------------------------------------------
class Timer:
    def __init__(self, device: torch.device, warmup: int, repeats: int):
        self.cuda = device.type == "cuda"
        self.warmup, self.repeats = warmup, repeats
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.cuda else None

    def __call__(self, fn: Callable[[], object]) -> float:
        """Median seconds of fn() (device time on CUDA)."""
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.repeats)]
        for start, end in events:
            self.flush.zero_()
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU spin: the host queues fn's launches meanwhile
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) / 1e3 for s, e in events)


def copy_bandwidth(device, timer: Timer, nbytes: int) -> float:
    """GB/s of a device-to-device copy of nbytes (counted as nbytes read + nbytes written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src)) / 1e9


# ---- the ops: inputs, fused call, the PyTorch code it replaces, minimal bytes --------------------
@dataclass
class Case:
    op: str
    baseline: str  # what "eager" and "compiled" run, in words
    inputs: list  # tensors; floating ones are differentiated in forward + backward
    fused: Callable
    reference: Callable
    bytes_fwd: int
    bytes_fwd_bwd: int
    differentiated: int = 0  # forward + backward asks gradients of inputs[:differentiated] (0: every float one)


def _llama_rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).type_as(x) * w


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def make_case(op: str, tokens: int, width: int, device, dtype) -> Case:
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    e = torch.tensor([], dtype=dtype).element_size()
    n = tokens * width  # elements of one activation
    row_stats = tokens * 4  # one fp32 statistic per row
    if op == "rms_norm":
        x, w = randn(tokens, width), randn(width, scale=0.1) + 1
        # fwd: x, w -> y, rstd; bwd: dy, x, w, rstd -> dx, dw
        return Case(op, "Llama's RMSNorm: x.float(), pow, mean, rsqrt, mul, type_as, mul by weight", [x, w],
                    lambda x, w: norms.rms_norm(x, w, EPS), _llama_rms,
                    2 * n * e + width * e + row_stats, 5 * n * e + 3 * width * e + 2 * row_stats)
    if op == "layer_norm":
        x, w, b = randn(tokens, width), randn(width, scale=0.1) + 1, randn(width, scale=0.1)
        # fwd: x, w, b -> y, mean, rstd; bwd: dy, x, w, mean, rstd -> dx, dw, db
        return Case(op, "F.layer_norm (aten's fused LayerNorm kernel)", [x, w, b],
                    lambda x, w, b: norms.layer_norm(x, w, b, EPS),
                    lambda x, w, b: F.layer_norm(x, (width,), w, b, EPS),
                    2 * n * e + 2 * width * e + 2 * row_stats, 5 * n * e + 5 * width * e + 4 * row_stats)
    if op == "add_rms_norm":
        x, r, w = randn(tokens, width), randn(tokens, width), randn(width, scale=0.1) + 1

        def ref(x, r, w):
            h = x + r
            return h, _llama_rms(h, w)
        # fwd: x, r, w -> h, y, rstd; bwd: dh, dy, h, w, rstd -> dx (= dresidual), dw
        return Case(op, "x + residual, then Llama's RMSNorm", [x, r, w],
                    lambda x, r, w: norms.add_rms_norm(x, r, w, EPS), ref,
                    4 * n * e + width * e + row_stats, 8 * n * e + 3 * width * e + 2 * row_stats)
    if op == "swiglu":
        a, b = randn(tokens, width), randn(tokens, width)
        # fwd: a, b -> y; bwd: dy, a, b -> da, db
        return Case(op, "F.silu(a) * b", [a, b], activations.swiglu, lambda a, b: F.silu(a) * b,
                    3 * n * e, 8 * n * e)
    if op == "gelu_bias":
        x, bias = randn(tokens, width), randn(width, scale=0.1)
        # fwd: x, bias -> y; bwd: dy, x, bias -> dx, dbias
        return Case(op, "F.gelu(x + bias, approximate='tanh') (GPT-2's MLP)", [x, bias],
                    lambda x, b: activations.gelu_bias(x, b, "tanh"),
                    lambda x, b: F.gelu(x + b, approximate="tanh"),
                    2 * n * e + width * e, 5 * n * e + 3 * width * e)
    if op == "rope":
        heads = max(1, width // HEAD_DIM)
        d = width // heads
        x = randn(1, heads, tokens, d)
        pos = torch.arange(tokens, dtype=torch.float32)[:, None] / (10000.0 ** (torch.arange(0, d, 2) / d))
        emb = torch.cat((pos, pos), dim=-1)
        cos, sin = emb.cos().to(device, dtype)[None, None], emb.sin().to(device, dtype)[None, None]
        table = tokens * d * e
        # fwd: x, cos, sin -> y; bwd: dy, cos, sin -> dx (cos and sin get no gradient)
        return Case(op, "x * cos + rotate_half(x) * sin (Llama / HF apply_rotary_pos_emb)", [x, cos, sin],
                    rope.rope, lambda x, c, s: x * c + _rotate_half(x) * s,
                    2 * n * e + 2 * table, 4 * n * e + 4 * table, differentiated=1)
    if op == "cross_entropy":
        logits = randn(tokens, width, scale=2.0)
        target = torch.randint(0, width, (tokens,), generator=g)
        target[::7] = -100  # some ignored rows, as padded batches have
        target = target.to(device)
        # fwd: logits, target -> max, sum-exp, target logit; bwd: logits, target, max, 2 grads -> dlogits
        return Case(op, "F.cross_entropy(logits.float(), target, reduction='none') (HF and Megatron upcast)",
                    [logits, target], cross_entropy.cross_entropy_loss,
                    lambda x, t: F.cross_entropy(x.float(), t, ignore_index=-100, reduction="none"),
                    n * e + tokens * 8 + 3 * row_stats, 3 * n * e + 2 * tokens * 8 + 6 * row_stats,
                    differentiated=1)
    raise ValueError(f"unknown op {op!r}; use one of {OPS}")


def _uses_triton(op: str, device) -> bool:
    module = {"rms_norm": norms, "layer_norm": norms, "add_rms_norm": norms, "swiglu": activations,
              "gelu_bias": activations, "rope": rope, "cross_entropy": cross_entropy}[op]
    return bool(module.uses_triton(device))


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _runners(fn, case: Case):
    """(forward under no_grad, forward + backward via torch.autograd.grad) closures over fixed inputs."""
    k = case.differentiated or len(case.inputs)
    leaves = [t.detach().requires_grad_(i < k and t.is_floating_point()) for i, t in enumerate(case.inputs)]
    wrt = [t for t in leaves if t.requires_grad]
    grads = [torch.randn_like(o) for o in _as_tuple(fn(*leaves))]

    def forward():
        with torch.no_grad():
            return fn(*case.inputs)

    def forward_backward():
        return torch.autograd.grad(_as_tuple(fn(*leaves)), wrt, grads)

    return forward, forward_backward


def bench_op(op, tokens, width, device, dtype, timer: Timer, compile_: bool, copy_gbps: float) -> dict:
    case = make_case(op, tokens, width, device, dtype)
    row = {"op": op, "tokens": tokens, "width": width, "dtype": str(dtype).removeprefix("torch."),
           "shapes": [list(t.shape) for t in case.inputs], "triton": _uses_triton(op, device),
           "baseline": case.baseline}
    with torch.no_grad():
        got, want = _as_tuple(case.fused(*case.inputs)), _as_tuple(case.reference(*case.inputs))
        row["max_abs_diff_vs_eager"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
    impls = {"fused": case.fused, "eager": case.reference}
    if compile_:
        torch._dynamo.reset()  # each op's graphs compiled afresh: no cache-size limit across ops
        impls["compiled"] = torch.compile(case.reference, dynamic=False)
    phases = {"fwd": {"bytes": case.bytes_fwd}, "fwd_bwd": {"bytes": case.bytes_fwd_bwd}}
    for name, fn in impls.items():
        try:
            runners = dict(zip(phases, _runners(fn, case)))
            seconds = {phase: timer(runner) for phase, runner in runners.items()}
        except Exception as exc:  # a baseline that fails (compile on an odd build) is reported, not fatal
            if name == "fused":
                raise
            for res in phases.values():
                res[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:500]
            continue
        for phase, res in phases.items():
            res[f"{name}_s"] = seconds[phase]
            res[f"{name}_gbps"] = res["bytes"] / seconds[phase] / 1e9
            res[f"{name}_pct_of_copy"] = 100 * res[f"{name}_gbps"] / copy_gbps
    for res in phases.values():
        for base in ("eager", "compiled"):
            if f"{base}_s" in res:
                res[f"speedup_vs_{base}"] = res[f"{base}_s"] / res["fused_s"]
    return row | phases


# ---- FP8 GEMM -----------------------------------------------------------------------------------
def bench_gemm(n: int, device, timer: Timer) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device, torch.bfloat16)
    b = torch.randn(n, n, generator=g).to(device, torch.bfloat16)
    row = {"n": n, "flops": 2 * n**3}
    row["bf16_s"] = timer(lambda: torch.mm(a, b))
    row["bf16_tflops"] = row["flops"] / row["bf16_s"] / 1e12
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        row["fp8_skipped"] = "this torch has no torch._scaled_mm / float8_e4m3fn"
        return row
    fp8 = torch.float8_e4m3fn
    # per-tensor scales mapping each operand's absolute max onto e4m3's largest value (448)
    sa, sb = a.abs().max().float() / 448.0, b.abs().max().float() / 448.0
    a8 = (a.float() / sa).to(fp8)
    b8 = (b.float() / sb).t().contiguous().to(fp8).t()  # column-major, as cuBLASLt's FP8 GEMM requires
    try:
        out = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except Exception as exc:  # no FP8 GEMM on this device (compute capability < 8.9) or build
        row["fp8_skipped"] = f"{type(exc).__name__}: {exc}"[:500]
        return row
    ref = (a.float() @ b.float())
    row["fp8_rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
    for key, fast in (("fp8", False), ("fp8_fast_accum", True)):
        try:
            row[f"{key}_s"] = timer(lambda fast=fast: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb,
                                                                       out_dtype=torch.bfloat16, use_fast_accum=fast))
        except Exception as exc:
            row[f"{key}_skipped"] = f"{type(exc).__name__}: {exc}"[:500]
            continue
        row[f"{key}_tflops"] = row["flops"] / row[f"{key}_s"] / 1e12
        row[f"{key}_speedup_vs_bf16"] = row["bf16_s"] / row[f"{key}_s"]
    return row


# ---- run ----------------------------------------------------------------------------------------
def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _machine(device) -> dict:
    m = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
         "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        m.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                 compute_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    return m


def run(args) -> dict:
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py measures on CUDA; this machine has none (use --smoke for the CPU check)")
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    tokens = args.tokens or (32 if smoke else 8192)
    widths = [int(w) for w in (args.widths or ("128,256" if smoke else "4096,8192")).split(",")]
    gemms = [int(n) for n in (args.gemm or ("64" if smoke else "4096,8192")).split(",")]
    ops = args.only.split(",") if args.only else list(OPS)
    if set(ops) - set(OPS):
        raise SystemExit(f"--only {args.only}: unknown op(s) {sorted(set(ops) - set(OPS))}; choose from {OPS}")
    compile_ = not (smoke or args.no_compile)
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 10)
    repeats = args.repeats if args.repeats is not None else (3 if smoke else 30)
    timer = Timer(device, warmup, repeats)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    t0 = time.perf_counter()
    copy_bytes = (1 << 20) if smoke else (1 << 30)
    result = {
        "benchmark": "kernels", "mode": "smoke" if smoke else "gpu", "commit": _commit(), "machine": _machine(device),
        "versions": {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version()},
        "settings": {
            "tokens": tokens, "widths": widths, "dtype": "bfloat16", "warmup": warmup, "repeats": repeats,
            "timing": "wall time per call on CPU, median (a check of the script, not a measurement)" if smoke
                      else "CUDA events per repeat after an L2 flush and a GPU backlog (device time), median",
            "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
            "torch_compile": True if compile_ else ("skipped in --smoke: compiling 14 CPU graphs takes minutes"
                                                    if smoke else "skipped (--no-compile)"),
            "bytes": "minimal: each input read once, each output (saved statistics included) written once",
        },
        "copy_bandwidth_gbps": copy_bandwidth(device, timer, copy_bytes),
        "copy_bytes": 2 * copy_bytes,
        "kernels": [], "gemm": [], "errors": [],
    }
    for width in widths:
        for op in ops:
            try:
                row = bench_op(op, tokens, width, device, torch.bfloat16, timer, compile_,
                               result["copy_bandwidth_gbps"])
            except Exception as exc:  # keep measuring the others; the error is in the JSON and the exit code
                result["errors"].append(f"{op} width={width}: {type(exc).__name__}: {exc}"[:800])
                continue
            result["kernels"].append(row)
            f, fb = row["fwd"], row["fwd_bwd"]
            nan = float("nan")
            print(f"{op:>13} w={width:<5} fwd {f['fused_gbps']:8.1f} GB/s ({f['fused_pct_of_copy']:5.1f}% of copy) "
                  f"x{f.get('speedup_vs_eager', nan):.2f} vs eager, x{f.get('speedup_vs_compiled', nan):.2f} vs "
                  f"compiled | fwd+bwd {fb['fused_gbps']:8.1f} GB/s ({fb['fused_pct_of_copy']:5.1f}%) "
                  f"x{fb.get('speedup_vs_eager', nan):.2f} vs eager, x{fb.get('speedup_vs_compiled', nan):.2f} "
                  "vs compiled", flush=True)
    for n in gemms:
        try:
            row = bench_gemm(n, device, timer)
        except Exception as exc:
            result["errors"].append(f"gemm n={n}: {type(exc).__name__}: {exc}"[:800])
            continue
        result["gemm"].append(row)
        print(f"gemm n={n}: bf16 {row['bf16_tflops']:.1f} TFLOP/s, fp8 "
              + (f"{row['fp8_tflops']:.1f} TFLOP/s" if "fp8_tflops" in row else f"skipped ({row.get('fp8_skipped')})"),
              flush=True)
    result["seconds"] = time.perf_counter() - t0
    return result


def main(args) -> int:
    result = run(args)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / ("kernels_smoke.json" if args.smoke
                                                                        else "kernels.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out} ({result['seconds']:.1f} s); copy bandwidth {result['copy_bandwidth_gbps']:.0f} GB/s")
    for err in result["errors"]:
        print(f"error: {err}", file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
