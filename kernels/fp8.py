"""FP8 training kernels: a fused cast + amax kernel, per-tensor scaling, and an FP8 linear (issue 6).

Formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): E4M3 (``torch.float8_e4m3fn``:
3 mantissa bits, largest finite 448, smallest normal 2^-6, no infinities) for what the forward reads
— activations and weights — and E5M2 (``torch.float8_e5m2``: 2 mantissa bits, largest 57344,
smallest normal 2^-14) for gradients, whose range matters more than their precision. Round to
nearest even; values beyond the largest finite saturate to it (as Transformer Engine casts do).

Per-tensor scaling. A tensor ``t`` is stored as ``t8 = fp8(t · s)`` with one fp32 scale ``s``, so
that its largest magnitude lands near the format's largest finite value; ``t ≈ t8 / s``. With
``amax = max |t|``::

    s = fp8_max / amax / 2^margin          (s = 1 where amax is 0 or not finite, or s overflows)

- *current* scaling takes amax of the tensor being cast (one extra read of it: the scale must be known
  before the cast starts, so an amax pass, then a cast pass that computes no amax again);
- *delayed* scaling (Transformer Engine's ``DelayedScaling`` recipe idea) takes the largest amax
  seen over the last ``history_len`` steps, and records the amax of this step as a by-product of
  the cast: the fused cast+amax kernel below reads the tensor once for both. A value larger than
  the history's max saturates (that is the recipe's bet: amaxes move slowly).

FP8 linear, ``y = x Wᵀ`` (x: (…, K), W: (N, K), the layout of ``aten.linear``)::

    forward   y  = (x8 · s_x⁻¹)(w8 · s_w⁻¹)ᵀ       x8, w8 in E4M3, one torch._scaled_mm
    backward  dx = (g8 · s_g⁻¹)(w8 · s_w⁻¹)        g8 = E5M2 cast of dy (E5M2 × E4M3)
              dW = (g8 · s_g⁻¹)ᵀ(x8 · s_x⁻¹)

The op receives the higher-precision weight (the fp32 master weight, or the runtime's compute-dtype
copy of it) and casts it inside: parameters, their gradients and the optimizer state stay in their
own precision; only the matmul operands are FP8. The FP8 casts of x and W are what backward saves
(a quarter of fp32 activation memory for the linear inputs). The products of two FP8 values are
exact in fp32 and ``torch._scaled_mm`` accumulates in fp32; where it cannot run (CUDA before sm_89,
shapes off its 16-multiples, other devices) the same math runs as a dequantized fp32 matmul.

Ops (``torch.library.custom_op`` with fake implementations; each backward is itself a custom op,
registered with ``register_autograd``, so forward and backward are one opaque node each in a
torch.export / AOTAutograd graph, DESIGN §5):

    mcompile::fp8_linear(x, weight, margin)                  -> (y, x8, x_scale_inv, w8, w_scale_inv)
    mcompile::fp8_linear_backward(dy, x8, x_scale_inv, w8, w_scale_inv, margin, w_dtype, need_dx, need_dw)
                                                             -> (dx, dw)   (empty where not needed)
    mcompile::fp8_linear_delayed(x, weight, history, margin) -> the same five, and (amax_x, amax_W)
    mcompile::fp8_linear_delayed_backward(dy, x8, x_scale_inv, w8, w_scale_inv, history, margin, w_dtype,
                                          need_dx, need_dw)   -> (dx, dw, amax_dy)

Each backward computes only the gradients the running backward reaches (``_needed``): a zero-bubble
pipeline's B step asks for dx alone and its W step, which runs the node again, for dW alone, so
each backward GEMM runs once (measured, llama3-tiny at pp=2 with 2 microbatches under ZB-H1: 42
FP8 GEMMs a step on the last stage — 7 linears x 2 microbatches x 3, as under 1F1B — where
computing both gradients in each call made 70).

    mcompile::fp8_history_push(history, amaxes)            (mutates ``history``; called by the delayed backward)

Where delayed scaling keeps its state, and why. Each delayed linear owns one fp32 tensor ``history``
of shape (3, history_len): rows x, W, dy; columns the amaxes of the last ``history_len`` steps,
newest first. It is an *input* of the ops and lives as a buffer of the program's GraphModule (a
``get_attr`` node), so the state is a tensor the graph names: torch.export and AOTAutograd see it
(tests/test_fp8.py traces a converted program both ways), it lives on the program's device, and
nothing updates hidden Python state while a program runs — a Python-side table keyed by node
would be exactly the side effect DESIGN §5 rules out (a traced or compiled program would silently
stop updating it). The one mutation is in backward, a separate op (``fp8_history_push``, declared
``mutates_args``): ``register_autograd`` accepts only functional ops, and AOTAutograd (torch 2.13)
functionalizes a mutation of a forward input made in backward — a ``copy_`` into it at the end of
the backward graph — but fails to partition a graph that mutates the same input in forward *and*
backward (measured). Recording everything in backward also makes the update exact:

- forward reads the history (scale from each row's max), records nothing; the amaxes of x and W
  come out of the cast kernel and are saved for backward;
- backward computes the dy scale from its row, then pushes (amax_x, amax_W, amax_dy) as the newest
  column. Backward runs once per forward, so a recomputed forward (activation checkpointing)
  uses the same scales and records nothing twice, and the history advances once per training step
  (per microbatch under gradient accumulation, as Transformer Engine advances per forward).
  Forward-only calls (evaluation) leave it alone. Where autograd runs one node's backward twice
  (a zero-bubble pipeline's weight step re-runs it for dW), the second call reuses the history the
  first one saw and pushes nothing;
- an empty history (the first step) falls back to current scaling. That fallback is chosen without
  a host sync: the Triton path launches an amax kernel gated on the history's max, whose loads are
  all masked off once the history has a value (the launch reads nothing of the tensor), and the
  reference decides on the host where that is free (CPU tensors). So past the first step delayed
  scaling reads each tensor once, in the cast that also yields its amax.

Work per FP8 linear (issue 38 item 7; counted by bench/fp8_ops.py, pinned by tests/test_fp8.py):

- the weight's cast is cached per optimizer step (:func:`step_cache`, which ``ParallelModule.train_step``
  opens around its microbatches, Transformer Engine's ``is_first_microbatch`` idea): the later
  microbatches of a step reuse the first one's w8 and scale; the weight's version counter (an in-place
  write) and the next step invalidate it. Under delayed scaling the cached cast keeps the scale of the
  step's first microbatch (see :func:`_weight_cast`);
- each operand's amax is read once (above);
- ``torch._scaled_mm`` on CUDA takes only K-major operands (row-major a, column-major b; cuBLASLt's FP8
  GEMM is "TN"). The forward's x8 (M, K) and w8ᵀ (w8 row-major (N, K)) already are: no copy. The dgrad
  g8 @ w8 needs w8 column-major: one copy, cached with the weight's cast, so once per step. The wgrad
  g8ᵀ @ x8 contracts over the tokens, the outer dim of both as cast: both copied (the token count padded
  to a multiple of 16 in the same copy). CPU's ``_scaled_mm`` takes any strides: no copies there.

Dispatch: the Triton kernel runs on CUDA tensors, and on CPU tensors when this module was imported
under ``TRITON_INTERPRET=1`` (correctness only, DESIGN §8); elsewhere the PyTorch reference. The
kernel rounds to FP8 with integer operations on the fp32 bits rather than Triton's fp8 conversion:
the interpreter's conversion truncates and mis-rounds across binades (measured on triton 3.9), and
the integer form is exact round-to-nearest-even on every backend, bit-identical to torch's cast.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref

import torch
from torch import Tensor

from mcompile.kernels._triton import jit as _jit
from mcompile.kernels._triton import runs_triton, tl, triton

__all__ = [
    "E4M3", "E5M2", "fp8_max", "uses_triton",
    "cast_to_fp8", "cast_to_fp8_reference", "amax", "compute_scale",
    "new_amax_history", "history_scale", "scaled_mm",
    "fp8_linear", "fp8_linear_delayed", "fp8_linear_reference", "step_cache", "stats",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_FORMATS = {  # dtype -> (largest finite, mantissa bits, exponent of the smallest normal): E4M3 448, 3, -6;
    dt: (torch.finfo(dt).max, -int(math.log2(torch.finfo(dt).eps)), int(math.log2(torch.finfo(dt).smallest_normal)))
    for dt in (E4M3, E5M2)  # E5M2 57344, 2, -14
}
_NAN_CODE = {dt: int(torch.tensor(float("nan")).to(dt).view(torch.uint8)) for dt in _FORMATS}
_BLOCK = 1024  # elements per program of the cast kernel
_MM_MULTIPLE = 16  # torch._scaled_mm on CUDA: contraction and output dims multiples of 16
X, W, G = 0, 1, 2  # rows of a delayed-scaling amax history
# devices whose torch._scaled_mm takes only cuBLASLt's FP8 layout, both operands K-major: a row-major
# (M, K), b column-major (K, N). CPU's takes any strides. (A module set: bench/fp8_ops.py counts the CUDA
# layout's copies on CPU by adding "cpu".)
KMAJOR_DEVICES = {"cuda"}
stats = {"weight_casts": 0}  # FP8 casts of weights since import (the per-step cache's test reads it)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format."""
    return _format(dtype)[0]


