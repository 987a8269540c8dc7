"""The sharding rule of the ``moe_ffn`` op (:mod:`mcompile.ir.moe`): an MoE layer sharded as a unit."""

from __future__ import annotations

from mcompile.ir.moe import ExpertForm, moe_ffn
from mcompile.ir.placements import BlockShard, Partial, Replicate, Shard
from mcompile.sharding.rules.base import Strategy, rule

__all__ = ["moe_rule"]


@rule(moe_ffn)
def moe_rule(info):
    """Per mesh axis, how ``moe_ffn`` runs on local pieces (inputs: x, idx, weights, *expert weights):

    * ``expert-parallel`` (only on an ``ep`` axis, the policy pins the expert weights ``Shard(0)``):
      tokens split (dim 0 of x, idx, weights), E/n experts a rank; the lowering dispatches tokens to
      their experts' ranks and back (``moe_ep``);
    * ``expert-tp``: tokens replicated, each expert's hidden units sharded (gate/up by their output
      features, down by its input features: Megatron's expert tensor parallelism), output Partial(sum);
    * ``token-split``: tokens split, experts replicated (data parallelism);
    * replicated."""
    R, S0 = Replicate(), Shard(0)
    form = ExpertForm.parse(info.node.kwargs["form"]) if info.node is not None else None
    n_w = len(info.inputs) - 3
    out = []
    out.append(Strategy((S0, S0, S0) + (S0,) * n_w, (S0,), lowering="moe_ep", name="expert-parallel"))
    if form is not None:
        hid = form.hidden_dims()
        sizes = [info.inputs[3 + i].shape[hid[i]] for i in range(n_w)]
        # a fused gate/up projection (and its bias): 2 hidden units per unit of down's input; [gate; up] split
        # block-wise (each rank its part of gate and of up), interleaved pairs contiguously
        fused = [form.kind.startswith("fused") and (i == 0 or i == form.n_matrices) for i in range(n_w)]
        if all(isinstance(s, int) and s % (info.n * (2 if fused[i] else 1)) == 0 for i, s in enumerate(sizes)):
            ws = tuple(BlockShard(hid[i], 2) if fused[i] and form.kind != "fused_il" else Shard(hid[i])
                       for i in range(n_w))
            out.append(Strategy((R, R, R) + ws, (Partial("sum"),), name="expert-tp"))
        else:
            info.notes.append(f"the experts' hidden sizes {sizes} do not divide by {info.n}")
    out.append(Strategy((S0, S0, S0) + (R,) * n_w, (S0,), name="token-split"))
    out.append(Strategy((R,) * (3 + n_w), (R,), name="replicate"))
    return out
