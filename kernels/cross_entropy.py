"""Softmax cross-entropy that never materialises the softmax, for whole or vocabulary-sharded logits.

The op works on logits x of shape (N, V_local) that may be one shard of the vocabulary: columns
[vocab_start, vocab_start + V_local) of a vocabulary of ``vocab_size``; columns at or beyond
``vocab_size`` are padding (Megatron pads the vocabulary to a multiple of tp) and count as -inf.
Per row it returns three fp32 statistics of its shard — never an (N, V) probability tensor:

    m = max_j x_j                      (-inf if the shard holds no real column)
    s = Σ_j exp(x_j - m)
    t = x_target if the target is a column of this shard and not ignore_index, else 0

computed in one pass over column blocks with the online-softmax rescaling
s ← s·exp(m_old - m_new) + Σ exp(x - m_new) (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"). The loss of a row is, over all shards r,

    M = max_r m_r,   S = Σ_r s_r exp(m_r - M),   T = Σ_r t_r,   loss = log S + M - T

(:func:`loss_from_statistics`; 0 for rows whose target is ``ignore_index``). That is the
vocabulary-parallel cross-entropy of Megatron-LM (Shoeybi et al. 2019, ``vocab_parallel_cross_entropy``)
with its three all-reduces (max, sum, sum) and its detached max (DESIGN §11); the
never-materialise-the-softmax idea and the backward-from-statistics idea are those of the fused
cross-entropy kernels in Liger-Kernel and Unsloth, with the blocking of the Triton fused-softmax
tutorial.

Backward. The loss is invariant to the stabiliser m (and M): ∂loss/∂m through exp(m - M) cancels
∂loss/∂s·∂s/∂m exactly. So the op defines m as gradient-free — its incoming gradient is ignored and
m is a constant inside s — and the backward kernel, from the saved logits and m alone, is

    dx_j = g_s · exp(x_j - m) + g_t · [j = target]      (0 on padding columns)

For the unsharded loss g_s = g / s and g_t = -g, so dx = g (softmax - onehot); in the sharded
combination g_s = g · exp(m_r - M) / S, which again gives g (softmax - onehot) over the full
vocabulary. This holds for any combination that is a function of the shift-invariant
log-sum-exp, which is what cross-entropy is; do not differentiate m on its own.

How a tensor-parallel caller uses it (rank r of n holds x_local = x[:, r·V_local : (r+1)·V_local]
of the vocabulary padded to n·V_local; ``all_reduce_max`` / ``all_reduce`` are mcompile's
collective ops — forward all-reduce, backward identity, Megatron's *g*)::

    m, s, t = torch.ops.mcompile.cross_entropy(x_local, target, -100, r * V_local, vocab_size)
    M = all_reduce_max(m.detach(), "tp", n)            # global max: no gradient
    S = all_reduce(s * torch.exp(m - M), "tp", n)      # global Σ exp(x - M)
    T = all_reduce(t, "tp", n)                         # the target logit lives on one rank
    loss = loss_from_statistics(M, S, T, target, -100)   # per row, fp32, 0 where ignored

Autograd then runs the backward kernel on each rank's shard with that rank's g_s and g_t; the
gradient needs nothing from other ranks (the all-reduces' backward is the identity).
:func:`cross_entropy_loss` is the unsharded case (vocab_start 0, vocab_size V, no collectives).

Dispatch: Triton on CUDA tensors, and on CPU tensors when this module was imported under
``TRITON_INTERPRET=1`` (Triton's interpreter; correctness only, DESIGN §8); otherwise the PyTorch
reference. Logits may be fp32 or bf16; statistics and the loss
are fp32, the logits' gradient has the logits' dtype.
"""

from __future__ import annotations

import torch

from mcompile.kernels._triton import jit as _jit
from mcompile.kernels._triton import pow2 as _pow2
from mcompile.kernels._triton import runs_triton, tl, triton

__all__ = [
    "uses_triton",
    "cross_entropy",
    "cross_entropy_reference",
    "cross_entropy_loss",
    "loss_from_statistics",
]

_TILE = 4096  # elements per program and loop step: BLOCK_M rows x BLOCK_V columns



def uses_triton(device: torch.device | str) -> bool:
    """Whether the ops run their Triton kernels for tensors on ``device`` (else the reference)."""
    return runs_triton(device, _INTERPRETED)



def _valid_cols(v_local: int, vocab_start: int, vocab_size: int) -> int:
    """How many of the shard's columns are real vocabulary (the rest is padding)."""
    return max(0, min(v_local, vocab_size - vocab_start))


def _target_in_shard(target, ignore_index, vocab_start, valid):
    """(local column of each target, whether it is a real column of this shard and not ignored)."""
    local = target - vocab_start
    hit = (target != ignore_index) & (local >= 0) & (local < valid)
    return local, hit