def _format(dtype):
    if dtype not in _FORMATS:
        raise ValueError(f"{dtype} is not an FP8 format mcompile casts to; use torch.float8_e4m3fn or "
                         "torch.float8_e5m2")
    return _FORMATS[dtype]


def uses_triton(device: torch.device | str) -> bool:
    """Whether the cast runs its Triton kernel for tensors on ``device`` (else the reference)."""
    return runs_triton(device, _INTERPRETED)


# ---- scales ----------------------------------------------------------------------------------
def amax(t: Tensor) -> Tensor:
    """max |t| as a 0-d fp32 tensor (0 for an empty tensor; NaN if t holds one)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return t.detach().abs().amax().float()


def compute_scale(amax_value: Tensor, dtype: torch.dtype, margin: int = 0) -> Tensor:
    """fp8_max / amax / 2^margin, or 1 where that is not a finite positive number (amax 0, inf, NaN,
    or so small that the scale overflows): the cast then keeps the tensor's own magnitudes."""
    s = fp8_max(dtype) / amax_value.float() / 2.0 ** margin
    return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))


def new_amax_history(history_len: int, device=None) -> Tensor:
    """Zeroed delayed-scaling state: rows (x, W, dy), columns the last ``history_len`` steps, newest first."""
    if not isinstance(history_len, int) or history_len < 1:
        raise ValueError(f"history_len={history_len!r} must be a positive integer")
    return torch.zeros(3, history_len, dtype=torch.float32, device=device)


