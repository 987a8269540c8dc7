"""Sharding rules: a registry keyed by aten ``OpOverload`` (DESIGN §4, CONVENTIONS 4).

A rule describes, for ONE mesh axis of size ``n``, the ways an op can run on local shards::

    @rule(torch.ops.aten.mm.default)
    def mm(info: OpInfo) -> list[Strategy]: ...

Each :class:`Strategy` gives the placement every tensor input must have and the placement(s) of
the output(s); executing the op on the local pieces then yields the local pieces of the true
output. Rules return their strategies in order of preference; the propagator
(:mod:`mcompile.propagate`) picks one per node given where the inputs currently are, and inserts
redistributions where they differ. Some strategies need more than the same op on local pieces
(vocab-parallel embedding and cross-entropy): they name a ``lowering`` that the lowering pass
implements.

A rule may also register a *localizer*: how the op's non-tensor arguments change on local pieces
(``view``'s sizes, ``split``'s split size). Sizes are sympy expressions in the captured batch and
sequence symbols, or ints; the lowering pass turns symbolic ones into graph nodes.

Adding an op never touches the propagator. Every rule is property-tested against single-device
execution (tests/test_rules.py, tests/test_rules_dtensor.py), Partial inputs included.

An op none of these modules registers gets DTensor's own strategies through the bridge in
:mod:`mcompile.rules.dtensor` (hand-written rules keep priority); a user's ``torch.autograd.Function``
(an ``mcompile_fn`` op) gets the rule :func:`mcompile.autograd_fn.pointwise_rule` infers from its code.
``registered_ops()`` lists the hand-written rules, ``bridged_ops()`` the ops the bridge covers,
``rule_source(op)`` which one an op uses.

A rule that returns no strategy for an op's inputs (an inferred rule that cannot prove a split) leaves
the op replicated, reported as if it had no rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from mcompile.placements import BlockShard, Partial, Replicate, Shard

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

R = Replicate()


def to_expr(x):
    """SymInt -> sympy expression; int stays int."""
    if isinstance(x, torch.SymInt):
        e = x.node.expr
        return int(e) if e.is_Integer else _exact_floordivs(e)
    return x


def _exact_floordivs(e):
    """``FloorDiv(a, b)`` where ``b`` divides ``a`` as polynomials (XLNet's relative shift: ``(s*s)//s``) is
    ``a / b``: products of sizes then compare equal (view groups) and rebuild as plain arithmetic."""
    from torch.utils._sympy.functions import FloorDiv

    if not e.has(FloorDiv):
        return e

    def exact(f):
        q = sympy.cancel(f.args[0] / f.args[1])
        return q if sympy.fraction(q)[1] == 1 else f

    return e.replace(lambda a: isinstance(a, FloorDiv), exact)


def same(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def divisible(size, n: int) -> bool:
    """Whether ``size`` splits evenly over ``n`` ranks (symbolic sizes are checked at run time)."""
    return (size % n == 0) if isinstance(size, int) else True


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple  # ints and sympy expressions
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def of(cls, val) -> TensorMeta:
        return cls(tuple(to_expr(s) for s in val.shape), val.dtype)


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on local pieces over one mesh axis."""

    inputs: tuple  # a placement per tensor input (tensor_input_nodes order)
    outputs: tuple  # a placement per output (one for single-output ops)
    lowering: str | None = None  # name of a special lowering, else the op itself on local pieces
    name: str = ""

    def __repr__(self) -> str:
        ins = ",".join(map(repr, self.inputs))
        outs = ",".join(map(repr, self.outputs))
        return f"{self.name or 'local'}[{ins} -> {outs}]"


@dataclass
class OpInfo:
    """What a rule sees: the node, the metadata of its tensor inputs and outputs, the axis size."""

    node: fx.Node | None
    op: object
    args: tuple
    kwargs: dict
    inputs: list[TensorMeta]  # tensor inputs, in tensor_input_nodes order
    outputs: list[TensorMeta]  # outputs (flattened)
    n: int  # axis size
    current: tuple = ()  # current placement of each tensor input (a hint; may be empty)
    notes: list[str] = field(default_factory=list)  # why a sharded strategy was impossible
    # on a context-parallel axis (cp): the sequence symbol; a Shard there is the tokens' split (mcompile.cp)
    token_symbol: object = None

    def arg(self, i: int, name: str | None = None, default=None):
        if i < len(self.args):
            return self.args[i]
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        return default


RuleFn = Callable[[OpInfo], list[Strategy]]
LocalizeFn = Callable[..., tuple[tuple, dict]]
_RULES: dict[object, RuleFn] = {}
_LOCALIZERS: dict[object, LocalizeFn] = {}


def rule(*ops):
    """Register ``fn(info) -> strategies`` for ``ops``: OpOverloads, or the names (``"transformers.x.default"``)
    of custom ops a library registers only once imported, which mcompile does not import to register a rule."""

    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            _RULES[op] = fn
        return fn

    return deco


def localizer(*ops):
    """Register ``fn(args, kwargs, in_placements, out_placements, local_out_shapes, n) -> (args, kwargs)``."""

    def deco(fn: LocalizeFn) -> LocalizeFn:
        for op in ops:
            _LOCALIZERS[op] = fn
        return fn

    return deco


def get_rule(op) -> RuleFn | None:
    """The hand-written rule of ``op``, else the inferred one of a custom autograd.Function, else DTensor's
    strategies through the bridge, else None."""
    _load()
    fn = _RULES.get(op) or _RULES.get(str(op))  # a library's custom op is registered by its name (below)
    if fn is None and _is_function_op(op):
        from mcompile.autograd_fn import pointwise_rule

        return pointwise_rule
    if fn is None and isinstance(op, torch._ops.OpOverload):
        from mcompile.rules.dtensor import bridge_rule

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
    """Ops without a hand-written rule that get DTensor's strategies (mcompile.rules.dtensor)."""
    from mcompile.rules.dtensor import bridged_ops as covered

    _load()
    return sorted((op for op in covered() if op not in _RULES), key=str)


def _is_function_op(op) -> bool:
    from mcompile.autograd_fn import NAMESPACE

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


def tensor_input_nodes(node: fx.Node) -> list[fx.Node]:
    """The fx nodes among a node's args/kwargs whose value is a tensor, in a fixed order."""
    out: list[fx.Node] = []

    def visit(a):
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            out.append(a)
        return a

    fx.node.map_aggregate(node.args, visit)
    fx.node.map_aggregate(node.kwargs, visit)
    return out


_loaded = False


def _load():
    global _loaded
    if not _loaded:
        _loaded = True
        from mcompile import moe  # noqa: F401 - the moe_ffn rule
        from mcompile.rules import factory, matmul, pointwise, reductions, ssm, views  # noqa: F401


def replicate_all(info: OpInfo) -> Strategy:
    return Strategy(tuple(R for _ in info.inputs), tuple(R for _ in info.outputs), name="replicate")


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


__all__ += ["BlockShard", "Partial", "Replicate", "Shard", "same", "divisible", "replicate_all", "norm_dim"]
