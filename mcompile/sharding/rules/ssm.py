"""Sharding rules of the Mamba-2 block's own ops (issue 19): the SSD scan and the depthwise causal conv1d
(and the depthwise conv2d, Nystromformer's convolution of the values per head, by the same rule).

Megatron Core's ``MambaMixer`` layout over tp: in_proj column-parallel (z, x, B, C, dt by heads and
groups), the conv1d per channel and the scan per head on each rank's own channels / heads, the gated
norm per group on the rank's own groups, out_proj row-parallel — one all-reduce forward (out_proj's)
and one backward (in_proj's input gradient) per Mamba-2 layer without sequence parallelism. It
requires ``ngroups % tp == 0`` (Megatron asserts it); with one group, B and C can instead stay
replicated (every head reads group 0).

``mcompile::ssd_scan(x, dt, A, B, C, D)`` (kernels/ssd_scan.py): heads are independent, so
    heads:  x S(2), dt S(2), A S(0), B/C S(2) (groups % n == 0) or R (one group), D S(0) -> y S(2)
    batch:  x, dt, B, C S(0), A, D R                                                      -> y S(0)
The sequence is never split inside the scan (it is a recurrence over it).

``aten.conv1d`` / ``aten.conv2d`` with ``groups == in_channels == out_channels`` (depthwise, weight
(C, 1, k) / (C, 1, kh, kw)):
    channels: input S(1), weight S(0), bias S(0) -> S(1), with ``groups`` localized to C / n
    blocks:   input B(1, b), weight and bias B(0, b) -> B(1, b) (channels of a fused projection's parts)
    batch:    input S(0), weight, bias R        -> S(0)
"""

from __future__ import annotations

import torch

from mcompile.ir.placements import BlockShard, Shard
from mcompile.sharding.rules.base import OpInfo, R, Strategy, divisible, localizer, rule, same

__all__ = ["ssd_scan_rule", "conv1d_rule"]

aten = torch.ops.aten


def _ssd_op():
    import mcompile.kernels.ssd_scan  # noqa: F401 - registers mcompile::ssd_scan

    return torch.ops.mcompile.ssd_scan.default


@rule(_ssd_op())
def ssd_scan_rule(info: OpInfo) -> list[Strategy]:
    x, _dt, _A, B = info.inputs[:4]
    heads, groups, n = x.shape[2], B.shape[2], info.n
    out = []
    bc = None
    if not divisible(heads, n):
        info.notes.append(f"mcompile::ssd_scan (Mamba-2 scan): {heads} SSM heads do not divide by {n}")
    elif isinstance(groups, int) and groups % n == 0:
        bc = Shard(2)
    elif same(groups, 1):
        bc = R
    else:
        info.notes.append(f"mcompile::ssd_scan (Mamba-2 scan): {groups} B/C groups over {n} ranks: the groups must "
                          f"divide by the axis size (or be 1) for the heads of a rank to read their own groups")
    if bc is not None:
        out.append(Strategy((Shard(2), Shard(2), Shard(0), bc, bc, Shard(0)), (Shard(2),), name="heads"))
    out.append(Strategy((Shard(0), Shard(0), R, Shard(0), Shard(0), R), (Shard(0),), name="batch"))
    return out + [Strategy((R,) * 6, (R,), name="replicate")]


def _depthwise(info: OpInfo) -> bool:
    x, w = info.inputs[0], info.inputs[1]
    groups = info.arg(6, "groups", 1)
    return x.ndim == w.ndim and same(w.shape[1], 1) and same(groups, x.shape[1]) and same(w.shape[0], x.shape[1])


@rule(aten.conv1d.default, aten.conv2d.default)
def conv1d_rule(info: OpInfo) -> list[Strategy]:
    has_bias = len(info.inputs) == 3
    rest = (R,) * (len(info.inputs) - 1)
    out = []
    if _depthwise(info):
        ch = info.inputs[0].shape[1]
        cur = info.current[0] if info.current else R
        if isinstance(cur, BlockShard) and cur.dim % 3 == 1 and isinstance(ch, int) and cur.divides(ch, info.n):
            # channels held as blocks of a fused projection (x | B | C, q | k | v): per channel, so the same blocks
            wb = BlockShard(0, cur.blocks)
            out.append(Strategy((cur, wb) + ((wb,) if has_bias else ()), (cur,), name="channel_blocks"))
        if divisible(ch, info.n):
            out.append(Strategy((Shard(1), Shard(0)) + ((Shard(0),) if has_bias else ()), (Shard(1),),
                                name="channels"))
        else:
            info.notes.append(f"depthwise {info.op}: {ch} channels do not divide by {info.n}")
    else:
        info.notes.append(f"{info.op}: only a depthwise conv (groups == channels) shards its channels")
    if info.inputs[0].ndim == info.inputs[1].ndim:  # batched
        out.append(Strategy((Shard(0),) + rest, (Shard(0),), name="batch"))
    return out + [Strategy((R,) * len(info.inputs), (R,), name="replicate")]


@localizer(aten.conv1d.default, aten.conv2d.default)
def _conv1d_local(args, kwargs, in_p, out_p, local_shapes, n):
    """A channel-sharded conv (only a depthwise one is: groups == channels) has as many groups as its local
    output channels. The lowering passes the output's placement per mesh axis (not the inputs')."""
    args = list(args)
    if not any(isinstance(p, Shard | BlockShard) and p.dim == 1 for p in (out_p or ())):
        return tuple(args), kwargs
    local = local_shapes[0][1]
    if "groups" in kwargs:
        return tuple(args), dict(kwargs, groups=local)
    args[6] = local
    return tuple(args), kwargs