def history_scale(t: Tensor, row: Tensor, dtype: torch.dtype, margin: int = 0) -> Tensor:
    """Delayed scale of ``t``: from the largest amax of the previous steps (one ``row`` of a history);
    current scaling while that history is still empty (all zeros)."""
    past = row.amax()
    return torch.where(past > 0, compute_scale(past, dtype, margin), compute_scale(amax(t), dtype, margin))


# ---- the fused cast + amax kernel --------------------------------------------------------------
@_jit
def _fp8_code(v, MBITS: tl.constexpr, EMIN: tl.constexpr, NAN_CODE: tl.constexpr):
    """FP8 bit pattern (int32 in 0..255) of fp32 ``v`` with |v| ≤ the format's largest finite value:
    round to nearest even, computed on the fp32 bits. Significand sig = 1.m·2^23 (24 bits) of
    exponent e; the FP8 quantum is 2^(max(e, EMIN) − MBITS), i.e. sig shifted right by
    23 − MBITS + max(0, EMIN − e) bits (more below the smallest normal: subnormals). The code is
    ((max(e, EMIN) − EMIN) << MBITS) + rounded sig: for normals the leading bit of sig lands in the
    exponent field as its +1 bias step, for subnormals it is absent, and a rounding carry moves into
    the exponent as it should."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    e = (mag >> 23) - 127  # fp32 zero and subnormals: -127, which shifts everything out (→ 0)
    sig = (mag & 0x7FFFFF) | 0x800000
    eff = tl.maximum(e, EMIN)
    shift = tl.minimum(23 - MBITS + (eff - e), 31)
    half = (shift * 0 + 1) << (shift - 1)  # tensor << tensor: a constant on the left is not portable
    rounded = (sig + (half - 1) + ((sig >> shift) & 1)) >> shift
    code = (sign << 7) | (((eff - EMIN) << MBITS) + rounded)
    return tl.where(v != v, NAN_CODE, code)


@_jit
def _cast_amax_kernel(X, Y, SCALE, AMAX_PART, n, FMAX: tl.constexpr, MBITS: tl.constexpr,
                      EMIN: tl.constexpr, NAN_CODE: tl.constexpr, BLOCK: tl.constexpr, AMAX: tl.constexpr):
    """Program p: y = fp8(clamp(x·scale, ±FMAX)) (as uint8 bits) for its block, and (``AMAX``) max |x|
    of the block into AMAX_PART[p] (NaN if the block holds one; the host takes the max over programs)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if AMAX:
        a = tl.max(tl.abs(x), axis=0)
        nans = tl.sum((x != x).to(tl.int32), axis=0)
        tl.store(AMAX_PART + pid, tl.where(nans > 0, float("nan"), a))
    v = x * tl.load(SCALE)
    v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -FMAX), FMAX))  # saturate, keep NaN
    tl.store(Y + offs, _fp8_code(v, MBITS, EMIN, NAN_CODE).to(tl.uint8), mask=mask)


