"""mcompile's fused kernels against PyTorch eager and torch.compile; FP8-vs-BF16 GEMM and FP8 linear layers.

    python bench/kernels.py          # CUDA, bf16, 8192 tokens x width 4096 and 8192 -> bench/results/kernels.json
    python bench/kernels.py --smoke  # CPU, tiny shapes, Triton's interpreter -> bench/results/kernels_smoke.json
    bash bench/gpu_run.sh            # the one prepared command for a lent GPU machine (versions, budget, logs)
    options: --tokens N --widths 4096,8192 --only rms_norm,rope --no-compile --repeats R --out PATH
             --sections kernels,gemm,layers --layers KxN,... --mlp KxF --budget SECONDS

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
That it is hidden is checked, per repeat: the host time of the launches against the backlog's device
time; a figure where it was not says so (``<impl>_host_bound``: then it is host time).
The first call of each implementation and phase (Triton's JIT, torch.compile's compilation) is
made and timed on its own before the warmup (``<impl>_first_call_s``): never in the timed repeats.
CPU (``--smoke``): wall time, median — a check that the script and its figures work, not a measurement.

GEMM: ``torch._scaled_mm`` of float8_e4m3fn operands (per-tensor scales, bf16 output) against bf16
``torch.mm``, square n x n x n, TFLOP/s = 2 n³ / time; skipped, with the reason, where the device
or build has no FP8 GEMM.

Layers: mcompile's FP8 linear (``mcompile.kernels.fp8.fp8_linear``, current scaling — the default
recipe of ``Config(fp8=...)`` — and ``fp8_linear_delayed`` with a warmed amax history) against bf16
``F.linear``, y = x Wᵀ with x (tokens, K) and W (N, K) in bf16 as the FP8 pass sees them, at Llama-3
8B's shapes (K x N = 4096x4096, 4096x14336 the MLP up/gate, 14336x4096 the MLP down); and a whole
Llama MLP block, down(silu(gate(x)) * up(x)), with its three linears in bf16 or FP8. TFLOP/s:
forward 2·tokens·N·K per linear, forward + backward three times that; the FP8 output's (and
gradients') relative error ‖fp8 − bf16‖ / ‖bf16‖. Each row says which GEMM the FP8 op ran
(``fp8_gemm``): torch._scaled_mm on FP8 tensor cores, the CPU _scaled_mm, or the op's dequantized
fp32-matmul fallback (CUDA before sm_89, dims off multiples of 16).

A one-shot run. The work runs in order of importance — every kernel (fused vs eager) at every
width, then the torch.compile baseline of each, then the GEMMs, then the layers — and the JSON is
rewritten after every item (``complete`` false and ``status`` naming the item in progress until the
end: a run killed by a time limit leaves what it measured). ``--budget SECONDS`` (default 480 on
CUDA) counts from the script's start, compilation included; once spent, the remaining items are
not started and are listed under ``skipped``.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # the budget counts from here: imports and compilation included

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import _results  # noqa: E402 - bench/_results.py: where the JSON goes (bench/ is the script's folder)

ROOT = Path(__file__).resolve().parent.parent
OPS = ("rms_norm", "layer_norm", "add_rms_norm", "swiglu", "gelu_bias", "rope", "cross_entropy")
SECTIONS = ("kernels", "gemm", "layers")
HEAD_DIM = 128
EPS = 1e-5
GPU_BUDGET_S = 480.0  # default --budget on CUDA: leaves room for one more item under a 10-minute command limit
LAYER_SHAPES = "4096x4096,4096x14336,14336x4096"  # K x N of y = x Wᵀ: attention-sized, Llama-3 8B MLP up, down
MLP_SHAPE = "4096x14336"  # hidden x intermediate of Llama-3 8B


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter, no torch.compile")
    p.add_argument("--tokens", type=int, default=None, help="rows per op and layer (default 8192; --smoke 32)")
    p.add_argument("--widths", default=None, help="comma-separated row widths (default 4096,8192; --smoke 128,256)")
    p.add_argument("--gemm", default=None, help="comma-separated GEMM sizes n (default 4096,8192; --smoke 64)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--layers", default=None,
                   help=f"comma-separated KxN linear shapes (default {LAYER_SHAPES}; --smoke 64x64,64x128,128x64)")
    p.add_argument("--mlp", default=None,
                   help=f"HxF of the Llama MLP block, '' for none (default {MLP_SHAPE}; --smoke 64x128)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds from the script's start after which remaining items are skipped "
                        f"(default {GPU_BUDGET_S:.0f} on CUDA, none with --smoke; 0: none)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--write", action="store_true", help="record the JSON as bench/results/kernels[_smoke].json "
                   "(default: a temporary file, named at the end)")
    p.add_argument("--out", default=None, help="JSON path (gpu_run.sh: $OUT/kernels.json)")
    return p.parse_args(argv)


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:
    # before anything imports triton (torch does): the kernels run on CPU tensors in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mcompile.kernels import activations, cross_entropy, fp8, norms, rope  # noqa: E402


# ---- timing -------------------------------------------------------------------------------------
class Timer:
    def __init__(self, device: torch.device, warmup: int, repeats: int):
        self.cuda = device.type == "cuda"
        self.warmup, self.repeats = warmup, repeats
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.cuda else None
        self.last: dict = {}  # CUDA: host_s, backlog_s, host_bound of the last call

    def __call__(self, fn: Callable[[], object], backlog_cycles: int = 2_000_000) -> float:
        """Median seconds of fn() (device time on CUDA). ``backlog_cycles``: the GPU spin queued ahead
        of each repeat (2M cycles ≈ 1 ms on an H100/H200), to be longer than fn's host-side time.
        Whether it was is measured, not assumed: each repeat's host time (launching fn) against its
        backlog's device time (flush + spin); ``self.last["host_bound"]`` is True where a repeat's
        host time reached its backlog — the GPU may then have waited for launches, and the figure
        is host time, not device time."""
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
        events = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(3)) for _ in range(self.repeats)]
        host = []
        for queued, start, end in events:
            queued.record()
            self.flush.zero_()
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(backlog_cycles)  # GPU spin: the host queues fn's launches meanwhile
            start.record()
            t0 = time.perf_counter()
            fn()
            end.record()
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        backlog = [q.elapsed_time(s) / 1e3 for q, s, _ in events]
        self.last = {"host_s": statistics.median(host), "backlog_s": statistics.median(backlog),
                     "host_bound": any(h >= b for h, b in zip(host, backlog))}
        return statistics.median(s.elapsed_time(e) / 1e3 for _, s, e in events)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_call(fn: Callable[[], object], device) -> float:
    """Wall seconds of one call, synchronized: the JIT compile / torch.compile of a first call, kept
    out of the timed repeats (and reported) — it counts in the run's budget all the same."""
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def copy_bandwidth(device, timer: Timer, nbytes: int) -> float:
    """GB/s of a device-to-device copy of nbytes (counted as nbytes read + nbytes written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src)) / 1e9


def _err(exc: BaseException, limit: int = 500) -> str:
    return f"{type(exc).__name__}: {exc}"[:limit]


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


def _time_impl(name: str, fn, case: Case, row: dict, device, timer: Timer, copy_gbps: float) -> None:
    """Time one implementation of a case, forward and forward + backward, into row["fwd"] / row["fwd_bwd"]."""
    t0 = time.perf_counter()
    runners = dict(zip(("fwd", "fwd_bwd"), _runners(fn, case)))  # calls fn once with grad
    _sync(device)
    # first calls apart: the grad-mode graph above, the no_grad one, and the backward (AOTAutograd compiles it
    # at its first run)
    first = time.perf_counter() - t0 + sum(_first_call(runner, device) for runner in runners.values())
    seconds, launch = {}, {}
    for phase, runner in runners.items():
        seconds[phase] = timer(runner)
        launch[phase] = timer.last
    row[f"{name}_first_call_s"] = first
    for phase, res in ((p, row[p]) for p in seconds):
        res[f"{name}_s"] = seconds[phase]
        if launch[phase]:  # CUDA: was the timed figure device time? (see Timer)
            res[f"{name}_host_s"] = launch[phase]["host_s"]
            res[f"{name}_host_bound"] = launch[phase]["host_bound"]
        res[f"{name}_gbps"] = res["bytes"] / seconds[phase] / 1e9
        if copy_gbps:
            res[f"{name}_pct_of_copy"] = 100 * res[f"{name}_gbps"] / copy_gbps
        if name != "fused" and "fused_s" in res:
            res[f"speedup_vs_{name}"] = res[f"{name}_s"] / res["fused_s"]


def bench_op(op, tokens, width, device, dtype, timer: Timer, copy_gbps: float) -> dict:
    """The fused op and the eager PyTorch it replaces (the torch.compile baseline: :func:`add_compiled`)."""
    case = make_case(op, tokens, width, device, dtype)
    row = {"op": op, "tokens": tokens, "width": width, "dtype": str(dtype).removeprefix("torch."),
           "shapes": [list(t.shape) for t in case.inputs], "triton": _uses_triton(op, device),
           "baseline": case.baseline}
    with torch.no_grad():
        got, want = _as_tuple(case.fused(*case.inputs)), _as_tuple(case.reference(*case.inputs))
        row["max_abs_diff_vs_eager"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
    row["fwd"], row["fwd_bwd"] = {"bytes": case.bytes_fwd}, {"bytes": case.bytes_fwd_bwd}
    _time_impl("fused", case.fused, case, row, device, timer, copy_gbps)
    try:
        _time_impl("eager", case.reference, case, row, device, timer, copy_gbps)
    except Exception as exc:  # a baseline that fails is reported, not fatal
        for phase in ("fwd", "fwd_bwd"):
            row[phase]["eager_error"] = _err(exc)
    return row


def add_compiled(row: dict, device, dtype, timer: Timer, copy_gbps: float) -> None:
    """The torch.compile baseline of a kernel row, added to it (compiled_* keys, speedup_vs_compiled)."""
    case = make_case(row["op"], row["tokens"], row["width"], device, dtype)
    torch._dynamo.reset()  # each op's graphs compiled afresh: no cache-size limit across ops
    try:
        _time_impl("compiled", torch.compile(case.reference, dynamic=False), case, row, device, timer, copy_gbps)
    except Exception as exc:  # compile failing on an odd build is reported, not fatal
        for phase in ("fwd", "fwd_bwd"):
            row[phase]["compiled_error"] = _err(exc)


def _kernel_line(row: dict, which: str) -> str:
    f, fb, nan = row["fwd"], row["fwd_bwd"], float("nan")
    if which == "compiled":
        if "compiled_error" in f:
            return f"{row['op']:>13} w={row['width']:<5} compiled: error {f['compiled_error'][:200]}"
        return (f"{row['op']:>13} w={row['width']:<5} fwd x{f.get('speedup_vs_compiled', nan):.2f} vs compiled "
                f"({f['compiled_gbps']:8.1f} GB/s) | fwd+bwd x{fb.get('speedup_vs_compiled', nan):.2f} vs compiled "
                f"({fb['compiled_gbps']:8.1f} GB/s); compile {row.get('compiled_first_call_s', nan):.1f} s")
    return (f"{row['op']:>13} w={row['width']:<5} fwd {f['fused_gbps']:8.1f} GB/s "
            f"({f.get('fused_pct_of_copy', nan):5.1f}% of copy) x{f.get('speedup_vs_eager', nan):.2f} vs eager | "
            f"fwd+bwd {fb['fused_gbps']:8.1f} GB/s ({fb.get('fused_pct_of_copy', nan):5.1f}%) "
            f"x{fb.get('speedup_vs_eager', nan):.2f} vs eager")


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
    e4m3 = torch.float8_e4m3fn
    # per-tensor scales mapping each operand's absolute max onto e4m3's largest value (448)
    sa, sb = a.abs().max().float() / 448.0, b.abs().max().float() / 448.0
    a8 = (a.float() / sa).to(e4m3)
    b8 = (b.float() / sb).t().contiguous().to(e4m3).t()  # column-major, as cuBLASLt's FP8 GEMM requires
    try:
        out = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except Exception as exc:  # no FP8 GEMM on this device (compute capability < 8.9) or build
        row["fp8_skipped"] = _err(exc)
        return row
    ref = (a.float() @ b.float())
    row["fp8_rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
    for key, fast in (("fp8", False), ("fp8_fast_accum", True)):
        try:
            row[f"{key}_s"] = timer(lambda fast=fast: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb,
                                                                       out_dtype=torch.bfloat16, use_fast_accum=fast))
        except Exception as exc:
            row[f"{key}_skipped"] = _err(exc)
            continue
        row[f"{key}_tflops"] = row["flops"] / row[f"{key}_s"] / 1e12
        row[f"{key}_speedup_vs_bf16"] = row["bf16_s"] / row[f"{key}_s"]
    return row


# ---- FP8 layers ---------------------------------------------------------------------------------
LAYER_BACKLOG = 4_000_000  # ≈ 2 ms of GPU spin: the FP8 op's forward + backward is ~40 launches and a few custom ops


def _fp8_gemm(device, weight_shapes) -> dict:
    """Which GEMM mcompile's fp8_linear runs for (N, K) weights on ``device`` (its own dispatch rule)."""
    if not hasattr(torch, "_scaled_mm"):
        return {"fp8_gemm": "dequantized fp32 matmul: this torch has no torch._scaled_mm", "fp8_gemm_hw": False}
    runs = getattr(fp8, "_scaled_mm_runs", None)
    if runs is None:
        return {"fp8_gemm": "unknown (mcompile.kernels.fp8._scaled_mm_runs not found)", "fp8_gemm_hw": None}
    native = True
    try:
        for n, k in weight_shapes:  # forward (M,K)(K,N); backward dx (M,N)(N,K), dW (N,M)(M,K)
            for kk, nn in ((k, n), (n, k)):
                a = torch.empty(16, kk, dtype=fp8.E4M3, device=device)
                native &= bool(runs(a, torch.empty(kk, nn, dtype=fp8.E4M3, device=device)))
    except Exception as exc:  # the kernel module's private rule changed: say so rather than stop
        return {"fp8_gemm": f"unknown (fp8._scaled_mm_runs: {_err(exc, 200)})", "fp8_gemm_hw": None}
    if native and device.type == "cuda":
        return {"fp8_gemm": "torch._scaled_mm on CUDA (cuBLASLt FP8 tensor cores)", "fp8_gemm_hw": True}
    if native:
        return {"fp8_gemm": f"torch._scaled_mm on {device.type} (a correctness path, not FP8 hardware)",
                "fp8_gemm_hw": False}
    why = "dims not multiples of 16"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        why = "compute capability {}.{} < 8.9".format(*torch.cuda.get_device_capability(device))
    elif device.type != "cuda":
        why = f"no FP8 GEMM on {device.type}"
    return {"fp8_gemm": f"dequantized fp32 matmul, fp8_linear's fallback ({why}): not an FP8 GEMM",
            "fp8_gemm_hw": False}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def _bench_layer(row: dict, impls: dict, inputs: list, names: list[str], dy: torch.Tensor, flops: int,
                 device, timer: Timer) -> dict:
    """Time each of ``impls`` (fn(*inputs) -> tensor; "bf16" first, the reference), forward (no_grad)
    and forward + backward (gradients of every input); speed-ups and relative errors against bf16."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    row["fwd"], row["fwd_bwd"] = {"flops": flops}, {"flops": 3 * flops}  # backward: two GEMMs per forward GEMM
    outs = {}
    for name, fn in impls.items():
        def forward(fn=fn):
            with torch.no_grad():
                return fn(*inputs)

        def forward_backward(fn=fn):
            return torch.autograd.grad(fn(*leaves), leaves, dy)

        try:
            row[f"{name}_first_call_s"] = _first_call(forward_backward, device) + _first_call(forward, device)
            for phase, runner in (("fwd", forward), ("fwd_bwd", forward_backward)):
                res = row[phase]
                res[f"{name}_s"] = timer(runner, LAYER_BACKLOG)
                if timer.last:
                    res[f"{name}_host_bound"] = timer.last["host_bound"]
                res[f"{name}_tflops"] = res["flops"] / res[f"{name}_s"] / 1e12
                if name != "bf16":
                    res[f"{name}_speedup_vs_bf16"] = res["bf16_s"] / res[f"{name}_s"]
            outs[name] = (forward(), *forward_backward())  # after the timing: a delayed history is warm
        except Exception as exc:  # an FP8 GEMM this device or build cannot run: the row says why
            if name == "bf16":
                raise
            row[f"{name}_error"] = _err(exc)
    ref = outs["bf16"]
    for name, got in outs.items():
        if name != "bf16":
            row[f"{name}_rel_err"] = {key: _rel_err(a, b) for key, a, b in zip(["y", *names], got, ref)}
    return row


def bench_linear(tokens: int, k: int, n: int, device, timer: Timer) -> dict:
    """y = x Wᵀ, x (tokens, K), W (N, K), all bf16: F.linear against mcompile's FP8 linear."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, k, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(device, torch.bfloat16)
    dy = torch.randn(tokens, n, generator=g).to(device, torch.bfloat16)
    history = fp8.new_amax_history(16, device)
    row = {"layer": "linear", "tokens": tokens, "in_features": k, "out_features": n, "dtype": "bfloat16",
           "fp8": "fp8_linear: current scaling (the default recipe); fp8_delayed: fp8_linear_delayed, "
                  "amax history of 16 warmed by the warmup steps; E4M3 x and W, E5M2 dy",
           **_fp8_gemm(device, [(n, k)])}
    impls = {"bf16": F.linear, "fp8": fp8.fp8_linear,
             "fp8_delayed": lambda x, w: fp8.fp8_linear_delayed(x, w, history)}
    return _bench_layer(row, impls, [x, w], ["dx", "dw"], dy, 2 * tokens * k * n, device, timer)


