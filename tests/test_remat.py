"""Automatic activation recompute (mcompile.passes.remat) on joint forward+backward graphs.

The integer program must agree with brute force (every saved set enumerated) on the recompute
FLOPs and, among the optima, the saved bytes, at budgets from the least feasible to "save
everything"; random ops must be saved, never recomputed; more budget never costs more FLOPs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import mcompile.ir.ops  # noqa: F401  (registers torch.ops.mcompile.*)
from mcompile.passes.remat import RematSolution, classify, exhaustive, min_budget, node_cost, report, solve

aten = torch.ops.aten


def joint_of(f, primals: list[torch.Tensor]) -> torch.fx.GraphModule:
    """The joint graph of ``f`` (returns a tuple of differentiable outputs), traced over fake tensors."""
    fwd = make_fx(f, tracing_mode="fake")(*primals)
    outs = next(n for n in fwd.graph.nodes if n.op == "output").args[0]
    tangents = [torch.ones(o.meta["val"].shape) for o in outs]

    def joint(primals, tangents):
        res = f(*primals)
        grads = torch.autograd.grad(res, [p for p in primals if p.requires_grad], tangents, allow_unused=True)
        return (*res, *grads)

    return make_fx(joint, tracing_mode="fake")(primals, tangents)


def param(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def by_target(gm, target) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is target]


# ---------------------------------------------------------------------------------------------
# the example graphs
# ---------------------------------------------------------------------------------------------
def mlp():
    def f(x, w1, b1, w2, w3):
        h = F.gelu(F.linear(x, w1, b1))
        h = F.gelu(h @ w2)
        return ((h @ w3).sin(),)

    return joint_of(f, [torch.randn(4, 8), param(16, 8), param(16), param(16, 12), param(12, 6)])


B, L, D, H = 2, 8, 16, 2


def attention():
    def f(x, wq, wo):
        q = (x @ wq).view(B, L, H, D // H).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return (o.transpose(1, 2).reshape(B, L, D) @ wo,)

    return joint_of(f, [torch.randn(B, L, D), param(D, D), param(D, D)])


def chain():
    """sin∘…∘sin with a widening step: each sin's backward reads its input, so which links are
    saved decides how long a run backward replays (the classic checkpointing chain)."""
    def f(x, w):
        h = x * w
        for i in range(6):
            h = h.sin() if i != 2 else torch.cat([h, h], 1).cos()
        return (h,)

    return joint_of(f, [torch.randn(4, 4), param(4, 4)])


def seq_parallel():
    """An all-gather (Megatron's SP entry into the TP region) feeding a matmul: recomputing the
    gathered input re-runs the collective."""
    def f(x, w):
        g = torch.ops.mcompile.all_gather(x.sin(), 0, "tp", 2, "rs")
        return ((g @ w).relu(),)

    return joint_of(f, [torch.randn(4, 8, requires_grad=True), param(8, 8)])


GRAPHS = {"mlp": mlp, "attention": attention, "chain": chain, "seq_parallel": seq_parallel}


def budgets(gm, n: int = 5) -> list[int]:
    """``n`` budgets from the least feasible to the bytes of saving everything needed."""
    lo, hi = min_budget(gm), solve(gm, None).saved_bytes
    return sorted({lo + (hi - lo) * i // (n - 1) for i in range(n)})


def check_against_exhaustive(gm, budget: int, **kw) -> RematSolution:
    ilp, ref = solve(gm, budget, **kw), exhaustive(gm, budget, **kw)
    assert ilp.optimal
    assert ilp.recompute_flops == ref.recompute_flops, (budget, ilp, ref)
    assert ilp.saved_bytes == ref.saved_bytes, (budget, ilp, ref)
    assert ilp.saved_bytes <= budget
    return ilp


# ---------------------------------------------------------------------------------------------
# classification and costs
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_classify_splits_on_tangents():
    gm = mlp()
    fwd, bwd = classify(gm)
    calls = {n.name for n in gm.graph.nodes if n.op == "call_function"}
    assert fwd | bwd == calls and not fwd & bwd
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in bwd:  # every backward node reads a tangent or a backward node
        assert any(a.name.startswith("tangents") or a.name in bwd for a in nodes[name].all_input_nodes)
    for name in fwd:
        assert not any(a.name.startswith("tangents") or a.name in bwd for a in nodes[name].all_input_nodes)
    assert {n.name for n in by_target(gm, aten.gelu.default)} <= fwd
    assert {n.name for n in by_target(gm, aten.gelu_backward.default)} <= bwd


@pytest.mark.timeout(60)
def test_node_cost_formulas():
    gm = mlp()
    addmm = by_target(gm, aten.addmm.default)[0]  # F.linear(x[4,8], w1[16,8], b1): 4x16 out, k=8
    assert node_cost(addmm) == (2 * 4 * 16 * 8 + 4 * 16, 4 * 16 * 4)
    mm = by_target(gm, aten.mm.default)[0]  # h[4,16] @ w2[16,12]
    assert node_cost(mm) == (2 * 4 * 12 * 16, 4 * 12 * 4)
    gelu = by_target(gm, aten.gelu.default)[0]
    assert node_cost(gelu) == (4 * 16, 4 * 16 * 4)
    t = by_target(gm, aten.t.default)[0]
    assert node_cost(t)[0] == 0

    att = attention()
    (sdpa,) = [n for n in att.graph.nodes if "scaled_dot_product" in str(n.target) and "backward" not in str(n.target)]
    assert node_cost(sdpa)[0] == 4 * B * H * L * L * (D // H) / 2  # causal: half
    assert all(node_cost(n)[0] == 0 for n in att.graph.nodes if n.target in (aten.view.default, aten.transpose.int))

    sp = seq_parallel()
    (ag,) = by_target(sp, torch.ops.mcompile.all_gather.default)
    assert node_cost(ag) == (8 * 8 * 4, 8 * 8 * 4)  # communication: its bytes


# ---------------------------------------------------------------------------------------------
# the integer program against brute force
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(GRAPHS))
def test_solve_matches_exhaustive_and_is_monotone(name):
    gm = GRAPHS[name]()
    bs = budgets(gm)
    assert len(bs) >= 4
    sols = [check_against_exhaustive(gm, b) for b in bs]
    flops = [s.recompute_flops for s in sols]
    assert flops == sorted(flops, reverse=True)  # more budget, never more FLOPs
    assert flops[-1] == 0  # saving everything needed recomputes nothing
    assert flops[0] > 0  # the least budget recomputes something in every example
    full = solve(gm, None)
    assert full.recomputed == set() and full.recompute_flops == 0


@pytest.mark.timeout(60)
def test_solution_is_consistent():
    """The recomputed set is exactly what backward must replay: every needed value is saved or
    recomputed, every recomputed node's forward inputs too; the totals match the node costs."""
    gm = attention()
    fwd, bwd = classify(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    for b in budgets(gm):
        s = solve(gm, b)
        have = s.saved | s.recomputed
        needed = {a.name for n in bwd for a in nodes[n].all_input_nodes if a.name in fwd}
        assert {v for v in needed if node_cost(nodes[v])[1]} <= have
        for v in s.recomputed:
            assert {a.name for a in nodes[v].all_input_nodes if a.name in fwd} <= have
        assert s.saved_bytes == sum(node_cost(nodes[v])[1] for v in s.saved)
        assert s.recompute_flops == sum(node_cost(nodes[v])[0] for v in s.recomputed)


@pytest.mark.timeout(60)
def test_attention_is_recomputed_before_the_projection():
    """With room for the projection only, recomputing causal attention (4096 FLOPs) beats
    recomputing the projection (8192): Korthikanti et al.'s selective recompute, found, not told.
    (What is saved is the projection or one of its views — the same bytes, equally good.)"""
    gm = attention()
    mm = by_target(gm, aten.mm.default)[0]
    s = solve(gm, node_cost(mm)[1])
    assert s.recompute_flops == 4 * B * H * L * L * (D // H) / 2
    assert mm.name not in s.recomputed
    assert any("scaled_dot_product" in v for v in s.recomputed)


# ---------------------------------------------------------------------------------------------
# random ops, forced choices, errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_dropout_is_saved_never_recomputed():
    def f(x, w1, w2):
        h = F.dropout(F.gelu(x @ w1), 0.5, True)
        return ((h @ w2).sin(),)

    gm = joint_of(f, [torch.randn(4, 8), param(8, 16), param(16, 8)])
    nodes = {n.name: n for n in gm.graph.nodes}
    random = {n.name for n in gm.graph.nodes if n.target is aten.bernoulli_.float}
    assert random
    for b in budgets(gm):
        s = check_against_exhaustive(gm, b)
        assert not s.recomputed & random
        # the mask (bernoulli_ scaled in place by div_) is kept, never drawn again
        assert not {v for v in s.recomputed if getattr(nodes[v].target, "_schema", None) is not None
                    and nodes[v].target._schema.is_mutable}


@pytest.mark.timeout(60)
def test_native_dropout_keeps_only_its_mask():
    def f(x, w):
        out, _ = aten.native_dropout(x @ w, 0.5, True)
        return (out * 3.0,)  # its backward reads the mask only

    gm = joint_of(f, [torch.randn(4, 8), param(8, 8)])
    (drop,) = by_target(gm, aten.native_dropout.default)
    mask = next(u for u in drop.users if u.args[1] == 1)
    # the (bool) mask alone is kept, not the dropout node (its output and mask)
    assert min_budget(gm) == node_cost(mask)[1] == 4 * 8
    assert solve(gm, min_budget(gm)).saved == {mask.name}
    for b in budgets(gm):
        s = check_against_exhaustive(gm, b)
        assert drop.name not in s.recomputed


@pytest.mark.timeout(60)
def test_dropout_with_p_zero_is_recomputable():
    def f(x, w):
        return (aten.native_dropout(x @ w, 0.0, True)[0].cos(),)

    gm = joint_of(f, [torch.randn(4, 8), param(8, 8)])
    assert min_budget(gm) == 0
    assert solve(gm, 0).recompute_flops > 0


@pytest.mark.timeout(60)
def test_infeasible_budget_names_the_minimum():
    def f(x, w):
        return (aten.native_dropout(x @ w, 0.5, True)[0].cos(),)

    gm = joint_of(f, [torch.randn(4, 8), param(8, 8)])
    least = min_budget(gm)
    assert least > 0
    solve(gm, least)
    with pytest.raises(ValueError, match=f"minimum feasible budget is {least} bytes"):
        solve(gm, least - 1)
    with pytest.raises(ValueError, match=f"minimum feasible budget is {least} bytes"):
        exhaustive(gm, least - 1)


@pytest.mark.timeout(60)
def test_must_save_and_must_recompute():
    gm = mlp()
    gelus = [n.name for n in by_target(gm, aten.gelu.default)]
    hi = solve(gm, None).saved_bytes
    s = check_against_exhaustive(gm, hi, must_recompute={gelus[1]})
    assert gelus[1] not in s.saved and gelus[1] in s.recomputed
    s = check_against_exhaustive(gm, hi, must_save={gelus[0]})
    assert gelus[0] in s.saved and gelus[0] not in s.recomputed
    lo = min_budget(gm, must_save={gelus[0]})
    assert lo >= node_cost(by_target(gm, aten.gelu.default)[0])[1]
    check_against_exhaustive(gm, lo, must_save={gelus[0]})
    with pytest.raises(ValueError, match="both"):
        solve(gm, hi, must_save={gelus[0]}, must_recompute={gelus[0]})
    with pytest.raises(ValueError, match="not forward nodes"):
        solve(gm, hi, must_save={"tangents_1"})


@pytest.mark.timeout(60)
def test_dynamic_shapes_size_nodes_are_free():
    """Under symbolic tracing, sizes (``aten.sym_size`` and SymInt arithmetic) are never saved nor
    recomputed: they are free, like the primals."""
    def joint(primals, tangents):
        x, w = primals
        out = (x @ w).sin().view(x.shape[0] * 2, -1).cos().sum()
        return (out, *torch.autograd.grad([out], [w], tangents))

    gm = make_fx(joint, tracing_mode="symbolic")([torch.randn(4, 8), param(8, 8)], [torch.ones(())])
    sizes = {n.name for n in gm.graph.nodes if n.op == "call_function" and not isinstance(n.meta["val"], torch.Tensor)}
    assert sizes and all(node_cost(n) == (0, 0) for n in gm.graph.nodes if n.name in sizes)
    for b in budgets(gm):
        s = check_against_exhaustive(gm, b)
        assert not (s.saved | s.recomputed) & sizes


@pytest.mark.timeout(60)
def test_report_names_the_choice():
    gm = mlp()
    s = solve(gm, budgets(gm)[1])
    text = report(s, gm)
    assert "FLOPs" in text and f"{len(s.saved)} values" in text
    assert all(v in text for v in s.saved | s.recomputed)


# ---------------------------------------------------------------------------------------------
# random programs
# ---------------------------------------------------------------------------------------------
N = 4
OPS = ["add", "mul", "sin", "matmul", "rowsum", "dropout"]


def program(steps: list[tuple[str, int, int]], n_params: int):
    """A function of ``n_params`` [N, N] parameters applying ``steps`` (op, operand, operand), each
    operand an index into the values so far (mod their count); the output sums the last two."""
    def f(*ps):
        vals = list(ps)
        for op, i, j in steps:
            a, b = vals[i % len(vals)], vals[j % len(vals)]
            if op == "matmul" and a.shape[-1] == b.shape[0]:
                vals.append(a @ b)
            elif op in ("add", "matmul"):
                vals.append(a + b)
            elif op == "mul":
                vals.append(a * b)
            elif op == "sin":
                vals.append(a.sin())
            elif op == "rowsum":
                vals.append(a.sum(-1, keepdim=True))
            else:
                vals.append(aten.native_dropout(a, 0.5, True)[0])
        return ((vals[-1] * vals[-2]).cos(),)

    return f


@pytest.mark.timeout(180)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(n_params=st.integers(2, 3),
       steps=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 7), st.integers(0, 7)), min_size=2, max_size=6),
       fractions=st.lists(st.floats(0, 1), min_size=2, max_size=2))
def test_random_programs_match_exhaustive(n_params, steps, fractions):
    gm = joint_of(program(steps, n_params), [param(N, N) for _ in range(n_params)])
    fwd, _ = classify(gm)
    assume(len(fwd) <= 15)
    lo, hi = min_budget(gm), solve(gm, None).saved_bytes
    assert lo <= hi
    prev = math.inf
    for b in sorted({lo, hi, *(lo + int((hi - lo) * x) for x in fractions)}):
        s = check_against_exhaustive(gm, b)
        assert s.recompute_flops <= prev
        prev = s.recompute_flops
    assert prev == 0