@_jit
def _amax_kernel(X, AMAX_PART, GATE, n, BLOCK: tl.constexpr, GATED: tl.constexpr):
    """Program p: max |x| of its block into AMAX_PART[p] (NaN if the block holds one). ``GATED``: only
    while GATE[0] ≤ 0 (a delayed-scaling history still empty); else every load is masked off, so the
    launch reads nothing of x — the choice is made on the device, with no host sync."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    end = n
    if GATED:
        end = tl.where(tl.load(GATE) <= 0, n, 0)
    x = tl.load(X + offs, mask=offs < end, other=0.0).to(tl.float32)
    a = tl.max(tl.abs(x), axis=0)
    nans = tl.sum((x != x).to(tl.int32), axis=0)
    tl.store(AMAX_PART + pid, tl.where(nans > 0, float("nan"), a))


_INTERPRETED = type(_cast_amax_kernel).__name__ == "InterpretedFunction"


def cast_to_fp8_reference(x: Tensor, scale: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(fp8(clamp(x·scale, ±fp8_max)), max |x|) in PyTorch: the kernel's specification."""
    return _cast_reference(x, scale, dtype), amax(x)


def _cast_reference(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    fmax = fp8_max(dtype)
    return (x.float() * scale.float()).clamp(-fmax, fmax).to(dtype)


def _triton_cast(x: Tensor, scale: Tensor, dtype: torch.dtype, with_amax: bool = True):
    fmax, mbits, emin = _format(dtype)
    flat = x.contiguous().view(-1)
    n = flat.numel()
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    grid = max(1, triton.cdiv(n, _BLOCK))
    part = torch.zeros(grid if with_amax else 1, dtype=torch.float32, device=x.device)
    if n:
        _cast_amax_kernel[(grid,)](flat, y.view(torch.uint8), scale.float().reshape(1).contiguous(), part, n,
                                   FMAX=fmax, MBITS=mbits, EMIN=emin, NAN_CODE=_NAN_CODE[dtype], BLOCK=_BLOCK,
                                   AMAX=with_amax)
    return y, (part.amax() if with_amax else None)


def _triton_amax(x: Tensor, gate: Tensor | None = None) -> Tensor:
    flat = x.contiguous().view(-1)
    n = flat.numel()
    grid = max(1, triton.cdiv(n, _BLOCK))
    part = torch.zeros(grid, dtype=torch.float32, device=x.device)
    if n:
        g = part if gate is None else gate.float().reshape(1).contiguous()
        _amax_kernel[(grid,)](flat, part, g, n, BLOCK=_BLOCK, GATED=gate is not None)
    return part.amax()


def cast_to_fp8(x: Tensor, scale: Tensor, dtype: torch.dtype = E4M3) -> tuple[Tensor, Tensor]:
    """(x8, amax): x·scale rounded to ``dtype`` (saturating), and max |x| of the unscaled input — in one
    read of x (Triton), or its PyTorch reference where Triton does not run. ``scale``: 0-d fp32."""
    _format(dtype)
    if uses_triton(x.device):
        return _triton_cast(x, scale, dtype)
    return cast_to_fp8_reference(x, scale, dtype)


# ---- the casts of a linear's operands: each tensor's amax taken once ------------------------------
def _cast_current(t: Tensor, dtype: torch.dtype, margin: int) -> tuple[Tensor, Tensor, Tensor]:
    """(t8, scale⁻¹, amax) under current scaling: the scale needs the amax before the cast can start, so
    one amax pass, then a cast pass that computes no amax again."""
    if uses_triton(t.device):
        a = _triton_amax(t)
        s = compute_scale(a, dtype, margin)
        return _triton_cast(t, s, dtype, with_amax=False)[0], s.reciprocal(), a
    a = amax(t)
    s = compute_scale(a, dtype, margin)
    return _cast_reference(t, s, dtype), s.reciprocal(), a


def _cast_delayed(t: Tensor, row: Tensor, dtype: torch.dtype, margin: int) -> tuple[Tensor, Tensor, Tensor]:
    """(t8, scale⁻¹, amax) under delayed scaling: the scale comes from the history ``row`` and the amax this
    step records is a by-product of the cast — one read of t. Only while the history is empty (the first
    step: current scaling) is t read once more, before the cast, for its scale. The Triton path decides
    that on the device (a gated amax launch that reads nothing once the history has a value); the
    reference decides on the host where that is free (CPU) and otherwise computes both and picks."""
    past = row.amax()  # the largest amax of the previous steps
    if uses_triton(t.device):
        cur = _triton_amax(t, gate=past)  # 0 without reading t once the history has a value
        s = torch.where(past > 0, compute_scale(past, dtype, margin), compute_scale(cur, dtype, margin))
        t8, a = _triton_cast(t, s, dtype)
        return t8, s.reciprocal(), a
    if t.device.type == "cpu":
        if not bool(past > 0):  # empty history (host read of a CPU tensor: no device sync)
            return _cast_current(t, dtype, margin)
        s = compute_scale(past, dtype, margin)
    else:
        s = history_scale(t, row, dtype, margin)
    t8, a = cast_to_fp8_reference(t, s, dtype)
    return t8, s.reciprocal(), a


# ---- the weight's cast, cached per optimizer step ---------------------------------------------------
class _Cached:
    """One weight's FP8 cast within a step: valid while the weight is the same tensor object at the same
    version (an in-place write bumps it) and the scaling (recipe, margin, history) is the same."""

    __slots__ = ("ref", "version", "key", "w8", "inv", "amax", "w8_kmajor")

    def __init__(self, weight, key, w8, inv, a, cache: dict):
        # the weight freed (a ZeRO-3 weight gathered per microbatch), its entry goes: the cache never holds
        # the FP8 copy of a weight nobody holds
        self.ref = weakref.ref(weight, functools.partial(_drop, cache, id(weight)))
        self.version, self.key = weight._version, key
        self.w8, self.inv, self.amax, self.w8_kmajor = w8, inv, a, None

    def valid(self, weight, key) -> bool:
        return self.ref() is weight and self.version == weight._version and self.key == key


def _drop(cache: dict, k: int, ref) -> None:
    """Weakref callback: the cached cast of a weight that was freed leaves the step's cache."""
    e = cache.get(k)
    if e is not None and e.ref is ref:
        del cache[k]
        _BY_W8.pop(e.w8.data_ptr(), None)


_STEP = threading.local()  # .cache: the active step's {id(weight): _Cached}, per thread (a simulated rank)
_BY_W8: dict[int, _Cached] = {}  # data_ptr of a cached w8 -> its entry: backward (any thread) finds w8ᵀ


@contextlib.contextmanager
def step_cache():
    """Within the block — one optimizer step: every microbatch's forward and backward, no weight update in
    between — each weight is cast to FP8 once and the cast reused by the later microbatches, as Transformer
    Engine's ``is_first_microbatch`` does (its Linear documentation); so is the dgrad's K-major copy of
    it on CUDA. The cast is redone within the block if the weight is written in place (its version
    counter moves) and at the next block (the next step): ParallelModule.train_step opens one per step.
    Outside any block every call casts. Nested blocks share the outer one."""
    if getattr(_STEP, "cache", None) is not None:
        yield
        return
    cache: dict[int, _Cached] = {}
    _STEP.cache = cache
    try:
        yield
    finally:
        _STEP.cache = None
        for e in cache.values():
            _BY_W8.pop(e.w8.data_ptr(), None)


def _weight_cast(weight: Tensor, margin: int, row: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(w8, scale⁻¹, amax) of a weight, from the step's cache where valid. ``row``: the delayed-scaling
    history row of W (None: current scaling). Under delayed scaling a cached cast keeps the scale of the
    step's first microbatch (with its own scale⁻¹, so the product stays exact), as Transformer Engine's
    cached weights do; the weight's amax, recorded by every backward, is the same all step."""
    cache = getattr(_STEP, "cache", None)
    key = (margin, None if row is None else row.data_ptr())
    if cache is not None:
        e = cache.get(id(weight))
        if e is not None and e.valid(weight, key):
            return e.w8, e.inv, e.amax
    w8, inv, a = _cast_current(weight, E4M3, margin) if row is None else _cast_delayed(weight, row, E4M3, margin)
    stats["weight_casts"] += 1
    if cache is not None:
        old = cache.get(id(weight))
        if old is not None:
            _BY_W8.pop(old.w8.data_ptr(), None)
        cache[id(weight)] = e = _Cached(weight, key, w8, inv, a, cache)
        _BY_W8[w8.data_ptr()] = e
    return w8, inv, a


# ---- FP8 matmul --------------------------------------------------------------------------------
def _scaled_mm_runs(a: Tensor, b: Tensor) -> bool:
    if a.device.type == "cpu":
        return True
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device) < (8, 9):
        return False
    return b.shape[1] % _MM_MULTIPLE == 0


def _row_major(t: Tensor, pad: int = 0) -> Tensor:
    """``t`` (R, C) as a row-major (R, C + pad) tensor, zeros in the pad: ``t`` itself where it already is
    one and no pad is asked, else one copy (the transpose and the pad in the same write)."""
    if not pad and t.is_contiguous():
        return t
    out = torch.empty(t.shape[0], t.shape[1] + pad, dtype=t.dtype, device=t.device)
    out[:, :t.shape[1]].copy_(t)
    if pad:  # FP8's zero is the all-zero code in both formats
        out[:, t.shape[1]:].view(torch.uint8).zero_()
    return out


def _col_major(t: Tensor, pad_rows: int = 0) -> Tensor:
    """``t`` (R, C) as a column-major (R + pad_rows, C) tensor (its transpose row-major), zeros in the pad."""
    return _row_major(t.t(), pad_rows).t()


def scaled_mm(a8: Tensor, b8: Tensor, a_scale_inv: Tensor, b_scale_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    """(a8·a_scale_inv) @ (b8·b_scale_inv) for FP8 a (M, K) and b (K, N), fp32 accumulation, in
    ``out_dtype``: ``torch._scaled_mm``, or — where it cannot run — the same products as a dequantized fp32
    matmul. On a :data:`KMAJOR_DEVICES` device (CUDA: cuBLASLt's FP8 GEMM is "TN" only) ``a`` must be
    row-major and ``b`` column-major — K the contiguous dim of both — and K a multiple of 16: an operand
    laid out otherwise is copied once, a K off the multiple (the token count, in the weight gradient)
    zero-padded in the same copy (zeros add nothing to the sums). Operands already K-major are not copied."""
    if not _scaled_mm_runs(a8, b8):
        out = (a8.float() @ b8.float()) * (a_scale_inv * b_scale_inv)
        return out.to(out_dtype)
    if a8.device.type in KMAJOR_DEVICES:
        pad = -a8.shape[1] % _MM_MULTIPLE
        a8, b8 = _row_major(a8, pad), _col_major(b8, pad)
    return torch._scaled_mm(a8, b8, a_scale_inv.float().reshape(()), b_scale_inv.float().reshape(()),
                            out_dtype=out_dtype)


def _weight_kmajor(w8: Tensor) -> Tensor:
    """The dgrad's b operand, w8 (N, K) as ``scaled_mm`` will take it: on a K-major device a column-major
    copy — made once per step for a cached weight cast (:func:`step_cache`), else per call — elsewhere w8."""
    if w8.device.type not in KMAJOR_DEVICES or w8.t().is_contiguous():
        return w8
    e = _BY_W8.get(w8.data_ptr())
    if e is None or e.w8.shape != w8.shape:
        return _col_major(w8)
    if e.w8_kmajor is None:
        e.w8_kmajor = _col_major(e.w8)
    return e.w8_kmajor


def _check(x: Tensor, weight: Tensor) -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not make a linear "
                         "(x: (..., K), weight: (N, K))")


def _forward(x: Tensor, weight: Tensor, margin: int, history: Tensor | None = None):
    """(y, x8, x_scale_inv, w8, w_scale_inv, amax_x, amax_w); ``history``: delayed scaling's, else current.
    The GEMM's operands are K-major as cast: x8 row-major, w8ᵀ column-major (w8 is row-major (N, K))."""
    x2 = x.reshape(-1, x.shape[-1])
    if history is None:
        x8, x_inv, ax = _cast_current(x2, E4M3, margin)
        w8, w_inv, aw = _weight_cast(weight, margin)
    else:
        x8, x_inv, ax = _cast_delayed(x2, history[X], E4M3, margin)
        w8, w_inv, aw = _weight_cast(weight, margin, history[W])
    y = scaled_mm(x8, w8.t(), x_inv, w_inv, x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0]), x8.view(x.shape), x_inv, w8, w_inv, ax, aw


