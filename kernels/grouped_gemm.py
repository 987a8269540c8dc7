"""Grouped GEMM over contiguous row groups (MoE experts), a Triton kernel beside its PyTorch path.

x (N, a), w (G, a, b), offs (G,) integer cumulative group ends (non-decreasing, ``offs[-1] == N``, empty
groups allowed; not checked: a check would sync the device) -> out (N, b)::

    out[r] = x[r] @ w[g]          for the rows r of group g: offs[g-1] <= r < offs[g]   (0 <= r < offs[0] for g = 0)
    dx[r]  = grad[r] @ w[g]^T                       (the same grouped GEMM, against w transposed)
    dw[g]  = x_g^T @ grad_g = Σ_{r in g} x[r]^T grad[r]      (zeros for an empty group; offs: no gradient)

``torch.ops.mcompile.grouped_mm`` is a ``torch.library.custom_op`` with a fake implementation and a
backward registered through ``torch.library.register_autograd`` whose work is the custom op
``mcompile::grouped_mm_backward`` returning (dx, dw), so ``torch.export`` and AOTAutograd see one node
forward and one backward (DESIGN §5), as kernels/activations.py does. The kernels take fp32, bf16 and
fp16 (other dtypes take the PyTorch path), accumulate in fp32 and store in the input's dtype (fp32
products in IEEE fp32, not TF32).

Kernels (the blocking of the Triton matrix-multiplication tutorial, grouped the way MegaBlocks'
block-sparse expert GEMMs and CUTLASS's grouped GEMM map tiles to problems — Gale et al. 2022,
"MegaBlocks: Efficient Sparse Training with Mixture-of-Experts"):

* ``_grouped_mm_kernel`` — out = x @ w[g] per group, and dx = grad @ w[g]^T through w's strides (a
  transposed view, no copy). One program per (row tile, column tile). Group g holds
  T_g = ceil(n_g / BLOCK_M) row tiles; row tile t belongs to the group g with
  Σ_{h<g} T_h <= t < Σ_{h<=g} T_h and starts at row offs[g-1] + (t - Σ_{h<g} T_h) BLOCK_M. A small
  table of (group, first row) per tile is computed from offs with torch ops on the tensors' device
  (cumsum, searchsorted: no device sync, :func:`_tile_table`). Σ_g T_g <= ceil(N / BLOCK_M) + G, which
  is the grid's row extent; the programs past the last real tile (group G in the table) do nothing.
  (A prefix sum over offs inside every program, with ``tl.cumsum``, avoids the table, but each reduction
  is a slow call in Triton's interpreter: the kernel tests ran several times slower.)
* ``_grouped_mm_dw_kernel`` — dw[g] = x_g^T @ grad_g: one program per (a tile, b tile, group), reducing
  over the group's rows in steps of BLOCK_R (an empty group stores its zero accumulator).

Dispatch (:func:`grouped_mm_path` says which, for a device, dtype and shape):

* ``"torch._grouped_mm"`` — PyTorch's CUTLASS grouped GEMM, on CUDA where it is a tuned kernel: bf16
  (inputs and output), compute capability 9.x or 10.x, fewer than 1024 groups, a and b multiples of 8
  (16 bytes) and every operand laid out on 16-byte aligned strides. That is the fast path of
  ``_grouped_mm_cuda`` (aten/src/ATen/native/cuda/GroupedBlas.cpp: ``_scaled_mm_allowed_device(sm90_only,
  sm100_only)`` and bf16; the kernel refuses 1024 groups or more, and its TMA loads need the 16-byte
  strides ``_grouped_mm`` checks). Elsewhere torch's ``_grouped_mm`` falls back to a loop over the groups
  that reads ``offs`` on the host (a device sync per call), and padding unaligned widths would copy every
  expert's weight on each call: the Triton kernels take those. torch 2.11 and 2.13 both have
  ``torch._grouped_mm`` (and ``torch.nn.functional.grouped_mm``) with this signature, ``(mat_a, mat_b,
  offs=None, bias=None, out_dtype=None)``, offs int32 group ends. Forward (2-d x 3-d), dx (against w
  transposed: a view) and dw (2-d x 2-d, the groups along the reduction) are each one call.
* ``"triton"`` — the kernels above: CUDA tensors otherwise (fp32, bf16, fp16), and CPU tensors when this
  module was imported under Triton's interpreter switch ``TRITON_INTERPRET=1`` (correctness only,
  DESIGN §8).
* ``"reference"`` — :func:`grouped_mm_reference`, loop-free over the groups: ``torch._grouped_mm`` where
  it runs (CPU: fp32, bf16, fp16; CUDA: as above), with a and b zero-padded to its 16-byte stride alignment
  (zeros add nothing to a product), else one padded ``torch.bmm`` over (G, capacity, ·) groups (capacity =
  the largest group: one device sync; a fallback for fp64, or a GPU without Triton).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcompile.kernels._triton import jit as _jit
from mcompile.kernels._triton import runs_triton, tl, triton

__all__ = ["uses_triton", "grouped_mm_path", "grouped_mm", "grouped_mm_reference", "grouped_mm_torch",
           "experts_mm"]

# Tiles of the forward/dx kernel (rows x output columns x reduction) and of the dw kernel (a x b x rows).
# 64 rows: MoE groups are often a few hundred tokens, so taller tiles waste more of a group's last tile.
# Not tuned on a GPU yet: sized from the Triton matmul tutorial's Hopper configurations and checked for
# registers and spills by bench/kernels_sm90.py.
_BLOCK_M, _BLOCK_N, _BLOCK_K = 64, 128, 64
_BLOCK_A, _BLOCK_B, _BLOCK_R = 64, 128, 64
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch._grouped_mm takes on CPU
_KERNEL_DTYPES = _NATIVE_DTYPES  # what the kernels' tl.dot takes


def uses_triton(device: torch.device | str) -> bool:
    """Whether the ops can run their Triton kernels for tensors on ``device`` (:func:`grouped_mm_path` says
    which path a call takes)."""
    return runs_triton(device, _INTERPRETED)


_CUTLASS_GROUPS = 1024  # torch's bf16 grouped kernel: "Can't process more than 1024 groups" (GroupMM.cu)


def _cuda_grouped_mm(dtype: torch.dtype, capability: tuple[int, int], groups: int) -> bool:
    """torch._grouped_mm runs its CUTLASS kernel (not its host-syncing loop) for ``dtype`` on a CUDA device
    of ``capability`` (module docstring)."""
    return (hasattr(torch, "_grouped_mm") and torch.version.hip is None and dtype == torch.bfloat16
            and capability[0] in (9, 10) and groups < _CUTLASS_GROUPS)


def grouped_mm_path(device: torch.device | str, dtype: torch.dtype, a: int, b: int, groups: int, *,
                    capability: tuple[int, int] | None = None, aligned: bool = True) -> str:
    """Which implementation :func:`grouped_mm` runs for x (N, a), w (groups, a, b) of ``dtype`` on
    ``device``: ``"torch._grouped_mm"``, ``"triton"`` or ``"reference"`` (module docstring).
    ``capability``: the CUDA device's (read from the device when None); ``aligned``: the operands' start
    and strides are 16-byte aligned (what :func:`_path` reads off real tensors)."""
    device = torch.device(device)
    if device.type == "cuda":
        cap = capability if capability is not None else torch.cuda.get_device_capability(device)
        align = 16 // dtype.itemsize
        if _cuda_grouped_mm(dtype, cap, groups) and aligned and a % align == 0 and b % align == 0:
            return "torch._grouped_mm"
    if runs_triton(device, _INTERPRETED) and dtype in _KERNEL_DTYPES:
        return "triton"
    return "reference"


def _aligned(t: torch.Tensor) -> bool:
    """``t``'s matrices sit on 16-byte aligned strides, as torch._grouped_mm's kernel reads them."""
    align = 16 // t.element_size()
    return _strides_ok(t) and all(s % align == 0 for s in t.stride()[:-2])


def _path(x: torch.Tensor, w: torch.Tensor) -> str:
    return grouped_mm_path(x.device, x.dtype, w.shape[1], w.shape[2], w.shape[0],
                           aligned=x.device.type != "cuda" or (_aligned(x) and _aligned(w)))


# ---- checks -----------------------------------------------------------------------------------
def _check(x, w, offs):
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"mcompile::grouped_mm needs x (N, a) and w (G, a, b); got x {tuple(x.shape)}, w {tuple(w.shape)} "
            "(flatten the tokens to rows; a stacked nn.Linear weight (G, b, a) is passed as w.transpose(1, 2))"
        )
    if offs.ndim != 1 or offs.shape[0] != w.shape[0] or offs.dtype.is_floating_point or offs.dtype == torch.bool:
        raise ValueError(
            f"mcompile::grouped_mm needs offs of integer dtype and shape (G,) = ({w.shape[0]},), the cumulative "
            f"row count at the end of each group; got {offs.dtype} {tuple(offs.shape)} "
            "(offs = torch.cumsum(rows_per_group, 0))"
        )
    if x.dtype != w.dtype or x.device != w.device or offs.device != x.device:
        raise ValueError(
            f"mcompile::grouped_mm needs x, w and offs on one device and x, w of one dtype; got x {x.dtype} "
            f"{x.device}, w {w.dtype} {w.device}, offs {offs.device}"
        )


def _empty(x, w) -> bool:
    return x.shape[0] == 0 or w.shape[0] == 0 or w.shape[1] == 0 or w.shape[2] == 0


# ---- PyTorch path -----------------------------------------------------------------------------
def _native_ok(t: torch.Tensor, groups: int) -> bool:
    """torch._grouped_mm runs for tensors like ``t`` (its dtype on its device), over ``groups`` groups,
    without a device sync (CUDA: its CUTLASS kernel, module docstring)."""
    if not hasattr(torch, "_grouped_mm") or t.dtype not in _NATIVE_DTYPES:
        return False
    if t.device.type == "cuda":
        return _cuda_grouped_mm(t.dtype, torch.cuda.get_device_capability(t.device), groups)
    return t.device.type == "cpu"


def _strides_ok(t: torch.Tensor) -> bool:
    """torch._grouped_mm's layout rule: a 16-byte aligned start, one of the two matrix dims of unit stride
    and the other's stride a multiple of 16 bytes."""
    align = 16 // t.element_size()
    (rows, cols), (s_rows, s_cols) = t.shape[-2:], t.stride()[-2:]
    if t.data_ptr() % 16:
        return False
    if s_cols == 1 and s_rows >= max(1, cols):
        return s_rows % align == 0
    if s_rows == 1 and s_cols >= max(1, rows):
        return s_cols % align == 0
    return False


