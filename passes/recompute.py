"""Activation recompute on a per-rank program (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models"; Megatron's ``--recompute-granularity``).

The pass takes an explicit set of nodes to recompute (so a later memory-budgeted search can choose
it), cuts the program, in order, into maximal runs of nodes that are all recomputed or all kept
and belong to one transformer layer, and runs each recomputed run under non-reentrant
``torch.utils.checkpoint``: only the run's inputs are saved, its forward runs again in backward.
A recomputed run that contains collectives re-runs them in backward (under sequence parallelism
that is Megatron's re-gather of the layer input).

Choices (``recompute_nodes``):
- ``full``: every node of every transformer layer; ``uniform`` groups ``num_layers`` consecutive
  layers into one checkpoint (only the group's input is kept), ``block`` recomputes the first
  ``num_layers`` layers one by one and keeps the rest (Megatron's ``--recompute-method``);
- ``selective``: the attention core only (the SDPA nodes), keeping the linears' inputs.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from mcompile.ir import meta as M

aten = torch.ops.aten


def recompute_nodes(gm: fx.GraphModule, mode: str, method: str = "uniform", num_layers: int = 1) -> dict[str, int]:
    """node name -> checkpoint group (nodes of one group are recomputed together)."""
    if mode == "none":
        return {}
    layers = sorted({n.meta.get(M.LAYER) for n in gm.graph.nodes if n.meta.get(M.LAYER) is not None})
    out = {}
    for n in gm.graph.nodes:
        layer = n.meta.get(M.LAYER)
        if n.op != "call_function" or layer is None:
            continue
        if mode == "full":
            pos = layers.index(layer)
            if method == "uniform":
                out[n.name] = pos // num_layers
            elif method == "block":
                if pos < num_layers:
                    out[n.name] = pos
            else:
                raise ValueError(f"recompute method {method!r}: use 'uniform' or 'block'")
        elif mode == "selective":
            if n.target is aten.scaled_dot_product_attention.default or n.meta.get(M.ATTENTION_CORE):
                out[n.name] = layers.index(layer)
        else:
            raise ValueError(f"recompute {mode!r}: use 'none', 'full' or 'selective'")
    return out


_SIZE_OPS = {aten.sym_size.int, operator.mul, operator.floordiv, operator.add, operator.sub}


def _checkpointed(module, *args):
    return checkpoint(module, *args, use_reentrant=False)


def apply_recompute(gm: fx.GraphModule, groups: dict[str, int]) -> fx.GraphModule:
    """Run the nodes in ``groups`` under checkpoint, one checkpoint per maximal run of a group."""
    if not groups:
        return gm
    part: dict[str, int] = {}
    recomputed: set[int] = set()
    current, key = 0, None
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.name not in groups and n.target in _SIZE_OPS and current:
            part[n.name] = current  # size arithmetic joins whatever run it sits in: it breaks no run
            continue
        k = ("rc", groups[n.name]) if n.name in groups else ("keep",)
        if k != key:
            current += 1
            key = k
            if k[0] == "rc":
                recomputed.add(current)
        part[n.name] = current
    split = split_module(gm, gm, lambda n: part[n.name], keep_original_order=True)
    for node in list(split.graph.nodes):
        if node.op == "call_module" and int(node.target.rsplit("_", 1)[1]) in recomputed:
            with split.graph.inserting_before(node):
                mod = split.graph.get_attr(node.target)
                new = split.graph.call_function(_checkpointed, (mod, *node.args), node.kwargs)
            node.replace_all_uses_with(new)
            split.graph.erase_node(node)
    split.graph.lint()
    split.recompile()
    split.meta[M.RECOMPUTE_GROUPS] = len(recomputed)
    return split
