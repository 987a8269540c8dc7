"""Attention whose heads are merged into the batch dim, rewritten to keep the heads a dim of their own.

BART/XLM-era attentions (XGLM, TrOCR, MVP, Bloom, ...) compute on 3-D tensors whose first dim is batch x heads::

    q = q4.reshape(b * h, s, d)                       # q4: (b, h, s, d)
    scores = torch.bmm(q, k.transpose(1, 2))          # (b*h, s, s)
    scores = (scores.view(b, h, s, s) + mask).view(b * h, s, s)
    out = torch.bmm(dropout(softmax(scores, -1)), v).view(b, h, s, d)

Sharding heads over tp would need a shard of the inner factor of the merged dim, a placement no rule offers,
so plans gathered q, k and v and ran the attention whole on every rank. ``unmerge_heads`` rewrites such a
region into the same ops on the 4-D values (``bmm`` -> ``matmul`` of (b, h, .., ..), ``baddbmm(c, a, b)`` ->
``c * beta + matmul(a, b) * alpha``, softmax / dropout / pointwise ops / transposes with their dims moved
one right), and a view that splits the merged dim back into (b, h) reads the 4-D value itself. The heads
are then dim 1 everywhere, as in a 4-D attention, and the existing rules shard them (Megatron's layout).

A region starts at a view/reshape merging dims 0 and 1 of a value whose dim 1 is static (heads); it is
rewritten only if it holds a batched matmul (``bmm`` / ``baddbmm``) of two such values with the same (b, h)
or a view splitting the merged dim back (XGLM's softmax between two views), and only whole: if any op
reading a merged value is not one of the above (a reduction over the merged dim, the graph's output, an op
this pass does not know), the region is left as captured. The 4-D ops compute the same elements (a row-major
(b*h, ...) tensor and its (b, h, ...) view hold them alike, so a dropout mask drawn from global indices is the
same too); only fp rounding may differ (baddbmm fuses its alpha).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mcompile.passes.nodes import _new

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_BATCHED = (aten.bmm.default, aten.baddbmm.default)
_DIM_OPS = (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
# ops of one tensor whose other arguments are not dims: the same op on the 4-D value
_SAME = {aten.dropout.default, aten.clone.default, aten.contiguous.default, aten.alias.default, aten.to.dtype,
         aten._to_copy.default, aten.detach.default, aten.type_as.default}


def _eq(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def _shape(n) -> tuple | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _same_shape(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))


def _merged_lead(node: fx.Node):
    """(b, h) if ``node`` is a view merging dims 0 and 1 of a value whose dim 1 (the heads) is static, else None."""
    if node.op != "call_function" or node.target not in _VIEWS or not isinstance(node.args[0], fx.Node):
        return None
    x, out = _shape(node.args[0]), _shape(node)
    if x is None or out is None or len(x) != len(out) + 1 or len(out) < 2 or not isinstance(x[1], int) or x[1] < 2:
        return None
    if not _eq(out[0], x[0] * x[1]) or not _same_shape(out[1:], x[2:]):
        return None
    return x[0], x[1]


class _Region:
    """Merged values reached from the merge views, joined into regions (a bmm of two joins theirs)."""

    def __init__(self):
        self.parent: dict[int, int] = {}

    def find(self, i: int) -> int:
        while self.parent.setdefault(i, i) != i:
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> int:
        a, b = self.find(a), self.find(b)
        self.parent[b] = a
        return a


def unmerge_heads(gm: fx.GraphModule) -> int:
    """Rewrite each attention region computed on (b*h, ...) values into (b, h, ...) ops (module docstring);
    returns how many regions were rewritten."""
    g = gm.graph
    u = _Unmerge(g)
    for node in list(g.nodes):
        u.visit(node)
    done = u.keep_whole_regions()
    if done:
        g.eliminate_dead_code()  # what only the rewritten ops read (Bloom's (b*h, 1, s) bias)
        g.lint()
        gm.recompile()
    return len(done)


class _Unmerge:
    """The rewrite's state over one graph, visited in order: each merged value's 4-D counterpart with its (b, h) and
    region (``four``), the views splitting a merged value back (``splits``), the nodes made per region (``made``, so
    a region left as captured can be erased again) and the regions holding a rewritten batched matmul
    (``batched``)."""

    def __init__(self, g: fx.Graph):
        self.g = g
        self.four: dict[fx.Node, tuple[fx.Node, tuple, int]] = {}  # merged value -> (its 4-D value, (b, h), region)
        self.splits: dict[fx.Node, tuple[fx.Node, int]] = {}  # a view splitting a merged value back -> (4-D, region)
        self.made: list[tuple[int, list[fx.Node]]] = []  # the nodes made, per region, in order
        self.batched: set[int] = set()
        self.regions = _Region()
        self.roots = 0
        self.new: list[fx.Node] = []  # the nodes made for the node being visited

    def visit(self, node: fx.Node) -> None:
        """A merge view starts a region; an op reading merged values gets its 4-D counterpart, made before it, where
        it is one this pass rewrites (else none, and what it made is erased: its region is then blocked)."""
        if node.op != "call_function":
            return
        four = self.four
        lead = _merged_lead(node)
        if lead is not None and node.args[0] not in four:
            four[node] = (node.args[0], lead, self.roots)
            self.regions.find(self.roots)
            self.roots += 1
            return
        ins = [a for a in node.all_input_nodes if a in four]
        if not ins:
            return
        _, lead, region = four[ins[0]]
        for a in ins[1:]:
            if _same_shape(four[a][1], lead):
                region = self.regions.union(region, four[a][2])
        self.new = new = []
        with self.g.inserting_before(node):
            result = self._rewrite(node, ins, lead, region)
            if result is not None and result not in new:
                new.append(result)
        if result is None:
            for n in reversed(new):
                self.g.erase_node(n)
            return
        four[node] = (result, lead, region)
        self.made.append((region, new))

    def _rewrite(self, node: fx.Node, ins: list, lead: tuple, region: int):
        """The 4-D op computing ``node`` from the 4-D values, or None where ``node`` is not one this pass rewrites.
        A view splitting the merged dim back makes nothing: it is recorded in ``splits`` (the 4-D value itself)."""
        g, t = self.g, node.target
        x = ins[0]
        x4 = self.four[x][0]
        rank = len(_shape(x))
        out = _shape(node)
        if t in _VIEWS and node.args[0] is x:
            if _same_shape(out, tuple(lead) + _shape(x)[1:]):
                self.splits[node] = (x4, region)  # splits the merged dim back: the 4-D value itself
            return None
        if t in _BATCHED and len(ins) >= 2:
            return self._batched(node, lead, region)
        if t in (aten.transpose.int,) and node.args[0] is x:
            i, j = (d % rank for d in node.args[1:3])
            return _new(g, t, (x4, i + 1, j + 1), node) if i and j else None
        if t is aten.permute.default and node.args[0] is x:
            dims = [d % rank for d in node.args[1]]
            return _new(g, t, (x4, [0, 1] + [d + 1 for d in dims[1:]]), node) if dims[0] == 0 else None
        if t in _DIM_OPS and node.args[0] is x and node.args[1] % rank:
            return _new(g, t, (x4, node.args[1] % rank + 1, *node.args[2:]), node, dict(node.kwargs))
        if t in _SAME and node.args[0] is x and len(ins) == 1:
            return _new(g, t, (x4, *node.args[1:]), node, dict(node.kwargs))
        if torch.Tag.pointwise in getattr(t, "tags", ()) and out is not None and len(out) == rank \
                and _eq(out[0], _shape(x)[0]):
            args = [self._counterpart(a, lead, rank) if isinstance(a, fx.Node) else a for a in node.args]
            if all(a is not None for a in args) and not any(isinstance(v, fx.Node) for v in node.kwargs.values()):
                return _new(g, t, tuple(args), node, dict(node.kwargs))
        return None

    def _batched(self, node: fx.Node, lead: tuple, region: int):
        """``bmm(a, b)`` -> ``matmul`` of (b, h, .., ..) values, ``baddbmm(c, a, b)`` -> ``c * beta + matmul(a, b) *
        alpha``, where both operands are merged values; the region then holds a batched matmul. None otherwise."""
        g, t, four, new = self.g, node.target, self.four, self.new
        i = 1 if t is aten.baddbmm.default else 0
        a4, b4 = self._counterpart(node.args[i], lead, 3), self._counterpart(node.args[i + 1], lead, 3)
        if not (node.args[i] in four and node.args[i + 1] in four and a4 is not None and b4 is not None):
            return None
        result = _new(g, aten.matmul.default, (a4, b4), node)
        new.append(result)
        if t is aten.baddbmm.default:
            beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
            c4 = self._counterpart(node.args[0], lead, 3)
            if c4 is None or len(node.args) > 3:
                result = None
            else:
                if alpha != 1:
                    result = _new(g, aten.mul.Tensor, (result, alpha), node)
                    new.append(result)
                if beta != 1:
                    c4 = _new(g, aten.mul.Tensor, (c4, beta), node)
                    new.append(c4)
                if beta != 0:
                    result = _new(g, aten.add.Tensor, (c4, result), node)
                    new.append(result)
        if result is not None:
            self.batched.add(region)
        return result

    def _counterpart(self, a, lead, rank):
        """A tensor argument of an op on merged values, as it is read by the 4-D op (None: cannot)."""
        if a in self.four:
            return self.four[a][0] if _same_shape(self.four[a][1], lead) else None
        s = _shape(a)
        if s is None or not isinstance(a, fx.Node):
            return a  # a number
        if len(s) < rank or (len(s) == rank and _eq(s[0], 1)):
            return a  # broadcast along the trailing dims (or a size-1 merged dim): the same against (b, h, ...)
        if len(s) == rank and _eq(s[0], lead[0] * lead[1]):  # a (b*h, ...) value made elsewhere: viewed 4-D
            v = self._from_heads(a, lead)
            if v is not None:
                return v
            g = self.g
            sizes = [-1, lead[1]] + [d if isinstance(d, int) else _new(g, aten.sym_size.int, (a, i), a)
                                     for i, d in enumerate(s[1:], 1)]
            self.new.extend(x for x in sizes[2:] if isinstance(x, fx.Node))
            v = _new(g, aten.view.default, (a, sizes), a)
            self.new.append(v)
            return v
        return None

    def _from_heads(self, a, lead):
        """A (b*h, ...) value made by merging a (b, h, ...) one (Bloom's ALiBi bias, ``(b, h, s)`` reshaped to
        ``(b*h, 1, s)`` then cast): the same ops from that value, reshaped to (b, h, ...) instead, so its heads
        stay the dim tp shards. None if it is not so made."""
        chain, cur = [], a
        while cur.op == "call_function" and cur.target in _SAME and len(cur.all_input_nodes) == 1:
            chain.append(cur)
            cur = cur.args[0]
        if cur.op != "call_function" or cur.target not in _VIEWS or not isinstance(cur.args[0], fx.Node):
            return None
        src, sizes = _shape(cur.args[0]), list(cur.args[1])
        if src is None or len(src) < 2 or not _same_shape(src[:2], lead) or -1 in sizes[1:]:
            return None
        v = _new(self.g, aten.reshape.default, (cur.args[0], [-1, lead[1], *sizes[1:]]), cur)
        self.new.append(v)
        for op in reversed(chain):
            v = _new(self.g, op.target, (v, *op.args[1:]), op, dict(op.kwargs))
            self.new.append(v)
        return v

    def keep_whole_regions(self) -> set[int]:
        """A region is rewritten whole, or not at all: each merged value's readers all rewritten, a bmm (or a view
        splitting the heads back) among them. The other regions' new nodes are erased; in the kept ones the split
        views read the 4-D values and the merged values no one reads are erased. Returns the kept regions."""
        g, four, splits, regions = self.g, self.four, self.splits, self.regions
        blocked = {regions.find(r) for n, (_, _, r) in four.items() if any(u not in four and u not in splits
                                                                           for u in n.users)}
        done = {regions.find(r) for r in self.batched | {r for _, r in splits.values()}} - blocked
        for region, nodes in reversed(self.made):
            if regions.find(region) not in done:
                for n in reversed(nodes):
                    g.erase_node(n)
        for view, (x4, region) in splits.items():
            if regions.find(region) in done:
                view.replace_all_uses_with(x4)
        for n in reversed(list(four) + list(splits)):
            if not n.users and regions.find((four.get(n) or splits[n])[-1]) in done:
                g.erase_node(n)
        return done
