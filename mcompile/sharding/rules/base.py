"""What a sharding rule is (the vocabulary of :mod:`mcompile.sharding.rules`): :class:`OpInfo` (what a rule sees),
:class:`Strategy` (one way to run an op on local pieces), :class:`TensorMeta`, the decorators that register a rule
or a localizer, and the size arithmetic rules share. The rule modules import it; the package
(:mod:`mcompile.sharding.rules`)
looks rules up and re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from mcompile.ir.placements import BlockShard, Partial, Replicate, Shard

__all__ = ["OpInfo", "Strategy", "TensorMeta", "rule", "localizer", "tensor_input_nodes", "to_expr", "R", "same",
           "divisible", "replicate_all", "norm_dim", "BlockShard", "Partial", "Replicate", "Shard"]

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
    # on a context-parallel axis (cp): the sequence symbol; a Shard there is the tokens' split (mcompile.passes.cp.ops)
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


def replicate_all(info: OpInfo) -> Strategy:
    return Strategy(tuple(R for _ in info.inputs), tuple(R for _ in info.outputs), name="replicate")


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0
