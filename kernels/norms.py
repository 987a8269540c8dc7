"""Fused normalisation kernels: RMSNorm, LayerNorm, and residual-add + RMSNorm (DESIGN §5; issue 6).

Each comes three ways, side by side: a Triton kernel pair (forward, backward), a plain PyTorch
reference, and a ``torch.library.custom_op`` with a fake implementation whose backward (itself a
custom op) is registered with ``register_autograd`` — so programs using them stay traceable by
torch.export and AOTAutograd, where forward and backward appear as single opaque nodes:

    mcompile::rms_norm(x, weight, eps)                   -> (y, rstd)
    mcompile::rms_norm_backward(dy, x, weight, rstd)     -> (dx, dw)
    mcompile::layer_norm(x, weight, bias, eps)           -> (y, mean, rstd)
    mcompile::layer_norm_backward(dy, x, weight, mean, rstd) -> (dx, dw, db)
    mcompile::add_rms_norm(x, residual, weight, eps)     -> (h, y, rstd)
    mcompile::add_rms_norm_backward(dh, dy, h, weight, rstd) -> (dx, dw)   (dx is also dresidual)

Call them through :func:`rms_norm`, :func:`layer_norm` and :func:`add_rms_norm`. The norm is over
the last dim (N); all leading dims are rows (M). Statistics and gradients are computed in fp32; y
and h take x's dtype, dw and db the weight's. As in Apex and Transformer Engine the weight
multiplies the fp32 normalised value (HF Llama instead casts to x's dtype first, then multiplies).

Dispatch: the Triton kernels run on CUDA tensors, and on CPU tensors when Triton's own switch
``TRITON_INTERPRET=1`` is set (its interpreter: correctness only, DESIGN §8); otherwise — plain
CPU, or no Triton — the reference runs. Set TRITON_INTERPRET before anything imports triton (torch
and mcompile do): triton.jit reads it once, when it wraps each function.

Math, per row (r = rstd, g = dy·w, <·> = mean over the N columns, Σ = sum over the M rows):

    RMSNorm      y  = x·r·w                 r = (<x²> + eps)^-1/2
                 dx = r·(g − x̂·<g·x̂>)       x̂ = x·r
                 dw = Σ dy·x̂
    LayerNorm    y  = x̂·w + b               x̂ = (x − μ)·r,  μ = <x>,  r = (<(x − μ)²> + eps)^-1/2
                 dx = r·(g − <g> − x̂·<g·x̂>)
                 dw = Σ dy·x̂,  db = Σ dy
    add+RMSNorm  h  = x + residual (rounded to x's dtype),  y = rmsnorm(h)·w
                 dx = dresidual = dh + r·(g − ĥ·<g·ĥ>),  ĥ = h·r     (both outputs' gradients)
                 dw = Σ dy·ĥ

The dx formulas come from differentiating through the row statistics: ∂r/∂x_j = −r³·x_j/N for
RMSNorm (Zhang & Sennrich 2019), plus ∂μ/∂x_j = 1/N for LayerNorm (Ba et al. 2016), so RMSNorm is
LayerNorm with μ = 0 and no <g> term — one backward kernel serves both.

Work layout. Forward: one program per row (Triton's layer-norm tutorial). A row of up to
``_MAX_BLOCK_N`` columns (every hidden size up to Llama-3 405B's 16384) is read from memory once
and kept in registers; wider rows are walked in column blocks, so any N works. Backward, for rows
of up to ``_MAX_FUSED_BWD_N`` = 8192 columns (wider, its registers spill on sm_90): one kernel
whose programs (about one per SM) each take a run of consecutive rows, write dx row by row and sum
dy·x̂ (and dy) over their rows in registers, then store those sums as one row of a (programs, N)
fp32 buffer that a final sum over programs reduces — the two-stage weight-gradient reduction of
Apex's fused layer norm, which Megatron uses (``cuComputePartGradGammaBeta`` then
``cuComputeGradGammaBeta``), with the first stage folded into the dx kernel as Liger-Kernel's
RMSNorm backward does. dy and x are read once for dx and dw: the minimum of 3 row-sized tensors
moved (dy, x in, dx out; 4 with add_rms_norm's dh), where separate dx and dw kernels move 5.
Deterministic (fixed programs, fixed order), unlike the tutorial's lock-and-accumulate. Wider rows
fall back to that split: a dx kernel walking the row in blocks, then a tiled weight-gradient kernel
over (row group, column block) tiles. Fusing the residual add into the norm is the pre-norm
transformer pattern of Megatron/Transformer Engine and
vLLM's ``fused_add_rms_norm``: one kernel reads x and residual and writes both h and y.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a Linux-only dependency: elsewhere the references run
    triton = None

__all__ = [
    "rms_norm", "layer_norm", "add_rms_norm", "uses_triton",
    "rms_norm_reference", "layer_norm_reference", "add_rms_norm_reference",
]

_MAX_BLOCK_N = 16384  # widest column block of the row kernels; wider rows loop over blocks
_DW_BLOCK_M, _DW_BLOCK_N = 32, 128  # tile of the weight-gradient kernel (rows wider than one block)
_DW_MAX_GROUPS = 256  # row groups (partial sums) of the weight-gradient reduction (rows wider than one block)
# widest row of the one-kernel backward: a program keeps x, dy, w and the weight-gradient sums of a
# row in registers; at 16384 columns the sm_90 build spills them to the stack whatever the warps
# (bench/kernels_sm90.py: 64 registers a thread at 32 warps, 104-208 stack bytes), at 8192 it takes
# 114-120 registers at 16 warps and spills nothing. Wider rows take the split dx + dw kernels.
_MAX_FUSED_BWD_N = 8192
_INTERPRETER_BWD_PROGRAMS = 8  # programs of the one-block backward under the interpreter (several rows each)


# ---- dispatch ------------------------------------------------------------------------------
# triton.jit picks interpreter or compiler when it wraps a function, reading TRITON_INTERPRET then:
# for Triton's own library (tl.zeros, tl.sum) when triton is first imported, for ours when this
# module is. So set it before anything imports triton; changing it later has no effect.
_jit = triton.jit if triton is not None else (lambda fn: fn)  # without triton nothing is launched


def uses_triton(device: torch.device | str) -> bool:
    """Whether the ops run their Triton kernels for tensors on ``device`` (else the reference)."""
    device = torch.device(device)
    return triton is not None and (device.type == "cuda" or (device.type == "cpu" and _INTERPRETED))


def _rows(t: Tensor) -> Tensor:
    """(M, N) contiguous view of t: every leading dim is a row."""
    return t.contiguous().view(-1, t.shape[-1])


def _launch_config(n: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the row kernels for rows of n columns."""
    if _INTERPRETED != _INTERPRETED_LIBRARY:
        raise RuntimeError(
            "TRITON_INTERPRET changed between `import triton` and `import mcompile.kernels.norms`, so Triton's "
            "own functions (tl.zeros, tl.sum) and these kernels were built for different modes: set it before "
            "anything imports triton (importing torch.export or mcompile does), e.g. at the top of conftest.py")
    block = min(triton.next_power_of_2(n), _MAX_BLOCK_N)
    # a row of `block` fp32 values spread over the program's threads: more warps for wider rows, so
    # each thread holds at most 16 values per live array (the usual step table of Triton row kernels)
    return block, 32 if block >= 16384 else 16 if block >= 8192 else 8 if block >= 2048 else 4


