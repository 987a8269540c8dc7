"""Canonicalise the captured graph before planning, so rules see one form per idea.

- ``inline_grad_regions``: a ``with torch.no_grad():`` inside forward (CPM-Ant's position buckets,
  M2M-100's sinusoidal positions) is exported as ``wrap_with_set_grad_enabled(False, submod, *args)``, a
  higher-order op over a subgraph. Its ops are inlined into the program and each value leaving the region
  is detached (no gradient flows out of a no-grad region, as in eager), so every later pass, the planner and
  the per-rank programs see plain aten ops (and block repetition one stretch of ops a layer). A
  ``torch.autocast(..., enabled=False)`` region (``wrap_with_autocast``) is inlined as it is; an enabled one
  is refused (mcompile runs one dtype of its own).
- ``expand_as_to_expand``: ``x.expand_as(y)`` (HRM's carried state) -> ``x.expand(y's sizes)``: ``y`` gives
  only its shape (its sizes read with ``sym_size`` where symbolic), and expand's rule serves both spellings.
- ``conv1d_to_matmul``: Hugging Face GPT-2's ``Conv1D`` flattens, ``addmm``s with a weight stored
  [in, out] and views back: ``view(addmm(b, view(x, [-1, k]), W), [.., n])``. Rewritten as
  ``add(matmul(x, W), b)`` on the unflattened activation, so the sequence dim survives for
  sequence parallelism and the weight is a direct argument of the contraction.
- ``functional_inplace``: ``y = x.add_(z)`` (Falcon's ``mlp_output += attention_output``) on a tensor the
  model made -> ``y = add(x, z)``, later readers of ``x`` reading ``y``, as AOTAutograd's functionalisation
  does: one rule per op (add's) serves both spellings, and no local op writes into a value the lowering
  may have redistributed (a copy). Writes into inputs, parameters and buffers stay writes (they are the
  program's effects); a write into a view, or into a tensor a view was taken of, stays too (the per-rank
  joint trace rewrites or refuses those: passes/joint.py ``functional_writes``).
- ``as_strided_of_storage``: ``as_strided(x, size, stride)`` with ``x`` a view of ``B`` (contiguous from offset 0 in
  the capture) -> ``as_strided(clone(B, contiguous), size, stride, x's offset)``: its strides read memory laid out as
  in the capture, which a rank's program may not keep for ``x`` (an all-gathered value); a copy of ``B`` keeps it.
- ``tiled_writes_to_cat``: a fresh tensor (``new_empty`` / ``zeros`` ...) filled by ``copy_`` into slices that
  tile one of its dims, then read whole (Hugging Face DeepSeek-V3's attention builds its keys so: the
  per-head ``k_nope`` and the shared rope key expanded to every head, written into the two halves of
  ``k.new_empty(...)``) -> ``cat`` of the sources along that dim: the same value, in the form the rules lay
  out by heads like the query's ``cat`` (the planner does not follow writes through views: the written
  tensor would stay whole, and attention with it). Writes into ``select``s of the dim count as slices of one
  (their sources unsqueezed), even a single one: Hugging Face's chunked gated delta rule (Qwen3.5, LaraMini)
  fills ``core_attn_out = zeros_like(...)`` by ``core_attn_out[:, :, i] = ...`` per chunk; left a write, the
  planner placed its destination by heads and its source whole, and the lowering's slice of the destination
  was a copy that the write went into (the output was all zeros, the mixer's gradients none).
- ``transposed_weight_to_linear``: ``matmul(x, W.T)`` (``numpy_T``, ``t``, ``transpose(0, 1)`` of a 2-D
  parameter; Falcon's ``FalconLinear``) -> ``linear(x, W)``: the weight is then a direct argument of the
  contraction, placed by it (column- or row-parallel), not by the transpose that reads it first.
- ``unmerge_heads`` (passes/tp/heads.py): attention computed on (batch x heads, ...) values (``bmm`` after
  ``reshape(b * h, s, d)``) -> the same ops on (b, h, ...) values, so the heads are a dim tp can shard.
- ``vectorize_index_loops`` (passes/tp/loops.py): a Python loop over the entries of a dim, captured as one copy
  of its body per entry (``select(x, d, i)``; Zamba's per-head scans), concatenated -> one copy over that dim,
  which tp shards (an op that picks one head survives no tp placement of the heads: they were gathered).
- ``view_as_to_view``: ``x.view_as(other)`` -> ``x.view(sizes of other)``, one rule (view's) for both.
- ``unflatten_rowwise``: a norm run on rows flattened from (token, head) pairs and reshaped back (a
  linear-attention mixer's gated per-head RMSNorm) runs on the unflattened tensor, so the heads stay
  split over tp through it. A flatten of a projection's features straight to rows of ``d`` (OLMo-hybrid's
  gate ``g_proj(h).reshape(-1, head_v_dim)``) makes the same rows as its ``unflatten(-1, (k, d))``: so read.
- ``projection_norm_statistics``: a LayerNorm straight after a projection, over its whole output (ESM-C's
  q/k norm over all heads: ``q_norm(q_proj(x))``) -> the norm written out (mean, centred, mean of squares,
  rsqrt, weight, bias), as OLMo-2's RMSNorm over all heads is written by the model. tp shards that output by
  heads, and the norm's statistics then reduce as ``Partial(avg)`` (an all-reduce of [b, s, 1], the
  model's, which the quality check does not count); the one ``layer_norm`` op has no such rule, so its input
  was gathered and the attention after it run whole. Computed in fp32, as the fused op does.
- ``split_linear_bias``: ``linear(x, W, b)`` -> ``add(linear(x, W), b)``. A row-parallel linear's
  output is Partial and its bias must be added after the reduction (DESIGN §11); splitting every
  bias lets the propagator place the add after the collective. (A later fusion pass re-fuses biases
  of column-parallel linears.)
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mcompile.capture.grad_regions import inline_grad_regions  # noqa: F401 - a pass of this module (moved: capture uses it)
from mcompile.ir import meta as M
from mcompile.ir.meta import ATTENTION_CORE
from mcompile.passes.nodes import _fake_call, _new, _product_value  # noqa: F401  (re-exported)

aten = torch.ops.aten



def _recompiled(gm: fx.GraphModule, count: int) -> int:
    """A rewrite's tail: the graph checked and its code regenerated when ``count`` nodes were rewritten."""
    if count:
        gm.graph.lint()
        gm.recompile()
    return count