def _padded(t: torch.Tensor, pads: tuple[int, ...]) -> torch.Tensor:
    """``t`` zero-padded at the end of its last dims (F.pad order), in a layout torch._grouped_mm takes."""
    if any(pads):
        return F.pad(t, pads)
    return t if _strides_ok(t) else t.clone(memory_format=torch.contiguous_format)


def _native_operands(x, w, grad=None):
    """x (N, a_p), w (G, a_p, b_p) and grad (N, b_p), a and b zero-padded to 16 bytes."""
    align = 16 // x.element_size()
    pad_a, pad_b = -x.shape[1] % align, -w.shape[2] % align
    xp, wp = _padded(x, (0, pad_a)), _padded(w, (0, pad_b, 0, pad_a))
    return xp, wp, None if grad is None else _padded(grad, (0, pad_b))


def _bmm_layout(offs: torch.Tensor, n_rows: int):
    """(group, position in group) of every row and the padded group size: one device sync."""
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    rows = torch.arange(n_rows, device=offs.device)
    group = torch.searchsorted(ends, rows, right=True)  # (N,) the group row r lies in
    capacity = int((ends - starts).max())
    return group, rows - starts[group], capacity


def _scatter_rows(t, group, pos, n_groups, capacity):
    out = t.new_zeros(n_groups, capacity, t.shape[1])
    out[group, pos] = t
    return out  # (G, capacity, ·), zero rows past each group's end


