"""Which positions of its inputs' sequences a rank's program reads: what a data loader must give a cp rank.

A context-parallel program takes every user input whole (its sequence dim the whole sequence: positions, masks
and shifted labels are computed from it) and keeps its own tokens with ``cp_slice`` (mcompile.passes.cp.ops). The
positions of an input a cp rank's program reads are therefore found by following the input's values from its
placeholder to the ``cp_slice`` calls that keep them: the placeholder holds *codes* (each element its flat index),
every node on the way must only move or copy values (views, slices, a constant pad, an exact cast), which are run
on the codes, and the codes that come out of the rank's ``cp_slice`` are the elements read. A use that computes
with the values (an embedding, a comparison, an arithmetic op) reads them all: that input is read whole. A use
that reads only the input's shape (``sym_size``, ``new_zeros``, ``zeros_like``, ...) reads nothing.

Over-approximation is safe (a loader then reads a position the program does not need) and the rules only
over-approximate: a pad value equal to some code names that position too. The result is per position along the
input's dim 1 (the sequence of a ``[batch, seq, ...]`` input), the union over its rows.

The runtime calls :func:`input_columns` through ``RankPrograms.input_columns`` (it imports no pass); the training
loop reads each cp rank's positions only (mcompile/apps/train/loop.py, ``data.read = "local"``).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from mcompile.passes.cp.ops import local_positions

__all__ = ["input_columns"]

aten = torch.ops.aten
_CP_SLICE = torch.ops.mcompile.cp_slice.default

# ops that only move or copy their first argument's elements: run on the codes
_MOVES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.contiguous.default,
          aten.clone.default, aten.alias.default, aten.detach.default, aten.slice.Tensor, aten.select.int,
          aten.narrow.default, aten.pad.default, aten.constant_pad_nd.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints, aten.unflatten.int,
          aten.permute.default, aten.transpose.int, aten.t.default, aten.expand.default, aten.movedim.int,
          aten.lift_fresh_copy.default}
# casts: the codes unchanged where the target dtype holds every code exactly
_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device}
_EXACT_BITS = {torch.int64: 63, torch.float64: 53, torch.int32: 31, torch.float32: 24}
# ops that read their tensor argument's shape, dtype or device only
_SHAPE_ONLY = {aten.sym_size.int, aten.sym_size.default, aten.sym_numel.default, aten.sym_stride.int,
               aten.sym_stride.default, aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
               aten.new_full.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
               aten.full_like.default}
# integer arithmetic on sizes (the sequence length a cp_slice is given): run on the concrete sizes
_INT_OPS = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
            operator.truediv, torch.sym_max, torch.sym_min, torch.sym_int}
_SIZE_OPS = {aten.sym_size.int: lambda t, d: int(t.shape[d]), aten.sym_numel.default: lambda t: int(t.numel())}


class _Codes:
    """An input's elements as their flat indices, after the moves so far."""

    def __init__(self, source: str, codes: torch.Tensor):
        self.source, self.codes = source, codes


def input_columns(gm: fx.GraphModule, names: list[str], inputs: dict[str, torch.Tensor], cp_rank: int
                  ) -> dict[str, torch.Tensor | None]:
    """Per user input of ``gm`` among ``names`` given in ``inputs`` (tensors of the shapes the program runs on:
    one microbatch): the sorted positions along dim 1 that the program reads when it runs as cp rank ``cp_rank``
    (an empty tensor where it reads no value, or only the shape), or None where it reads every position (a use that
    computes with the values, or an input of fewer than two dims)."""
    wanted = {n: t for n, t in inputs.items() if n in names and isinstance(t, torch.Tensor)}
    read: dict[str, list | None] = {n: [] for n in wanted}  # the code tensors the rank's cp_slices keep
    env: dict[str, object] = {}

    def whole(source: str) -> None:
        read[source] = None

    def value(a):
        """A node argument's concrete value: an int, a list of them, a code tensor; ``...`` where unknown."""
        if isinstance(a, fx.Node):
            return env.get(a.name, ...)
        if isinstance(a, list | tuple):
            vals = [value(x) for x in a]
            return ... if any(v is ... or isinstance(v, _Codes) for v in vals) else type(a)(vals)
        return a

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            t = wanted.get(node.name)
            if t is not None:
                env[node.name] = _Codes(node.name, torch.arange(t.numel()).view(t.shape))
            continue
        if not any(a.name in env for a in node.all_input_nodes):  # nothing known flows in: not an input's use
            continue
        if node.op == "output":  # an input returned (inside the outputs) is read whole
            for a in node.all_input_nodes:
                if isinstance(env.get(a.name), _Codes):
                    whole(env[a.name].source)
            continue
        args = [value(a) for a in node.args]
        kwargs = {k: value(v) for k, v in node.kwargs.items()}
        coded = [v for v in [*args, *kwargs.values()] if isinstance(v, _Codes)]
        for a in node.all_input_nodes:  # a code tensor inside a list (a cat's): computed with
            v = env.get(a.name)
            if isinstance(v, _Codes) and not any(v is c for c in coded):
                whole(v.source)
        if not coded:
            if node.op == "call_function" and node.target in _INT_OPS and all(
                    v is not ... for v in [*args, *kwargs.values()]):
                env[node.name] = node.target(*args, **kwargs)
            continue
        src, t = coded[0], node.target
        if len(coded) > 1 or any(v is ... for v in [*args, *kwargs.values()]):
            for c in coded:
                whole(c.source)
        elif t in _SIZE_OPS:
            env[node.name] = _SIZE_OPS[t](src.codes, *args[1:])
        elif t in _SHAPE_ONLY:
            pass
        elif t in _CASTS and args[0] is src:
            dtypes = [v for v in [*args[1:], *kwargs.values()] if isinstance(v, torch.dtype)]  # to.device's is third
            bits = _EXACT_BITS.get(dtypes[0], 0) if dtypes else 63
            if src.codes.numel() < (1 << bits):
                env[node.name] = src
            else:
                whole(src.source)
        elif t in _MOVES and args[0] is src:
            try:
                env[node.name] = _Codes(src.source, t(src.codes, *args[1:], **kwargs))
            except (RuntimeError, ValueError, TypeError, IndexError):  # e.g. a size baked in for another shape
                whole(src.source)
        elif t is _CP_SLICE and args[0] is src:
            dim, _axis, n, seq = args[1:5]
            balanced = args[5] if len(args) > 5 else kwargs.get("balanced", True)
            codes = src.codes.movedim(dim, 0)
            codes = codes.reshape(-1, seq, *codes.shape[1:]).index_select(1, local_positions(seq, n, cp_rank,
                                                                                              balanced))
            if read[src.source] is not None:
                read[src.source].append(codes.reshape(-1))
        else:
            whole(src.source)
    out = {}
    for name, codes in read.items():
        t = wanted[name]
        if codes is None or t.ndim < 2:
            out[name] = None if (codes is None or codes) else torch.zeros(0, dtype=torch.int64)
            continue
        flat = torch.cat([torch.zeros(0, dtype=torch.int64), *codes])
        flat = flat[(flat >= 0) & (flat < t.numel())]  # a pad's value is no element
        inner = math.prod(t.shape[2:])  # elements per position: flat = (row * seq + position) * inner + k
        out[name] = torch.unique(flat // inner % t.shape[1])
    return out