def _backward(dy: Tensor, x8: Tensor, x_inv: Tensor, w8: Tensor, w_inv: Tensor, margin: int,
              w_dtype: torch.dtype, history: Tensor | None = None, need_dx: bool = True, need_dw: bool = True):
    """(dx, dw, amax_dy); a gradient not needed is not computed (an empty tensor stands in). On a K-major
    device the dgrad's w8 is taken column-major (once per step, :func:`_weight_kmajor`), and the wgrad
    copies both operands transposed: its contraction runs over the tokens, the outer dim of both g8 and x8
    as cast — those two copies are what cuBLASLt's layout requires."""
    d2 = dy.reshape(-1, dy.shape[-1])
    g8, g_inv, ag = _cast_current(d2, E5M2, margin) if history is None else \
        _cast_delayed(d2, history[G], E5M2, margin)
    x2 = x8.view(-1, x8.shape[-1])
    dx = scaled_mm(g8, _weight_kmajor(w8), g_inv, w_inv, dy.dtype).view(*dy.shape[:-1], w8.shape[1]) if need_dx \
        else dy.new_empty(0)  # (M, N)(N, K)
    dw = scaled_mm(g8.t(), x2, g_inv, x_inv, w_dtype) if need_dw else dy.new_empty(0, dtype=w_dtype)  # (N, M)(M, K)
    return dx, dw, ag


