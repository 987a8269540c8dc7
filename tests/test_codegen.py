"""``codegen="inductor"`` (mcompile.passes.codegen): Inductor-compiled forward and backward modules
of the joint programs give eager's outputs, with mcompile's collectives kept as opaque calls.

What is checked: the forward and backward modules of llama3-tiny at tp=2 with sequence parallelism
(each rank's joint program: passes/joint.py ``trace_joint`` + ``partition`` with the saved set of
recompute "none", through :class:`~mcompile.runtime.joint_runner.JointRunner`) run compiled in the thread
simulator and match the eager modules output by output (float32: rtol 1e-5, atol 1e-6; Inductor
reorders float reductions, so not bit for bit), issuing the same collectives in the same order; a
graph with every collective op compiles, calls each op by name in the generated code and matches
eager; the in-memory cache; the error raised when Inductor cannot compile a graph; and the runtime
end to end: ``parallelize(..., codegen="inductor")`` at dp=2 x tp=2 SP on four gloo processes trains
as the single-device reference does. dp=2 x tp=2 in the simulator and the end-to-end run are in the
slow tier (four ranks compiling on a small machine; skipped unless ``-m slow`` selects them, since
the project's addopts does not deselect ``slow``).
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import torch.utils._pytree as pytree
from sim_harness import rank_args
from torch.fx.experimental.proxy_tensor import make_fx

from mcompile.compiler import joint_runner
from mcompile.ir import ops
from mcompile.ir.config import Config
from mcompile.ir.mesh import Mesh
from mcompile.passes.codegen import CodegenError, cache_size, clear_cache, compile_graph
from mcompile.runtime.sim import ThreadedWorld, run_threads

RTOL, ATOL = 1e-5, 1e-6
_TRACE = threading.Lock()  # tracing is not thread-safe: each rank traces under the lock, then runs


def _slow_only(request, why: str):
    expr = request.config.getoption("markexpr") or ""
    if "slow" not in expr or "not slow" in expr:
        pytest.skip(f"slow tier ({why}): run with -m slow")


def _clone(args):
    return pytree.tree_map(lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a, list(args))


def compare(eager, compiled) -> float:
    """Max abs difference of two outputs (nested tuples / lists of tensors: a saved multi-output value
    is a tuple); asserts they agree (float: allclose, else equal) and have the same structure."""
    el, es = pytree.tree_flatten(eager)
    cl, cs = pytree.tree_flatten(compiled)
    assert es == cs, f"output structure {cs} != {es}"
    worst = 0.0
    for i, (e, c) in enumerate(zip(el, cl)):
        if not isinstance(e, torch.Tensor):
            assert c == e, f"output {i}: {c!r} != {e!r}"
            continue
        assert c.shape == e.shape and c.dtype == e.dtype, f"output {i}: {c.shape}/{c.dtype} vs {e.shape}/{e.dtype}"
        if e.is_floating_point():
            assert torch.allclose(c, e, rtol=RTOL, atol=ATOL, equal_nan=True), \
                f"output {i}: max diff {(c - e).abs().max().item():.3g}"
            if e.numel():
                worst = max(worst, (c.double() - e.double()).abs().max().item())
        else:
            assert torch.equal(c, e), f"output {i} ({e.dtype}) differs"
    return worst


def capture_fw_bw(c, inputs, world: ThreadedWorld, config: Config | None = None):
    """Each rank's joint forward and backward modules (passes/joint.py, recompute "none": the modules
    ``JointRunner`` runs) and the real inputs they take in one training step. Traced one rank at a
    time (tracing is not thread-safe), then run eagerly in the simulator to record the inputs:
    forward ``(*program inputs, *lifted constants)``, backward ``(*saved, *primals it reads,
    *tangents)`` with the loss's tangent 1 and the other differentiable outputs' 0."""
    state = c.captured.state_values()
    config = config or Config(sequence_parallel=True)

    def rank(r):
        prog, args = rank_args(c, r, inputs, state)
        runner = joint_runner(prog, config, name=f"rank {r}")
        with _TRACE:
            jp = runner.compile(args)
        fw_in = list(args) + jp.joint.constants
        rec = {"jp": jp, "fw": jp.forward, "fw_in": _clone(fw_in)}
        outs, ctx = runner.forward(args)
        tangents = runner.tangents(ctx, outs)
        rec["bw"], rec["bw_in"] = jp.backward, _clone([*ctx.saved, *ctx.primals, *tangents])
        return rec

    return dict(enumerate(run_threads(world, rank)))


# ---- small graphs ---------------------------------------------------------------------------------------


def _every_collective(x, w):
    y = torch.ops.mcompile.copy_ar_bwd(x, "tp", 2)
    h = torch.relu(y @ w.t()) * 2 + 1  # a matmul and a fused pointwise kernel between the collectives
    s = torch.ops.mcompile.all_reduce(h, "tp", 2)
    m = torch.ops.mcompile.all_reduce_max(h.amax(-1, keepdim=True), "tp", 2)
    g = torch.ops.mcompile.all_gather(s - m, 0, "tp", 2, "split")
    rs = torch.ops.mcompile.reduce_scatter(g.exp(), 0, "tp", 2)
    sh = torch.ops.mcompile.shard_slice(g * 3, 1, "tp", 2)
    sn = torch.ops.mcompile.shard_slice_nograd(g.tanh(), 0, "tp", 2)
    return rs + sn, sh.sum(-1), g.t()


COLLECTIVES = ("copy_ar_bwd", "all_reduce", "all_reduce_max", "all_gather", "reduce_scatter", "shard_slice",
               "shard_slice_nograd")


@pytest.mark.timeout(240)
def test_every_collective_stays_opaque_and_matches_eager():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g)
    gm = make_fx(_every_collective, tracing_mode="fake")(x, w)
    fn = compile_graph(gm, [x, w], "inductor", name="every_collective")
    called = re.findall(r"torch\.ops\.mcompile\.(\w+)\.default\(", fn.source_code)
    assert called == list(COLLECTIVES), called  # each once, in the graph's order, none decomposed
    per_rank = [(torch.randn(4, 8, generator=g), w) for _ in range(2)]
    world = ThreadedWorld(Mesh.parse("tp=2"))
    logs = {}

    def rank(r):
        comm = ops.current()
        eager = gm(*per_rank[r])
        n = len(comm.log)
        out = fn(*per_rank[r])
        logs[r] = (comm.log[:n], comm.log[n:])
        return compare(eager, out)

    run_threads(world, rank)  # compare() asserts allclose per output
    for eager_log, compiled_log in logs.values():
        assert compiled_log == eager_log  # same collectives, same axis, same shapes, same order


@pytest.mark.timeout(120)
def test_eager_is_the_graph_itself_and_cache():
    x = torch.randn(4, 8)
    gm = make_fx(lambda a: (a * 2 + 1, a.sum()))(x)
    assert compile_graph(gm, [x]) is gm and compile_graph(gm, [x], "eager") is gm
    with pytest.raises(ValueError, match="codegen='triton'"):
        compile_graph(gm, [x], "triton")
    clear_cache()
    fn = compile_graph(gm, [x], "inductor")
    t = time.perf_counter()
    again = compile_graph(gm, [x], "inductor")
    assert again is fn and time.perf_counter() - t < 0.05
    assert cache_size() == 1
    compare(gm(x), fn(x))
    y = torch.randn(3, 5)  # another shape: another entry
    other = compile_graph(gm, [y], "inductor")
    assert other is not fn and cache_size() == 2
    compare(gm(y), other(y))
    single = make_fx(lambda a: a.cos() * 2)(x)  # a graph returning one tensor, not a tuple
    assert torch.allclose(compile_graph(single, [x], "inductor")(x), single(x), rtol=RTOL, atol=ATOL)


@torch.library.custom_op("mcompile_test_codegen::no_fake", mutates_args=())
def _no_fake(x: torch.Tensor) -> torch.Tensor:  # no fake implementation: Inductor cannot trace it
    return x + 1


@pytest.mark.timeout(60)
def test_failure_names_graph_cause_and_fallback():
    x = torch.randn(4)
    gm = make_fx(lambda a: (torch.ops.mcompile_test_codegen.no_fake(a) * 2,))(x)
    with pytest.raises(CodegenError) as err:
        compile_graph(gm, [x], "inductor", name="backward[rank 3]")
    msg = str(err.value)
    assert "backward[rank 3]" in msg and "no_fake" in msg and 'codegen="eager"' in msg, msg
    assert compile_graph(gm, [x], "eager")(x)[0].equal((x + 1) * 2)


def _overlapped_program(n: int, k: int, b: int, s: int, h: int, f: int):
    """A column-parallel linear whose output is all-reduced asynchronously (passes/overlap.make_async: started
    at once, waited at the end) while a pointwise function of it feeds a row-parallel linear into a
    sequence-parallel reduce-scatter, rewritten by collective matmul (``tp_overlap=k``: k chunk GEMMs, each
    chunk's reduce-scatter started under the next chunk's GEMM)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mcompile.passes.dp.overlap import check_waits, make_async
    from mcompile.passes.tp import collective_matmul as CM

    def prog(a, w1, w2):
        z = torch.mm(a, w1.t())
        g = torch.relu(z) * 2  # after the start: where Inductor wrote g over z in place
        r = ops.OPS["all_reduce"](z, "tp", n)
        y = torch.mm(g, w2).view(b, s, h)
        return ops.OPS["reduce_scatter"](y, 1, "tp", n), r, g

    with FakeTensorMode():
        gm = make_fx(prog)(torch.empty(b * s, f), torch.empty(h, f), torch.empty(h, h))
    # the all-reduce is not chunked (relu reads its partial products before it): made asynchronous below instead
    assert sorted((d.pattern, d.chunks) for d in CM.rewrite(gm, tp_overlap=k)) == [(CM.MM_AR, 1), (CM.MM_RS, k)]
    ar = next(x for x in gm.graph.nodes if x.target is ops.OPS["all_reduce"])
    make_async(gm, ar, wait_before=next(x for x in gm.graph.nodes if x.op == "output"))
    gm.recompile()
    check_waits(gm)
    return gm


