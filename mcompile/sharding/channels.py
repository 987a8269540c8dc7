"""Walks along a value's channels (the tensor-parallel hints of convolutional mixers,
:mod:`mcompile.sharding.mixer_hints`,
and the ``cat`` rule, :mod:`mcompile.sharding.rules.views`): a depthwise conv1d and the ops that keep each channel
apart,
up to the cut (a split or chunk) that takes the channels into parts.
"""

from __future__ import annotations

import torch

__all__ = ["cut_apart", "depthwise", "split_dim", "SPLITS", "PER_CHANNEL"]

aten = torch.ops.aten
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
_CONVS = (aten.conv1d.default, aten.convolution.default)
PER_CHANNEL = (aten.silu.default, aten.sigmoid.default, aten.relu.default, aten.gelu.default, aten.tanh.default)


def split_dim(node: torch.fx.Node) -> int:
    nd = len(node.args[0].meta["val"].shape)
    return (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd


def cut_apart(node: torch.fx.Node, dim: int, sizes: list) -> bool:
    """Whether ``node``'s value reaches, as the only reader at each step, a cut of ``dim`` into exactly ``sizes``
    (a split, split_with_sizes or chunk) through ops that keep each channel of ``dim`` apart: transposes,
    permutes, casts and copies, per-channel activations, slices of another dim, a depthwise conv1d over it.
    BailingHybrid's ``cat([q, k, v], -1).transpose(1, 2)`` -> conv1d -> silu -> ``transpose(1, 2).split(...)``:
    the cat of column-parallel parts may then be held as their blocks (``mcompile.sharding.rules.views.cat``), which
    every op on the way keeps and the cut turns back into each part's plain shard."""
    cur = node
    while True:
        users = [u for u in cur.users if u.target is not aten._assert_tensor_metadata.default]  # checks: no value
        if len(users) != 1:
            return False
        u = users[0]
        if u.op != "call_function" or u.args[0] is not cur:
            return False
        nd = cur.meta["val"].ndim
        if u.target in SPLITS:
            if split_dim(u) != dim % nd or not isinstance(u.meta.get("val"), list | tuple):
                return False
            return [o.shape[dim % nd] for o in u.meta["val"]] == list(sizes)
        if u.target is aten.transpose.int:
            a, b = u.args[1] % nd, u.args[2] % nd
            dim = b if dim % nd == a else a if dim % nd == b else dim
        elif u.target is aten.permute.default:
            dim = [d % nd for d in u.args[1]].index(dim % nd)
        elif u.target is aten.slice.Tensor:
            if (u.args[1] if len(u.args) > 1 else 0) % nd == dim % nd:
                return False
        elif depthwise(u) is not None:
            if dim % nd != 1:
                return False
        elif u.target not in (*PER_CHANNEL, aten.to.dtype, aten._to_copy.default, aten.alias.default,
                              aten.contiguous.default, aten.clone.default):
            return False
        cur = u


def depthwise(n: torch.fx.Node) -> int | None:
    """The channels of a depthwise conv1d (groups == in == out channels, input (b, channels, s)), else None."""
    if n.op != "call_function" or n.target not in _CONVS:
        return None
    x, w = n.args[0], n.args[1]
    groups = n.args[6] if n.target is aten.conv1d.default and len(n.args) > 6 else \
        n.args[8] if n.target is aten.convolution.default and len(n.args) > 8 else n.kwargs.get("groups", 1)
    xv, wv = x.meta["val"], w.meta["val"]
    if xv.ndim != 3 or wv.ndim != 3 or not isinstance(xv.shape[1], int):
        return None
    c = int(xv.shape[1])
    return c if groups == c and int(wv.shape[0]) == c and int(wv.shape[1]) == 1 else None
