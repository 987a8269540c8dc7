"""Every argument of an op is honoured or refused — never dropped (issue 21).

A sharding rule says where an op's tensors may live; the op then runs on local pieces with the
*same* non-tensor arguments (``eps``, ``scale``, ``approximate``, ``dim``, ...), which keeps their
meaning wherever a rule offers a strategy (tests/test_rules.py checks every strategy forward and
backward; tests/test_op_args.py draws non-default arguments end to end). Where an argument's meaning
depends on data the op no longer sees whole, the rule offers no strategy that would change it
(``scale_grad_by_freq`` counts ids: no vocab-parallel or id-sharded embedding for it; a ``mean``
cross-entropy is never split over the batch inside a program), and a special lowering carries the
argument itself (``padding_idx`` in the vocab-parallel embedding, ``ignore_index`` and ``reduction``
in the vocab-parallel loss).

What no placement can keep is refused here, before anything runs, with the argument, the source
line and what to do:

- ``nn.Embedding(max_norm=...)`` renormalises rows of the weight *in place* during forward
  (``aten.embedding_renorm_``): a sharded or gathered copy would be renormalised, not the parameter.
- ``scale_grad_by_freq=True`` divides each row's gradient by the number of times its id occurs in
  the batch: when the batch is split (dp, microbatches) each piece would count only its own ids.
- ``sparse=True`` embeddings (a sparse weight gradient): parameters are DTensors with dense,
  reduced and sharded gradients (when the programs are to run).
- dropout in training mode (``p > 0``) drawn from torch's generator under tensor parallelism:
  ``native_dropout``, ``feature_dropout`` (``nn.Dropout2d``/``3d``), ``alpha_dropout`` and
  ``feature_alpha_dropout``. A rank-local mask on a sharded activation repeats the other ranks' masks, and
  a replicated activation needs the same mask on every tp rank. ``F.dropout`` / ``nn.Dropout``
  (``aten.dropout``) and attention dropout (``scaled_dot_product_attention(dropout_p=)``, rewritten into
  its math form by passes/canonicalize.py) are lowered to masks from global indices instead
  (mcompile/ir/dropout.py, passes/lower_dropout.py), the same on every layout.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from mcompile.ir.mesh import Mesh
from mcompile.ir.plan import PlanError

aten = torch.ops.aten

__all__ = ["check_arguments", "training_dropout_p"]


def _where(node: fx.Node) -> str:
    from mcompile.sharding.planner import _where as source_line  # the planner's errors name the line alike

    line = source_line(node)
    return f" (at {line})" if line else ""


_TORCH_RNG_DROPOUTS = (aten.feature_dropout.default, aten.alpha_dropout.default, aten.feature_alpha_dropout.default)


def training_dropout_p(node: fx.Node) -> float:
    """The drop probability of a dropout that is active in this graph, else 0."""
    a = node.args
    if node.target is aten.dropout.default or node.target in _TORCH_RNG_DROPOUTS:
        return float(a[1]) if a[2] else 0.0
    if node.target is aten.native_dropout.default:
        train = a[2] if len(a) > 2 else node.kwargs.get("train", True)
        return float(a[1]) if train is not False else 0.0
    if node.target is aten.scaled_dot_product_attention.default:
        return float(a[4] if len(a) > 4 else node.kwargs.get("dropout_p", 0.0))
    return 0.0


def check_arguments(gm: fx.GraphModule, mesh: Mesh, microbatches: int = 1, runtime: bool = True) -> None:
    """Refuse (PlanError) the arguments no per-rank program can honour on this mesh. ``runtime=False``
    (planning and cost estimates only: nothing will run) leaves training-mode dropout alone: its masks
    are the runtime's limitation, not the plan's, and its activation memory is worth estimating."""
    from mcompile.sharding.rules.matmul import embedding_args

    tp = mesh.size("tp") if "tp" in mesh.axis_names else 1
    batch_split = [f"{ax}={mesh.size(ax)}" for ax in ("dp", "cp") if ax in mesh.axis_names and mesh.size(ax) > 1]
    if microbatches > 1:
        batch_split.append(f"microbatches={microbatches}")
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.embedding_renorm_.default and mesh.size() > 1:
            raise PlanError(
                f"nn.Embedding(max_norm={node.args[2]}) renormalises rows of its weight in place during forward"
                f"{_where(node)}; mcompile cannot carry that update onto a sharded or gathered weight. Drop max_norm "
                "(renormalise the rows after the optimizer step instead), or run on one device."
            )
        if node.target is aten.embedding.default and embedding_args(node)[1] and batch_split:
            raise PlanError(
                f"embedding with scale_grad_by_freq=True{_where(node)} scales each row's gradient by how often its "
                f"id occurs in the whole batch, but {' and '.join(batch_split)} split the batch, so each piece "
                "would count only its own ids. Use scale_grad_by_freq=False, or a layout that keeps the batch "
                "whole (tp / pp without microbatches)."
            )
        sparse = node.target is aten.embedding.default and (
            node.args[4] if len(node.args) > 4 else node.kwargs.get("sparse", False))
        if sparse and runtime:
            raise PlanError(
                f"embedding with sparse=True{_where(node)} asks for a sparse weight gradient, but mcompile's "
                "parameters are DTensors whose gradients are reduced and sharded dense (the vocab-parallel "
                "lookup computes a dense one). Use sparse=False (and a dense optimizer)."
            )
        p = training_dropout_p(node)
        torch_rng = node.target is aten.native_dropout.default or node.target in _TORCH_RNG_DROPOUTS
        if p > 0 and tp > 1 and runtime and torch_rng:
            what = node.target.__name__.split(".")[0]
            raise PlanError(
                f"{what}(p={p}) runs in training mode{_where(node)}, and draws its mask from torch's generator, "
                f"which under tensor parallelism (tp={tp}) would repeat one rank's mask on the others' pieces. "
                "mcompile gives layout-independent masks to F.dropout / nn.Dropout and attention dropout: use "
                "those, build the model with this dropout at 0, or use a layout without tp."
            )
