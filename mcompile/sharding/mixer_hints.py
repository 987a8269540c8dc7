"""Tensor-parallel hints for convolutional state-space mixers (Mamba v1, HF's torch path of Mamba-2 and
hybrids), found from the graph: Megatron Core's ``MambaMixer`` layout over tp.

A mixer of this family projects the residual stream up (``in_proj``), runs a depthwise causal conv and a scan
on each channel, and projects back (``out_proj``). Megatron shards every per-channel op by channel:

- ``in_proj`` column-parallel, its fused output (x | z, or z | x | B | C | dt) held as blocks so each rank
  keeps its channels of every part: :func:`channels_first_blocks` finds the parts cut along a dim the
  output was transposed to (HF Mamba's ``in_proj(h).transpose(1, 2).chunk(2, dim=1)``, channels first for
  the conv), which :func:`mcompile.sharding.planner.block_hints` (cuts of the last dim) does not see;
- a projection reading the conv's channels (Mamba v1's ``x_proj`` to dt, B, C; a gated conv mixer's
  ``out_proj``) row-parallel: :func:`conv_readers`. Mamba v1's B and C are one vector a token shared by all
  channels (groups = 1), so they cannot be split with the channels: x_proj's output is all-reduced, whole on
  every rank, one more forward collective a layer than the mixer's exit (the quality check counts x_proj as
  the tp region exit it is: its input is the conv's output). Held as blocks instead (what a fused projection
  cut into parts gets), each rank would hold a slice of B and C and gather them for every channel.
"""

from __future__ import annotations

import operator

import torch

from mcompile.capture.export import Captured
from mcompile.ir.placements import BlockShard, Replicate, Shard
from mcompile.sharding.channels import PER_CHANNEL, SPLITS, depthwise, split_dim
from mcompile.sharding.propagate import _contraction

__all__ = ["mixer_hints", "channels_first_blocks", "conv_readers", "few_groups"]

aten = torch.ops.aten
_KEEP = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.to.dtype, aten._to_copy.default,
         aten.alias.default, aten.contiguous.default, aten.clone.default)
_SKIPS = (aten.add.Tensor, aten.sub.Tensor)


def mixer_hints(cap: Captured, tp: int = 1) -> dict[str, object]:
    """Placements over tp of the mixers' weights (placeholder name -> placement); see the module docstring."""
    return {**channels_first_blocks(cap, tp), **conv_readers(cap)}


def few_groups(cap: Captured, tp: int) -> list[torch.fx.Node]:
    """The fused projections :func:`channels_first_blocks` keeps whole: a part of their cut output is read
    by heads through ``repeat_interleave`` over fewer groups than ``tp`` divides (Mamba-2's B and C with
    ``n_groups = 1``, HF Bamba / Falcon-H1 / Zamba2 / GraniteMoeHybrid)."""
    return [lin for lin, _, whole in _mixer_cuts(cap, tp) if whole]


def _groups(part: torch.fx.Node) -> list[int]:
    """The sizes of the dims ``part`` is repeated along by ``repeat_interleave`` for the heads (through views
    and casts): Mamba-2's ``B.view(b, s, groups, n).repeat_interleave(heads // groups, dim=2)``."""
    out, todo = [], [part]
    while todo:
        for u in todo.pop().users:
            if u.op != "call_function":
                continue
            if u.target is aten.repeat_interleave.self_int and len(u.args) > 2 and isinstance(u.args[1], int):
                size = u.args[0].meta["val"].shape[u.args[2]]
                if isinstance(size, int):
                    out.append(int(size))
            elif u.target in _KEEP or u.target in _PIECES:
                todo.append(u)
    return out


# pieces of another dim on the way to the heads (HF's scan: ``torch.tensor_split(B, [s], dim=1)``)
_PIECES = (aten.tensor_split.indices, aten.tensor_split.sections, aten.slice.Tensor, operator.getitem, *SPLITS)