@pytest.mark.timeout(240)
def test_started_collectives_under_inductor_send_the_eager_bytes_and_stay_overlapped():
    """Issue 38 item 8. A started collective reads its input until its wait, but Inductor was told the
    start is functional: it computed the next kernel's output in place over the input of an in-flight
    all-reduce (``buf3 = buf0; del buf0  # reuse``) and, with its peak-memory reordering, moved every wait
    up to just after its start (no overlap left). The wait now takes the start's input, and a graph with
    started collectives keeps its order (passes/codegen.py). The simulator runs a started collective at its
    wait (the latest read a backend may make) and records what it sent: the compiled program sends what
    the eager one does, collective by collective, and returns its outputs; its generated code keeps each
    GEMM between the starts and the waits the overlap passes put around it."""
    n, k, (b, s, h, f) = 2, 2, (2, 8, 8, 16)
    gm = _overlapped_program(n, k, b, s, h, f)
    inputs = [[torch.randn(b * s, f, generator=torch.Generator().manual_seed(r)),
               torch.randn(h, f, generator=torch.Generator().manual_seed(9)),
               torch.randn(h, h, generator=torch.Generator().manual_seed(8))] for r in range(n)]
    fn = compile_graph(gm, inputs[0], "inductor", name="overlapped program")
    code = fn.source_code[fn.source_code.index("def call"):]
    calls = re.findall(r"(extern_kernels\.mm|torch\.ops\.mcompile\.(?:start_\w+|wait)\.default)\(", code)
    calls = [c.split(".")[-2] if "mcompile" in c else "mm" for c in calls]
    assert calls == ["mm", "start_all_reduce"] + ["mm", "start_reduce_scatter"] * k + ["wait"] * (k + 1), calls

    def rank(r):
        comm = ops.current()
        eager = gm(*_clone(inputs[r]))
        n0 = len(comm.log)
        out = fn(*_clone(inputs[r]))
        return comm.log[:n0], comm.log[n0:], comm.sent[:n0], comm.sent[n0:], eager, out

    for log_e, log_c, sent_e, sent_c, eager, out in run_threads(ThreadedWorld(Mesh.parse(f"tp={n}"), record_sent=True),
                                                                 rank):
        assert log_c == log_e and len(log_e) == k + 1
        for i, (se, sc) in enumerate(zip(sent_e, sent_c)):
            torch.testing.assert_close(sc, se, rtol=0, atol=1e-6, msg=lambda m, i=i: f"collective {i}: {m}")
        compare(eager, out)


