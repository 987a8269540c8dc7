"""Fusion: find the aten subgraphs plain PyTorch code makes and run them as mcompile's fused ops.

Runs on a per-rank program after lowering, so it sees local shapes and composes with tp/sp (the
patterns never span a collective: a norm, a rotation or a gating product is computed on one rank's
local piece). Matched:

- RMSNorm, as Llama and HF Llama write it::

      xf = x.to(float32)                       (optional)
      y  = xf * rsqrt(mean(xf ** 2, -1, keepdim=True) + eps)
      y  = y.type_as(x) | y.to(dtype)          (optional)
      out = y * w | w * y                      (w: a 1-D parameter)

  -> ``mcompile::rms_norm(x, w, eps)[0]`` (computed in fp32, returned in x's dtype: the pattern's
  own precision when its final cast is back to x's dtype, which is checked);
- residual add + RMSNorm: the same with ``x = add(a, b)`` (a pre-norm block's residual stream, same
  shape and dtype) -> ``mcompile::add_rms_norm(a, b, w, eps)``, whose first output h replaces the
  add for every other user (the next residual add), its second the norm;
- SwiGLU: ``silu(a) * b`` with a and b of one shape -> ``mcompile::swiglu(a, b)``;
- RoPE, rotate-half form (GPT-NeoX, Llama, HF ``apply_rotary_pos_emb``)::

      x1, x2 = x[..., :d/2], x[..., d/2:]      (slices, chunk(2, -1) or split(d/2, -1))
      out = x * cos + cat((-x2, x1), -1) * sin (either operand order of each mul and of the add)

  -> ``mcompile::rope(x, cos, sin)`` for x of shape (b, heads, s, d), with cos and sin
  broadcasting to it and free of parameters (the op gives them no gradient), in the memory layout
  the pattern wrote (views downstream depend on it; see ``_fuse_rope``). One op per rotated
  tensor: q and k of a layer are two;
- LayerNorm: ``aten.layer_norm(x, [d], w, b, eps)`` with weight and bias -> ``mcompile::layer_norm``.

Fused nodes keep ``mc_origin`` of the node they replace (add_rms_norm's h: the add's) and
``mc_layer`` of the norm, and get ``mc_fused`` = the op's name, so ``mcompile show`` marks them.
Dtypes and global shapes come from the captured nodes the program's nodes implement.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mcompile.ir import meta as M

aten = torch.ops.aten
FUSED = M.FUSED
PATTERNS = ("rms_norm", "add_rms_norm", "swiglu", "rope", "layer_norm")  # the keys fuse() counts
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.to.dtype_layout}
_END = 2**63 - 1  # the stop of a slice written x[..., a:]


def _val(node, origins: dict[str, fx.Node]):
    """The captured node's FakeTensor (global shape, dtype) for a program node, or None."""
    if not isinstance(node, fx.Node):
        return None
    org = origins.get(node.meta.get(M.ORIGIN, node.name))
    val = org.meta.get("val") if org is not None else None
    return val if isinstance(val, torch.Tensor) else None


def _dtype(node: fx.Node, origins: dict[str, fx.Node]):
    val = _val(node, origins)
    return val.dtype if val is not None else None


