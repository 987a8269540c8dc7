"""Token-weighted loss: rewrite a mean cross-entropy output into a (sum, count) pair (DESIGN §3).
Class weights and label smoothing are kept: the count is then the summed weight of the counted
targets, the divisor torch's own mean uses.

A model returning ``cross_entropy(logits, targets, ignore_index=-100)`` (mean over the targets not
ignored) computes the mean of *its* batch. Split over data-parallel ranks and microbatches, the
mean of per-piece means is not the global mean when pieces ignore different numbers of targets.
So the captured graph is rewritten to return ``(sum of token losses, number of counted
targets)``; the runtime adds both up over microbatches and dp ranks and divides once — the exact
global mean, whatever the split.

A model whose output is not such a loss keeps its output; the runtime then treats it as a mean
over its batch (``count = 1`` per piece), exact for equal pieces.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from mcompile.passes.nodes import _fake_call

aten = torch.ops.aten
_PASSTHROUGH = {aten._to_copy.default, aten.to.dtype, aten.clone.default, aten.alias.default,
                aten.to.dtype_layout, aten.to.device}


def mean_loss_to_sum_count(gm: fx.GraphModule) -> bool:
    """Returns whether the graph was rewritten (its output becomes ``(loss_sum, count)``)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    results = out_node.args[0]
    if not isinstance(results, tuple | list) or len(results) != 1:
        return False
    node = results[0]
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _PASSTHROUGH:
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target is aten.cross_entropy_loss.default):
        return False
    args = list(node.args) + [None] * (6 - len(node.args))
    x, target, weight, reduction, ignore, smoothing = args[:6]
    reduction = 1 if reduction is None else reduction
    ignore = -100 if ignore is None else ignore
    smoothing = 0.0 if smoothing is None else smoothing
    if node.kwargs or reduction != 1:
        return False
    if len(node.users) != 1 and results[0] is not node:
        return False
    wide = torch.promote_types(x.meta["val"].dtype, torch.float32)  # float64 logits stay float64
    if x.meta["val"].dtype != wide:  # sum the token losses in at least fp32 (as Megatron does)
        with gm.graph.inserting_before(node):
            up = gm.graph.call_function(aten._to_copy.default, (x,), {"dtype": wide})
            up.meta["val"] = _fake_call(aten._to_copy.default, (x,), {"dtype": wide})
        x = up
    # torch's mean divides the summed (weighted, smoothed) token losses by the summed weights of the
    # counted targets -- by their number without a class weight (LossNLL.cpp, label smoothing too)
    node.args = (x, target, weight, 2, ignore) + ((smoothing,) if smoothing else ())
    node.meta["val"] = _fake_call(aten.cross_entropy_loss.default, node.args)

    def call(op, *args):
        n = gm.graph.call_function(op, args)
        n.meta["val"] = _fake_call(op, args)
        return n

    with gm.graph.inserting_before(out_node):
        kept = call(aten.ne.Scalar, target, ignore)
        if weight is None:
            count = call(aten.sum.default, kept)
        else:  # sum of weight[target] over the counted targets
            safe = call(aten.masked_fill.Scalar, target, call(aten.logical_not.default, kept), 0)
            picked = call(aten.index.Tensor, weight, [safe])
            count = call(aten.sum.default, call(aten.mul.Tensor, picked, kept))
    out_node.args = ((results[0], count),)
    gm.graph.lint()
    gm.recompile()
    return True
