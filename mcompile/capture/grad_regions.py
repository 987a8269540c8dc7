"""``with torch.no_grad():`` regions of a captured graph inlined (``passes/canonicalize.py`` runs this on every
capture; :mod:`mcompile.capture.loops` on a capture whose unrolled loops lie in such regions, before it edits them).

torch.export (training IR) keeps a no-grad region as ``wrap_with_set_grad_enabled(False, submod, *args)``, a
higher-order op over a subgraph. Its ops are inlined into the program and each value leaving the region is
detached (no gradient flows out of a no-grad region, as in eager), except a region input handed back as it is
(a no-op ``.to`` of its own dtype, an alias: eager returns the caller's tensor itself, gradient and all). A
``torch.autocast(..., enabled=False)`` region (``wrap_with_autocast``) is inlined as it is; an enabled one is
refused (mcompile runs one dtype of its own).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten
__all__ = ["inline_grad_regions"]


def _detached(graph: fx.Graph, out: fx.Node, like: fx.Node) -> fx.Node:
    n = graph.call_function(aten.detach.default, (out,))
    with out.meta["val"].fake_mode:
        n.meta["val"] = aten.detach.default(out.meta["val"])
    for k in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if k in like.meta:
            n.meta[k] = like.meta[k]
    return n


_NO_OP_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.alias.default)  # not _to_copy: a copy


def _region_input(out, placeholders: dict):
    """The region input ``out`` is in eager: ``x.to(x.dtype)`` (``.to`` of an unchanged dtype and device, not a
    copy), ``alias``, through any number of them, back to a placeholder of the region's subgraph -> the value
    the region was called with there; else None. Eager returns the input tensor itself from such an op, grad
    and all: the tensor stays the caller's (export's non-strict tracer even reads it from the region's output
    afterwards: Dots3Note's attention reads ``hidden_states`` for its g_proj after its no-grad indexer casts it
    to the weights' dtype), so it must not be detached."""
    cur = out
    while isinstance(cur, fx.Node) and cur.op == "call_function" and cur.target in _NO_OP_CASTS:
        src = cur.args[0]
        a, b = getattr(src, "meta", {}).get("val"), cur.meta.get("val")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.device == b.device and not cur.kwargs.get("copy", False)
                and not (len(cur.args) > 3 and cur.args[3] is True)
                and cur.kwargs.get("memory_format") in (None, torch.preserve_format)):
            return None
        cur = src
    return placeholders.get(cur) if isinstance(cur, fx.Node) and cur.op == "placeholder" else None


def inline_grad_regions(gm: fx.GraphModule) -> int:
    from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled

    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (wrap_with_set_grad_enabled, wrap_with_autocast):
            continue
        if node.target is wrap_with_autocast:
            device_type, dtype, autocast, _, attr, *args = node.args
            if autocast:
                from mcompile.ir.plan import PlanError

                where = (node.meta.get("stack_trace") or "").strip().splitlines()
                raise PlanError(f"torch.autocast({device_type!r}, dtype={dtype}) inside forward: mcompile runs the "
                                "model in one dtype of its own and does not plan autocast regions; remove the "
                                f"region (or run it with enabled=False). {where[-2].strip() if len(where) > 1 else ''}")
            enabled = True  # autocast switched off (HF's rotary embeddings): the ops as they are
        else:
            enabled, attr, *args = node.args
        sub = getattr(gm, attr.target)
        env = dict(zip((n for n in sub.graph.nodes if n.op == "placeholder"), args))
        with gm.graph.inserting_before(node):
            for n in sub.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    outs = fx.node.map_arg(n.args[0], env.__getitem__)
                    sub_outs = list(n.args[0]) if isinstance(n.args[0], list | tuple) else [n.args[0]]
                    break
                if n.op == "get_attr":  # a region nested in this one: its subgraph moves to the program
                    name = f"{attr.target}_{n.target}"
                    gm.add_submodule(name, getattr(sub, n.target))
                    env[n] = gm.graph.get_attr(name)
                    env[n].meta.update(n.meta)
                    continue
                env[n] = gm.graph.node_copy(n, env.__getitem__)
        outs = list(outs) if isinstance(outs, list | tuple) else [outs]
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise NotImplementedError(f"{node.name}: a no-grad region's result read by {user.target}, "
                                          "not by index")
            out = outs[user.args[1]]
            same = _region_input(sub_outs[user.args[1]], env) if not enabled else None
            if same is not None:  # the caller's own tensor, as eager returns it: not detached
                out = same
            elif not enabled and isinstance(out, fx.Node) and isinstance(out.meta.get("val"), torch.Tensor):
                with gm.graph.inserting_before(user):
                    out = _detached(gm.graph, out, user)
            user.replace_all_uses_with(out)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not attr.users:
            gm.graph.erase_node(attr)
            delattr(gm, attr.target)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
