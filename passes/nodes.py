"""Making nodes in a captured graph: a new node carries the fake value of its op run on its arguments' fake values
(``meta["val"]``), as export's nodes do, so later passes and the planner read its shape and dtype. Shared by the
rewrites (passes/canonicalize.py, heads.py, moe.py, loss.py)."""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def _fake_call(target, args, kwargs=None, like: fx.Node | None = None):
    """Run ``target`` on the fake values of its node arguments: the new node's ``meta["val"]`` (in the
    fake mode of a tensor argument, or of ``like``'s value for a factory such as ``arange(size)``)."""
    vals = fx.node.map_aggregate(args, lambda a: a.meta["val"] if isinstance(a, fx.Node) else a)
    nodes = [a for a in fx.node.map_aggregate(args, lambda a: a) if isinstance(a, fx.Node)]
    mode = next(a.meta["val"].fake_mode for a in nodes + ([like] if like is not None else [])
                if hasattr(a.meta.get("val"), "fake_mode"))
    with mode:
        if target in (aten.linear.default, aten.matmul.default) and all(
                isinstance(v, torch.Tensor) and v.ndim >= 2 for v in vals[:2]):
            return _product_value(target, vals)
        return target(*vals, **(kwargs or {}))


def _product_value(target, vals) -> torch.Tensor:
    """The value of ``linear(x, W[, b])`` / ``matmul(a, b)`` (both operands at least 2-D) from its sizes
    alone. Running the op instead is not safe on every torch ``pyproject.toml`` claims: torch 2.11's fake
    kernels of a bias-free ``linear`` and of ``matmul`` with a >2-D input fold the leading dims through a
    view that guards on the capture's symbolic sizes and so specialises ``batch`` and ``seq`` to the
    example's (every later size a constant: programs of one batch size, wrong on any dp or microbatch
    split; the compat run, docs/testing.md). The result is contiguous, as the op's is."""
    a, b = vals[0], vals[1]
    if target is aten.linear.default:
        shape = [*a.shape[:-1], b.shape[0]]
    else:
        shape = [*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1]]
    return a.new_empty(shape, dtype=torch.promote_types(a.dtype, b.dtype))


def _new(graph: fx.Graph, target, args, like: fx.Node, kwargs: dict | None = None) -> fx.Node:
    n = graph.call_function(target, args, kwargs or {})
    n.meta["val"] = _fake_call(target, args, kwargs, like)
    for k in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if k in like.meta:
            n.meta[k] = like.meta[k]
    return n


def lazy_module(root, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """A GraphModule whose Python code is generated when it is first called or its code read (torch.fx's
    ``_LazyGraphModule``, as Inductor uses it): the signature passes rewrite a module several times (gradient
    accumulation, bucket launches, collective matmul, in-place all-reduces), each followed by ``recompile``, and
    generating and compiling the code of a 16-layer backward took ~0.1 s each time."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph, class_name=class_name)


def fake_args(args: list) -> tuple[object, list]:
    """``args`` as fake tensors of one mode: theirs when some are fake already (a pipeline's shape probe), else a
    new one (non-fake tensors of the arguments are converted into it)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = detect_fake_mode(args) or FakeTensorMode(allow_non_fake_inputs=True)
    return mode, [mode.from_tensor(a) if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) else a
                  for a in args]
