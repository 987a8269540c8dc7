"""Lowering of training-mode dropout to ``mcompile::dropout`` with global element indices (mcompile/ir/dropout.py).

A rank's local piece of the dropout's input is a box (or, for block shards and context-parallel chunks, a
union of boxes) of the single-device tensor. Its elements' global coordinates are found dim by dim the way
the data was cut: start from ``arange`` over the dim's size in this program, then take this rank's piece
of it along every axis that shards the dim, in mesh order (outer axes first, as :func:`local_shape` and
the placements' ``local_piece`` cut):

* ``Shard(d)``: the ``rank``-th of ``n`` equal slices;
* ``BlockShard(d, k)``: the dim as ``k`` equal blocks, the ``rank``-th slice of each;
* a context-parallel ``Shard(d)``: the load-balanced chunks of the sequence (``mcompile::cp_slice`` of the
  index itself, so the two can never disagree);
* ``Replicate`` and ``Partial``: the whole dim (a Partial value is masked alike on every rank: dropout is
  linear, so the sum of the masked pieces is the masked sum).

Axes whose inputs arrive split (dp, ep: ``inputs_presharded``) have already cut the batch: the program's
batch symbol is its own rows, which start at row ``batch offset`` (the runtime's ``mc_rng[2]``: the data
rank's slice and the microbatch) of the global batch. The dim carrying the batch symbol is the *row* dim;
when it is a flattened ``[b*s]`` its program-level row ``j`` is global row ``offset * s + j``
(``row_scale = s``). Every other dim's global size is its captured size, rebuilt from the program's input
sizes (sequence and hidden sizes are whole there).
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from mcompile.ir.dropout import dropout as dropout_op
from mcompile.ir.dropout import node_key, random_like
from mcompile.ir.placements import BlockShard, Shard
from mcompile.sharding.rules import to_expr

aten = torch.ops.aten
OP = torch.ops.mcompile.dropout.default
RANDOM_OP = torch.ops.mcompile.random_like.default
# a random op -> (its arguments after the input -> (kind, a, b) of mcompile::random_like)
RANDOM = {  # by the op's schema arguments (defaults filled in)
    aten.rand_like.default: lambda v: ("uniform", 0.0, 1.0),
    aten.uniform.default: lambda v: ("uniform", v["from"], v["to"]),
    aten.exponential.default: lambda v: ("exponential", v["lambd"], 0.0),
}

__all__ = ["OP", "RANDOM_OP", "RANDOM", "is_training_dropout", "is_random", "lower_dropout", "lower_random", "rekey"]


def is_training_dropout(node: fx.Node) -> bool:
    """``aten.dropout(x, p, train=True)`` with p > 0: the op this lowering replaces."""
    return node.op == "call_function" and node.target is aten.dropout.default and bool(node.args[2]) \
        and float(node.args[1]) > 0


def lower_dropout(g: fx.Graph, node: fx.Node, x: fx.Node, in_pl: tuple, axes, sym, batch_sym, seq_sym, rng: fx.Node,
                  device) -> fx.Node:
    """Emit ``mcompile::dropout`` of the local value ``x`` (the captured ``node``'s input, placed ``in_pl``
    per axis) into ``g``. ``sym`` rebuilds a size from the program's inputs; ``rng`` is the program input
    ``mc_rng``."""
    assert dropout_op is not None  # registers the op
    index, sizes, row_dim, row_scale = _global_index(g, node, "dropout", in_pl, axes, sym, batch_sym, seq_sym, device)
    p = float(node.args[1])
    return g.call_function(OP, (x, rng, p, node_key(node.name), index, sizes, row_dim, row_scale))


def is_random(node: fx.Node) -> bool:
    """A random op whose values :func:`lower_random` draws from the counter (``torch.rand_like``,
    ``Tensor.uniform_``, ``Tensor.exponential_``, functionalised), without a generator argument."""
    return node.op == "call_function" and node.target in RANDOM and node.kwargs.get("generator") is None


def lower_random(g: fx.Graph, node: fx.Node, x: fx.Node, in_pl: tuple, axes, sym, batch_sym, seq_sym, rng: fx.Node,
                 device) -> fx.Node:
    """Emit ``mcompile::random_like`` for the captured random op ``node`` whose (shape-giving) input is the local
    value ``x``: the numbers of each element depend on its place in the single-device tensor only, as dropout's
    masks (mcompile/ir/dropout.py random_like)."""
    assert random_like is not None  # registers the op
    index, sizes, row_dim, row_scale = _global_index(g, node, "random numbers", in_pl, axes, sym, batch_sym, seq_sym,
                                                     device)
    schema = node.target._schema.arguments
    vals = {a.name: a.default_value for a in schema if a.has_default_value()}
    vals.update(zip((a.name for a in schema), node.args))
    vals.update(node.kwargs)
    kind, a, b = RANDOM[node.target](vals)
    return g.call_function(RANDOM_OP, (x, rng, kind, node_key(node.name), index, sizes, row_dim, row_scale,
                                       float(a), float(b)))


def _global_index(g: fx.Graph, node: fx.Node, what: str, in_pl: tuple, axes, sym, batch_sym, seq_sym, device):
    """(index, sizes, row_dim, row_scale): the global coordinates of the local piece of ``node``'s first input
    (placed ``in_pl``), as :func:`mcompile.ir.dropout.keep_mask` reads them (the module docstring)."""
    xv = node.args[0].meta["val"]
    shape = [to_expr(s) for s in xv.shape]
    where = _where(node)
    rows = [d for d, e in enumerate(shape) if batch_sym is not None and isinstance(e, sympy.Expr)
            and batch_sym in e.free_symbols]
    if len(rows) > 1:
        raise NotImplementedError(f"{node.name}{where}: {what} of a tensor whose dims {rows} all carry the batch "
                                  f"({list(xv.shape)}); mcompile's counter indexes one batch dim")
    row_dim = rows[0] if rows else -1
    row_scale = 1
    if rows:
        k = sympy.simplify(shape[row_dim] / batch_sym)
        if batch_sym in k.free_symbols:
            raise NotImplementedError(f"{node.name}{where}: {what} of a tensor whose dim {row_dim} is "
                                      f"{shape[row_dim]}, not the batch times a size")
        row_scale = sym(k)
    dev = device if device is not None else xv.device
    index, sizes = [], []
    for d, e in enumerate(shape):
        length = sympy.sympify(e)  # this program's size of the dim, cut further below
        idx = g.call_function(aten.arange.default, (sym(e),), {"dtype": torch.int64, "device": dev})
        for ax, p in zip(axes, in_pl):
            if ax.inputs_presharded or not isinstance(p, Shard | BlockShard) or p.dim % len(shape) != d:
                continue
            # (a flattened [b*s] row dim cut here is still fine: the program's row j is global row offset*s + j
            # for every j, a piece of them included)
            n = ax.size
            if length.is_Integer and int(length) % n:
                raise NotImplementedError(f"{node.name}{where}: {what} of a dim of {length} that {ax.name}={n} does "
                                          "not divide (a padded shard)")
            if ax.context_parallel:
                if seq_sym is None:
                    raise NotImplementedError(f"{node.name}{where}: context parallelism needs a dynamic sequence")
                idx = g.call_function(torch.ops.mcompile.cp_slice.default, (idx, 0, ax.name, n, sym(seq_sym)))
            elif isinstance(p, BlockShard):
                if not isinstance(p.blocks, int):
                    raise NotImplementedError(f"{node.name}{where}: {what} of a tensor sharded in unequal blocks "
                                              f"({p!r}) over {ax.name}")
                piece = length / (p.blocks * n)
                blocks = g.call_function(aten.view.default, (idx, [p.blocks, -1]))
                mine = g.call_function(aten.narrow.default, (blocks, 1, sym(piece * ax.rank), sym(piece)))
                idx = g.call_function(aten.reshape.default, (mine, [-1]))
            else:
                piece = length / n
                idx = g.call_function(aten.narrow.default, (idx, 0, sym(piece * ax.rank), sym(piece)))
            length = length / n
        index.append(idx)
        sizes.append(0 if d == row_dim else sym(e))
    return index, sizes, row_dim, row_scale


def rekey(gm: fx.GraphModule, origin_key: str) -> int:
    """Give every ``mcompile::dropout`` / ``mcompile::random_like`` node the key of the captured node it implements
    (``node.meta[origin_key]``): the copies of repeated blocks (mcompile.sharding.repeat) carry their group's
    name there, and must not reuse the first group's masks. Returns how many changed."""
    changed = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (OP, RANDOM_OP) and n.meta.get(origin_key):
            key = node_key(n.meta[origin_key])
            if n.args[3] != key:
                args = list(n.args)
                args[3] = key
                n.args = tuple(args)
                changed += 1
    if changed:
        gm.recompile()
    return changed


def _where(node: fx.Node) -> str:
    from mcompile.sharding.planner import _where as source_line

    line = source_line(node)
    return f" (at {line})" if line else ""