# ---- reference --------------------------------------------------------------------------------
def cross_entropy_reference(logits, target, ignore_index: int, vocab_start: int, vocab_size: int):
    """(m, s, t) per row, as the op defines them, in plain PyTorch (fp32)."""
    n, v_local = logits.shape
    valid = _valid_cols(v_local, vocab_start, vocab_size)
    x = logits[:, :valid].float()  # padding columns dropped: the same as masking them to -inf
    local, hit = _target_in_shard(target, ignore_index, vocab_start, valid)
    if valid == 0:
        zeros = x.new_zeros(n)
        return torch.full_like(zeros, float("-inf")), zeros, zeros
    m = x.amax(1)
    s = torch.exp(x - m[:, None]).sum(1)
    t = x.gather(1, local.clamp(0, valid - 1)[:, None].long()).squeeze(1)
    return m, s, torch.where(hit, t, 0.0)


def _cross_entropy_backward_reference(logits, target, row_max, grad_sum_exp, grad_target_logit,
                                      ignore_index, vocab_start, vocab_size):
    n, v_local = logits.shape
    valid = _valid_cols(v_local, vocab_start, vocab_size)
    dx = torch.zeros((n, v_local), dtype=torch.float32, device=logits.device)
    if valid:
        x = logits[:, :valid].float()
        dx[:, :valid] = grad_sum_exp[:, None] * torch.exp(x - row_max[:, None])
        local, hit = _target_in_shard(target, ignore_index, vocab_start, valid)
        rows = torch.arange(n, device=logits.device)[hit]
        dx[rows, local[hit].long()] += grad_target_logit[hit]
    return dx.to(logits.dtype)