def _source_dim(x: torch.fx.Node, dim: int):
    """Follow ``x``'s ``dim`` back through transposes, permutes, casts, views that keep it, per-channel ops
    (an activation, a slice of another dim, a depthwise conv1d over it) to the op that made it:
    ``(that op, its dim, the convs passed, whether the dim moved or passed a conv)``, or None where a view
    regroups it."""
    cur, convs, moved = x, [], False
    outer: list[tuple[list, int]] = []
    while isinstance(cur, torch.fx.Node) and cur.op == "call_function":
        src = cur.args[0] if cur.args else None
        scaled = _scaled(cur, dim)
        if scaled is not None:  # a per-channel scale (Falcon-H1's ``in_proj(h) * mup_vector``)
            cur = scaled
            continue
        if cur.target is operator.getitem and isinstance(src, torch.fx.Node) and src.target in SPLITS:
            # a part of an earlier cut of the same dim (Mamba-2: in_proj's [z | xBC | dt], then xBC's [x | B | C])
            nd = len(src.meta["val"][0].shape)
            if split_dim(src) != dim % nd:
                break
            outer.append(([o.shape[dim] for o in src.meta["val"]], cur.args[1]))
            cur = src.args[0]
            continue
        if not isinstance(src, torch.fx.Node) or not isinstance(src.meta.get("val"), torch.Tensor):
            break
        if cur.target is aten.transpose.int:
            nd = cur.meta["val"].ndim
            a, b = cur.args[1] % nd, cur.args[2] % nd
            dim, moved = (b if dim == a else a if dim == b else dim), moved or dim in (a, b)
        elif cur.target is aten.permute.default:
            new = list(cur.args[1])[dim] % src.meta["val"].ndim
            dim, moved = new, moved or new != dim
        elif cur.target in _KEEP:
            if src.meta["val"].ndim != cur.meta["val"].ndim or str(src.meta["val"].shape[dim]) != str(
                    cur.meta["val"].shape[dim]):
                return None  # the view regroups the dim: its parts are not blocks of the producer's dim
        elif cur.target in PER_CHANNEL:
            pass
        elif cur.target is aten.slice.Tensor:
            if (cur.args[1] if len(cur.args) > 1 else 0) % cur.meta["val"].ndim == dim:
                break
        elif depthwise(cur) is not None and dim == 1:
            convs.append(cur)
            moved = True
        else:
            break
        cur = src
    return (cur, dim, convs, moved, outer) if isinstance(cur, torch.fx.Node) else None


def _scaled(node: torch.fx.Node, dim: int) -> torch.fx.Node | None:
    """The value ``node`` multiplies (or divides) by a factor constant along every dim but ``dim`` (a
    per-channel scale, or a scalar), else None."""
    if node.target not in (aten.mul.Tensor, aten.div.Tensor) or len(node.args) != 2:
        return None
    out = node.meta["val"]
    for i, (a, b) in enumerate((node.args, node.args[::-1])):
        if i == 1 and node.target is aten.div.Tensor:
            break  # factor / x is not a scale of x
        av = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        if not isinstance(av, torch.Tensor) or tuple(av.shape) != tuple(out.shape):
            continue
        bv = b.meta.get("val") if isinstance(b, torch.fx.Node) else b
        if not isinstance(bv, torch.Tensor):
            return a if isinstance(bv, int | float) else None
        k = dim - (out.ndim - bv.ndim)
        if bv.ndim <= out.ndim and all(s == 1 for j, s in enumerate(bv.shape) if j != k):
            return a
    return None


def _nest(sizes: list, outer: list[tuple[list, int]]) -> list | None:
    """The blocks of the dim a cut into ``sizes`` was taken from through parts of earlier cuts (``outer``,
    innermost first: (the earlier cut's sizes, which part)): [z, x, B, C, dt] from [x, B, C] in [z, xBC, dt]."""
    for cut, i in outer:
        if not all(isinstance(s, int) for s in cut) or sum(sizes) != cut[i]:
            return None
        sizes = [*cut[:i], *sizes, *cut[i + 1:]]
    return sizes


def channels_first_blocks(cap: Captured, tp: int = 1) -> dict[str, object]:
    """A linear's output cut into parts along its features after a transpose or a depthwise conv over them
    (HF Mamba: ``in_proj(h).transpose(1, 2).chunk(2, dim=1)``, x and z channels first; a gated delta net:
    ``conv1d(in_proj_qkv(h).transpose(1, 2)).transpose(1, 2).split([k, k, v], -1)``): the weight (and
    bias) ``BlockShard(0, part sizes)``, and the conv's weight and bias the same blocks, so every rank
    keeps its channels of each part through the conv."""
    hints: dict[str, object] = {}
    for _, ops, whole in _mixer_cuts(cap, tp):
        for op, b in ops:
            for a in (op.args[1], op.args[2] if len(op.args) > 2 else None):
                a = _param_of(a, cap)
                if a is not None:
                    hints[a] = Replicate() if whole else b
    return hints