# ---- llama3-tiny ------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mesh", ["tp=2", pytest.param("dp=2,tp=2", marks=pytest.mark.slow)])
def test_llama_forward_backward_graphs_match_eager(compiled_model, mesh, request):
    if mesh != "tp=2":
        _slow_only(request, "four ranks, minutes of compilation on 2 cores")
    _, inputs, c, _ = compiled_model("llama3-tiny", mesh, True)
    rec = capture_fw_bw(c, inputs, ThreadedWorld(c.mesh))
    fns = {}
    for r, s in rec.items():  # compiled one rank at a time, before any rank runs
        for kind in ("fw", "bw"):
            fns[r, kind] = compile_graph(s[kind], s[kind + "_in"], "inductor", name=f"llama3-tiny {kind}[rank {r}]")
    for kind in ("fw", "bw"):
        src = fns[0, kind].source_code
        ops_called = set(re.findall(r"torch\.ops\.mcompile\.(\w+)\.default\(", src))
        graph_ops = {n.target.__name__.split(".")[0] for n in rec[0][kind].graph.nodes
                     if n.op == "call_function" and str(n.target).startswith("mcompile.")}
        assert ops_called == graph_ops and graph_ops, (kind, ops_called, graph_ops)
    world = ThreadedWorld(c.mesh)

    def rank(r):
        comm = ops.current()
        diffs = {}
        for kind in ("fw", "bw"):
            g, args = rec[r][kind], rec[r][kind + "_in"]
            n0 = len(comm.log)
            eager = g(*_clone(args))
            n1 = len(comm.log)
            out = fns[r, kind](*_clone(args))
            assert comm.log[n1:] == comm.log[n0:n1], kind
            diffs[kind] = compare(eager, out)
        return diffs

    diffs = run_threads(world, rank)
    print("max |inductor - eager| per rank:", diffs)


