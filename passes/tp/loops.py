"""A Python loop over the entries of a dim, captured unrolled, rewritten as one computation over that dim.

Zamba's Mamba mixer splits its channels into heads and runs each head's selective scan in a Python loop::

    outs = [scan(x[i], dt[i], A[i], B[i], C[i], D[i], z[i]) for i in range(heads)]   # x: (heads, b, d, s)
    y = torch.cat(outs, dim=1)                                                      # (b, heads * d, s)

torch.export unrolls it: ``heads`` copies of the body, copy ``i`` reading ``select(X, 0, i)`` of the same tensors
``X``. No tp placement survives an op that picks one head (a rank holds only some of them): the plan gathered every
tensor the loop indexed, 38 forward collectives a layer where Megatron's layout runs one.

``vectorize_index_loops`` rewrites the copies into one computation over a leading dim of size ``n`` (what
``torch.vmap`` does, written out for the ops such bodies hold): a ``select(X, d, i)`` becomes ``X`` with dim ``d``
moved first; every op of the body gets that leading dim (its dims shifted by one; a batched operand with fewer
dims than the op's result unsqueezed after the leading dim, so broadcasting lines up as in the body); and the
``cat`` / ``stack`` of the copies' results becomes that dim moved back (a ``cat`` merges it into the dim it
concatenated). Each entry of each new op computes what the copy of its index computed, so the loop's heads are
one dim that tp shards like any other (Zamba: in_proj column-parallel by heads, out_proj row-parallel, one
all-reduce).

A loop is rewritten only when all of this holds, and left as captured otherwise (its indexed tensors gathered,
which the layout check reports):

- its results are the ``n >= 2`` inputs of one ``cat``/``stack``, each read by it alone;
- copy ``i``'s ops are those its result needs that descend from a select at index ``i`` of a dim of size ``n`` of
  a tensor made outside the loop (its roots); the copies share no op, and nothing outside reads a value of one
  (a ``_assert_tensor_metadata`` check of one is dropped with it);
- the copies are alike: the same ops in the same order, each reading the same values from outside (or alike
  copies of one: a ``zeros`` each copy makes), their roots differing only in the index;
- every op of the body has a rule in :func:`_batched` (no random op: a dropout's mask per copy is not the mask of
  the batched op).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mcompile.passes.nodes import _new

__all__ = ["vectorize_index_loops"]

aten = torch.ops.aten
_COMBINES = (aten.cat.default, aten.stack.default)
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
          aten.detach.default, aten.type_as.default, aten.lift_fresh_copy.default}
_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default}
_NEW = {aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default}
_ONE_DIM = {aten.select.int: 1, aten.slice.Tensor: 1, aten.split.Tensor: 2, aten.split_with_sizes.default: 2,
            aten.chunk.default: 2, aten.unbind.int: 1, aten.softmax.int: 1, aten._softmax.default: 1,
            aten.log_softmax.int: 1, aten._log_softmax.default: 1, aten.cumsum.default: 1,
            aten.squeeze.dim: 1, aten.narrow.default: 1}  # op -> the position of its dim argument
_DIM_DEFAULT_0 = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}
_DIM_LISTS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.flip.default,
              aten.squeeze.dims, aten.var.correction, aten.std.correction, aten.logsumexp.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CONTRACTIONS = {aten.matmul.default, aten.bmm.default, aten.mm.default}
_CHECKS = {aten._assert_tensor_metadata.default}


class _Refused(Exception):
    """An op of the body with no rule here: the loop stays unrolled."""


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _ndim(n) -> int:
    v = _val(n)
    if not isinstance(v, torch.Tensor):
        raise _Refused(f"{n} is not a tensor")
    return v.ndim


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _static_size(x, d) -> int | None:
    """Dim ``d`` of ``x`` where it is a plain int (a symbolic size is never compared: that would guard on it)."""
    v = _val(x)
    if not isinstance(v, torch.Tensor) or not isinstance(d, int) or not -v.ndim <= d < v.ndim:
        return None
    size = v.shape[d]
    return size if isinstance(size, int) else None


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = {node}, [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def _iteration(y: fx.Node, i: int, n: int, order: dict) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """``(roots, body)`` of copy ``i``, whose result is ``y`` (module docstring), body in graph order."""
    anc = _ancestors(y)
    picks = [a for a in anc if a.op == "call_function" and a.target is aten.select.int and a.args[2] == i and
             _static_size(a.args[0], a.args[1]) == n]
    if not picks:
        return None
    below = set()  # what a pick's value reaches within anc, the picks excluded
    for a in sorted(anc, key=order.__getitem__):
        if any(x in below or x in picks for x in a.all_input_nodes):
            below.add(a)
    roots = [p for p in picks if p.args[0] not in below]
    body, reach = [], set(roots)
    for a in sorted(anc, key=order.__getitem__):
        if a in reach or any(x in reach for x in a.all_input_nodes):
            reach.add(a)
            body.append(a)
    return (roots, body) if y in reach else None


def _pure(n: fx.Node) -> bool:
    t = n.target
    return n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and not t._schema.is_mutable and \
        torch.Tag.nondeterministic_seeded not in t.tags


def _alike_outside(a, b, depth: int = 6) -> bool:
    """Whether ``a`` (read by copy 0) and ``b`` (read by another copy at the same place) are the same value: the
    same node, equal constants, or the same pure op of alike arguments (a ``zeros`` each copy makes)."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        if a is b:
            return True
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or depth == 0 or not (_pure(a) and _pure(b)):
            return False
        return a.target is b.target and _alike_args(a.args, b.args, lambda x, y: _alike_outside(x, y, depth - 1)) \
            and _alike_args(a.kwargs, b.kwargs, lambda x, y: _alike_outside(x, y, depth - 1))
    return _alike_args(a, b, _alike_outside)