def _fake_forward(x, weight):
    _check(x, weight)
    one = x.new_empty((), dtype=torch.float32)
    return (x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty(x.shape, dtype=E4M3), one,
            weight.new_empty(weight.shape, dtype=E4M3), torch.empty_like(one))


def _fake_backward(dy, x8, w8, w_dtype, need_dx=True, need_dw=True):
    return (dy.new_empty((*dy.shape[:-1], w8.shape[1]) if need_dx else (0,)),
            w8.new_empty(w8.shape if need_dw else (0,), dtype=w_dtype))


def _will_execute(fn) -> bool:
    """Whether the running backward reaches autograd node ``fn`` (conservatively True where autograd
    cannot say: a leaf's accumulator under autograd.grad, or no backward running)."""
    if fn is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(fn))
    except RuntimeError:
        return True


def _needed(ctx) -> tuple[bool, bool]:
    """Which of (dx, dW) this backward call must produce. Not only what required grad at forward: a
    zero-bubble pipeline's B step (torch's stage_backward_input) asks for the input gradient alone and
    its W step (stage_backward_weight) runs this node again for the weight gradient alone — computing
    both each time would run each backward GEMM twice. So an input whose gradient the running backward
    does not reach (its next autograd node will not execute) is skipped. Plain .backward() reaches both."""
    return tuple(need and _will_execute(ctx.next_functions[i][0]) for i, need in enumerate(ctx.needs))


