"""Fused activations: SwiGLU and GELU(x + bias), as Triton kernels beside their PyTorch references.

Each op is a ``torch.library.custom_op`` in the ``mcompile`` namespace with a fake implementation and a
backward registered through ``torch.library.register_autograd`` whose work is itself a custom op, so
``torch.export`` and AOTAutograd see one node forward and one node backward (DESIGN §5). Every kernel
loads its inputs, computes in fp32 and stores in the input's dtype (fp32 or bf16).

SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"; Llama's MLP ``silu(gate) * up``)::

    y  = silu(a) * b = a * σ(a) * b
    da = g * b * σ(a) * (1 + a * (1 - σ(a)))        # d silu(a)/da = σ(a) + a σ(a)(1 - σ(a))
    db = g * a * σ(a)

GELU with the bias folded in (Megatron-LM's ``bias_gelu`` fusion of the MLP's first bias add;
Hendrycks & Gimpel 2016 for GELU), u = x + bias::

    "none":  y = u Φ(u),                          dy/du = Φ(u) + u φ(u),  φ(u) = exp(-u²/2) / √(2π)
    "tanh":  y = ½ u (1 + t),  t = tanh(k (u + c u³)),  k = √(2/π), c = 0.044715
             dy/du = ½ (1 + t) + ½ u (1 - t²) k (1 + 3 c u²)
    dx = g * dy/du,   dbias = Σ_rows dx   (fp32 partial sums per group of rows, then one sum over groups:
                                         deterministic, as Apex's two-stage layer-norm weight gradient)

The kernel writes the tanh form through σ (tanh z = 2σ(2z) - 1, so ½(1 + t) = σ(2z) and
1 - t² = 4σ(2z)σ(-2z)): Triton's core language has σ but no tanh on every version we support (3.6 on
the GPU machine, 3.9 here), and the σ form avoids the cancellation in 1 - t² near |t| = 1.

Dispatch (the kernel layout follows the Triton tutorials' vector-add / fused-softmax blocking): Triton
on CUDA tensors, and on CPU tensors when this module was imported under Triton's interpreter switch
``TRITON_INTERPRET=1`` (Triton reads it when ``triton.jit`` runs; correctness only, DESIGN §8);
otherwise the PyTorch reference — so a CPU machine without the interpreter runs the same graph with
the same op nodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcompile.kernels._triton import jit as _jit
from mcompile.kernels._triton import pow2 as _pow2
from mcompile.kernels._triton import runs_triton, tl, triton

__all__ = [
    "uses_triton",
    "swiglu",
    "swiglu_reference",
    "gelu_bias",
    "gelu_bias_reference",
]

_BLOCK = 1024  # elements per program of the flat SwiGLU kernel
_TILE = 4096  # elements per program of the 2-d GELU kernels (BLOCK_M x BLOCK_D)
_MAX_BLOCK_D = 1024  # widest column block; wider rows take several programs along the columns
_MAX_GROUPS = 256  # row groups of the dbias reduction: partial sums in a (groups, d) fp32 buffer



def uses_triton(device: torch.device | str) -> bool:
    """Whether the ops run their Triton kernels for tensors on ``device`` (else the reference)."""
    return runs_triton(device, _INTERPRETED)



# ---- SwiGLU -----------------------------------------------------------------------------------
def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b, computed in fp32 and returned in a's dtype."""
    return (F.silu(a.float()) * b.float()).to(a.dtype)


def _swiglu_backward_reference(g, a, b):
    af, bf, gf = a.float(), b.float(), g.float()
    sig = torch.sigmoid(af)
    da = gf * bf * sig * (1 + af * (1 - sig))
    db = gf * af * sig
    return da.to(a.dtype), db.to(b.dtype)