def bench_mlp(tokens: int, hidden: int, inter: int, device, timer: Timer) -> dict:
    """Llama's MLP, down(silu(gate(x)) * up(x)), its three linears bf16 F.linear or FP8 (current scaling)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, torch.bfloat16)

    x = randn(tokens, hidden)
    wg, wu = randn(inter, hidden, scale=hidden ** -0.5), randn(inter, hidden, scale=hidden ** -0.5)
    wd = randn(hidden, inter, scale=inter ** -0.5)
    dy = randn(tokens, hidden)

    def mlp(linear):
        return lambda x, wg, wu, wd: linear(F.silu(linear(x, wg)) * linear(x, wu), wd)

    row = {"layer": "llama_mlp", "tokens": tokens, "hidden": hidden, "intermediate": inter, "dtype": "bfloat16",
           "fp8": "the three linears as fp8_linear (current scaling); SiLU and the product in bf16 in both",
           **_fp8_gemm(device, [(inter, hidden), (hidden, inter)])}
    impls = {"bf16": mlp(F.linear), "fp8": mlp(fp8.fp8_linear)}
    return _bench_layer(row, impls, [x, wg, wu, wd], ["dx", "dw_gate", "dw_up", "dw_down"], dy,
                        3 * 2 * tokens * hidden * inter, device, timer)


def _layer_line(row: dict) -> str:
    shape = (f"linear {row['tokens']}x{row['in_features']}->{row['out_features']}" if row["layer"] == "linear"
             else f"llama_mlp {row['tokens']}x{row['hidden']}/{row['intermediate']}")
    parts = []
    for phase, label in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
        res = row[phase]
        fp8_part = (f"fp8 {res['fp8_tflops']:6.1f} (x{res['fp8_speedup_vs_bf16']:.2f})"
                    if "fp8_speedup_vs_bf16" in res else "fp8 error")
        parts.append(f"{label} bf16 {res['bf16_tflops']:6.1f} TFLOP/s, {fp8_part}")
    err = row.get("fp8_rel_err", {}).get("y", float("nan"))
    return f"{shape:>28}: " + " | ".join(parts) + f"; rel err {err:.4f} [{row['fp8_gemm']}]" + (
        f" error: {row['fp8_error'][:200]}" if "fp8_error" in row else "")


# ---- run ----------------------------------------------------------------------------------------
def _commit() -> str:
    if os.environ.get("MCOMPILE_COMMIT"):  # a copy of the tree without .git (a lent GPU machine): told by the caller
        return os.environ["MCOMPILE_COMMIT"]
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


def _shapes(spec: str) -> list[tuple[int, int]]:
    return [tuple(int(d) for d in s.lower().split("x")) for s in spec.split(",") if s.strip()]


class Run:
    """The ordered work of one run, its JSON rewritten after every item (atomically: a kill leaves a
    whole file), and the time budget."""

    def __init__(self, result: dict, out: Path, budget: float | None, t_start: float | None = None):
        self.result, self.out, self.budget = result, out, budget
        self.t_start = T_START if t_start is None else t_start  # the budget and "seconds" count from here

    def write(self) -> None:
        self.result["seconds"] = time.perf_counter() - self.t_start
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1) + "\n")
        os.replace(tmp, self.out)

    def execute(self, items: list[tuple[str, Callable[[], None]]]) -> None:
        r = self.result
        current = None
        try:
            for i, (name, fn) in enumerate(items):
                elapsed = time.perf_counter() - self.t_start
                if self.budget and elapsed >= self.budget:
                    r["skipped"] = [{"item": n, "reason": f"--budget {self.budget:.0f} s spent ({elapsed:.0f} s "
                                                          "elapsed)"} for n, _ in items[i:]]
                    print(f"budget of {self.budget:.0f} s spent: skipping {len(items) - i} item(s): "
                          + ", ".join(n for n, _ in items[i:]), flush=True)
                    break
                current = name
                r["status"] = f"running {name} (a file still saying so: the run was killed during it)"
                self.write()
                t0 = time.perf_counter()
                try:
                    fn()
                    outcome = "ok"
                except Exception as exc:  # keep measuring the others; the error is in the JSON and the exit code
                    r["errors"].append(f"{name}: {_err(exc, 800)}")
                    print(f"error: {name}: {_err(exc, 300)}", flush=True)
                    outcome = "error"
                r["timeline"].append({"item": name, "start_s": round(t0 - self.t_start, 2),
                                      "seconds": round(time.perf_counter() - t0, 2), "outcome": outcome})
                current = None
            r["complete"] = not r["skipped"]
            r["status"] = "complete" if r["complete"] else f"budget spent: {len(r['skipped'])} item(s) skipped"
        except BaseException as exc:  # SIGTERM (a time limit), Ctrl-C: the file says where it stopped
            why = "SIGTERM: a time limit?" if isinstance(exc, SystemExit) else type(exc).__name__
            r["status"] = f"interrupted ({why}) during {current}"
            raise
        finally:
            self.write()


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through Run.execute, which records where it stopped


def run(args, out: Path) -> dict:
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py measures on CUDA; this machine has none (use --smoke for the CPU check)")
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    tokens = args.tokens or (32 if smoke else 8192)
    widths = [int(w) for w in (args.widths or ("128,256" if smoke else "4096,8192")).split(",")]
    gemms = [int(n) for n in (args.gemm or ("64" if smoke else "4096,8192")).split(",")]
    layers = _shapes(args.layers if args.layers is not None else ("64x64,64x128,128x64" if smoke else LAYER_SHAPES))
    mlp = _shapes(args.mlp if args.mlp is not None else ("64x128" if smoke else MLP_SHAPE))
    ops = args.only.split(",") if args.only else list(OPS)
    if set(ops) - set(OPS):
        raise SystemExit(f"--only {args.only}: unknown op(s) {sorted(set(ops) - set(OPS))}; choose from {OPS}")
    sections = [s for s in args.sections.split(",") if s]
    if set(sections) - set(SECTIONS):
        raise SystemExit(f"--sections {args.sections}: choose from {SECTIONS}")
    compile_ = not (smoke or args.no_compile)
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 10)
    repeats = args.repeats if args.repeats is not None else (3 if smoke else 30)
    budget = args.budget if args.budget is not None else (None if smoke else GPU_BUDGET_S)
    timer = Timer(device, warmup, repeats)
    # --smoke: the FP8 layers' casts run in Triton's interpreter (tens of ms a call): one timed call each
    layer_timer = Timer(device, 0, 1) if smoke and args.warmup is None and args.repeats is None else timer
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    copy_bytes = (1 << 20) if smoke else (1 << 30)
    result = {
        "benchmark": "kernels", "mode": "smoke" if smoke else "gpu", "complete": False, "status": "starting",
        "commit": _commit(), "machine": _machine(device),
        "versions": {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version()},
        "settings": {
            "tokens": tokens, "widths": widths, "dtype": "bfloat16", "warmup": warmup, "repeats": repeats,
            "layers_warmup_repeats": [layer_timer.warmup, layer_timer.repeats],
            "sections": sections, "layer_shapes_kxn": [list(s) for s in layers], "mlp_hxf": [list(s) for s in mlp],
            "budget_s": budget,
            "timing": "wall time per call on CPU, median (a check of the script, not a measurement)" if smoke
                      else "CUDA events per repeat after an L2 flush and a GPU backlog (device time), median; "
                           "first calls (JIT, torch.compile) timed apart, as <impl>_first_call_s",
            "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
            "torch_compile": True if compile_ else ("skipped in --smoke: compiling 14 CPU graphs takes minutes"
                                                    if smoke else "skipped (--no-compile)"),
            "bytes": "minimal: each input read once, each output (saved statistics included) written once",
            "flops": "layers: forward 2*tokens*K*N per linear, forward + backward 3x that",
        },
        "copy_bandwidth_gbps": None, "copy_bytes": 2 * copy_bytes,
        "kernels": [], "gemm": [], "layers": [], "errors": [], "skipped": [], "timeline": [],
    }
    job = Run(result, out, budget)
    rows: dict[tuple[str, int], dict] = {}

    def copy():
        result["copy_bandwidth_gbps"] = copy_bandwidth(device, timer, copy_bytes)
        print(f"copy bandwidth {result['copy_bandwidth_gbps']:.0f} GB/s", flush=True)

    def kernel(op, width):
        row = bench_op(op, tokens, width, device, dtype, timer, result["copy_bandwidth_gbps"])
        result["kernels"].append(row)
        rows[op, width] = row
        print(_kernel_line(row, "fused"), flush=True)

    def compiled(op, width):
        if (op, width) not in rows:
            raise RuntimeError("no kernel row to add the compiled baseline to (its fused run failed)")
        add_compiled(rows[op, width], device, dtype, timer, result["copy_bandwidth_gbps"])
        print(_kernel_line(rows[op, width], "compiled"), flush=True)

    def gemm(n):
        row = bench_gemm(n, device, timer)
        result["gemm"].append(row)
        print(f"gemm n={n}: bf16 {row['bf16_tflops']:.1f} TFLOP/s, fp8 "
              + (f"{row['fp8_tflops']:.1f} TFLOP/s" if "fp8_tflops" in row else f"skipped ({row.get('fp8_skipped')})"),
              flush=True)

    def layer(bench, *shape):
        row = bench(tokens, *shape, device, layer_timer)
        result["layers"].append(row)
        print(_layer_line(row), flush=True)

    # in order of importance: what a time limit cuts is the end of this list
    items = [("copy bandwidth", copy)]
    if "kernels" in sections:
        items += [(f"kernel {op} w={w}", lambda op=op, w=w: kernel(op, w)) for w in widths for op in ops]
        if compile_:
            items += [(f"compiled {op} w={w}", lambda op=op, w=w: compiled(op, w)) for w in widths for op in ops]
    if "gemm" in sections:
        items += [(f"gemm n={n}", lambda n=n: gemm(n)) for n in gemms]
    if "layers" in sections:
        items += [(f"linear {k}x{n}", lambda k=k, n=n: layer(bench_linear, k, n)) for k, n in layers]
        items += [(f"llama_mlp {h}x{f}", lambda h=h, f=f: layer(bench_mlp, h, f)) for h, f in mlp]
    job.execute(items)
    return result


def main(args) -> int:
    # rewritten after every item (a run cut short keeps what it measured): never the record unless --write
    out = _results.destination("kernels_smoke" if args.smoke else "kernels", args.write, args.out, temporary=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    result = run(args, out)
    print(f"wrote {out} ({result['seconds']:.1f} s, {result['status']}); copy bandwidth "
          f"{result['copy_bandwidth_gbps'] or float('nan'):.0f} GB/s")
    for err in result["errors"]:
        print(f"error: {err}", file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