def _setup(ctx, inputs, output):
    x, weight = inputs[0], inputs[1]
    _, *saved = output  # the FP8 operands and their inverse scales (+ the amaxes under delayed scaling)
    ctx.mark_non_differentiable(*saved)
    ctx.save_for_backward(*saved)
    ctx.margin = inputs[-1]
    ctx.w_dtype = weight.dtype
    ctx.needs = (x.requires_grad, weight.requires_grad)


# ---- current scaling ---------------------------------------------------------------------------
@torch.library.custom_op("mcompile::fp8_linear", mutates_args=())
def _fp8_linear(x: Tensor, weight: Tensor, margin: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check(x, weight)
    return _forward(x, weight, margin)[:5]


@_fp8_linear.register_fake
def _(x, weight, margin):
    return _fake_forward(x, weight)


@torch.library.custom_op("mcompile::fp8_linear_backward", mutates_args=())
def _fp8_linear_backward(dy: Tensor, x8: Tensor, x_scale_inv: Tensor, w8: Tensor, w_scale_inv: Tensor,
                         margin: int, w_dtype: torch.dtype, need_dx: bool = True,
                         need_dw: bool = True) -> tuple[Tensor, Tensor]:
    dx, dw, _ = _backward(dy, x8, x_scale_inv, w8, w_scale_inv, margin, w_dtype, None, need_dx, need_dw)
    return dx, dw


@_fp8_linear_backward.register_fake
def _(dy, x8, x_scale_inv, w8, w_scale_inv, margin, w_dtype, need_dx=True, need_dw=True):
    return _fake_backward(dy, x8, w8, w_dtype, need_dx, need_dw)


def _current_backward(ctx, dy, *_unused):
    x8, x_inv, w8, w_inv = ctx.saved_tensors
    need = _needed(ctx)
    dx, dw = torch.ops.mcompile.fp8_linear_backward(dy.contiguous(), x8, x_inv, w8, w_inv, ctx.margin, ctx.w_dtype,
                                                    *need)
    return (dx if need[0] else None), (dw if need[1] else None), None


torch.library.register_autograd("mcompile::fp8_linear", _current_backward, setup_context=_setup)


# ---- delayed scaling ---------------------------------------------------------------------------
@torch.library.custom_op("mcompile::fp8_linear_delayed", mutates_args=())
def _fp8_linear_delayed(x: Tensor, weight: Tensor, history: Tensor,
                        margin: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check(x, weight)
    y, x8, x_inv, w8, w_inv, ax, aw = _forward(x, weight, margin, history)
    return y, x8, x_inv, w8, w_inv, torch.stack([ax, aw])


@_fp8_linear_delayed.register_fake
def _(x, weight, history, margin):
    return (*_fake_forward(x, weight), x.new_empty(2, dtype=torch.float32))


@torch.library.custom_op("mcompile::fp8_linear_delayed_backward", mutates_args=())
def _fp8_linear_delayed_backward(dy: Tensor, x8: Tensor, x_scale_inv: Tensor, w8: Tensor, w_scale_inv: Tensor,
                                 history: Tensor, margin: int, w_dtype: torch.dtype, need_dx: bool = True,
                                 need_dw: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(dy, x8, x_scale_inv, w8, w_scale_inv, margin, w_dtype, history, need_dx, need_dw)


@_fp8_linear_delayed_backward.register_fake
def _(dy, x8, x_scale_inv, w8, w_scale_inv, history, margin, w_dtype, need_dx=True, need_dw=True):
    return (*_fake_backward(dy, x8, w8, w_dtype, need_dx, need_dw), dy.new_empty((), dtype=torch.float32))


@torch.library.custom_op("mcompile::fp8_history_push", mutates_args=("history",))
def _fp8_history_push(history: Tensor, amaxes: Tensor) -> None:
    """history (3, L), newest column first: shift right by one, amaxes (x, W, dy) into column 0."""
    history.copy_(torch.cat([amaxes.to(history.dtype).view(3, 1), history[:, :-1]], 1))


@_fp8_history_push.register_fake
def _(history, amaxes):
    return None


def _delayed_setup(ctx, inputs, output):
    _setup(ctx, inputs, output)
    # an attribute, not save_for_backward: the saved-tensor version check would refuse what is by design,
    # a history moved on between this forward and its backward (by an earlier microbatch's backward)
    ctx.history = inputs[2]


def _delayed_backward(ctx, dy, *_unused):
    x8, x_inv, w8, w_inv, amax_xw = ctx.saved_tensors
    # A second backward of the same node (a zero-bubble pipeline's W step: torch's stage_backward_weight
    # runs this node again, from the dy its B step saw, for the weight gradient) scales dy from the
    # history as the first call saw it and records nothing: one push per forward, the same dW.
    seen = getattr(ctx, "history_seen", None)
    history = ctx.history if seen is None else seen
    need = _needed(ctx)
    dx, dw, ag = torch.ops.mcompile.fp8_linear_delayed_backward(dy.contiguous(), x8, x_inv, w8, w_inv, history,
                                                               ctx.margin, ctx.w_dtype, *need)
    if seen is None:
        ctx.history_seen = ctx.history.clone()
        torch.ops.mcompile.fp8_history_push(ctx.history, torch.cat([amax_xw, ag.view(1)]))
    return (dx if need[0] else None), (dw if need[1] else None), None, None


torch.library.register_autograd("mcompile::fp8_linear_delayed", _delayed_backward, setup_context=_delayed_setup)


# ---- public functions --------------------------------------------------------------------------
def fp8_linear(x: Tensor, weight: Tensor, margin: int = 0) -> Tensor:
    """``x @ weight.T`` with E4M3 operands (current per-tensor scaling) and E5M2 gradients."""
    return torch.ops.mcompile.fp8_linear(x, weight, margin)[0]


def fp8_linear_delayed(x: Tensor, weight: Tensor, history: Tensor, margin: int = 0) -> Tensor:
    """``x @ weight.T`` in FP8 with delayed scaling; ``history`` (see :func:`new_amax_history`) is updated."""
    return torch.ops.mcompile.fp8_linear_delayed(x, weight, history, margin)[0]


def fp8_linear_reference(x: Tensor, weight: Tensor, margin: int = 0) -> Tensor:
    """The current-scaling forward in float64 from the same FP8 operands: quantize, dequantize, matmul."""
    xs = compute_scale(amax(x), E4M3, margin)
    ws = compute_scale(amax(weight), E4M3, margin)
    xd = cast_to_fp8_reference(x, xs, E4M3)[0].double() / xs.double()
    wd = cast_to_fp8_reference(weight, ws, E4M3)[0].double() / ws.double()
    return xd @ wd.t()