def _is(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _strip_cast(node):
    return node.args[0] if _is(node, *_CASTS) else node


def _tag(nodes, like: fx.Node, name: str | None, origin_of: fx.Node | None = None) -> None:
    """Meta of new nodes: origin and layer of ``like`` (origin of ``origin_of`` if given), and
    ``mc_fused`` = name on the fused op and its outputs (not on view helpers: name None)."""
    for n in nodes:
        n.meta.update({M.ORIGIN: (origin_of or like).meta.get(M.ORIGIN), M.LAYER: like.meta.get(M.LAYER)})
        if name is not None:
            n.meta[FUSED] = name


# ---- RMSNorm (+ residual add) -------------------------------------------------------------------
def _match_rms(mul: fx.Node, params: set[str]):
    """mul(y, w) or mul(w, y) -> (xf, y, w, eps) if y is an RMSNorm of xf."""
    if not _is(mul, aten.mul.Tensor) or len(mul.args) != 2:
        return None
    for y, w in (mul.args, reversed(mul.args)):
        if not (isinstance(w, fx.Node) and w.op == "placeholder" and w.name in params):
            continue
        inner = _strip_cast(y)
        if not _is(inner, aten.mul.Tensor):
            continue
        a, b = inner.args
        for xf, r in ((a, b), (b, a)):
            if not _is(r, aten.rsqrt.default):
                continue
            add = r.args[0]
            if not (_is(add, aten.add.Tensor) and isinstance(add.args[1], float)):
                continue
            mean = add.args[0]
            if not (_is(mean, aten.mean.dim) and list(mean.args[1]) in ([-1],) and mean.args[2] is True):
                continue
            pw = mean.args[0]
            if not (_is(pw, aten.pow.Tensor_Scalar) and pw.args[0] is xf and pw.args[1] == 2):
                continue
            return xf, y, w, add.args[1]
    return None


def _residual_add(x, dtype, origins):
    """(a, b) if x = add(a, b) of two tensors of x's global shape and of ``dtype``, else None."""
    if not (_is(x, aten.add.Tensor) and len(x.args) == 2 and not x.kwargs):
        return None
    vx, va, vb = (_val(n, origins) for n in (x, *x.args))
    if va is None or vb is None or vx is None:
        return None
    if va.dtype == vb.dtype == vx.dtype == dtype and va.shape == vb.shape == vx.shape:
        return x.args
    return None


def _fuse_rms(g: fx.Graph, node: fx.Node, m, origins) -> str | None:
    xf, _y, w, eps = m
    x = xf.args[0] if _is(xf, aten.to.dtype, aten._to_copy.default) else xf
    out_dtype, x_dtype = _dtype(node, origins), _dtype(x, origins)
    if out_dtype is None or x_dtype is None or out_dtype != x_dtype:
        x = xf  # the pattern returns another dtype than its input's: normalise the cast value
        if _dtype(xf, origins) != out_dtype:
            return None
    res = _residual_add(x, out_dtype, origins)
    if res is not None:
        # after the add, so that the add's other users (the next residual add) can take h
        with g.inserting_after(x):
            fused = g.call_function(torch.ops.mcompile.add_rms_norm.default, (*res, w, float(eps)))
        with g.inserting_after(fused):
            h = g.call_function(operator.getitem, (fused, 0))
        with g.inserting_after(h):
            out = g.call_function(operator.getitem, (fused, 1))
        _tag((fused, out), node, "add_rms_norm")
        _tag((h,), node, "add_rms_norm", origin_of=x)
        x.replace_all_uses_with(h)
        node.replace_all_uses_with(out)
        return "add_rms_norm"
    with g.inserting_before(node):
        fused = g.call_function(torch.ops.mcompile.rms_norm.default, (x, w, float(eps)))
        out = g.call_function(operator.getitem, (fused, 0))
    _tag((fused, out), node, "rms_norm")
    node.replace_all_uses_with(out)
    return "rms_norm"


# ---- SwiGLU -------------------------------------------------------------------------------------
def _fuse_swiglu(g: fx.Graph, node: fx.Node, origins) -> str | None:
    if not (_is(node, aten.mul.Tensor) and len(node.args) == 2):
        return None
    a, b = node.args
    if _is(b, aten.silu.default) and not _is(a, aten.silu.default):
        a, b = b, a
    if not (_is(a, aten.silu.default) and isinstance(b, fx.Node)):
        return None
    x = a.args[0]
    vx, vb = _val(x, origins), _val(b, origins)
    if vx is None or vb is None or vx.dtype != vb.dtype or vx.shape != vb.shape:
        return None
    with g.inserting_before(node):
        fused = g.call_function(torch.ops.mcompile.swiglu.default, (x, b))
    _tag((fused,), node, "swiglu")
    node.replace_all_uses_with(fused)
    return "swiglu"


# ---- RoPE ---------------------------------------------------------------------------------------
def _last_dim(dim, ndim: int) -> bool:
    return dim in (-1, ndim - 1)


def _halves(first, second, d: int):
    """x if ``first`` and ``second`` are x's two halves along its last dim (of size d), else None."""
    if _is(first, aten.slice.Tensor) and _is(second, aten.slice.Tensor):
        x = first.args[0]
        if second.args[0] is not x or first.kwargs or second.kwargs or min(len(first.args), len(second.args)) < 4:
            return None
        (_, d1, s1, e1, *st1), (_, d2, s2, e2, *st2) = first.args, second.args
        if (_last_dim(d1, 4) and _last_dim(d2, 4) and (s1, e1, s2) == (0, d // 2, d // 2) and e2 in (d, _END)
                and all(s == 1 for s in (*st1, *st2))):
            return x
        return None
    if _is(first, operator.getitem) and _is(second, operator.getitem):
        src = first.args[0]
        if second.args[0] is not src or (first.args[1], second.args[1]) != (0, 1) or len(src.args) < 3:
            return None
        if _is(src, aten.chunk.default) and src.args[1] == 2 and _last_dim(src.args[2], 4):
            return src.args[0]
        if _is(src, aten.split.Tensor) and src.args[1] == d // 2 and _last_dim(src.args[2], 4):
            return src.args[0]
    return None


def _param_dependent(g: fx.Graph, params: set[str]) -> set[str]:
    """Names of the nodes computed from a parameter (the graph is in topological order)."""
    dep: set[str] = set()
    for n in g.nodes:
        if (n.op == "placeholder" and n.name in params) or any(i.name in dep for i in n.all_input_nodes):
            dep.add(n.name)
    return dep


def _match_rope(add: fx.Node, origins, param_dependent: set[str]):
    """add(x*cos, rotate_half(x)*sin) in any operand order -> (x, cos, sin)."""
    if not (_is(add, aten.add.Tensor) and len(add.args) == 2 and not add.kwargs):
        return None
    out = _val(add, origins)
    for lin, rot in (add.args, reversed(add.args)):
        if not (_is(lin, aten.mul.Tensor) and _is(rot, aten.mul.Tensor)):
            continue
        for cat, sin in (rot.args, reversed(rot.args)):
            if not (_is(cat, aten.cat.default) and len(cat.args[0]) == 2 and isinstance(sin, fx.Node)):
                continue
            if not _last_dim(cat.args[1] if len(cat.args) > 1 else 0, 4):
                continue
            neg, first = cat.args[0]
            if not _is(neg, aten.neg.default):
                continue
            for x, cos in (lin.args, reversed(lin.args)):
                vx = _val(x, origins)
                if not (isinstance(cos, fx.Node) and vx is not None and vx.ndim == 4 and out is not None):
                    continue
                d = vx.shape[-1]
                if not isinstance(d, int) or d % 2 or _halves(first, neg.args[0], d) is not x:
                    continue
                # rope returns x's dtype and shape: the pattern must too (cos/sin broadcast into x)
                if not (out.dtype == vx.dtype and out.shape == vx.shape):
                    continue
                vc, vs = _val(cos, origins), _val(sin, origins)
                if vc is None or vs is None or vc.ndim > 4 or vs.ndim > 4:
                    continue
                if cos.name in param_dependent or sin.name in param_dependent:
                    continue  # the op gives cos and sin no gradient
                return x, cos, sin
    return None


def _fuse_rope(g: fx.Graph, node: fx.Node, origins, param_dependent: set[str],
               swapped: dict[str, fx.Node]) -> str | None:
    m = _match_rope(node, origins, param_dependent)
    if m is None:
        return None
    x, cos, sin = m
    # The op writes its output contiguous; the pattern's pointwise ops write the layout TensorIterator
    # picks from their operands, and views downstream were traced against that layout (Llama's
    # transpose(1, 2).view after attention). So the fused node must give the captured add's layout:
    # contiguous -> rope(x); (b, s, heads, d) memory seen as (b, heads, s, d), as q and k are made
    # by transpose(1, 2) when x·cos comes first -> rotate the (b, s, heads, d) tensor itself, with
    # cos and sin transposed alike (the rotation is per element along d: which dim holds heads does
    # not matter), and transpose the result back — same layout, no copy. Any other layout: unfused.
    out = _val(node, origins)
    base = None
    if not out.is_contiguous():
        if not (_is(x, aten.transpose.int) and sorted(d % 4 for d in x.args[1:]) == [1, 2]
                and out.transpose(1, 2).is_contiguous()):
            return None
        base = x.args[0]
        if _val(base, origins) is None or not _val(base, origins).is_contiguous():
            return None
    if base is None:
        with g.inserting_before(node):
            fused = out = g.call_function(torch.ops.mcompile.rope.default, (x, cos, sin))
    else:
        cos, sin = (_heads_seq_swapped(g, t, _val(t, origins).ndim, swapped) for t in (cos, sin))
        with g.inserting_before(node):
            fused = g.call_function(torch.ops.mcompile.rope.default, (base, cos, sin))
            out = g.call_function(aten.transpose.int, (fused, 1, 2))
        _tag((out,), node, None)
    _tag((fused,), node, "rope")
    node.replace_all_uses_with(out)
    return "rope"


def _heads_seq_swapped(g: fx.Graph, t: fx.Node, ndim: int, swapped: dict[str, fx.Node]) -> fx.Node:
    """t, broadcast against (b, heads, s, d), as it broadcasts against (b, s, heads, d): dims 1 and 2
    of its right-aligned 4-d shape swapped (a view; one per cos/sin node, made right after it)."""
    if ndim <= 1 or t.name in swapped:
        return swapped.get(t.name, t)
    with g.inserting_after(t):
        if ndim == 2:  # (s, d) -> (s, 1, d)
            view = g.call_function(aten.unsqueeze.default, (t, -2))
        else:  # (heads, s, d) or (b, heads, s, d)
            view = g.call_function(aten.transpose.int, (t, ndim - 4 + 1, ndim - 4 + 2))
    view.meta.update({M.ORIGIN: t.meta.get(M.ORIGIN), M.LAYER: t.meta.get(M.LAYER)})
    swapped[t.name] = view
    return view


# ---- LayerNorm ----------------------------------------------------------------------------------
def _fuse_layer_norm(g: fx.Graph, node: fx.Node, origins) -> str | None:
    if not _is(node, aten.layer_norm.default):
        return None
    x, shape, w, b, eps = (*node.args, None, None, None)[:5]  # (input, normalized_shape, weight, bias, eps)
    w, b = node.kwargs.get("weight", w), node.kwargs.get("bias", b)
    eps = node.kwargs.get("eps", 1e-5 if eps is None else eps)
    vx, vw, vb = _val(x, origins), _val(w, origins), _val(b, origins)
    if vx is None or vw is None or vb is None or len(shape) != 1:
        return None
    if vw.ndim != 1 or vb.ndim != 1 or _dtype(node, origins) != vx.dtype:
        return None
    with g.inserting_before(node):
        fused = g.call_function(torch.ops.mcompile.layer_norm.default, (x, w, b, float(eps)))
        out = g.call_function(operator.getitem, (fused, 0))
    _tag((fused, out), node, "layer_norm")
    node.replace_all_uses_with(out)
    return "layer_norm"


def fuse(gm: fx.GraphModule, origins: dict[str, fx.Node], params: set[str]) -> dict[str, int]:
    """Rewrite ``gm`` in place; returns how many of each pattern (``PATTERNS``) were fused."""
    from mcompile.kernels import activations, norms, rope  # noqa: F401 - registers the ops

    counts = dict.fromkeys(PATTERNS, 0)
    g = gm.graph
    param_dependent = _param_dependent(g, params)
    swapped: dict[str, fx.Node] = {}  # cos/sin node -> its view for (b, s, heads, d) rotations
    for node in list(g.nodes):
        if not node.users:  # replaced by an earlier fusion (or dead): nothing to rewrite
            continue
        m = _match_rms(node, params)
        kind = (_fuse_rms(g, node, m, origins) if m is not None else None) \
            or _fuse_swiglu(g, node, origins) or _fuse_rope(g, node, origins, param_dependent, swapped) \
            or _fuse_layer_norm(g, node, origins)
        if kind is not None:
            counts[kind] += 1
    g.eliminate_dead_code()
    g.lint()
    gm.recompile()
    return counts
