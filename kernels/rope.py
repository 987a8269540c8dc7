"""Rotary position embedding (RoPE), rotate-half form, as a Triton kernel beside its PyTorch reference.

RoPE (Su et al. 2021, "RoFormer") in the layout of GPT-NeoX, Llama and Hugging Face's
``apply_rotary_pos_emb``: the last dim d is split into halves (x1, x2) and

    y = x * cos + rotate_half(x) * sin,     rotate_half(x) = cat(-x2, x1)
    i.e. y1 = x1 * cos1 - x2 * sin1,        y2 = x2 * cos2 + x1 * sin2

x has shape (b, heads, s, d); cos and sin broadcast to it, normally (b or 1, 1, s, d) as HF builds
them (the rotary cache repeats its d/2 frequencies twice, but the kernel does not rely on it).

Backward: y is linear in x, y = C x + S R x with R = rotate_half, whose transpose is
R^T(v) = cat(v2, -v1), so

    dx = g * cos + R^T(g * sin),   i.e. dx1 = g1 * cos1 + g2 * sin2,   dx2 = g2 * cos2 - g1 * sin1

cos and sin get no gradient (they are a function of positions only). Megatron-LM's fused RoPE
(``fused_apply_rotary_pos_emb``) and Unsloth's Triton RoPE kernel fuse the same two
multiply-adds; our kernel is one program per block of (b·heads·s) rows, each row's two halves as
two vectors, with cos/sin read through their broadcast strides so they are never expanded in
memory, and x read through its strides so HF's transposed (b, s, heads, d) → (b, heads, s, d) view
needs no copy. Everything is computed in fp32 and stored in x's dtype.

Dispatch: Triton on CUDA tensors, and on CPU tensors when this module was imported under
``TRITON_INTERPRET=1`` (Triton's interpreter; correctness only, DESIGN §8); otherwise the PyTorch
reference.
"""

from __future__ import annotations

import torch

from mcompile.kernels._triton import jit as _jit
from mcompile.kernels._triton import pow2 as _pow2
from mcompile.kernels._triton import runs_triton, tl, triton

__all__ = ["uses_triton", "rope", "rope_reference", "rotate_half"]

_TILE = 4096  # elements per program: BLOCK_M rows x BLOCK_H half-row columns
# 8 warps: 16 elements of each of the six half-row tiles per thread. With Triton's default 4 the
# sm_90 build took 156 registers a thread (bench/kernels_sm90.py), so few warps fit an SM to hide
# the memory latency of a kernel that only streams.
_WARPS = 8



def uses_triton(device: torch.device | str) -> bool:
    """Whether the ops run their Triton kernels for tensors on ``device`` (else the reference)."""
    return runs_triton(device, _INTERPRETED)



def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) over the halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, computed in fp32 and returned in x's dtype."""
    xf = x.float()
    return (xf * cos.float() + rotate_half(xf) * sin.float()).to(x.dtype)


def _rope_backward_reference(grad, cos, sin, dtype):
    gs = grad.float() * sin.float()
    g1, g2 = gs.chunk(2, dim=-1)
    return (grad.float() * cos.float() + torch.cat((g2, -g1), dim=-1)).to(dtype)


@_jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, n_rows, heads, seq, half,
                 xs_b, xs_h, xs_s, xs_d, cs_b, cs_h, cs_s, cs_d, ss_b, ss_h, ss_s, ss_d,
                 BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """Forward: y = x cos + rotate_half(x) sin. BACKWARD: x is the output gradient g and
    y = g cos + rotate_half^T(g sin). Rows are (b, head, position) triples; y is contiguous."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (cols < half)[None, :]
    bi = rows // (heads * seq)
    hi = (rows // seq) % heads
    si = rows % seq
    x_row = (bi * xs_b + hi * xs_h + si * xs_s)[:, None]
    c_row = (bi * cs_b + hi * cs_h + si * cs_s)[:, None]
    s_row = (bi * ss_b + hi * ss_h + si * ss_s)[:, None]
    lo = cols[None, :]  # first half's columns
    hi_cols = lo + half  # second half's columns
    x1 = tl.load(x_ptr + x_row + lo * xs_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_row + hi_cols * xs_d, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + c_row + lo * cs_d, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + c_row + hi_cols * cs_d, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + s_row + lo * ss_d, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + s_row + hi_cols * ss_d, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    y_row = rows[:, None] * (2 * half)
    tl.store(y_ptr + y_row + lo, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + y_row + hi_cols, y2.to(y_ptr.dtype.element_ty), mask=mask)


_INTERPRETED = type(_rope_kernel).__name__ == "InterpretedFunction"


def _check_rope(x, cos, sin):
    if x.ndim != 4 or x.shape[-1] % 2:
        raise ValueError(
            f"mcompile::rope needs x of shape (b, heads, s, d) with d even; got {tuple(x.shape)} "
            "(transpose (b, s, heads, d) activations to (b, heads, s, d) first, as HF Llama does)"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        try:
            fits = torch.broadcast_shapes(t.shape, x.shape) == x.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"mcompile::rope: {name} of shape {tuple(t.shape)} does not broadcast to x's {tuple(x.shape)}; "
                "expected (b or 1, 1, s, d), e.g. HF Llama's cos.unsqueeze(1)"
            )


def _apply(x, cos, sin, backward: bool, out_dtype):
    b, h, s, d = x.shape
    cos, sin = cos.broadcast_to(x.shape), sin.broadcast_to(x.shape)  # views: stride 0 on broadcast dims
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n_rows, half = b * h * s, d // 2
    block_h = _pow2(half)
    block_m = max(1, min(_pow2(n_rows), _TILE // block_h))
    _rope_kernel[(triton.cdiv(n_rows, block_m),)](
        x, cos, sin, y, n_rows, h, s, half, *x.stride(), *cos.stride(), *sin.stride(),
        BACKWARD=backward, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=_WARPS,
    )
    return y


@torch.library.custom_op("mcompile::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x (b, heads, s, d); output contiguous, in x's dtype."""
    _check_rope(x, cos, sin)
    if not uses_triton(x.device) or x.numel() == 0:
        return rope_reference(x, cos, sin).contiguous()
    return _apply(x, cos, sin, False, x.dtype)


@rope.register_fake
def _(x, cos, sin):
    _check_rope(x, cos, sin)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("mcompile::rope_backward", mutates_args=())
def rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """dx of rope for the output gradient ``grad``: grad * cos + rotate_half^T(grad * sin)."""
    if not uses_triton(grad.device) or grad.numel() == 0:
        return _rope_backward_reference(grad, cos, sin, grad.dtype).contiguous()
    return _apply(grad, cos, sin, True, grad.dtype)


@rope_backward.register_fake
def _(grad, cos, sin):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _rope_setup(ctx, inputs, output):
    _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _rope_bwd(ctx, grad):
    cos, sin = ctx.saved_tensors
    return rope_backward(grad, cos, sin), None, None


torch.library.register_autograd("mcompile::rope", _rope_bwd, setup_context=_rope_setup)