def _alike_args(a, b, same) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (fx.Node, list, tuple, dict)) or isinstance(b, (fx.Node, list, tuple, dict)):
        return same(a, b) if isinstance(a, fx.Node) or isinstance(b, fx.Node) else False
    return type(a) is type(b) and a == b


def _copies(first: tuple, other: tuple, index: int) -> bool:
    """Whether copy ``index`` (roots, body) is copy 0 with its roots' index changed (module docstring)."""
    (roots0, body0), (roots_i, body_i) = first, other
    if len(body0) != len(body_i) or len(roots0) != len(roots_i):
        return False
    pos = {v: k for k, v in enumerate(body0)}
    mine = set(body_i)

    def same(a, b):
        if isinstance(a, fx.Node) and a in pos:
            return b is body_i[pos[a]]
        if isinstance(b, fx.Node) and b in mine:
            return False
        if isinstance(a, (list, tuple, dict)):
            return _alike_args(a, b, same)
        return _alike_outside(a, b)

    for v0, vi in zip(body0, body_i):
        if v0.op != vi.op or v0.target is not vi.target:
            return False
        if v0 in roots0:
            if vi not in roots_i or v0.args[0] is not vi.args[0] or v0.args[1] != vi.args[1] or vi.args[2] != index:
                return False
            continue
        if not (_alike_args(v0.args, vi.args, same) and _alike_args(v0.kwargs, vi.kwargs, same)):
            return False
    return True