def expand_as_to_expand(gm: fx.GraphModule) -> int:
    """``x.expand_as(y)`` (HRM's carried state) -> ``x.expand(y's sizes)``: the expand rule places it."""
    return _sized_like_other(gm, aten.expand_as.default, aten.expand.default)


def _sized_like_other(gm: fx.GraphModule, src_op, dst_op) -> int:
    """``src_op(x, other)`` -> ``dst_op(x, other's sizes)``, a symbolic size read from ``other`` by
    ``sym_size`` (a dynamic batch): only other's shape is read, so one rule (the sized op's) places both."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not src_op:
            continue
        x, other = node.args
        with gm.graph.inserting_before(node):
            sizes = [d if isinstance(d, int) else _new(gm.graph, aten.sym_size.int, (other, i), node)
                     for i, d in enumerate(other.meta["val"].shape)]
            new = _new(gm.graph, dst_op, (x, sizes), node)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    return _recompiled(gm, count)


def conv1d_to_matmul(gm: fx.GraphModule) -> int:
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.addmm.default:
            continue
        bias, flat, w = node.args[:3]
        if len(node.args) > 3 or node.kwargs:
            continue  # beta/alpha given: leave it
        if not (isinstance(flat, fx.Node) and flat.target in (aten.view.default, aten.reshape.default)):
            continue
        x = flat.args[0]
        users = list(node.users)
        if len(users) != 1 or users[0].target not in (aten.view.default, aten.reshape.default):
            continue
        back = users[0]
        xv, outv = x.meta["val"], back.meta["val"]
        if xv.ndim < 3 or list(outv.shape[:-1]) != list(xv.shape[:-1]):
            continue
        with gm.graph.inserting_before(back):
            mm = _new(gm.graph, aten.matmul.default, (x, w), node)
            add = _new(gm.graph, aten.add.Tensor, (mm, bias), node)
        back.replace_all_uses_with(add)
        gm.graph.erase_node(back)
        gm.graph.erase_node(node)
        if not flat.users:
            gm.graph.erase_node(flat)
        count += 1
    gm.graph.lint()
    gm.recompile()
    return count


# writes that change no value (autograd flags): rules of their own, nothing to rewrite; and copy_, whose
# functional form aten.copy has no derivative (the joint trace, passes/joint.py, rewrites the copies it can)
_KEPT_WRITES = {aten.detach_.default, aten.requires_grad_.default, aten.copy_.default}


def _aliases(node: fx.Node) -> bool:
    """Whether ``node``'s value is a view of another tensor (a write into it writes that tensor too)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:  # an element of split / unbind / chunk
        return _aliases(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def functional_inplace(gm: fx.GraphModule) -> int:
    """In-place ops on tensors the model made -> their functional form (module docstring)."""
    count = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in list(gm.graph.nodes):
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not schema.is_mutable or n.target in _KEPT_WRITES:
            continue
        dst = n.args[0] if n.args else None
        packet, overload = schema.name.split("::")[1], n.target._overloadname
        functional = getattr(getattr(aten, packet[:-1], None), overload, None) if packet.endswith("_") else None
        if (not isinstance(dst, fx.Node) or dst.op != "call_function" or _aliases(dst) or functional is None
                or not schema.arguments[0].alias_info or not schema.arguments[0].alias_info.is_write):
            continue
        # a view of dst taken before the write would see it: leave such a write as it is
        # (a view of something else that merely reads dst, as expand_as(mask, dst) does, sees no write)
        if any(u is not n and order[u] < order[n] and _aliases(u) and u.args[0] is dst for u in dst.users):
            continue
        val = _fake_call(functional, n.args, n.kwargs)
        old = n.meta.get("val")
        if not isinstance(old, torch.Tensor) or val.shape != old.shape or val.dtype != old.dtype:
            continue  # type promotion or broadcasting the in-place form does not do: not the same value
        with gm.graph.inserting_after(n):
            new = gm.graph.call_function(functional, tuple(n.args), dict(n.kwargs))
        new.meta = {**n.meta, "val": val}
        for u in list(dst.users):  # who reads dst after the write reads the written value
            if u is not n and u is not new and order[u] > order[n]:
                u.replace_input_with(dst, new)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        order[new] = order[n]
        count += 1
    return _recompiled(gm, count)


_STORAGE_READERS = {aten.as_strided.default}


def _storage_owner(x: fx.Node) -> fx.Node | None:
    """The node whose value owns ``x``'s storage, ``x`` reached from it through views alone (None when a link is
    not an aten view or a split's element: a function whose aliasing we cannot see)."""
    while _aliases(x):
        if x.target is not operator.getitem and getattr(x.target, "_schema", None) is None:
            return None
        x = x.args[0]
        if not isinstance(x, fx.Node):
            return None
    return x


def as_strided_of_storage(gm: fx.GraphModule) -> int:
    """``as_strided(x, size, stride[, offset])`` -> ``as_strided(clone(B, contiguous), size, stride, offset)``, B
    the tensor whose storage ``x`` views (module docstring). ``as_strided`` reads memory, not values: its
    strides were computed from the capture's layout of ``x`` (Longformer's overlapping chunks: a view of a
    projection in (seq, batch, hidden) order, strides in ``batch``). A per-rank program holds the same values in
    other layouts (an all-gathered or re-sliced tensor is contiguous in its own order), where those strides read
    the wrong elements: a silently wrong value and gradient. Read from a contiguous copy of the storage's owner,
    the strides mean what they meant in the capture in any program. Left as it is where the owner was not
    contiguous from offset 0 in the capture or ``x``'s offset is not a constant: the planner then refuses to run
    it on any value a rank program may lay out differently (``mcompile.sharding.propagate``)."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _STORAGE_READERS or not isinstance(n.args[0], fx.Node):
            continue
        x = n.args[0]
        base = _storage_owner(x)
        if base is None or base is x and base.target is aten.clone.default:
            continue
        bv, xv = base.meta.get("val"), x.meta.get("val")
        if not isinstance(bv, torch.Tensor) or not isinstance(xv, torch.Tensor):
            continue
        offset = n.args[3] if len(n.args) > 3 else n.kwargs.get("storage_offset")
        if offset is None:
            offset = xv.storage_offset()
        try:
            ok = bool(bv.is_contiguous()) and int(bv.storage_offset()) == 0 and isinstance(offset, int | fx.Node)
            offset = int(offset) if not isinstance(offset, fx.Node) else offset
        except (TypeError, ValueError, RuntimeError):  # a symbolic offset or a layout decided by a symbol
            ok = False
        if not ok:
            continue
        with gm.graph.inserting_before(n):
            owner = _new(gm.graph, aten.clone.default, (base,), base, {"memory_format": torch.contiguous_format})
        n.args = (owner, n.args[1], n.args[2], offset)
        n.kwargs = {}
        count += 1
        while x is not base and not x.users and _aliases(x):  # the views read by the as_strided alone
            up = x.args[0]
            gm.graph.erase_node(x)
            x = up
    return _recompiled(gm, count)


_FRESH = {aten.new_empty.default, aten.new_zeros.default, aten.empty.memory_format, aten.zeros.default,
          aten.empty_like.default, aten.zeros_like.default}


def _tiling_writes(base: fx.Node, order: dict) -> tuple[int, list[fx.Node]] | None:
    """``(dim, copies in slice order)`` when every use of the fresh tensor ``base`` before its last write is
    ``copy_(slice(base, dim, a, b), src)``, the slices tile ``dim`` and each ``src`` has its slice's shape
    and dtype (nothing to broadcast or cast); None otherwise."""
    n = base.meta["val"]
    dims, parts, readers = set(), [], []
    selects = False
    for u in base.users:
        picked = u.op == "call_function" and u.target is aten.select.int and u.args[0] is base \
            and isinstance(u.args[2], int)
        if picked:  # one index of the dim: the slice [i, i + 1) without the dim
            i = u.args[2] % n.shape[u.args[1]] if isinstance(n.shape[u.args[1]], int) else u.args[2]
            selects = True
        if picked or u.op == "call_function" and u.target is aten.slice.Tensor and u.args[0] is base:
            dim, start, end, step = (u.args[1], i, i + 1, 1) if picked else \
                (list(u.args[1:]) + [0, None, None, 1][len(u.args) - 1:])[:4]
            users = list(u.users)
            if step != 1 or len(users) != 1 or users[0].target is not aten.copy_.default or users[0].args[0] is not u \
                    or users[0].users or not isinstance(start, int) or not isinstance(end, int | None):
                return None
            src = users[0].args[1]
            sv, dv = getattr(src, "meta", {}).get("val"), u.meta["val"]
            if not isinstance(sv, torch.Tensor) or sv.dtype != dv.dtype or str(tuple(sv.shape)) != str(tuple(dv.shape)):
                return None
            dims.add(dim % n.ndim)
            size = n.shape[dim]
            parts.append((start, size if end is None or (isinstance(size, int) and end >= size) else end, users[0]))
        else:
            readers.append(u)
    # one write covering the whole dim is a plain copy, unless it is a select (the dim is then its unsqueeze:
    # the gated delta rule's output chunks, ``out[:, :, i] = ...`` for each of its one or more chunks)
    if len(dims) != 1 or len(parts) < (1 if selects else 2) or not isinstance(n.shape[next(iter(dims))], int):
        return None
    parts.sort(key=lambda p: p[:2])
    size = n.shape[next(iter(dims))]
    if parts[0][0] != 0 or parts[-1][1] != size or any(a[1] != b[0] for a, b in zip(parts, parts[1:])):
        return None
    last = max(order[c] for *_, c in parts)
    if any(order[r] < last or getattr(getattr(r.target, "_schema", None), "is_mutable", False) for r in readers):
        return None
    return next(iter(dims)), [c for *_, c in parts]


def tiled_writes_to_cat(gm: fx.GraphModule) -> int:
    """A fresh tensor filled by ``copy_`` into slices tiling a dim -> ``cat`` of the sources (module docstring)."""
    count = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for base in list(gm.graph.nodes):
        if base.op != "call_function" or base.target not in _FRESH or not isinstance(base.meta.get("val"),
                                                                                       torch.Tensor):
            continue
        found = _tiling_writes(base, order)
        if found is None:
            continue
        dim, copies = found
        last = max(copies, key=order.__getitem__)
        with gm.graph.inserting_before(last.next):  # in order, after the last write
            pieces = [_new(gm.graph, aten.unsqueeze.default, (c.args[1], dim), c) if c.args[0].target is
                      aten.select.int else c.args[1] for c in copies]  # a select's source lacks the dim
            cat = _new(gm.graph, aten.cat.default, (pieces, dim), last)
        written = {c.args[0] for c in copies}  # the slices / selects written into: erased below
        base.replace_all_uses_with(cat, delete_user_cb=lambda u, written=written: u not in written)
        for c in copies:
            sl = c.args[0]
            gm.graph.erase_node(c)
            gm.graph.erase_node(sl)
        gm.graph.erase_node(base)
        count += 1
    return _recompiled(gm, count)


_TRANSPOSES = {aten.numpy_T.default, aten.t.default, aten.transpose.int, aten.permute.default}


def transposed_weight_to_linear(gm: fx.GraphModule) -> int:
    """``matmul(x, W.T)`` of a 2-D parameter -> ``linear(x, W)`` (module docstring)."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.matmul.default or node.kwargs:
            continue
        x, wt = node.args
        if not (isinstance(wt, fx.Node) and wt.op == "call_function" and wt.target in _TRANSPOSES):
            continue
        w = wt.args[0]
        if not (isinstance(w, fx.Node) and w.op == "placeholder" and M.PARAM_FQN in w.meta
                and w.meta["val"].ndim == 2):
            continue
        if wt.target is aten.transpose.int and sorted(d % 2 for d in wt.args[1:3]) != [0, 1]:
            continue
        if wt.target is aten.permute.default and [d % 2 for d in wt.args[1]] != [1, 0]:
            continue
        with gm.graph.inserting_after(node):
            lin = _new(gm.graph, aten.linear.default, (x, w), node)
        node.replace_all_uses_with(lin)
        gm.graph.erase_node(node)
        if not wt.users:
            gm.graph.erase_node(wt)
        count += 1
    return _recompiled(gm, count)


def view_as_to_view(gm: fx.GraphModule) -> int:
    """``x.view_as(other)`` -> ``x.view(other's sizes)`` (a symbolic size read by ``sym_size``): the view rule
    places it (Beam's attention)."""
    return _sized_like_other(gm, aten.view_as.default, aten.view.default)


def split_linear_bias(gm: fx.GraphModule) -> int:
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if bias is None:
            continue
        with gm.graph.inserting_after(node):
            lin = _new(gm.graph, aten.linear.default, (node.args[0], node.args[1]), node)
        with gm.graph.inserting_after(lin):
            add = _new(gm.graph, aten.add.Tensor, (lin, bias), node)
        node.replace_all_uses_with(add)
        gm.graph.erase_node(node)
        count += 1
    gm.graph.lint()
    gm.recompile()
    return count


_CASTS = (aten.to.dtype, aten._to_copy.default)


def projection_norm_statistics(gm: fx.GraphModule) -> int:
    """A LayerNorm over the whole output of a projection -> its statistics written out (module docstring)."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.layer_norm.default:
            continue
        x, shape = node.args[0], node.args[1]
        w = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        b = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
        eps = node.args[4] if len(node.args) > 4 else node.kwargs.get("eps", 1e-5)
        src = x
        while isinstance(src, fx.Node) and src.op == "call_function" and src.target in _CASTS:
            src = src.args[0]
        if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.linear.default):
            continue
        weight = src.args[1]
        if not (isinstance(weight, fx.Node) and weight.op == "placeholder" and M.PARAM_FQN in weight.meta):
            continue
        val = x.meta["val"]
        if len(shape) != 1 or not val.dtype.is_floating_point or val.shape[-1] != weight.meta["val"].shape[0]:
            continue
        g = gm.graph
        with g.inserting_before(node):
            h = x if val.dtype == torch.float32 else _new(g, aten.to.dtype, (x, torch.float32), node)
            mean = _new(g, aten.mean.dim, (h, [-1], True), node)
            centred = _new(g, aten.sub.Tensor, (h, mean), node)
            var = _new(g, aten.mean.dim, (_new(g, aten.mul.Tensor, (centred, centred), node), [-1], True), node)
            y = _new(g, aten.mul.Tensor, (centred, _new(g, aten.rsqrt.default, (
                _new(g, aten.add.Tensor, (var, eps), node),), node)), node)
            if w is not None:
                y = _new(g, aten.mul.Tensor, (y, w), node)
            if b is not None:
                y = _new(g, aten.add.Tensor, (y, b), node)
            if y.meta["val"].dtype != node.meta["val"].dtype:
                y = _new(g, aten.to.dtype, (y, node.meta["val"].dtype), node)
        node.replace_all_uses_with(y)
        g.erase_node(node)
        count += 1
    return _recompiled(gm, count)


def drop_noop_slices(gm: fx.GraphModule) -> int:
    """``x[:, 0:]`` (HF's ``hidden_states[:, slice(-0, None)]`` before the LM head) is the identity; as
    a slice of the sequence dim it would force an all-gather under sequence parallelism."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.slice.Tensor:
            continue
        args = list(node.args) + [None] * (5 - len(node.args))
        x, dim, start, end, step = args[:5]
        dim = 0 if dim is None else dim
        step = 1 if step is None else step
        size = x.meta["val"].shape[dim]
        full_end = end is None or (isinstance(end, int) and (end >= 2**62 or (isinstance(size, int) and end >= size)))
        if start in (None, 0) and full_end and step == 1 and not node.kwargs:
            node.replace_all_uses_with(x)
            gm.graph.erase_node(node)
            count += 1
    gm.recompile()
    return count


def drop_squeeze_unsqueeze(gm: fx.GraphModule) -> int:
    """``w.squeeze(d).unsqueeze(d)`` of a size-1 dim ``d`` is ``w`` (HF's Mamba-2 / Bamba causal conv:
    ``conv1d.weight.squeeze(1)`` handed to ``F.conv1d`` as ``weight.unsqueeze(1)``). Left in, a conv weight
    held as blocks of a fused projection's parts ([x | B | C]) would reach the conv through two views that
    choose their layout before the conv asks for one."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.unsqueeze.default:
            continue
        src = node.args[0]
        if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is aten.squeeze.dim):
            continue
        w = src.args[0]
        nd = w.meta["val"].ndim
        d, e = src.args[1] % nd, node.args[1] % nd
        if d == e and w.meta["val"].shape[d] == 1:
            node.replace_all_uses_with(w)
            gm.graph.erase_node(node)
            count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


def drop_empty_cats(gm: fx.GraphModule) -> int:
    """``cat([empty, x])`` is ``x``: a key/value cache created empty and appended to in a training forward
    (transformers' DynamicCache, HF T5's cross-attention cache). Left in, the empty whole tensor would make
    the cat gather the heads-sharded x over tp."""
    from mcompile.passes.attention import _only_nonempty

    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.cat.default:
            kept = _only_nonempty(node)
            if kept is not None:
                node.replace_all_uses_with(kept)
                count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


_ROWWISE = {aten.to.dtype, aten._to_copy.default, aten.pow.Tensor_Scalar, aten.mul.Tensor, aten.add.Tensor,
            aten.sub.Tensor, aten.div.Tensor, aten.rsqrt.default, aten.sqrt.default, aten.silu.default,
            aten.sigmoid.default, aten.neg.default, aten.exp.default, aten.type_as.default, aten.alias.default,
            aten.clone.default, aten.contiguous.default}
_ROW_STATS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default}
_FLATTENS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}


def _flattened(n) -> fx.Node | None:
    """The tensor ``n`` flattens to rows of its last dim (``x.reshape(-1, d)`` of an x of 3 or more dims), or
    to rows of ``d`` from a last dim of ``k * d`` (OLMo-hybrid's gate ``g_proj(h).reshape(-1, head_dim)``:
    the rows of ``x.unflatten(-1, (k, d))``, see :func:`_row_shape`)."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target in _FLATTENS):
        return None
    x, out = n.args[0], n.meta.get("val")
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not (isinstance(xv, torch.Tensor) and isinstance(out, torch.Tensor)) or xv.ndim < 3 or out.ndim != 2:
        return None
    if str(out.shape[-1]) == str(xv.shape[-1]):
        return x
    d, full = out.shape[-1], xv.shape[-1]
    return x if isinstance(d, int) and isinstance(full, int) and 0 < d < full and full % d == 0 else None


def _row_shape(flat: fx.Node) -> tuple[str, ...]:
    """The shape whose rows the flatten ``flat`` makes: its input's, with a last dim of ``k * d`` read as
    ``(k, d)`` (each run of ``d`` features one row: heads of ``d``)."""
    xs, d = list(flat.args[0].meta["val"].shape), flat.meta["val"].shape[-1]
    if str(xs[-1]) != str(d):
        xs[-1:] = [int(xs[-1]) // int(d), d]
    return tuple(str(s) for s in xs)


def _rowwise(u: fx.Node) -> bool:
    """Elementwise, or a statistic of each row (over the last dim of a 2-D value, kept)."""
    if u.target in _ROW_STATS:
        dims = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim")
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        keep = u.args[2] if len(u.args) > 2 else u.kwargs.get("keepdim", False)
        return len(dims) == 1 and dims[0] % 2 == 1 and bool(keep) and u.meta["val"].ndim == 2
    return u.target in _ROWWISE


def _small(a: fx.Node, lead: tuple) -> bool:
    """A scalar tensor or a 1-D one over the rows' last dim (a norm's weight): broadcast over any leading dims."""
    av = a.meta.get("val")
    return isinstance(av, torch.Tensor) and (av.ndim == 0 or av.ndim == 1 and str(av.shape[0]) == lead[-1])


def _rows_of(a: fx.Node, lead: tuple):
    """``(flattens, row-wise ops)`` that make ``a`` from flattens of tensors of shape ``lead``, or None."""
    if _small(a, lead):
        return set(), []
    x = _flattened(a)
    if x is not None:
        return ({a}, []) if _row_shape(a) == lead else None
    if not (isinstance(a, fx.Node) and a.op == "call_function" and _rowwise(a)):
        return None
    flats, ops = set(), []
    for b in a.all_input_nodes:
        got = _rows_of(b, lead)
        if got is None:
            return None
        flats |= got[0]
        ops += got[1]
    return flats, ops + [a]


def unflatten_rowwise(gm: fx.GraphModule) -> int:
    """``norm(x.reshape(-1, d)).reshape(b, s, -1)`` (Qwen3.5's and OLMo-hybrid's gated RMSNorm over each head
    of a linear-attention output: rows are (token, head) pairs) -> the same row-wise ops on x itself. The
    rows flatten the heads into the tokens, which no tp placement of the heads survives (each rank's heads
    are strided in the rows): the heads would be gathered for the norm and the output projection would
    read a whole activation. Rewritten when every op between the flatten(s) and the reshape back is
    row-wise (elementwise with the rows, a 1-D weight, or another flatten of the same shape; a statistic
    over the last dim kept): those ops broadcast over any leading dims, so they compute the same values."""
    count = 0
    for node in list(gm.graph.nodes):
        x = _flattened(node)
        if x is None or not node.users:
            continue
        lead = _row_shape(node)
        flats, region, exits, todo, ok = {node}, [], [], [node], True
        while todo and ok:
            cur = todo.pop()
            for u in cur.users:
                if u in region or u in exits or u.target is aten._assert_tensor_metadata.default:
                    continue  # (a metadata check: the lowering drops it)
                if u.target in _FLATTENS and u.meta["val"].ndim >= 3:
                    exits.append(u)  # the reshape back to (b, s, ...)
                    continue
                ok = _rowwise(u)
                for a in u.all_input_nodes:
                    if not ok or a in flats or a in region:
                        continue
                    more = _rows_of(a, lead)  # the gate, flattened the same way and made row-wise
                    if more is None:
                        ok = False
                    else:
                        flats.update(more[0])
                        region.extend(n for n in more[1] if n not in region)
                if not ok:
                    break
                region.append(u)
                todo.append(u)
        if not ok or not exits or not region:
            continue
        for f in flats:
            src = f.args[0]
            if tuple(str(d) for d in src.meta["val"].shape) != lead:  # (.., k * d) -> (.., k, d): the same rows
                nd, d = src.meta["val"].ndim, int(f.meta["val"].shape[-1])
                with gm.graph.inserting_before(f):
                    src = _new(gm.graph, aten.unflatten.int, (src, nd - 1, [int(src.meta["val"].shape[-1]) // d, d]),
                               f)
            f.replace_all_uses_with(src)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for u in sorted(region, key=order.__getitem__):
            if u.target in _ROW_STATS:
                u.args = (u.args[0], [-1], *u.args[2:])
            u.meta["val"] = _fake_call(u.target, u.args, u.kwargs)
        for e in exits:
            e.meta["val"] = _fake_call(e.target, e.args, e.kwargs)
        for f in flats:
            if not f.users:
                gm.graph.erase_node(f)
        count += 1
    return _recompiled(gm, count)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def attention_dropout_to_math(gm: fx.GraphModule) -> int:
    """``scaled_dot_product_attention(..., dropout_p=p > 0)`` -> its math form with an explicit
    ``aten.dropout`` of the probabilities: ``dropout(softmax(q kᵀ · scale + mask), p) v``.

    A fused attention draws its dropout mask inside the kernel from torch's generator; mcompile's masks
    come from a counter over global indices (mcompile/ir/dropout.py), so the probabilities must be a value
    of the graph (torch's own math backend computes the same expression). Models in eval mode pass
    dropout_p=0 and keep their fused attention."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
            continue
        args = list(node.args) + [None] * (8 - len(node.args))
        a = {k: node.kwargs.get(k, args[i]) for i, k in enumerate(_SDPA_ARGS)}
        p = a["dropout_p"]
        if not p:
            continue
        if not isinstance(p, float | int):
            raise NotImplementedError(f"{node.name}: attention dropout_p={p} computed in the graph: pass a number")
        if a["enable_gqa"]:
            raise NotImplementedError(f"{node.name}: attention dropout with enable_gqa=True: repeat the key/value "
                                      "heads before the attention (transformers' repeat_kv) or train with "
                                      "attention dropout 0")
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        qv = q.meta["val"]
        scale = a["scale"] if a["scale"] is not None else float(qv.shape[-1]) ** -0.5
        g = gm.graph
        before = set(g.nodes)
        with g.inserting_before(node):
            # the scale on the scores, as Megatron's baddbmm(alpha=) does (a scaled copy of q would be kept)
            kt = _new(g, aten.transpose.int, (k, -2, -1), node)
            scores = _new(g, aten.mul.Tensor, (_new(g, aten.matmul.default, (q, kt), node), scale), node)
            if a["is_causal"]:  # torch's is_causal: query i sees keys j <= i (top-left aligned)
                dev = qv.device
                rows = _new(g, aten.arange.default, (_new(g, aten.sym_size.int, (q, qv.ndim - 2), node),), node,
                            {"device": dev})
                cols = _new(g, aten.arange.default, (_new(g, aten.sym_size.int, (k, qv.ndim - 2), node),), node,
                            {"device": dev})
                above = _new(g, aten.gt.Tensor, (_new(g, aten.unsqueeze.default, (cols, 0), node),
                                                 _new(g, aten.unsqueeze.default, (rows, 1), node)), node)
                scores = _new(g, aten.masked_fill.Scalar, (scores, above, float("-inf")), node)
            if isinstance(mask, fx.Node) and mask.meta["val"].dtype == torch.bool:
                hidden = _new(g, aten.logical_not.default, (mask,), node)
                scores = _new(g, aten.masked_fill.Scalar, (scores, hidden, float("-inf")), node)
            elif isinstance(mask, fx.Node):
                scores = _new(g, aten.add.Tensor, (scores, mask), node)
            probs = _new(g, aten.softmax.int, (scores, -1), node)
            probs = _new(g, aten.dropout.default, (probs, float(p), True), node)
            out = _new(g, aten.matmul.default, (probs, v), node)
        for n in set(g.nodes) - before:  # the nodes made above: selective recompute's attention core
            n.meta[ATTENTION_CORE] = True
        node.replace_all_uses_with(out)
        g.erase_node(node)
        count += 1
    return _recompiled(gm, count)


def canonicalize(gm: fx.GraphModule) -> dict[str, int]:
    out = _canonicalize(gm)
    # a write through ``x[:, :, i]`` is captured as select(slice(slice(x, 0, 0, max) ...)): its tiling is seen
    # once the no-op slices are gone
    out["tiled_writes_to_cat"] += tiled_writes_to_cat(gm)
    return out


def _canonicalize(gm: fx.GraphModule) -> dict[str, int]:
    return {
        "inline_grad_regions": inline_grad_regions(gm),
        "tiled_writes_to_cat": tiled_writes_to_cat(gm),
        "functional_inplace": functional_inplace(gm),
        "as_strided_of_storage": as_strided_of_storage(gm),
        "expand_as_to_expand": expand_as_to_expand(gm),
        "transposed_weight_to_linear": transposed_weight_to_linear(gm),
        "view_as_to_view": view_as_to_view(gm),
        "unmerge_heads": _unmerge_heads(gm),
        "attention_dropout_to_math": attention_dropout_to_math(gm),
        "drop_noop_slices": drop_noop_slices(gm),
        "drop_empty_cats": drop_empty_cats(gm),
        "drop_squeeze_unsqueeze": drop_squeeze_unsqueeze(gm),
        "vectorize_index_loops": _vectorize_index_loops(gm),
        "unflatten_rowwise": unflatten_rowwise(gm),
        "conv1d_to_matmul": conv1d_to_matmul(gm),
        "projection_norm_statistics": projection_norm_statistics(gm),
        "split_linear_bias": split_linear_bias(gm),
        "moe_layers": _moe_layers(gm),
    }


def _unmerge_heads(gm: fx.GraphModule) -> int:
    from mcompile.passes.tp.heads import unmerge_heads

    return unmerge_heads(gm)


def _vectorize_index_loops(gm: fx.GraphModule) -> int:
    from mcompile.passes.tp.loops import vectorize_index_loops

    return vectorize_index_loops(gm)


def _moe_layers(gm: fx.GraphModule) -> int:
    from mcompile.passes.ep.find_moe import find_moe_layers

    return find_moe_layers(gm)
