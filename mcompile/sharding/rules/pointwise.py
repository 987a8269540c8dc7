"""Pointwise ops with broadcasting: a dim of the output may be sharded when every tensor input
either has that dim (right-aligned, same size) sharded the same way, or broadcasts along it.
Partial passes through ops that are linear in that input (add/sub of two Partials, mul/div by a
replicated factor, casts, copies, dropout with a shared RNG stream)."""

from __future__ import annotations

from dataclasses import replace

import torch

from mcompile.ir.placements import BlockShard
from mcompile.sharding.rules.base import OpInfo, Partial, R, Shard, Strategy, rule, same

aten = torch.ops.aten

UNARY = [
    aten.neg.default, aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default,
    aten.silu.default, aten.gelu.default, aten.tanh.default, aten.sigmoid.default, aten.relu.default,
    aten.cos.default, aten.sin.default, aten.abs.default, aten.reciprocal.default, aten.erf.default,
    aten.pow.Tensor_Scalar, aten.clone.default, aten.contiguous.default, aten.detach.default,
    aten.detach_.default, aten.alias.default, aten.lift_fresh_copy.default, aten.to.dtype, aten.to.device,
    aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default, aten.dropout.default,
    aten.native_dropout.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.empty_like.default, aten.logical_not.default, aten.bitwise_not.default, aten.clamp.default,
    aten.gelu.default, aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar,
    aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar,
    aten.masked_fill.Scalar, aten.log_sigmoid_forward.default if hasattr(aten, "log_sigmoid_forward") else None,
    aten.log_sigmoid.default, aten.clamp_max.default, aten.floor_divide.Scalar,
    aten.real.default, aten.greater.Scalar, aten.greater_equal.Scalar, aten.less.Scalar, aten.less_equal.Scalar,
    aten.not_equal.Scalar,  # torch.greater & co.: aliases of gt & co.
]
BINARY = [
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.pow.Tensor_Tensor,
    aten.maximum.default, aten.minimum.default, aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor,
    aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor, aten.logical_and.default, aten.logical_or.default,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.where.self, aten.masked_fill.Tensor,
    aten.rsub.Tensor, aten.rsub.Scalar, aten.atan2.default, aten.__and__.Tensor, aten.__or__.Tensor,
    aten.multiply.Tensor, aten.floor_divide.default, aten.greater.Tensor, aten.greater_equal.Tensor,
    aten.less.Tensor, aten.less_equal.Tensor, aten.not_equal.Tensor,
]
# Ops linear in their (single, or every) tensor input, so a Partial input gives a Partial output.
_LINEAR_UNARY = {
    aten.neg.default, aten.clone.default, aten.contiguous.default, aten.detach.default, aten.detach_.default,
    aten.alias.default, aten.lift_fresh_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout,
    aten._to_copy.default, aten.dropout.default, aten.mul.Scalar, aten.div.Scalar, aten.type_as.default,
    aten.real.default,  # the real part of a sum is the sum of the real parts
}
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def pointwise_shard_strategies(info: OpInfo) -> list[Strategy]:
    """R -> R, and S(d) of the output wherever every input has d or broadcasts along it."""
    out = info.outputs[0]
    strategies = []
    for d in range(out.ndim):
        ins = []
        ok = True
        for t in info.inputs:
            k = d - (out.ndim - t.ndim)  # right-aligned input dim
            if k < 0 or same(t.shape[k], 1) and not same(out.shape[d], 1):
                ins.append(R)
            elif same(t.shape[k], out.shape[d]):
                ins.append(Shard(k))
            else:
                ok = False
        if ok and not same(out.shape[d], 1):
            strategies.append(Strategy(tuple(ins), (Shard(d),), name=f"pointwise_S{d}"))
    # blocks of a fused projection ([q | k | v]) stay blocks through pointwise ops (bias add)
    for c, t in zip(info.current, info.inputs):
        if isinstance(c, BlockShard):
            d = c.dim % t.ndim + (out.ndim - t.ndim)
            if d < 0 or not same(out.shape[d], t.shape[c.dim % t.ndim]):
                continue  # not broadcast into the output (type_as's `other` lends only its dtype)
            ins = []
            for u in info.inputs:
                k = d - (out.ndim - u.ndim)
                ins.append(R if k < 0 or same(u.shape[k], 1) else BlockShard(k, c.blocks))
            strategies.insert(0, Strategy(tuple(ins), (BlockShard(d, c.blocks),), name="pointwise_blocks"))
            break
    return strategies