def _bwd_layout(m: int, n: int, device: torch.device) -> tuple[bool, int, int, int, int]:
    """(one_block, BLOCK_N, num_warps, programs, rows per program) of the backward of m rows of n.

    One block (n <= _MAX_FUSED_BWD_N): about one program per SM for the widest rows (what their registers
    allow), more for narrower ones; a few under the interpreter. Wider rows: the weight-gradient
    kernel's row groups (rows per program unused)."""
    block, warps = _launch_config(n)
    if n > block or n > _MAX_FUSED_BWD_N:
        return False, block, warps, max(1, min(triton.cdiv(m, _DW_BLOCK_M), _DW_MAX_GROUPS)), 0
    if device.type == "cuda":
        target = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        target *= max(1, 8192 // block)
    else:
        target = _INTERPRETER_BWD_PROGRAMS
    per = triton.cdiv(m, max(1, min(m, target)))
    return True, block, warps, triton.cdiv(m, per) if m else 1, per


_SMS: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _check(name: str, x: Tensor, *params: Tensor) -> None:
    n = x.shape[-1] if x.dim() else 0
    if n == 0:
        raise ValueError(f"{name}: x of shape {tuple(x.shape)} has no last dim to normalise over")
    for p in params:
        if p.dim() != 1 or p.shape[0] != n:
            raise ValueError(f"{name}: weight/bias of shape {tuple(p.shape)} does not match x of shape "
                             f"{tuple(x.shape)}; pass 1-d parameters of x.shape[-1] = {n} elements")


# ---- Triton kernels ------------------------------------------------------------------------
@_jit
def _round(value, dtype: tl.constexpr):
    """fp32 ``value`` rounded to nearest-even in ``dtype``, kept in fp32. Compiled Triton's casts round
    so, but the interpreter's fp32 -> bf16 cast truncates: for bf16 round the bits here (add half an
    ulp, ties to even, drop the low 16 bits), so both modes agree with torch and the cast is exact."""
    if dtype == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    return value.to(dtype).to(tl.float32)


@_jit
def _store(ptr, value, mask):
    """tl.store of fp32 ``value`` into ptr's dtype, rounded to nearest-even (see _round)."""
    tl.store(ptr, _round(value, ptr.dtype.element_ty).to(ptr.dtype.element_ty), mask=mask)


@_jit
def _rms_fwd_kernel(X, RES, W, Y, H, RSTD, stride, N, eps,
                    HAS_RES: tl.constexpr, ONE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per row: r = (<h²> + eps)^-1/2, y = h·r·w, with h = x (+ residual, stored).
    ONE_BLOCK (N <= BLOCK_N): the row is read once and kept in registers; else walked twice in blocks."""
    row = tl.program_id(0).to(tl.int64)
    X += row * stride
    Y += row * stride
    RES += row * stride
    H += row * stride
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:  # h rounded to x's dtype, as the unfused x + residual would be
            x = _round(x + tl.load(RES + cols, mask=mask, other=0.0).to(tl.float32), X.dtype.element_ty)
            tl.store(H + cols, x.to(H.dtype.element_ty), mask=mask)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        tl.store(RSTD + row, rstd)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        _store(Y + cols, x * rstd * w, mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = cols < N
            x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                x = _round(x + tl.load(RES + cols, mask=mask, other=0.0).to(tl.float32), X.dtype.element_ty)
                tl.store(H + cols, x.to(H.dtype.element_ty), mask=mask)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
        tl.store(RSTD + row, rstd)
        for off in range(0, N, BLOCK_N):  # recompute h rather than read back this program's own store
            cols = off + tl.arange(0, BLOCK_N)
            mask = cols < N
            x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                x = _round(x + tl.load(RES + cols, mask=mask, other=0.0).to(tl.float32), X.dtype.element_ty)
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            _store(Y + cols, x * rstd * w, mask)


@_jit
def _ln_fwd_kernel(X, W, B, Y, MEAN, RSTD, stride, N, eps, ONE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per row: mean, then variance about the mean (two passes over the values: stable),
    then y. ONE_BLOCK: the row is read from memory once; else each pass walks it in blocks."""
    row = tl.program_id(0).to(tl.int64)
    X += row * stride
    Y += row * stride
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / N
        d = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / N + eps)
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        _store(Y + cols, d * rstd * w + b, mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            acc += tl.load(X + cols, mask=cols < N, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = cols < N
            d = tl.where(mask, tl.load(X + cols, mask=mask, other=0.0).to(tl.float32) - mean, 0.0)
            acc += d * d
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = cols < N
            x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
            _store(Y + cols, (x - mean) * rstd * w + b, mask)


@_jit
def _norm_bwd_fused_kernel(DY, X, W, MEAN, RSTD, DH, DX, DW_PART, DB_PART, stride, M, N, rows_per_program,
                           CENTERED: tl.constexpr, HAS_DH: tl.constexpr, HAS_DB: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    """Rows that fit one block (N <= BLOCK_N): program p takes rows [p·R, (p+1)·R), R = rows_per_program,
    and for each writes dx = r·(g − [<g>] − x̂·<g·x̂>) (+ dh) while summing dy·x̂ (and dy) over its rows in
    registers; row p of the partials gets the sums. dy and x are read from memory once for both dx
    and the weight gradient (the split dx + dw kernels below read them twice)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    acc_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for row in range(first, last):
        offs = row * stride + cols
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if CENTERED:
            xhat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
        else:
            xhat = x * rstd
        g = dy * w  # 0 off the row
        dx = g - xhat * (tl.sum(g * xhat, axis=0) / N)
        if CENTERED:
            dx -= tl.sum(g, axis=0) / N
        dx *= rstd
        if HAS_DH:
            dx += tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        _store(DX + offs, dx, mask)
        acc_w += dy * xhat
        if HAS_DB:
            acc_b += dy
    tl.store(DW_PART + pid * N + cols, acc_w, mask=mask)
    if HAS_DB:
        tl.store(DB_PART + pid * N + cols, acc_b, mask=mask)


@_jit
def _norm_bwd_dx_kernel(DY, X, W, MEAN, RSTD, DH, DX, stride, N,
                        CENTERED: tl.constexpr, HAS_DH: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per row: dx = r·(g − [<g>] − x̂·<g·x̂>) (+ dh); CENTERED: LayerNorm, else RMSNorm."""
    row = tl.program_id(0).to(tl.int64)
    DY += row * stride
    X += row * stride
    DH += row * stride
    DX += row * stride
    rstd = tl.load(RSTD + row)
    mean = tl.load(MEAN + row) if CENTERED else 0.0
    sum_gxhat = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32) * w
        sum_gxhat += g * (x - mean) * rstd  # g is 0 off the row: no mask needed
        if CENTERED:
            sum_g += g
    c_gxhat = tl.sum(sum_gxhat, axis=0) / N
    c_g = tl.sum(sum_g, axis=0) / N if CENTERED else 0.0
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32) * w
        dx = (g - c_g - (x - mean) * rstd * c_gxhat) * rstd
        if HAS_DH:
            dx += tl.load(DH + cols, mask=mask, other=0.0).to(tl.float32)
        _store(DX + cols, dx, mask)


@_jit
def _norm_bwd_dw_kernel(DY, X, MEAN, RSTD, DW_PART, DB_PART, stride, M, N,
                        CENTERED: tl.constexpr, HAS_DB: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (column block, row group g) writes Σ_{rows of g} dy·x̂ (and Σ dy) into row g of the partials."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    groups = tl.num_programs(1)
    col_mask = cols < N
    acc_w = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(group * BLOCK_M, M, groups * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * stride + cols[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)  # 0 off the tile: no other masks
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        if CENTERED:
            x -= tl.load(MEAN + rows, mask=row_mask, other=0.0)[:, None]
        acc_w += dy * x * rstd[:, None]
        if HAS_DB:
            acc_b += dy
    tl.store(DW_PART + group * N + cols, tl.sum(acc_w, axis=0), mask=col_mask)
    if HAS_DB:
        tl.store(DB_PART + group * N + cols, tl.sum(acc_b, axis=0), mask=col_mask)


# compiled kernels (triton.jit's JITFunction) or the interpreter's stand-ins
_INTERPRETED = triton is not None and not isinstance(_rms_fwd_kernel, triton.runtime.JITFunction)
_INTERPRETED_LIBRARY = triton is not None and not isinstance(tl.zeros, triton.runtime.JITFunction)


# ---- host wrappers of the kernels (2-d contiguous (M, N) tensors in, as _rows makes) -------
def _triton_rms_fwd(x2: Tensor, res2: Tensor | None, weight: Tensor, eps: float):
    m, n = x2.shape
    weight = weight.contiguous()
    y = torch.empty_like(x2)
    h = torch.empty_like(x2) if res2 is not None else y  # y stands in for absent pointers: never touched
    rstd = torch.empty(m, dtype=torch.float32, device=x2.device)
    if m:
        block, warps = _launch_config(n)
        _rms_fwd_kernel[(m,)](x2, res2 if res2 is not None else x2, weight, y, h, rstd, x2.stride(0), n, eps,
                              HAS_RES=res2 is not None, ONE_BLOCK=n <= block, BLOCK_N=block, num_warps=warps)
    return y, h, rstd


def _triton_ln_fwd(x2: Tensor, weight: Tensor, bias: Tensor, eps: float):
    m, n = x2.shape
    weight, bias = weight.contiguous(), bias.contiguous()
    y = torch.empty_like(x2)
    mean = torch.empty(m, dtype=torch.float32, device=x2.device)
    rstd = torch.empty_like(mean)
    if m:
        block, warps = _launch_config(n)
        _ln_fwd_kernel[(m,)](x2, weight, bias, y, mean, rstd, x2.stride(0), n, eps, ONE_BLOCK=n <= block,
                             BLOCK_N=block, num_warps=warps)
    return y, mean, rstd


def _triton_bwd(dy2: Tensor, x2: Tensor, weight: Tensor, mean: Tensor | None, rstd: Tensor,
                dh2: Tensor | None = None, with_db: bool = False):
    """(dx, dw, db or None) for the row stats given; mean None means RMSNorm.

    Rows that fit one block: one kernel, each program a run of rows, dx written and the weight
    gradient summed in registers as it goes (dy, x read once). Wider rows: a dx kernel walking the
    row in blocks, then the tiled weight-gradient kernel (dy, x read again)."""
    m, n = x2.shape
    weight = weight.contiguous()
    dx = torch.empty_like(x2)
    one_block, block, warps, groups, per = _bwd_layout(m, n, x2.device)
    # every (group, column) is written when rows exist (each group gets at least one row or row tile)
    alloc = torch.empty if m else torch.zeros
    dw_part = alloc(groups, n, dtype=torch.float32, device=x2.device)
    db_part = alloc(groups, n, dtype=torch.float32, device=x2.device) if with_db else dw_part
    if m:
        centered = mean is not None
        stat = mean if centered else rstd  # stands in for the absent mean: never read
        dh = dh2 if dh2 is not None else dy2  # likewise for the absent dh
        if one_block:
            _norm_bwd_fused_kernel[(groups,)](
                dy2, x2, weight, stat, rstd, dh, dx, dw_part, db_part, x2.stride(0), m, n, per,
                CENTERED=centered, HAS_DH=dh2 is not None, HAS_DB=with_db, BLOCK_N=block, num_warps=warps)
        else:
            _norm_bwd_dx_kernel[(m,)](dy2, x2, weight, stat, rstd, dh, dx, x2.stride(0), n, CENTERED=centered,
                                      HAS_DH=dh2 is not None, BLOCK_N=block, num_warps=warps)
            _norm_bwd_dw_kernel[(triton.cdiv(n, _DW_BLOCK_N), groups)](
                dy2, x2, stat, rstd, dw_part, db_part, x2.stride(0), m, n, CENTERED=centered, HAS_DB=with_db,
                BLOCK_M=_DW_BLOCK_M, BLOCK_N=_DW_BLOCK_N, num_warps=4)
    dw = dw_part.sum(0).to(weight.dtype)
    return dx, dw, db_part.sum(0).to(weight.dtype) if with_db else None


# ---- plain PyTorch references (fp32 inside, like the kernels) -----------------------------
def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """(y, rstd): y = x·rsqrt(<x²> + eps)·w in fp32, cast to x's dtype; rstd of shape x.shape[:-1]."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return (xf * rstd.unsqueeze(-1) * weight.float()).to(x.dtype), rstd


def layer_norm_reference(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd): y = (x − μ)·rsqrt(var + eps)·w + b in fp32 (biased variance), cast to x's dtype."""
    xf = x.float()
    mean = xf.mean(-1)
    rstd = torch.rsqrt((xf - mean.unsqueeze(-1)).pow(2).mean(-1) + eps)
    y = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1) * weight.float() + bias.float()
    return y.to(x.dtype), mean, rstd


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor,
                           eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """(h, y, rstd): h = x + residual, (y, rstd) = rms_norm_reference(h)."""
    h = x + residual
    return (h, *rms_norm_reference(h, weight, eps))


def _norm_backward_reference(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor | None, rstd: Tensor):
    """(dx, dw, db) by the formulas of the module docstring, fp32; mean None means RMSNorm."""
    n = x.shape[-1]
    r = rstd.unsqueeze(-1)
    xhat = (x.float() - (mean.unsqueeze(-1) if mean is not None else 0.0)) * r
    dyf = dy.float()
    g = dyf * weight.float()
    dx = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if mean is not None:
        dx = dx - g.mean(-1, keepdim=True)
    sum_rows = lambda t: t.reshape(-1, n).sum(0).to(weight.dtype)
    return dx * r, sum_rows(dyf * xhat), sum_rows(dyf)


# ---- custom ops ----------------------------------------------------------------------------
@torch.library.custom_op("mcompile::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    _check("rms_norm", x, weight)
    if not uses_triton(x.device):
        y, rstd = rms_norm_reference(x.contiguous(), weight, eps)
        return y, rstd
    y, _, rstd = _triton_rms_fwd(_rows(x), None, weight, eps)
    return y.view(x.shape), rstd.view(x.shape[:-1])


@_rms_norm.register_fake
def _(x, weight, eps):
    _check("rms_norm", x, weight)
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("mcompile::rms_norm_backward", mutates_args=())
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    if not uses_triton(x.device):
        dx, dw, _ = _norm_backward_reference(dy, x, weight, None, rstd)
        return dx.to(x.dtype).contiguous(), dw
    dx, dw, _ = _triton_bwd(_rows(dy), _rows(x), weight, None, rstd.contiguous())
    return dx.view(x.shape), dw


@_rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.mcompile.rms_norm_backward(dy, x, weight, rstd)
    return dx, dw, None


torch.library.register_autograd("mcompile::rms_norm", _rms_backward, setup_context=_rms_setup)


@torch.library.custom_op("mcompile::layer_norm", mutates_args=())
def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    _check("layer_norm", x, weight, bias)
    if not uses_triton(x.device):
        y, mean, rstd = layer_norm_reference(x.contiguous(), weight, bias, eps)
        return y, mean, rstd
    y, mean, rstd = _triton_ln_fwd(_rows(x), weight, bias, eps)
    return y.view(x.shape), mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])


@_layer_norm.register_fake
def _(x, weight, bias, eps):
    _check("layer_norm", x, weight, bias)
    stat = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape), stat, torch.empty_like(stat)


@torch.library.custom_op("mcompile::layer_norm_backward", mutates_args=())
def _layer_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor,
                         rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if not uses_triton(x.device):
        dx, dw, db = _norm_backward_reference(dy, x, weight, mean, rstd)
        return dx.to(x.dtype).contiguous(), dw, db
    dx, dw, db = _triton_bwd(_rows(dy), _rows(x), weight, mean.contiguous(), rstd.contiguous(), with_db=True)
    return dx.view(x.shape), dw, db


@_layer_norm_backward.register_fake
def _(dy, x, weight, mean, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _ln_setup(ctx, inputs, output):
    x, weight, _, _ = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])