# ---- kernels ----------------------------------------------------------------------------------
@_jit
def _ce_fwd_kernel(x_ptr, tgt_ptr, max_ptr, sum_ptr, tlogit_ptr, n_rows, row_stride, valid_cols,
                   ignore_index, vocab_start, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=ignore_index)
    local = tgt - vocab_start
    hit = (tgt != ignore_index) & (local >= 0) & (local < valid_cols)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], dtype=tl.float32)
    t = tl.zeros([BLOCK_M], dtype=tl.float32)
    base = (rows * row_stride)[:, None]
    for start in range(0, valid_cols, BLOCK_V):  # padding columns are never read
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (cols < valid_cols)[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no column yet: exp(-inf) = 0
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        t += tl.sum(tl.where(cols[None, :] == local[:, None], x, 0.0), axis=1)
        m = m_new
    tl.store(max_ptr + rows, m, mask=row_ok)
    tl.store(sum_ptr + rows, s, mask=row_ok)
    tl.store(tlogit_ptr + rows, tl.where(hit, t, 0.0), mask=row_ok)


@_jit
def _ce_bwd_kernel(x_ptr, tgt_ptr, max_ptr, gs_ptr, gt_ptr, dx_ptr, n_rows, n_cols, row_stride, valid_cols,
                   ignore_index, vocab_start, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=ignore_index)
    local = tgt - vocab_start
    hit = (tgt != ignore_index) & (local >= 0) & (local < valid_cols)
    m = tl.load(max_ptr + rows, mask=row_ok, other=0.0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a shard of padding only: every column is masked below
    gs = tl.load(gs_ptr + rows, mask=row_ok, other=0.0)
    gt = tl.where(hit, tl.load(gt_ptr + rows, mask=row_ok, other=0.0), 0.0)
    base = (rows * row_stride)[:, None]
    out = (rows * n_cols)[:, None]
    for start in range(0, n_cols, BLOCK_V):  # every column, padding included (its gradient is 0)
        cols = start + tl.arange(0, BLOCK_V)
        real = row_ok[:, None] & (cols < valid_cols)[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=real, other=float("-inf")).to(tl.float32)
        dx = gs[:, None] * tl.exp(x - m[:, None])
        dx += tl.where(cols[None, :] == local[:, None], gt[:, None], 0.0)
        tl.store(dx_ptr + out + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < n_cols)[None, :])


_INTERPRETED = type(_ce_fwd_kernel).__name__ == "InterpretedFunction"


def _blocks(n_rows: int, n_cols: int):
    block_v = min(_pow2(max(n_cols, 1)), _TILE)
    block_m = max(1, min(_pow2(n_rows), _TILE // block_v))
    return block_m, block_v, (triton.cdiv(n_rows, block_m),)


def _rows_major(logits):
    return logits if logits.stride(-1) == 1 else logits.contiguous()


# ---- ops --------------------------------------------------------------------------------------
def _check(logits, target, vocab_start, vocab_size):
    if logits.ndim != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"mcompile::cross_entropy needs logits (N, V_local) and target (N,); got {tuple(logits.shape)} and "
            f"{tuple(target.shape)} (flatten (b, s, V) logits to (b*s, V), or use cross_entropy_loss)"
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ValueError(f"mcompile::cross_entropy: target must hold class indices (int64), got {target.dtype}")
    if vocab_start < 0 or vocab_size <= 0:
        raise ValueError(
            f"mcompile::cross_entropy: vocab_start={vocab_start}, vocab_size={vocab_size}; a shard starts at "
            "rank * V_local >= 0 of a vocabulary of size > 0"
        )


@torch.library.custom_op("mcompile::cross_entropy", mutates_args=())
def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, vocab_start: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row fp32 statistics (max, Σ exp(x - max), target logit) of a vocabulary shard; see the
    module docstring for how to combine them into the loss, sharded or not."""
    _check(logits, target, vocab_start, vocab_size)
    if not uses_triton(logits.device) or logits.numel() == 0:
        return cross_entropy_reference(logits, target, ignore_index, vocab_start, vocab_size)
    x = _rows_major(logits)
    n, v_local = x.shape
    stats = [torch.empty(n, dtype=torch.float32, device=x.device) for _ in range(3)]
    valid = _valid_cols(v_local, vocab_start, vocab_size)
    block_m, block_v, grid = _blocks(n, valid)
    _ce_fwd_kernel[grid](x, target.contiguous(), *stats, n, x.stride(0), valid, ignore_index, vocab_start,
                         BLOCK_M=block_m, BLOCK_V=block_v)
    return tuple(stats)


@cross_entropy.register_fake
def _(logits, target, ignore_index, vocab_start, vocab_size):
    _check(logits, target, vocab_start, vocab_size)
    n = logits.shape[0]
    return tuple(logits.new_empty(n, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("mcompile::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(
    logits: torch.Tensor, target: torch.Tensor, row_max: torch.Tensor, grad_sum_exp: torch.Tensor,
    grad_target_logit: torch.Tensor, ignore_index: int, vocab_start: int, vocab_size: int,
) -> torch.Tensor:
    """dlogits = grad_sum_exp · exp(x - row_max) + grad_target_logit · onehot(target), 0 on padding."""
    if not uses_triton(logits.device) or logits.numel() == 0:
        return _cross_entropy_backward_reference(logits, target, row_max, grad_sum_exp, grad_target_logit,
                                                 ignore_index, vocab_start, vocab_size)
    x = _rows_major(logits)
    n, v_local = x.shape
    dx = torch.empty((n, v_local), dtype=logits.dtype, device=logits.device)
    valid = _valid_cols(v_local, vocab_start, vocab_size)
    block_m, block_v, grid = _blocks(n, v_local)
    _ce_bwd_kernel[grid](x, target.contiguous(), row_max.contiguous(), grad_sum_exp.float().contiguous(),
                         grad_target_logit.float().contiguous(), dx, n, v_local, x.stride(0), valid,
                         ignore_index, vocab_start, BLOCK_M=block_m, BLOCK_V=block_v)
    return dx


@cross_entropy_backward.register_fake
def _(logits, target, row_max, grad_sum_exp, grad_target_logit, ignore_index, vocab_start, vocab_size):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _ce_setup(ctx, inputs, output):
    logits, target, ignore_index, vocab_start, vocab_size = inputs
    ctx.save_for_backward(logits, target, output[0])
    ctx.args = (ignore_index, vocab_start, vocab_size)


def _ce_bwd(ctx, grad_max, grad_sum_exp, grad_target_logit):
    # grad_max is ignored on purpose: m is a stabiliser the loss does not depend on (module docstring)
    logits, target, row_max = ctx.saved_tensors
    zeros = torch.zeros_like(row_max)
    grad_sum_exp = zeros if grad_sum_exp is None else grad_sum_exp
    grad_target_logit = zeros if grad_target_logit is None else grad_target_logit
    dx = cross_entropy_backward(logits, target, row_max, grad_sum_exp, grad_target_logit, *ctx.args)
    return dx, None, None, None, None


torch.library.register_autograd("mcompile::cross_entropy", _ce_bwd, setup_context=_ce_setup)


# ---- the loss ---------------------------------------------------------------------------------
def loss_from_statistics(row_max, sum_exp, target_logit, target, ignore_index: int = -100):
    """Per-row loss log(S) + M - T from global (all-reduced) statistics; 0 where target == ignore_index."""
    loss = torch.log(sum_exp) + row_max - target_logit
    return torch.where(target == ignore_index, 0.0, loss)


def cross_entropy_loss(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-row softmax cross-entropy of unsharded logits (..., V) against target (...), fp32, 0 for rows
    whose target is ``ignore_index`` — F.cross_entropy(..., reduction="none") computed in fp32, with a
    backward kernel that recomputes softmax - onehot from the saved row max (no saved softmax).
    Targets outside [0, V) other than ``ignore_index`` are not checked (a device-side check would sync)."""
    vocab = logits.shape[-1]
    flat_logits, flat_target = logits.reshape(-1, vocab), target.reshape(-1)
    m, s, t = cross_entropy(flat_logits, flat_target, ignore_index, 0, vocab)
    return loss_from_statistics(m, s, t, flat_target, ignore_index).reshape(target.shape)
