"""Sharding rules: a registry keyed by aten ``OpOverload`` (DESIGN §4, CONVENTIONS 4).

A rule describes, for ONE mesh axis of size ``n``, the ways an op can run on local shards::

    @rule(torch.ops.aten.mm.default)
    def mm(info: OpInfo) -> list[Strategy]: ...

Each :class:`Strategy` gives the placement every tensor input must have and the placement(s) of
the output(s); executing the op on the local pieces then yields the local pieces of the true
output. Rules return their strategies in order of preference; the propagator
(:mod:`mcompile.sharding.propagate`) picks one per node given where the inputs currently are, and inserts
redistributions where they differ. Some strategies need more than the same op on local pieces
(vocab-parallel embedding and cross-entropy): they name a ``lowering`` that the lowering pass
implements.

A rule may also register a *localizer*: how the op's non-tensor arguments change on local pieces
(``view``'s sizes, ``split``'s split size). Sizes are sympy expressions in the captured batch and
sequence symbols, or ints; the lowering pass turns symbolic ones into graph nodes.

Adding an op never touches the propagator. Every rule is property-tested against single-device
execution (tests/test_rules.py, tests/test_rules_dtensor.py), Partial inputs included.

An op none of these modules registers gets DTensor's own strategies through the bridge in
:mod:`mcompile.sharding.rules.dtensor` (hand-written rules keep priority); a user's ``torch.autograd.Function``
(an ``mcompile_fn`` op) gets the rule :func:`mcompile.sharding.rules.inferred.pointwise_rule` infers from its code.
``registered_ops()`` lists the hand-written rules, ``bridged_ops()`` the ops the bridge covers,
``rule_source(op)`` which one an op uses.

A rule that returns no strategy for an op's inputs (an inferred rule that cannot prove a split) leaves
the op replicated, reported as if it had no rule.
"""

from __future__ import annotations

import torch

# what a rule is (mcompile.sharding.rules.base), re-exported: a user writing a rule imports it from here
from mcompile.sharding.rules.base import (
    _LOCALIZERS,
    _RULES,
    BlockShard,
    LocalizeFn,
    OpInfo,
    Partial,
    Replicate,
    RuleFn,
    Shard,
    Strategy,
    TensorMeta,
    divisible,
    localizer,
    norm_dim,
    replicate_all,
    rule,
    same,
    tensor_input_nodes,
    to_expr,
)

__all__ = [
    "OpInfo",
    "Strategy",
    "TensorMeta",
    "get_rule",
    "get_localizer",
    "rule",
    "localizer",
    "registered_ops",
    "bridged_ops",
    "rule_source",
    "tensor_input_nodes",
    "to_expr",
]


def get_rule(op) -> RuleFn | None:
    """The hand-written rule of ``op``, else the inferred one of a custom autograd.Function, else DTensor's
    strategies through the bridge, else None."""
    _load()
    fn = _RULES.get(op) or _RULES.get(str(op))  # a library's custom op is registered by its name (rule)
    if fn is None and _is_function_op(op):
        from mcompile.sharding.rules.inferred import pointwise_rule

        return pointwise_rule
    if fn is None and isinstance(op, torch._ops.OpOverload):
        from mcompile.sharding.rules.dtensor import bridge_rule

        fn = bridge_rule(op)
    return fn


def get_localizer(op) -> LocalizeFn | None:
    _load()
    return _LOCALIZERS.get(op)


def registered_ops() -> list:
    """Ops with a hand-written rule."""
    _load()
    return list(_RULES)


def bridged_ops() -> list:
    """Ops without a hand-written rule that get DTensor's strategies (mcompile.sharding.rules.dtensor)."""
    from mcompile.sharding.rules.dtensor import bridged_ops as covered

    _load()
    return sorted((op for op in covered() if op not in _RULES), key=str)


def _is_function_op(op) -> bool:
    from mcompile.capture.autograd_fn import NAMESPACE

    return isinstance(op, torch._ops.OpOverload) and op.namespace == NAMESPACE


def rule_source(op) -> str | None:
    """``"hand-written"``, ``"inferred"`` (a custom autograd.Function's), ``"dtensor"`` (the bridge) or None
    (the op runs replicated)."""
    _load()
    if op in _RULES:
        return "hand-written"
    if _is_function_op(op):
        return "inferred"
    return "dtensor" if get_rule(op) is not None else None


_loaded = False


def _load():
    global _loaded
    if not _loaded:
        _loaded = True
        from mcompile.sharding.rules import factory, matmul, moe, pointwise, reductions, ssm, views  # noqa: F401


__all__ += ["BlockShard", "Partial", "Replicate", "Shard", "same", "divisible", "replicate_all", "norm_dim"]