def _ln_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.mcompile.layer_norm_backward(dy, x, weight, mean, rstd)
    return dx, dw, db, None


torch.library.register_autograd("mcompile::layer_norm", _ln_backward, setup_context=_ln_setup)


@torch.library.custom_op("mcompile::add_rms_norm", mutates_args=())
def _add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    _check("add_rms_norm", x, weight)
    _check_residual(x, residual)
    if not uses_triton(x.device):
        h, y, rstd = add_rms_norm_reference(x.contiguous(), residual.contiguous(), weight, eps)
        return h, y, rstd
    y, h, rstd = _triton_rms_fwd(_rows(x), _rows(residual), weight, eps)
    return h.view(x.shape), y.view(x.shape), rstd.view(x.shape[:-1])


def _check_residual(x: Tensor, residual: Tensor) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}; cast or broadcast it before the call")


@_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    _check("add_rms_norm", x, weight)
    _check_residual(x, residual)
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("mcompile::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward(dh: Tensor, dy: Tensor, h: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    if not uses_triton(h.device):
        dx, dw, _ = _norm_backward_reference(dy, h, weight, None, rstd)
        return (dx + dh.float()).to(h.dtype).contiguous(), dw
    dx, dw, _ = _triton_bwd(_rows(dy), _rows(h), weight, None, rstd.contiguous(), dh2=_rows(dh))
    return dx.view(h.shape), dw


@_add_rms_norm_backward.register_fake
def _(dh, dy, h, weight, rstd):
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


def _add_rms_setup(ctx, inputs, output):
    ctx.save_for_backward(output[0], inputs[2], output[2])  # h, weight, rstd


def _add_rms_backward(ctx, dh, dy, _drstd):  # autograd passes zeros, never None, for an unused output
    h, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.mcompile.add_rms_norm_backward(dh, dy, h, weight, rstd)
    return dx, dx, dw, None  # h = x + residual: both get dh's total


torch.library.register_autograd("mcompile::add_rms_norm", _add_rms_backward, setup_context=_add_rms_setup)


# ---- public functions ----------------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim: x·rsqrt(mean(x²) + eps)·weight, in x's dtype."""
    return torch.ops.mcompile.rms_norm(x, weight, eps)[0]


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim with weight and bias, as torch.nn.functional.layer_norm, in x's dtype."""
    return torch.ops.mcompile.layer_norm(x, weight, bias, eps)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """(h, y): h = x + residual (the new residual stream) and y = rms_norm(h, weight, eps), in one kernel."""
    h, y, _ = torch.ops.mcompile.add_rms_norm(x, residual, weight, eps)
    return h, y