def _native_mm(x, w, offs):
    """torch._grouped_mm, a and b padded where they are not aligned (a no-op where they are)."""
    xp, wp, _ = _native_operands(x, w)
    return torch._grouped_mm(xp, wp, offs=offs.to(torch.int32))[:, :w.shape[2]].contiguous()


def _native_mm_backward(grad, x, w, offs):
    a, b = w.shape[1:]
    offs32 = offs.to(torch.int32)
    xp, wp, gp = _native_operands(x, w, grad.to(x.dtype))
    dx = torch._grouped_mm(gp, wp.transpose(1, 2), offs=offs32)[:, :a]
    dw = torch._grouped_mm(xp.t(), gp, offs=offs32)[:, :a, :b]  # 2-d x 2-d: groups along the reduction
    return dx.contiguous(), dw.contiguous()


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The PyTorch path of :func:`grouped_mm`: ``torch._grouped_mm`` where it runs, else one padded bmm."""
    n, b = x.shape[0], w.shape[2]
    if _empty(x, w):
        return x.new_zeros(n, b)
    if _native_ok(x, w.shape[0]):
        return _native_mm(x, w, offs)
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 accumulation, fp64 kept
    group, pos, capacity = _bmm_layout(offs, n)
    xs = _scatter_rows(x.to(acc), group, pos, w.shape[0], capacity)
    return torch.bmm(xs, w.to(acc))[group, pos].to(x.dtype)


def _grouped_mm_backward_reference(grad, x, w, offs):
    a, b = w.shape[1:]
    if _empty(x, w):
        return x.new_zeros(x.shape), w.new_zeros(w.shape)
    if _native_ok(x, w.shape[0]):
        return _native_mm_backward(grad, x, w, offs)
    acc = torch.promote_types(x.dtype, torch.float32)
    group, pos, capacity = _bmm_layout(offs, x.shape[0])
    xs = _scatter_rows(x.to(acc), group, pos, w.shape[0], capacity)  # (G, capacity, a)
    gs = _scatter_rows(grad.to(acc), group, pos, w.shape[0], capacity)  # (G, capacity, b)
    dx = torch.bmm(gs, w.to(acc).transpose(1, 2))[group, pos]
    dw = torch.bmm(xs.transpose(1, 2), gs)  # padding rows are zero: they add nothing
    return dx.to(x.dtype), dw.to(w.dtype)


# ---- kernels ----------------------------------------------------------------------------------
@_jit
def _grouped_mm_kernel(x_ptr, w_ptr, out_ptr, offs_ptr, tiles_ptr, n_tiles, n_groups, n_cols, k_dim,
                       stride_xm, stride_xk, stride_wg, stride_wk, stride_wn, stride_om,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[rows of g] = x[rows of g] @ w[g] for row tile program_id(0), column tile program_id(1); the
    row tile's group and first row are entries program_id(0) and n_tiles + program_id(0) of the table."""
    tile = tl.program_id(0)
    group = tl.load(tiles_ptr + tile)
    if group < n_groups:  # else: a program past the last real tile (the grid is an upper bound)
        row_end = tl.load(offs_ptr + group)
        rows = tl.load(tiles_ptr + n_tiles + tile) + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows = rows.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        w_base = w_ptr + group.to(tl.int64) * stride_wg
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_dim
            xt = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_base + ks[:, None].to(tl.int64) * stride_wk + cols[None, :] * stride_wn,
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter only: see _upcast
                xt, wt = xt.to(tl.float32), wt.to(tl.float32)
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@_jit
def _grouped_mm_dw_kernel(x_ptr, g_ptr, dw_ptr, offs_ptr, k_dim, n_cols, stride_xm, stride_xk, stride_gm,
                          PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_A: tl.constexpr,
                          BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr):
    """dw[g, a tile, b tile] = Σ over the rows r of g of x[r, a tile]^T grad[r, b tile]; dw contiguous."""
    group = tl.program_id(2)
    row_start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0)
    row_end = tl.load(offs_ptr + group)
    ks = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    cols = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    k_ok, col_ok = ks < k_dim, cols < n_cols
    acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < row_end
        rows = rows.to(tl.int64)
        xt = tl.load(x_ptr + rows[None, :] * stride_xm + ks[:, None] * stride_xk,
                     mask=k_ok[:, None] & row_ok[None, :], other=0.0)  # (BLOCK_A, BLOCK_R) of x_g^T
        gt = tl.load(g_ptr + rows[:, None] * stride_gm + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # (BLOCK_R, BLOCK_B)
        if UPCAST:
            xt, gt = xt.to(tl.float32), gt.to(tl.float32)
        acc = tl.dot(xt, gt, acc, input_precision=PRECISION)
    out = dw_ptr + group.to(tl.int64) * k_dim * n_cols + ks[:, None].to(tl.int64) * n_cols + cols[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


_INTERPRETED = type(_grouped_mm_kernel).__name__ == "InterpretedFunction"
# apart from _INTERPRETED, which bench/kernels_sm90.py sets to record launches on CPU tensors for the compiler
_INTERPRETER_DOT = _INTERPRETED


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 as torch.mm computes it; ignored for bf16/fp16


def _upcast(dtype: torch.dtype) -> bool:
    """Whether the kernels cast their bf16/fp16 tiles to fp32 before ``tl.dot``: in Triton's interpreter
    only, whose dot multiplies bf16 tiles as the uint16 bit patterns it stores them in (3.9). Exact: a
    product of two bf16 (or fp16) values is exact in fp32, so the fp32 dot is the tensor cores' bf16 x bf16
    -> fp32 accumulate up to the order of the sums. Compiled kernels keep the 16-bit tensor-core dot."""
    return _INTERPRETER_DOT and dtype != torch.float32


def _tile_table(offs32: torch.Tensor, n_rows: int) -> torch.Tensor:
    """(2, T) int32: the group and the first row of each of the T = ceil(N / BLOCK_M) + G row tiles (an
    upper bound on Σ_g ceil(n_g / BLOCK_M)); tiles past the last real one get group G. Torch ops on
    offs' device, no sync."""
    n_groups = offs32.shape[0]
    starts = torch.cat([offs32.new_zeros(1), offs32[:-1]])
    tile_ends = torch.cumsum(torch.div(offs32 - starts + _BLOCK_M - 1, _BLOCK_M, rounding_mode="floor"), 0)
    tiles = torch.arange(triton.cdiv(n_rows, _BLOCK_M) + n_groups, device=offs32.device, dtype=torch.int32)
    group = torch.searchsorted(tile_ends.to(torch.int32), tiles, right=True, out_int32=True)
    safe = group.clamp(max=n_groups - 1)
    first_tile = tile_ends[safe] - (tile_ends - torch.cat([tile_ends.new_zeros(1), tile_ends[:-1]]))[safe]
    first_row = starts[safe] + (tiles - first_tile) * _BLOCK_M
    return torch.stack([group, first_row.to(torch.int32)]).contiguous()


def _launch_mm(x, w, offs32, out):
    """out = grouped x @ w through their strides (w may be a transposed view)."""
    n_groups, k_dim, n_cols = w.shape
    tiles = _tile_table(offs32, x.shape[0])
    n_tiles = tiles.shape[1]
    _grouped_mm_kernel[(n_tiles, triton.cdiv(n_cols, _BLOCK_N))](
        x, w, out, offs32, tiles, n_tiles, n_groups, n_cols, k_dim, x.stride(0), x.stride(1), w.stride(0),
        w.stride(1), w.stride(2), out.stride(0), PRECISION=_precision(x.dtype), UPCAST=_upcast(x.dtype),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K)
    return out


# ---- ops --------------------------------------------------------------------------------------
@torch.library.custom_op("mcompile::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[r] = x[r] @ w[g] for the rows r of group g (rows offs[g-1]:offs[g]); x (N, a), w (G, a, b),
    offs (G,) cumulative group ends -> (N, b) in x's dtype. See the module docstring."""
    _check(x, w, offs)
    path = "reference" if _empty(x, w) else _path(x, w)
    if path == "torch._grouped_mm":
        return _native_mm(x, w, offs)
    if path == "reference":
        return grouped_mm_reference(x, w, offs)
    out = torch.empty((x.shape[0], w.shape[2]), dtype=x.dtype, device=x.device)
    return _launch_mm(x, w, offs.to(torch.int32).contiguous(), out)


@grouped_mm.register_fake
def _grouped_mm_fake(x, w, offs):
    _check(x, w, offs)
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("mcompile::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of grouped_mm for the output gradient ``grad`` (N, b): dx = grad @ w[g]^T per group,
    dw[g] = x_g^T @ grad_g (zeros for an empty group)."""
    path = "reference" if _empty(x, w) else _path(x, w)
    if path == "torch._grouped_mm":
        return _native_mm_backward(grad, x, w, offs)
    if path == "reference":
        return _grouped_mm_backward_reference(grad, x, w, offs)
    offs32 = offs.to(torch.int32).contiguous()
    grad = grad.to(x.dtype).contiguous()
    dx = _launch_mm(grad, w.transpose(1, 2), offs32, torch.empty_like(x, memory_format=torch.contiguous_format))
    n_groups, k_dim, n_cols = w.shape
    dw = torch.empty((n_groups, k_dim, n_cols), dtype=w.dtype, device=w.device)
    grid = (triton.cdiv(k_dim, _BLOCK_A), triton.cdiv(n_cols, _BLOCK_B), n_groups)
    _grouped_mm_dw_kernel[grid](x, grad, dw, offs32, k_dim, n_cols, x.stride(0), x.stride(1), grad.stride(0),
                                PRECISION=_precision(x.dtype), UPCAST=_upcast(x.dtype), BLOCK_A=_BLOCK_A,
                                BLOCK_B=_BLOCK_B, BLOCK_R=_BLOCK_R)
    return dx, dw


@grouped_mm_backward.register_fake
def _grouped_mm_backward_fake(grad, x, w, offs):
    fmt = torch.contiguous_format
    return torch.empty_like(x, memory_format=fmt), torch.empty_like(w, memory_format=fmt)


def _grouped_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_bwd(ctx, grad):
    x, w, offs = ctx.saved_tensors
    dx, dw = grouped_mm_backward(grad, x, w, offs)
    return dx, dw, None


torch.library.register_autograd("mcompile::grouped_mm", _grouped_mm_bwd, setup_context=_grouped_mm_setup)


# ---- the PyTorch path as its own op -------------------------------------------------------------
# The MoE runtime (mcompile/ir/moe.py) runs the local experts through these on CPU: the same loop-free
# PyTorch path (torch._grouped_mm, padded), never Triton's interpreter, whose launches are not
# thread-safe (the in-process simulator runs ranks as threads) and which is for correctness tests only.
@torch.library.custom_op("mcompile::grouped_mm_torch", mutates_args=())
def grouped_mm_torch(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm` on its PyTorch path only (:func:`grouped_mm_reference`); differentiated through
    :func:`experts_mm`."""
    _check(x, w, offs)
    return grouped_mm_reference(x, w, offs)


grouped_mm_torch.register_fake(_grouped_mm_fake)


@torch.library.custom_op("mcompile::grouped_mm_torch_backward", mutates_args=())
def grouped_mm_torch_backward(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _grouped_mm_backward_reference(grad, x, w, offs)


grouped_mm_torch_backward.register_fake(_grouped_mm_backward_fake)


class _ExpertsMM(torch.autograd.Function):
    """The ops above as an autograd.Function that ``torch.func`` transforms take (a custom op's registered
    autograd is not one): the MoE runtime differentiates its local experts with ``torch.func.vjp``."""

    @staticmethod
    def forward(x, w, offs, triton_op):
        return (grouped_mm if triton_op else grouped_mm_torch)(x, w, offs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, offs, ctx.triton_op = inputs
        ctx.save_for_backward(x, w, offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        dx, dw = (grouped_mm_backward if ctx.triton_op else grouped_mm_torch_backward)(grad, x, w, offs)
        return dx, dw, None, None


def experts_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM the MoE runtime runs its local experts with, differentiable (also under
    ``torch.func``): on CUDA :func:`grouped_mm` (``torch._grouped_mm`` where its CUTLASS kernel runs, the
    Triton kernels otherwise: :func:`grouped_mm_path`), the PyTorch path elsewhere (:func:`grouped_mm_torch`)."""
    return _ExpertsMM.apply(x, w, offs, x.device.type == "cuda")