class _Batcher:
    """Emits copy 0's body over a leading dim of size ``n`` (module docstring)."""

    def __init__(self, graph: fx.Graph, n: int, roots: list[fx.Node]):
        self.g, self.n, self.roots = graph, n, set(roots)
        self.out: dict[fx.Node, fx.Node] = {}  # body node -> its batched node (or its unbatched value)
        self.batched: set[fx.Node] = set()  # body nodes whose new node has the leading dim
        self.moved: dict[tuple, fx.Node] = {}

    def new(self, target, args, like, kwargs=None) -> fx.Node:
        return _new(self.g, target, args, like, kwargs)

    def lift(self, a: fx.Node, ndim: int, like: fx.Node):
        """Batched ``a`` (body dims ``_ndim(a)``) unsqueezed after the leading dim to ``ndim`` body dims."""
        x = self.out[a]
        for _ in range(ndim - _ndim(a)):
            x = self.new(aten.unsqueeze.default, (x, 1), like)
        return x

    def arg(self, a):
        if isinstance(a, fx.Node) and a in self.out:
            return self.out[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(x) for x in a)
        return a

    def root(self, v: fx.Node) -> fx.Node:
        x, d = v.args[0], _norm(v.args[1], _ndim(v.args[0]))
        if (x, d) not in self.moved:
            nd = _ndim(x)
            self.moved[x, d] = x if d == 0 else \
                self.new(aten.permute.default, (x, [d] + [j for j in range(nd) if j != d]), v)
        return self.moved[x, d]

    def emit(self, v: fx.Node) -> None:
        with self.g.inserting_before(v):
            if v in self.roots:
                self.out[v] = self.root(v)
                self.batched.add(v)
                return
            new, is_batched = self._batched(v)
        self.out[v] = new
        if is_batched:
            self.batched.add(v)

    def _batched(self, v: fx.Node) -> tuple[fx.Node, bool]:
        """The batched node of body node ``v`` and whether it has the leading dim."""
        t, args, kw = v.target, v.args, v.kwargs
        b = [a for a in v.all_input_nodes if a in self.batched]
        if not b:
            raise _Refused(f"{v} reads no batched value")
        if t is operator.getitem:  # an element of a batched split
            got = self.g.call_function(t, (self.out[args[0]], args[1]))
            got.meta.update({k: m for k, m in v.meta.items() if k != "val"})
            got.meta["val"] = self.out[args[0]].meta["val"][args[1]]
            return got, True
        if not isinstance(t, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in t.tags:
            raise _Refused(f"{t}")
        x = args[0] if args else None
        first_only = isinstance(x, fx.Node) and b == [x]
        if t is aten.sym_size.int and first_only:
            return self.new(t, (self.out[x], _norm(args[1], _ndim(x)) + 1), v), False
        if t in _NEW and first_only:
            return self.new(t, (self.out[x], *args[1:]), v, dict(kw)), False
        if torch.Tag.pointwise in t.tags or t in _CASTS or t in _LIKE:
            nd = _ndim(v)
            new = tuple(self.lift(a, nd, v) if isinstance(a, fx.Node) and a in self.batched else self.arg(a)
                        for a in args)
            if any(isinstance(a, fx.Node) and a in self.batched for a in kw.values()):
                raise _Refused(f"{t}: a batched keyword argument")
            return self.new(t, new, v, self.arg(dict(kw))), True
        if t in _CONTRACTIONS:
            a, c = args[0], args[1]
            if _ndim(a) < 2 or _ndim(c) < 2 or kw:
                raise _Refused(f"{t} of a vector")
            nd = max(_ndim(a), _ndim(c))
            ops = [self.lift(o, nd, v) if o in self.batched else self.arg(o) for o in (a, c)]
            return self.new(aten.matmul.default, tuple(ops), v), True
        if t is aten.linear.default and first_only:
            return self.new(t, (self.out[x], *args[1:]), v, dict(kw)), True
        if t in (aten.cat.default, aten.stack.default):
            xs = args[0]
            if not all(a in self.batched for a in xs) or len({_ndim(a) for a in xs}) != 1:
                raise _Refused(f"{t} of batched and unbatched values")
            nd = _ndim(xs[0]) + (t is aten.stack.default)
            d = args[1] if len(args) > 1 else kw.get("dim", 0)
            return self.new(t, ([self.out[a] for a in xs], _norm(d, nd) + 1), v), True
        if not first_only or any(isinstance(a, fx.Node) for a in kw.values()):
            raise _Refused(f"{t} with a batched argument other than its first")
        nd, bx, args = _ndim(x), self.out[x], self.arg(args)
        if t in _ONE_DIM:
            k = _ONE_DIM[t]
            rest = list(args[1:])
            if len(args) > k:
                rest[k - 1] = _norm(args[k], nd) + 1
            elif "dim" in kw:
                kw = {**kw, "dim": _norm(kw["dim"], nd) + 1}
            elif t in _DIM_DEFAULT_0:
                rest += [None] * (k - 1 - len(rest)) + [1]
            else:
                raise _Refused(f"{t} on its default dim")
            return self.new(t, (bx, *rest), v, dict(kw)), True
        if t is aten.unsqueeze.default:
            return self.new(t, (bx, _norm(args[1], nd + 1) + 1), v), True
        if t is aten.transpose.int:
            return self.new(t, (bx, _norm(args[1], nd) + 1, _norm(args[2], nd) + 1), v), True
        if t is aten.permute.default:
            return self.new(t, (bx, [0] + [_norm(p, nd) + 1 for p in args[1]]), v), True
        if t in _VIEWS:  # reshape: a permuted root may not be viewable as the copy's select was
            return self.new(aten.reshape.default, (bx, [self.n, *args[1]]), v), True
        if t is aten.expand.default:
            sizes = list(args[1])
            return self.new(t, (self.lift(x, len(sizes), v), [self.n, *sizes]), v), True
        if t is aten.constant_pad_nd.default and len(args[1]) // 2 <= nd:
            return self.new(t, (bx, *args[1:]), v), True
        if t in _DIM_LISTS:
            dims = args[1] if len(args) > 1 else kw.get("dim")
            if not dims:
                raise _Refused(f"{t} over every dim")
            dims = [dims] if isinstance(dims, int) else dims
            shifted = [_norm(d, nd) + 1 for d in dims]
            if len(args) > 1:
                return self.new(t, (bx, shifted, *args[2:]), v, dict(kw)), True
            return self.new(t, (bx,), v, {**kw, "dim": shifted}), True
        raise _Refused(f"no batching rule for {t}")


def _combine(g: fx.Graph, cat: fx.Node, y: fx.Node, by: fx.Node) -> fx.Node:
    """``cat``/``stack`` of the copies' results from their batched result ``by`` (the result dims of ``y``)."""
    nd = _ndim(y)
    d = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    at = _norm(d, nd + 1 if cat.target is aten.stack.default else nd)
    moved = by if at == 0 else _new(g, aten.permute.default, (by, [*range(1, at + 1), 0, *range(at + 1, nd + 1)]),
                                    cat)
    if cat.target is aten.stack.default:
        return moved
    sizes = []
    for j, s in enumerate(cat.meta["val"].shape):
        if j == at:
            sizes.append(-1)
        elif isinstance(s, int):
            sizes.append(s)
        else:
            sizes.append(_new(g, aten.sym_size.int, (moved, j + (j > at)), cat))
    return _new(g, aten.reshape.default, (moved, sizes), cat)


def _vectorize(g: fx.Graph, cat: fx.Node, order: dict) -> bool:
    ys = cat.args[0]
    n = len(ys)
    if n < 2 or not all(isinstance(y, fx.Node) for y in ys) or len(set(ys)) != n or \
            any(len(y.users) != 1 for y in ys) or len({y.target for y in ys}) != 1:
        return False  # (copies of one body end in the same op: a cheap test before their ancestors are walked)
    copies = []
    for i, y in enumerate(ys):
        it = _iteration(y, i, n, order)
        if it is None:
            return False
        copies.append(it)
    if len({v for _, body in copies for v in body}) != sum(len(body) for _, body in copies):
        return False  # the copies share an op: not independent
    checks = []
    for i, (_, body) in enumerate(copies):
        mine = set(body)
        for v in body:
            for u in v.users:
                if u in mine or (u is cat and v is ys[i]):
                    continue
                if u.op == "call_function" and u.target in _CHECKS:
                    checks.append(u)
                    continue
                return False  # a value of the copy is read outside it
    if not all(_copies(copies[0], copies[i], i) for i in range(1, n)):
        return False
    roots, body = copies[0]
    batcher = _Batcher(g, n, roots)
    made_before = set(g.nodes)
    try:
        for v in body:
            batcher.emit(v)
        if ys[0] not in batcher.batched:
            raise _Refused("the copy's result has no leading dim")
        with g.inserting_before(cat):
            out = _combine(g, cat, ys[0], batcher.out[ys[0]])
    except _Refused:
        for made in reversed([m for m in g.nodes if m not in made_before]):
            g.erase_node(made)
        return False
    cat.replace_all_uses_with(out)
    dead = sorted({cat, *checks, *(v for _, b in copies for v in b)}, key=lambda m: -order[m])
    read = {a for v in dead for a in v.all_input_nodes}
    for v in dead:
        g.erase_node(v)
    # what only the copies read (the other copies' own ``zeros``, a size read for one): gone with them
    todo = [a for a in read if a not in dead]
    while todo:
        a = todo.pop()
        if not a.users and (_pure(a) or a.target is aten.sym_size.int) and a.graph is g and a in order:
            todo += a.all_input_nodes
            order.pop(a)
            g.erase_node(a)
    return True


def vectorize_index_loops(gm: fx.GraphModule) -> int:
    """Unrolled loops over the entries of a dim -> one computation over that dim (module docstring)."""
    count = 0
    order = {v: k for k, v in enumerate(gm.graph.nodes)}
    for cat in [v for v in gm.graph.nodes if v.op == "call_function" and v.target in _COMBINES]:
        if cat in order and cat.graph is gm.graph and not getattr(cat, "_erased", False) and \
                _vectorize(gm.graph, cat, order):
            count += 1
            order = {v: k for k, v in enumerate(gm.graph.nodes)}
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