@_jit
def _swiglu_fwd_kernel(a_ptr, b_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@_jit
def _swiglu_bwd_kernel(g_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    da = g * b * sig * (1.0 + a * (1.0 - sig))
    db = g * a * sig
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=mask)


def _check_swiglu(a, b):
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(
            f"mcompile::swiglu needs a and b of one shape, dtype and device; got {tuple(a.shape)} {a.dtype} "
            f"{a.device} and {tuple(b.shape)} {b.dtype} {b.device} (split the gate/up projection evenly)"
        )


@torch.library.custom_op("mcompile::swiglu", mutates_args=())
def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b (SwiGLU's gating), fp32 inside, output in a's dtype."""
    _check_swiglu(a, b)
    if not uses_triton(a.device) or a.numel() == 0:
        return swiglu_reference(a, b).contiguous()
    a, b = a.contiguous(), b.contiguous()
    y = torch.empty_like(a)
    n = a.numel()
    _swiglu_fwd_kernel[(triton.cdiv(n, _BLOCK),)](a, b, y, n, BLOCK=_BLOCK)
    return y


@swiglu.register_fake
def _(a, b):
    _check_swiglu(a, b)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.custom_op("mcompile::swiglu_backward", mutates_args=())
def swiglu_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) of swiglu for the output gradient ``grad``."""
    if not uses_triton(a.device) or a.numel() == 0:
        return tuple(t.contiguous() for t in _swiglu_backward_reference(grad, a, b))
    grad, a, b = grad.contiguous(), a.contiguous(), b.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    _swiglu_bwd_kernel[(triton.cdiv(n, _BLOCK),)](grad, a, b, da, db, n, BLOCK=_BLOCK)
    return da, db


@swiglu_backward.register_fake
def _(grad, a, b):
    fmt = torch.contiguous_format
    return torch.empty_like(a, memory_format=fmt), torch.empty_like(b, memory_format=fmt)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_bwd(ctx, grad):
    a, b = ctx.saved_tensors
    return swiglu_backward(grad, a, b)


torch.library.register_autograd("mcompile::swiglu", _swiglu_bwd, setup_context=_swiglu_setup)


_INTERPRETED = type(_swiglu_fwd_kernel).__name__ == "InterpretedFunction"


# ---- GELU(x + bias) ---------------------------------------------------------------------------
_APPROXIMATE = ("none", "tanh")


def gelu_bias_reference(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias) as torch computes it, in fp32, returned in x's dtype."""
    return F.gelu(x.float() + bias.float(), approximate=approximate).to(x.dtype)


def _gelu_bias_backward_reference(g, x, bias, approximate):
    u = x.float() + bias.float()
    dx = torch.ops.aten.gelu_backward(g.float(), u, approximate=approximate)
    return dx.to(x.dtype), dx.reshape(-1, x.shape[-1]).sum(0).to(bias.dtype)


@_jit
def _gelu(u, TANH: tl.constexpr):
    """(gelu(u), d gelu / du) in fp32."""
    if TANH:
        # with z = k (u + c u³) and s = σ(2z): 1 + t = 2s and 1 - t² = 4 s σ(-2z), free of the cancellation
        # that 1 - t*t suffers where t is close to ±1; k = sqrt(2 / pi), c = 0.044715
        z2 = 2.0 * 0.7978845608028654 * (u + 0.044715 * u * u * u)
        s = tl.sigmoid(z2)
        y = u * s
        dy = s + 2.0 * u * s * tl.sigmoid(-z2) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * u * u)
    else:
        cdf = 0.5 * (1.0 + tl.erf(u * 0.7071067811865476))  # Φ(u), 1/sqrt(2)
        y = u * cdf
        dy = cdf + u * tl.exp(-0.5 * u * u) * 0.3989422804014327  # φ(u), 1/sqrt(2 pi)
    return y, dy


@_jit
def _gelu_bias_fwd_kernel(x_ptr, bias_ptr, y_ptr, n_rows, n_cols, TANH: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
    y, _ = _gelu(u, TANH)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@_jit
def _gelu_bias_bwd_kernel(g_ptr, x_ptr, bias_ptr, dx_ptr, dbias_part_ptr, n_rows, n_cols, TANH: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (group, column block) walks row blocks group, group + groups, ... and writes its share of
    dbias to row ``group`` of the (groups, d) partial buffer; the host sums the groups in fp32."""
    group, groups = tl.program_id(0), tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < n_cols
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    for first in range(group * BLOCK_M, n_rows, groups * BLOCK_M):
        rows = first + tl.arange(0, BLOCK_M).to(tl.int64)
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        _, dy = _gelu(u, TANH)
        dx = g * dy  # masked lanes loaded g = 0: they add nothing to the bias sum
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        acc += tl.sum(dx, axis=0)
    tl.store(dbias_part_ptr + group.to(tl.int64) * n_cols + cols, acc, mask=col_ok)


def _check_gelu_bias(x, bias, approximate):
    if approximate not in _APPROXIMATE:
        raise ValueError(f"mcompile::gelu_bias: approximate={approximate!r}; use one of {_APPROXIMATE}")
    if x.ndim < 1 or bias.ndim != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(
            f"mcompile::gelu_bias needs bias of shape (d,) for x of shape (..., d); got x {tuple(x.shape)}, "
            f"bias {tuple(bias.shape)}"
        )


def _gelu_blocks(n_rows: int, n_cols: int):
    block_d = min(_pow2(n_cols), _MAX_BLOCK_D)
    block_m = max(1, min(_pow2(n_rows), _TILE // block_d))
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_d))
    return block_m, block_d, grid


@torch.library.custom_op("mcompile::gelu_bias", mutates_args=())
def gelu_bias(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias) over the last dim, ``approximate`` "none" (erf) or "tanh"; output in x's dtype."""
    _check_gelu_bias(x, bias, approximate)
    if not uses_triton(x.device) or x.numel() == 0:
        return gelu_bias_reference(x, bias, approximate).contiguous()
    x, bias = x.contiguous(), bias.contiguous()
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    y = torch.empty_like(x)
    block_m, block_d, grid = _gelu_blocks(n_rows, n_cols)
    _gelu_bias_fwd_kernel[grid](x, bias, y, n_rows, n_cols, TANH=approximate == "tanh",
                                BLOCK_M=block_m, BLOCK_D=block_d)
    return y


@gelu_bias.register_fake
def _(x, bias, approximate="none"):
    _check_gelu_bias(x, bias, approximate)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("mcompile::gelu_bias_backward", mutates_args=())
def gelu_bias_backward(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str = "none"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias) of gelu_bias; dbias is dx summed over every dim but the last."""
    if not uses_triton(x.device) or x.numel() == 0:
        return tuple(t.contiguous() for t in _gelu_bias_backward_reference(grad, x, bias, approximate))
    grad, x, bias = grad.contiguous(), x.contiguous(), bias.contiguous()
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    block_m, block_d, grid = _gelu_blocks(n_rows, n_cols)
    grid = (min(grid[0], _MAX_GROUPS), grid[1])  # row groups: a bounded partial buffer however many rows
    dx = torch.empty_like(x)
    partial = torch.empty((grid[0], n_cols), dtype=torch.float32, device=x.device)  # (groups, d)
    _gelu_bias_bwd_kernel[grid](grad, x, bias, dx, partial, n_rows, n_cols, TANH=approximate == "tanh",
                                BLOCK_M=block_m, BLOCK_D=block_d)
    return dx, partial.sum(0).to(bias.dtype)


@gelu_bias_backward.register_fake
def _(grad, x, bias, approximate="none"):
    return torch.empty_like(x, memory_format=torch.contiguous_format), bias.new_empty(bias.shape)


def _gelu_bias_setup(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _gelu_bias_bwd(ctx, grad):
    x, bias = ctx.saved_tensors
    dx, dbias = gelu_bias_backward(grad, x, bias, ctx.approximate)
    return dx, dbias, None


torch.library.register_autograd("mcompile::gelu_bias", _gelu_bias_bwd, setup_context=_gelu_bias_setup)