def _partial_strategies(info: OpInfo) -> list[Strategy]:
    if info.outputs[0].dtype not in _FLOAT or not info.inputs:
        return []
    op = info.op
    n_in = len(info.inputs)
    P = Partial()
    if n_in == 1 and op in _LINEAR_UNARY:
        return [Strategy((P,), (P,), name="partial")]
    if n_in == 2 and op in (aten.add.Tensor, aten.sub.Tensor):
        return [Strategy((P, P), (P,), name="partial")]
    if n_in == 2 and op in (aten.mul.Tensor, aten.multiply.Tensor):
        return [Strategy((P, R), (P,), name="partial"), Strategy((R, P), (P,), name="partial")]
    if n_in == 2 and op is aten.div.Tensor:
        return [Strategy((P, R), (P,), name="partial")]
    if n_in == 1 and op in (aten.mul.Tensor, aten.multiply.Tensor):  # tensor * python scalar
        return [Strategy((P,), (P,), name="partial")]
    if n_in == 1 and op is aten.div.Tensor:  # tensor / python scalar
        return [Strategy((P,), (P,), name="partial")]
    if n_in == 3 and op is aten.where.self:
        # where(c, a1 + a2, b1 + b2) = where(c, a1, b1) + where(c, a2, b2): a whole condition selects between two
        # partial sums term by term (an unrolled expert loop's update kept or not, mcompile/capture/loops.py)
        return [Strategy((R, P, P), (P,), name="partial")]
    return []


@rule(*[op for op in UNARY + BINARY if op is not None])
def pointwise(info: OpInfo) -> list[Strategy]:
    rep = Strategy(tuple(R for _ in info.inputs), (R,), name="replicate")
    out = pointwise_shard_strategies(info) + _partial_strategies(info) + [rep]
    # multi-output ops (native_dropout: output and mask; log_sigmoid_forward: output and buffer) lay
    # every output out like the first: one placement per output, as getitem expects
    k = len(info.outputs)
    return [replace(s, outputs=s.outputs * k) for s in out] if k > 1 else out


# In-place arithmetic on a view the model keeps reading through its base (Longformer / LED's
# ``attn_scores += diagonal_mask`` on a transpose of a fresh tensor, Funnel's ``positional_attn *= cls_mask``:
# passes/canonicalize.py makes writes into fresh tensors functional, not writes through views). The destination
# is the output: every strategy keeps its placement (a split destination is written where it lies); no Partial (a
# write is no sum).
INPLACE_BINARY = [aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.div_.Tensor]


@rule(*INPLACE_BINARY)
def inplace_pointwise(info) -> list[Strategy]:
    kept = [s for s in pointwise_shard_strategies(info) if s.inputs[0] == s.outputs[0]]
    return kept + [Strategy(tuple(R for _ in info.inputs), (R,), name="replicate")]


# ``torch.where`` with a Python scalar for one branch (where.ScalarSelf / ScalarOther: a decoder's start token
# where the position is 0, the shifted labels elsewhere) and ``dst.copy_(src)`` (Hugging Face T5's
# ``_shift_right`` writes the labels into a slice of a new tensor): pointwise over their tensors (src
# broadcasting), so every output dim they share may be split. No Partial: the scalar branch would not scale
# with the summands, and a copy is no sum.


@rule(aten.where.ScalarSelf, aten.where.ScalarOther)
def where_scalar(info) -> list[Strategy]:
    out = pointwise_shard_strategies(info)
    if info.op is aten.where.ScalarOther and info.arg(2) == 0 and len(info.inputs) == 2 and \
            info.outputs[0].dtype in _FLOAT:
        # where(c, x, 0) keeps or zeroes each entry of x: linear in x, so a Partial x gives a Partial output (an
        # unrolled expert loop's rows kept or not, mcompile/capture/loops.py); a nonzero scalar would not sum
        out.append(Strategy((R, Partial()), (Partial(),), name="partial"))
    return out + [Strategy(tuple(R for _ in info.inputs), (R,), name="replicate")]


@rule(aten.copy_.default)
def copy_(info) -> list[Strategy]:
    return pointwise_shard_strategies(info) + [Strategy(tuple(R for _ in info.inputs), (R,), name="replicate")]


@rule(aten.rand_like.default, aten.uniform.default, aten.exponential.default)
def random_like(info: OpInfo) -> list[Strategy]:
    """Random numbers shaped like the input (its values unread): drawn per element from a counter over the
    element's place in the single-device tensor (passes/lower_dropout.py lower_random), so any Shard of the input
    gives the output the same Shard and replicated gives replicated, every rank holding the single-device
    run's numbers. A Partial input is no shape donor of a whole value: not offered."""
    nd = info.inputs[0].ndim
    out = [Strategy((Shard(d),), (Shard(d),), name="other_dim") for d in range(nd)]
    cur = info.current[0] if info.current else R
    out.sort(key=lambda s: s.inputs[0] != cur)
    return out + [Strategy((R,), (R,), name="replicate")]