def _mixer_cuts(cap: Captured, tp: int):
    """``(linear, [(op, its weight's blocks)], whole)`` for each cut :func:`channels_first_blocks` lays out;
    ``whole`` where a part is read by heads over fewer groups than ``tp`` divides: B and C must then be whole on
    every rank (Megatron Core's MambaMixer asserts ``ngroups % tp == 0``; vLLM's MambaMixer2 repeats the groups
    on every rank instead), and one placement cannot split the rest of the fused weight and keep B and C
    whole, so the projection and the conv stay whole (as :func:`mcompile.sharding.planner.kv_hints` keeps a fused
    q | k | v with one key/value head) and each rank slices its heads of x, z and dt
    (:func:`mcompile.sharding.planner.kv_sliced`)."""
    for node in cap.gm.graph.nodes:
        if node.op != "call_function" or node.target not in SPLITS or not isinstance(node.args[0], torch.fx.Node):
            continue
        x = node.args[0]
        nd = x.meta["val"].ndim
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
        sizes = [o.shape[dim] for o in node.meta["val"]]
        if len(sizes) < 2 or not all(isinstance(s, int) for s in sizes):
            continue
        found = _source_dim(x, dim)
        if found is None:
            continue
        lin, d, convs, moved, outer = found
        if not moved or lin.target is not aten.linear.default or d != lin.meta["val"].ndim - 1:
            continue  # a cut straight of a linear's features is planner.block_hints'
        nested = _nest(sizes, outer)
        if nested is None:
            continue
        blocks = BlockShard(0, tuple(sizes))
        parts = [u for u in node.users if u.target is operator.getitem]
        whole = tp > 1 and any(g % tp for p in parts for g in _groups(p))
        yield lin, [(lin, BlockShard(0, tuple(nested))), *((c, blocks) for c in convs)], whole


def _param_of(a, cap: Captured) -> str | None:
    """The parameter placeholder ``a`` is, through squeezes / unsqueezes (HF's ``conv1d.weight.squeeze(1)``)."""
    while isinstance(a, torch.fx.Node) and a.op == "call_function" and a.target in (
            aten.squeeze.dim, aten.unsqueeze.default, *_KEEP):
        a = a.args[0]
    return a.name if isinstance(a, torch.fx.Node) and a.name in cap.params else None


def conv_readers(cap: Captured) -> dict[str, object]:
    """Linears reading a depthwise conv's channels, before any other contraction, with as many input
    features as the conv has channels: row-parallel (``Shard(1)``), as every projection reading a
    tp-sharded activation is in Megatron's layout. Overrides a block layout their cut output would get.

    The walk stops where the conv's output is added to a value the conv itself was computed from (a skip
    around the conv: Inkling's short conv on the residual stream, ``conv(h) + h``): past it the value is that
    stream again, whole on every rank, and the next layer's projections reading it are column-parallel as
    usual (hinted row-parallel, they had no strategy for their replicated input)."""
    hints: dict[str, object] = {}
    for conv in cap.gm.graph.nodes:
        c = depthwise(conv)
        if c is None:
            continue
        before, back = set(), list(conv.all_input_nodes)
        while back:
            a = back.pop()
            if a not in before:
                before.add(a)
                back.extend(a.all_input_nodes)
        todo, seen = [conv], set()
        while todo:
            for u in todo.pop().users:
                if u in seen or u.op != "call_function":
                    continue
                seen.add(u)
                if u.target in _SKIPS and any(a in before for a in u.all_input_nodes):
                    continue  # the conv's skip connection: the stream it read, not its channels
                w = u.args[1] if u.target is aten.linear.default and len(u.args) > 1 else None
                if getattr(w, "name", None) in cap.params and w.meta["val"].ndim == 2 and \
                        int(w.meta["val"].shape[1]) == c:
                    hints[w.name] = Shard(1)
                elif not _contraction(u):
                    todo.append(u)
    return hints