@pytest.mark.timeout(600)
def test_joint_runner_with_inductor_gives_the_eager_gradients(compiled_model):
    """``JointRunner`` with ``Config(codegen="inductor")`` (each module compiled on its first call, the
    backward with the compiled forward's saved values, a tuple among them) at tp=2 SP, in the thread
    simulator: the gradients of two calls match the eager joint modules' (the second call runs the
    compiled code only)."""
    _, inputs, c, _ = compiled_model("llama3-tiny", "tp=2", True)
    state = c.captured.state_values()

    def rank(r):
        prog, args = rank_args(c, r, inputs, state)
        runners = {cg: joint_runner(prog, Config(sequence_parallel=True, codegen=cg)) for cg in ("eager", "inductor")}
        with _TRACE:
            for runner in runners.values():
                runner.compile(args)
        worst = 0.0
        for _ in range(2):
            grads = {}
            for cg, runner in runners.items():
                outs, ctx = runner.forward(args)
                grads[cg] = runner.backward(ctx, runner.tangents(ctx, outs))
            worst = max(worst, compare(grads["eager"], grads["inductor"]))
        assert type(runners["inductor"].last.forward.fn).__name__ == "CompiledGraph"
        return worst

    print("max |inductor - eager| of the gradients per rank:", run_threads(ThreadedWorld(c.mesh), rank))


# ---- the runtime end to end ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_runtime_with_inductor_trains_as_the_reference(request):
    """``parallelize(..., sequence_parallel=True, codegen="inductor")`` at dp=2 x tp=2 on four gloo
    processes (JointRunner compiles each rank's forward and backward on the first step): three AdamW
    steps give the single-device losses and clip norms (rel 1e-5) and unclipped gradients (relative
    error in norm <= 1e-5)."""
    _slow_only(request, "four processes each compiling forward and backward: minutes on 2 cores")
    from runtime_cases import grad_errors, reference, train

    from conftest import pool

    out = pool(4).run(train, "llama3-tiny", "dp=2,tp=2", {"sequence_parallel": True, "codegen": "inductor"},
                      timeout=840)
    ref_losses, ref_grads, ref_norms = reference("llama3-tiny")
    losses, grads, _, norms = out[0]
    for r, (l_r, _, _, n_r) in enumerate(out):
        assert l_r == pytest.approx(ref_losses, rel=1e-5), (r, l_r, ref_losses)
        assert n_r == pytest.approx(ref_norms, rel=1e-5), (r, n_r, ref_norms)
    errs = grad_errors(grads, ref_grads)
    assert max(errs.values()) <= 1e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:5]
