"""Fusion: find the aten subgraphs plain PyTorch code makes and run them as mcompile's fused ops.

Runs on a per-rank program after lowering, so it sees local shapes and composes with tp/sp.
Matched so far (the rest of the kernels issue adds RoPE and the norms with bias):

- RMSNorm, as Llama and HF Llama write it::

      xf = x.to(float32)                       (optional)
      y  = xf * rsqrt(mean(xf ** 2, -1, keepdim=True) + eps)
      y  = y.type_as(x) | y.to(dtype)          (optional)
      out = y * w | w * y                      (w: a 1-D parameter)

  -> ``mcompile::rms_norm(x, w, eps)[0]`` (computed in fp32, returned in x's dtype: the pattern's
  own precision when its final cast is back to x's dtype, which is checked);
- SwiGLU: ``silu(a) * b`` with a and b of one shape -> ``mcompile::swiglu(a, b)``.

Fused nodes keep ``mc_origin`` of the node they replace and get ``mc_fused`` = the op's name, so
``mcompile show`` marks them. Dtypes come from the captured nodes the program's nodes implement.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mcompile import meta as M

aten = torch.ops.aten
FUSED = "mc_fused"
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.to.dtype_layout}


def _dtype(node: fx.Node, origins: dict[str, fx.Node]):
    org = origins.get(node.meta.get(M.ORIGIN, ""))
    val = org.meta.get("val") if org is not None else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _is(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _strip_cast(node):
    return node.args[0] if _is(node, *_CASTS) else node


def _match_rms(mul: fx.Node, params: set[str]):
    """mul(y, w) or mul(w, y) -> (x, w, eps) if y is an RMSNorm of x."""
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


def fuse(gm: fx.GraphModule, origins: dict[str, fx.Node], params: set[str]) -> dict[str, int]:
    """Rewrite ``gm`` in place; returns how many of each pattern were fused."""
    from mcompile.kernels import activations, norms  # noqa: F401 - registers the ops

    counts = {"rms_norm": 0, "swiglu": 0}
    g = gm.graph
    for node in list(g.nodes):
        m = _match_rms(node, params)
        if m is not None:
            xf, y, w, eps = m
            x = xf.args[0] if _is(xf, aten.to.dtype, aten._to_copy.default) else xf
            out_dtype, x_dtype = _dtype(node, origins), _dtype(x, origins)
            if out_dtype is None or x_dtype is None or out_dtype != x_dtype:
                x = xf  # the pattern returns another dtype than its input's: normalise the cast value
                if _dtype(xf, origins) != out_dtype:
                    continue
            with g.inserting_before(node):
                fused = g.call_function(torch.ops.mcompile.rms_norm.default, (x, w, float(eps)))
                out = g.call_function(operator.getitem, (fused, 0))
            for n in (fused, out):
                n.meta.update({M.ORIGIN: node.meta.get(M.ORIGIN), M.LAYER: node.meta.get(M.LAYER),
                               FUSED: "rms_norm"})
            node.replace_all_uses_with(out)
            counts["rms_norm"] += 1
            continue
        if _is(node, aten.mul.Tensor) and len(node.args) == 2:
            a, b = node.args
            if _is(b, aten.silu.default) and not _is(a, aten.silu.default):
                a, b = b, a
            if _is(a, aten.silu.default) and isinstance(b, fx.Node):
                x = a.args[0]
                if _dtype(x, origins) is not None and _dtype(x, origins) == _dtype(b, origins):
                    ox, ob = origins.get(x.meta.get(M.ORIGIN, "")), origins.get(b.meta.get(M.ORIGIN, ""))
                    if ox is not None and ob is not None and ox.meta["val"].shape == ob.meta["val"].shape:
                        with g.inserting_before(node):
                            fused = g.call_function(torch.ops.mcompile.swiglu.default, (x, b))
                        fused.meta.update({M.ORIGIN: node.meta.get(M.ORIGIN), M.LAYER: node.meta.get(M.LAYER),
                                           FUSED: "swiglu"})
                        node.replace_all_uses_with(fused)
                        counts["swiglu"] += 1
    g.eliminate_dead_code()
    g.lint()
    gm.recompile()
    return counts
