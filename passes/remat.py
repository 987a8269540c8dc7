"""Automatic activation recompute: which forward values to save for backward, under a memory budget.

Input is a **joint graph** (forward + ``torch.autograd.grad`` traced together with ``make_fx``;
placeholders ``primals_*`` and ``tangents_*``). A call_function node is a **forward node** when it
does not depend, transitively, on a tangent; every other call_function node is a **backward node**.
A forward node is **needed** when a backward node reads it directly. Each needed value must be
either *saved* by forward (it stays in memory until backward) or *recomputed* in backward from
values that are themselves saved, recomputed, or always available (primals).

The model is a two-phase simplification of Checkmate (Jain et al., "Checkmate: Breaking the Memory
Wall with Optimal Tensor Rematerialization", MLSys 2020): instead of a schedule over stages, one
decision per forward node v, as in the joint-graph partitioners of AOTAutograd
(``torch._functorch.partitioners.min_cut_rematerialization_partition`` solves the memory-only
version as a min cut):

- s_v ∈ {0,1}: forward saves v for backward; r_v ∈ {0,1}: backward recomputes v;
- every needed v:                       s_v + r_v >= 1;
- every forward input u of v:           s_u + r_u >= r_v  (a recomputed node needs its inputs);
- the budget:                           Σ bytes_v · s_v <= budget_bytes;
- random ops (dropout, bernoulli, rand*, ops tagged ``nondeterministic_seeded``, SDPA with
  ``dropout_p > 0``), in-place ops and the values they mutate, and ``must_save`` nodes have r_v = 0
  (recomputing them would draw other numbers or read/write a mutated buffer); ``must_recompute``
  nodes and their views have s_v = 0 (a saved view keeps its base's storage), ``must_save`` nodes
  s_v = 1.

Objective: minimise the recompute cost Σ flops_v · r_v, then, among the optima, the saved bytes —
lexicographically, by a second solve with the first optimum as a constraint (an ε weight on bytes
would not be exact at realistic FLOP counts). Both are integer programs solved with HiGHS (as
:func:`mcompile.search.block_placements`).

Always available, never saved nor counted: placeholders (primals; the model's parameters and
inputs are live through backward anyway), ``get_attr`` constants, and size-only nodes (SymInt/int
outputs such as ``aten.sym_size``: a size is recomputed from any tensor's shape at no cost).

Costs (:func:`node_cost`): contractions 2·m·n·k, attention 4·B·H·L·S·E (half when causal), views
and ``getitem`` 0, other ops one FLOP per output element; mcompile collectives cost their output
bytes — a stand-in for communication time (one byte moved ≈ one FLOP, a deliberately crude rate:
re-gathering under sequence parallelism is allowed, as Megatron does, but never free).

Aliasing: a view's bytes are counted as its own output's, although it shares its base's storage.
Because a view costs no FLOPs to recompute, an optimal solution never saves a view whose base is
saved or recomputed (recomputing the view is free and saves its bytes), so the double count only
matters for views of values that are not otherwise kept — where saving the view alone is right.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx

from mcompile.ir import meta as M
from mcompile.ir.compat import optimization_hint, require

__all__ = ["RematSolution", "BudgetError", "classify", "node_cost", "solve", "exhaustive", "min_budget", "report"]

aten = torch.ops.aten

# contractions: op -> (index of the first matrix operand, whether a bias/"beta·input" term is added)
_CONTRACTIONS = {
    aten.mm.default: (0, False),
    aten.bmm.default: (0, False),
    aten.matmul.default: (0, False),
    aten.addmm.default: (1, True),
    aten.baddbmm.default: (1, True),
    aten.addbmm.default: (1, True),
    aten.linear.default: (1, None),  # k from the weight; bias only when given
}

# ops whose output aliases an input (no FLOPs); anything with an ``is_view`` schema counts too
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
          aten.transpose.int, aten.permute.default, aten.expand.default, aten.unsqueeze.default,
          aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor, aten.select.int,
          aten.detach.default, aten.alias.default, aten.as_strided.default, aten.split.Tensor,
          aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int, aten.narrow.default,
          operator.getitem}

# random ops named explicitly (most also carry Tag.nondeterministic_seeded)
_RANDOM_NAMES = ("native_dropout", "bernoulli", "rand", "randn", "randint", "randperm", "normal",
                 "uniform", "multinomial", "exponential", "geometric", "cauchy", "log_normal", "poisson", "rrelu")


class BudgetError(ValueError):
    """A budget below the least any saved set needs; ``budget`` and ``minimum`` in bytes, so a caller
    that derived the budget (a pipeline stage's share) can say how far off it is in its own terms."""

    def __init__(self, budget: int, minimum: int, message: str | None = None):
        super().__init__(message or f"recompute budget {budget} bytes is infeasible: the minimum feasible budget "
                         f"is {minimum} bytes")
        self.budget, self.minimum = budget, minimum


@dataclass
class RematSolution:
    """A saved set and what backward must recompute because of it.

    ``saved``: forward nodes kept for backward; ``recomputed``: forward nodes backward runs again
    (the closure of the needed values that are not saved, through their unsaved forward inputs);
    ``saved_bytes`` = Σ bytes of ``saved``; ``recompute_flops`` = Σ FLOPs of ``recomputed``;
    ``optimal``: proven optimal (False when the solver stopped at its time limit)."""

    saved: set[str]
    recomputed: set[str]
    saved_bytes: int
    recompute_flops: float
    optimal: bool


# ---------------------------------------------------------------------------------------------
# classification and costs
# ---------------------------------------------------------------------------------------------
def classify(joint: fx.GraphModule) -> tuple[set[str], set[str]]:
    """(forward node names, backward node names) of the joint graph's call_function nodes.

    When the graph says how many of its outputs are the forward's (``joint.meta["mc_num_fwd_outputs"]``,
    set by :func:`mcompile.passes.joint.trace_joint`), the forward nodes are the ancestors of those
    outputs: a node that depends on no tangent but only backward reads (autograd's ``t(weight)``
    for an input gradient, a norm's statistics recomputed by its backward formula) is backward
    work — computing it there costs nothing extra, saving it from forward would cost memory."""
    n_out = joint.meta.get(M.NUM_FWD_OUTPUTS)
    if n_out is not None:
        out = next(n for n in joint.graph.nodes if n.op == "output")
        todo = [a for a in list(out.args[0])[:n_out] if isinstance(a, fx.Node)]
        anc: set[fx.Node] = set()
        while todo:
            n = todo.pop()
            if n not in anc:
                anc.add(n)
                todo.extend(n.all_input_nodes)
        calls = [n for n in joint.graph.nodes if n.op == "call_function"]
        for n in calls:  # an element of a forward op's tuple output (SDPA's logsumexp) is a forward value
            if n.target is operator.getitem and n.all_input_nodes and n.all_input_nodes[0] in anc:
                anc.add(n)
        order = {n: i for i, n in enumerate(calls)}
        for n in calls:  # what read a forward value before an in-place op overwrote it (autograd's clone
            if n in anc:  # of ``v`` for ``v /= s``) ran in forward: in backward it would read the new value
                for m in _mutated(n):
                    anc.update(u for u in m.users if u in order and order[u] < order[n])
        return {n.name for n in calls if n in anc}, {n.name for n in calls if n not in anc}
    tainted: set[fx.Node] = set()
    fwd: set[str] = set()
    bwd: set[str] = set()
    for n in joint.graph.nodes:
        if n.op == "placeholder" and n.name.startswith("tangents"):
            tainted.add(n)
        elif n.op == "call_function":
            if any(a in tainted for a in n.all_input_nodes):
                tainted.add(n)
                bwd.add(n.name)
            else:
                fwd.add(n.name)
    return fwd, bwd


def _tensors(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, tuple | list):
        return [t for v in val for t in _tensors(v)]
    return []


def _int(x) -> int:
    """A concrete int for a (possibly symbolic) size: its hint under dynamic shapes."""
    return optimization_hint(x) if isinstance(x, torch.SymInt) else int(x)


def _numel(val) -> int:
    return sum(_int(t.numel()) for t in _tensors(val))


def _shape(a) -> list[int]:
    val = a.meta["val"] if isinstance(a, fx.Node) else a
    return [_int(s) for s in val.shape]


def _arg(node: fx.Node, name: str, default=None):
    """Argument ``name`` of an ATen call, positional or keyword, by the op's schema."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.name == name and not a.kwarg_only and i < len(node.args):
                return node.args[i]
    return default


def _is_sdpa(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t.namespace == "aten" and \
        (t.name().startswith("aten::_scaled_dot_product_") or t.name().startswith("aten::scaled_dot_product_attention"))


def _is_view(node: fx.Node) -> bool:
    return node.target in _VIEWS or getattr(node.target, "is_view", False)


def _is_collective(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t.namespace == "mcompile"


def _size_only(node: fx.Node) -> bool:
    """No tensor output (SymInt, int, None): free to recompute, never saved."""
    return not _tensors(node.meta.get("val"))


def node_cost(node: fx.Node) -> tuple[float, int]:
    """(FLOPs to recompute ``node``, bytes of its tensor outputs).

    FLOPs: contractions (mm, bmm, matmul, addmm, baddbmm, linear, convolution) 2·numel(out)·k
    (= 2·m·n·k), plus numel(out) for an added bias; SDPA ops 2·B·H·L·S·(E + Ev) (= 4·B·H·L·S·E),
    halved when ``is_causal``, their ``_backward`` variants twice that; views and ``getitem`` 0;
    mcompile collectives their output bytes (communication, see the module docstring); anything
    else one FLOP per output element."""
    val = node.meta.get("val")
    nbytes = sum(_int(t.numel()) * t.element_size() for t in _tensors(val))
    if node.op != "call_function" or _size_only(node):
        return 0.0, nbytes
    t = node.target
    out = _numel(val)
    if _is_collective(node):
        return float(nbytes), nbytes
    if _is_view(node):
        return 0.0, nbytes
    if t in _CONTRACTIONS:
        first, bias = _CONTRACTIONS[t]
        if t is aten.linear.default:
            k = _shape(node.args[1])[-1]
            bias = _arg(node, "bias") is not None
        else:
            k = _shape(node.args[first])[-1]
        return float(2 * out * k + (out if bias else 0)), nbytes
    if t is aten.convolution.default:
        w = _shape(node.args[1])
        o = _int(_tensors(val)[0].numel())
        return float(2 * o * math.prod(w[1:]) + (o if node.args[2] is not None else 0)), nbytes
    if _is_sdpa(node):
        q, k, v = (_shape(a) for a in node.args[:3])
        bh = math.prod(q[:-2])  # B·H (the query's leading dims)
        flops = 2 * bh * q[-2] * k[-2] * (q[-1] + v[-1])
        if _arg(node, "is_causal", False):
            flops //= 2
        if t.name().endswith("_backward"):
            flops *= 2
        return float(flops), nbytes
    return float(out), nbytes


def _is_random(node: fx.Node) -> bool:
    """A random op: recomputing it would draw other numbers. SDPA and dropout carry the
    ``nondeterministic_seeded`` tag for their dropout, so they are random only with p > 0."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if _is_sdpa(node):
        return float(_arg(node, "dropout_p", 0.0)) > 0
    if t is aten.native_dropout.default:
        return float(node.args[1]) > 0 and _arg(node, "train") is not False
    base = t.name().split("::")[-1].rstrip("_")
    return torch.Tag.nondeterministic_seeded in t.tags or base in _RANDOM_NAMES or \
        (base.endswith("_like") and base[:-5] in _RANDOM_NAMES)


def _mutated(node: fx.Node) -> list[fx.Node]:
    """The nodes an in-place/out= op writes to (schema arguments with a write alias)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            x = node.kwargs.get(a.name, node.args[i] if i < len(node.args) and not a.kwarg_only else None)
            if isinstance(x, fx.Node):
                out.append(x)
    return out


# ---------------------------------------------------------------------------------------------
# the model shared by the ILP and the brute force
# ---------------------------------------------------------------------------------------------
@dataclass
class _Model:
    order: list[str]                   # forward nodes with a decision (not free), graph order
    inputs: dict[str, list[str]]       # v -> its forward inputs that have a decision
    needed: set[str]
    flops: dict[str, float]
    nbytes: dict[str, int]
    no_recompute: set[str]             # r_v = 0
    no_save: set[str]                  # s_v = 0
    must_save: set[str]                # s_v = 1


def _model(joint: fx.GraphModule, must_save: Collection[str], must_recompute: Collection[str]) -> _Model:
    fwd, bwd = classify(joint)
    nodes = {n.name: n for n in joint.graph.nodes}
    unknown = (set(must_save) | set(must_recompute)) - fwd
    if unknown:
        raise ValueError(f"must_save/must_recompute name nodes that are not forward nodes: {sorted(unknown)}")
    both = set(must_save) & set(must_recompute)
    if both:
        raise ValueError(f"nodes both in must_save and must_recompute: {sorted(both)}")
    decide = [n.name for n in joint.graph.nodes if n.name in fwd and not _size_only(n)]
    dset = set(decide)
    inputs = {v: [a.name for a in nodes[v].all_input_nodes if a.name in dset] for v in decide}
    needed = {a.name for b in bwd for a in nodes[b].all_input_nodes if a.name in dset}
    # only ancestors of needed values (and forced saves) matter; the rest is left out
    relevant = set(needed) | set(must_save)
    for v in reversed(decide):
        if v in relevant:
            relevant.update(inputs[v])
    order = [v for v in decide if v in relevant]
    costs = {v: node_cost(nodes[v]) for v in order}
    no_recompute = {v for v in order if _is_random(nodes[v]) or _mutated(nodes[v])}
    no_recompute |= {m.name for n in joint.graph.nodes for m in _mutated(n)} & relevant
    no_recompute |= set(must_save) & relevant
    # a view of a value that must not be saved must not be saved either: it would keep its storage
    no_save = set(must_recompute)
    for v in order:
        base = nodes[v].all_input_nodes[:1]
        if _is_view(nodes[v]) and base and base[0].name in no_save:
            no_save.add(v)
    return _Model(order, {v: inputs[v] for v in order}, needed, {v: c[0] for v, c in costs.items()},
                  {v: c[1] for v, c in costs.items()}, no_recompute, no_save & relevant, set(must_save))


def _closure(m: _Model, saved: Iterable[str]) -> set[str] | None:
    """What backward recomputes for ``saved``: the needed values not saved, and, transitively, their
    unsaved forward inputs. None when that reaches a node that cannot be recomputed."""
    saved = set(saved)
    rec = m.needed - saved
    for v in reversed(m.order):  # consumers before their inputs
        if v in rec:
            if v in m.no_recompute:
                return None
            rec.update(u for u in m.inputs[v] if u not in saved)
    return rec


def _solution(m: _Model, saved: set[str], optimal: bool) -> RematSolution:
    rec = _closure(m, saved)
    assert rec is not None, "a saved set whose recompute closure reaches a non-recomputable node"
    return RematSolution(saved, rec, sum(m.nbytes[v] for v in saved), float(sum(m.flops[v] for v in rec)), optimal)


# ---------------------------------------------------------------------------------------------
# the integer program
# ---------------------------------------------------------------------------------------------
_NEEDS_HIGHS = "recompute='auto' with an activation_budget (the recompute integer program, passes/remat.py)"


def _highspy():
    """HiGHS, imported when a budget is solved for (an unbudgeted joint program never needs it)."""
    return require("highspy", _NEEDS_HIGHS)


def _highs():
    from mcompile.ir.compat import quiet_highs

    h = quiet_highs(_NEEDS_HIGHS)
    h.setOptionValue("mip_rel_gap", 0.0)  # proven optima: HiGHS stops at a 1e-4 relative gap by default
    return h


class _Program:
    """The model as a HiGHS MIP: columns s_v (index 2i) and r_v (2i+1)."""

    def __init__(self, m: _Model, budget_bytes: int | None, time_limit: float):
        self.m, self.budget = m, budget_bytes
        self.idx = {v: i for i, v in enumerate(m.order)}
        n = 2 * len(m.order)
        lo, hi = np.zeros(n), np.ones(n)
        for v, i in self.idx.items():
            if v in m.must_save:
                lo[2 * i] = 1
            if v in m.no_save:
                hi[2 * i] = 0
            if v in m.no_recompute:
                hi[2 * i + 1] = 0
        h = self.h = _highs()
        h.setOptionValue("time_limit", float(time_limit))
        h.addVars(n, lo, hi)
        hs = _highspy()
        h.changeColsIntegrality(n, np.arange(n, dtype=np.int32), np.array([hs.HighsVarType.kInteger] * n))
        inf = hs.kHighsInf
        for v, i in self.idx.items():
            if v in m.needed:  # s_v + r_v >= 1
                self.row(1, inf, [2 * i, 2 * i + 1], [1, 1])
            for u in m.inputs[v]:  # s_u + r_u - r_v >= 0
                j = self.idx[u]
                self.row(0, inf, [2 * j, 2 * j + 1, 2 * i + 1], [1, 1, -1])
        if budget_bytes is not None:
            self.row(-inf, budget_bytes, [2 * i for i in self.idx.values()], [m.nbytes[v] for v in self.idx])

    def row(self, lo: float, hi: float, idx: list[int], val: list[float]) -> None:
        self.h.addRow(lo, hi, len(idx), np.array(idx, dtype=np.int32), np.array(val, dtype=np.float64))

    def minimise(self, cost: dict[int, float]) -> tuple[set[str], bool] | None:
        """Minimise Σ cost[col]·x[col]; (saved set, proven optimal), or None when infeasible."""
        hs = _highspy()
        n = 2 * len(self.m.order)
        if n == 0:  # nothing to decide (HiGHS reports an empty model, not an optimum)
            return None if self.budget is not None and self.budget < 0 else (set(), True)
        self.h.changeColsCost(n, np.arange(n, dtype=np.int32), np.array([cost.get(c, 0.0) for c in range(n)]))
        self.h.run()
        status = self.h.getModelStatus()
        if status in (hs.HighsModelStatus.kInfeasible, hs.HighsModelStatus.kUnboundedOrInfeasible):
            return None
        feasible = self.h.getInfo().primal_solution_status == 2  # kSolutionStatusFeasible
        if status != hs.HighsModelStatus.kOptimal and not feasible:
            raise RuntimeError(f"the recompute integer program was not solved: {self.h.modelStatusToString(status)}")
        sol = self.h.getSolution().col_value
        return {v for v, i in self.idx.items() if sol[2 * i] > 0.5}, status == hs.HighsModelStatus.kOptimal

    def bytes_cost(self) -> dict[int, float]:
        return {2 * i: float(self.m.nbytes[v]) for v, i in self.idx.items()}


def _min_bytes(m: _Model, time_limit: float) -> int:
    """The least budget for which the model is feasible (ValueError when it never is)."""
    p = _Program(m, None, time_limit)
    res = p.minimise(p.bytes_cost())
    if res is None:
        raise ValueError("no saved set is feasible: a must_recompute node (or one a must_recompute node reads) "
                         "cannot be recomputed (random or in-place)")
    return sum(m.nbytes[v] for v in res[0])


def min_budget(joint: fx.GraphModule, must_save: Collection[str] = frozenset(),
               must_recompute: Collection[str] = frozenset(), *, time_limit: float = 60.0) -> int:
    """The smallest ``budget_bytes`` :func:`solve` accepts: the bytes of what must be saved (random
    and in-place values backward reads, ``must_save``, and what recomputing everything else needs)."""
    return _min_bytes(_model(joint, must_save, must_recompute), time_limit)


def solve(joint: fx.GraphModule, budget_bytes: int | None, must_save: Collection[str] = frozenset(),
          must_recompute: Collection[str] = frozenset(), *, time_limit: float = 60.0) -> RematSolution:
    """The saved set of least recompute FLOPs (then least bytes) whose bytes fit ``budget_bytes``.

    ``budget_bytes=None``: no limit — save every needed value (except ``must_recompute`` ones, which
    are recomputed from saved inputs), recompute nothing else. Raises :class:`BudgetError` (a ValueError),
    naming the minimum feasible budget, when the budget is below it."""
    m = _model(joint, must_save, must_recompute)
    if budget_bytes is None:
        return _baseline(m)
    p = _Program(m, budget_bytes, time_limit)
    flops_cost = {2 * i + 1: m.flops[v] for v, i in p.idx.items()}
    first = p.minimise(flops_cost)
    if first is None:
        raise BudgetError(budget_bytes, _min_bytes(m, time_limit))
    best = _solution(m, first[0], first[1])
    # second phase: least bytes among the least-FLOP saved sets (FLOP counts are integers, so the
    # bound best + 0.5 admits exactly the optima)
    p.row(-_highspy().kHighsInf, best.recompute_flops + 0.5, [2 * i + 1 for i in p.idx.values()],
           [m.flops[v] for v in p.idx])
    second = p.minimise(p.bytes_cost())
    if second is not None:
        cand = _solution(m, second[0], first[1] and second[1])
        if (cand.recompute_flops, cand.saved_bytes) <= (best.recompute_flops, best.saved_bytes):
            best = cand
    return best


def _baseline(m: _Model) -> RematSolution:
    """No budget: save every needed value that may be saved; a needed ``must_recompute`` value is
    recomputed, its inputs saved unless they must be recomputed too."""
    saved = (m.needed - m.no_save) | (m.must_save & set(m.order))
    todo = [v for v in m.order if v in m.needed and v in m.no_save]
    seen = set(todo)
    while todo:
        v = todo.pop()
        if v in m.no_recompute:
            raise ValueError(f"{v} must be recomputed but cannot be (random or in-place)")
        for u in m.inputs[v]:
            if u in m.no_save:
                if u not in seen:
                    seen.add(u)
                    todo.append(u)
            else:
                saved.add(u)
    return _solution(m, saved, True)


# ---------------------------------------------------------------------------------------------
# the brute-force reference
# ---------------------------------------------------------------------------------------------
def exhaustive(joint: fx.GraphModule, budget_bytes: int, must_save: Collection[str] = frozenset(),
               must_recompute: Collection[str] = frozenset(), *, max_nodes: int = 18) -> RematSolution:
    """The optimum by enumeration of every saved set (a test oracle for :func:`solve`, independent of
    the integer program): for each subset of the savable forward nodes within the budget, the
    recompute closure of the needed values; least FLOPs, then least bytes. At most ``max_nodes``
    savable nodes (2^n subsets)."""
    m = _model(joint, must_save, must_recompute)
    cand = [v for v in m.order if v not in m.no_save]
    if len(cand) > max_nodes:
        raise ValueError(f"{len(cand)} savable forward nodes: too many to enumerate (max_nodes={max_nodes})")
    forced = sum(1 << i for i, v in enumerate(cand) if v in m.must_save)
    size = [m.nbytes[v] for v in cand]

    def subsets(limit: float):
        """(saved set, bytes, recompute closure) of every feasible subset within ``limit`` bytes."""
        for mask in range(1 << len(cand)):
            if mask & forced != forced:
                continue
            nbytes = sum(b for i, b in enumerate(size) if mask >> i & 1)
            if nbytes > limit:
                continue
            saved = {v for i, v in enumerate(cand) if mask >> i & 1}
            rec = _closure(m, saved)
            if rec is not None:
                yield saved, nbytes, rec

    best: tuple[float, int, set[str]] | None = None
    for saved, nbytes, rec in subsets(budget_bytes):
        key = (float(sum(m.flops[v] for v in rec)), nbytes)
        if best is None or key < best[:2]:
            best = (*key, saved)
    if best is None:
        least = min((nbytes for _, nbytes, _ in subsets(math.inf)), default=None)
        if least is None:
            raise ValueError("no saved set is feasible")
        raise BudgetError(budget_bytes, least)
    return _solution(m, best[2], True)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.4g} {unit}"
        n /= 1024
    return f"{n} B"


def report(solution: RematSolution, joint: fx.GraphModule) -> str:
    """A short summary: saved and recomputed nodes (graph order, with their bytes / FLOPs), totals."""
    nodes = [n for n in joint.graph.nodes if n.name in solution.saved | solution.recomputed]
    saved = [f"{n.name} ({_fmt_bytes(node_cost(n)[1])})" for n in nodes if n.name in solution.saved]
    rec = [f"{n.name} ({node_cost(n)[0]:.4g} FLOPs)" for n in nodes if n.name in solution.recomputed]
    head = (f"activation recompute{'' if solution.optimal else ' (not proven optimal)'}: "
            f"save {len(saved)} values, {_fmt_bytes(solution.saved_bytes)}; "
            f"recompute {len(rec)} nodes, {solution.recompute_flops:.4g} FLOPs")
    return "\n".join([head, "  saved:      " + (", ".join(saved) or "-"),
                      "  recomputed: " + (", ".join(rec) or "-")])
