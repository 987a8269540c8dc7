"""Collective matmul (passes/tp/collective_matmul.py): tp all-gather -> matmul and matmul -> reduce-scatter
decomposed into chunks whose communication overlaps the other chunks' GEMMs.

What is isolated: the rewrite of one module, run against the same module unrewritten, on in-process
ranks (runtime/sim.py) with a different input on every rank, so that a chunk taken from the wrong rank
or rows, or a chunk concatenated in the wrong order, changes the result:

- a hand-built module (gather -> addmm and mm; two mms added -> reduce-scatter) at tp=2 and tp=4;
- llama3-tiny's real forward and backward modules at tp=2 with sequence parallelism (outputs, saved
  tensors and gradients);
- the order of starts, GEMMs and waits, and ``check_waits`` on a rewritten and a broken graph;
- ``tp_overlap="auto"``'s decisions on the H100 profile, and the symm_mem fallback warning.

Tolerance: the rewrite computes every value with the same reductions (a row block of a GEMM is the GEMM
of the row block; a collective over a chunk of a non-collective dim is a chunk of the collective), so
the results are bitwise equal here; the tests allow 1e-6 absolute in fp32 for a BLAS that would
block the contraction differently by row count.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.fx as fx
from sim_harness import combine_grads, rank_args
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from mcompile.ir import ops
from mcompile.ir.mesh import Mesh
from mcompile.passes.dp.overlap import OverlapError, check_waits, is_start, is_wait
from mcompile.passes.tp import collective_matmul as CM
from mcompile.runtime.sim import ThreadedWorld, run_threads

from conftest import build, compiled

aten = torch.ops.aten
MM = (aten.mm.default, aten.addmm.default)


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # module docstring: bitwise in practice


def _program(n: int):
    """An SP block in miniature: gather the sequence into a column-parallel pair of linears (one with a
    bias), then two row-parallel linears whose partial sums are added and reduce-scattered. Returns the
    reduce-scattered output and the gathered input (a saved activation: read whole)."""

    def f(x, w1, b1, w3, w2, w4):
        y = ops.OPS["all_gather"](x, 1, "tp", n, "split")  # (b, s, h)
        b, s, h = y.shape
        h1 = torch.addmm(b1, y.view(b * s, h), w1.t())  # (b*s, f/tp)
        h3 = torch.mm(y.view(b * s, h), w3.t())
        a = torch.relu(h1) * h3
        z = (torch.mm(a, w2.t()) + torch.mm(h3, w4.t())).view(b, s, h)  # partial sums over tp
        return ops.OPS["reduce_scatter"](z, 1, "tp", n), y

    return f


def _shapes(b: int, s: int, h: int, f: int):
    return [(b, s, h), (f, h), (f,), (f, h), (h, f), (h, f)]


def _trace(n: int, shapes, dtype=torch.float32) -> fx.GraphModule:
    """The aten graph of :func:`_program` over fake inputs (no memory, any size), meta['val'] on every node."""
    with FakeTensorMode() as mode:
        args = [torch.empty(s, dtype=dtype) for s in shapes]
        with mode:
            return make_fx(_program(n), tracing_mode="real")(*args)


def _inputs(n: int, r: int, shapes):
    g = torch.Generator().manual_seed(100 + r)  # the input differs per rank, the weights do not
    x = torch.randn(shapes[0], generator=g)
    g = torch.Generator().manual_seed(7)
    return [x] + [torch.randn(s, generator=g) for s in shapes[1:]]


def _run(n: int, modules, shapes):
    def rank(r):
        args = _inputs(n, r, shapes)
        return [m(*args) for m in modules]

    return run_threads(ThreadedWorld(Mesh.parse(f"tp={n}")), rank)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,k", [(2, 2), (4, 2), (4, 4)])
def test_hand_built_module_equals_unrewritten(n, k):
    shapes = _shapes(4, 4, 8, 12)
    ref, new = _trace(n, shapes), _trace(n, shapes)
    dec = CM.rewrite(new, tp_overlap=k)
    assert [(d.pattern, d.chunks) for d in dec] == [(CM.AG_MM, k), (CM.MM_RS, k)], dec
    code = new.code
    assert "mcompile.all_gather.default" not in code and "mcompile.reduce_scatter.default" not in code
    assert code.count("mcompile.start_all_gather.default(") == k
    assert code.count("mcompile.start_reduce_scatter.default(") == k
    for want, got in _run(n, [ref, new], shapes):
        for w, g in zip(want, got):
            _close(g, w)


def _chunk_nodes(gm: fx.GraphModule, kind: str):
    """Per chunk (in start order): (start, wait, its matmuls), for the collective of ``kind``."""
    nodes = list(gm.graph.nodes)
    starts = [n for n in nodes if is_start(n) and kind in n.target.name()]
    out = []
    for s in starts:
        wait = next(u for u in s.users if is_wait(u))
        if kind == "all_gather":  # the matmuls reading this chunk's buffer (through shape ops, not the cat)
            seen, todo, mms = set(), [s], []
            while todo:
                for u in todo.pop().users:
                    if u not in seen and u.target is not aten.cat.default:
                        seen.add(u)
                        todo.append(u)
                        if u.target in MM:
                            mms.append(u)
        else:  # the matmuls this chunk's reduce-scatter reads
            seen, todo, mms = set(), [s], []
            while todo:
                for a in todo.pop().all_input_nodes:
                    if a not in seen and a.op == "call_function" and a.target is not aten.cat.default:
                        seen.add(a)
                        todo.append(a)
                        if a.target in MM:
                            mms.append(a)
        out.append((s, wait, mms))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("k", [2, 4])
def test_starts_gemms_and_waits_interleave(k):
    gm = _trace(4, _shapes(4, 4, 8, 12))
    CM.rewrite(gm, tp_overlap=k)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    ag = _chunk_nodes(gm, "all_gather")
    assert len(ag) == k and all(len(mms) == 2 for _, _, mms in ag)
    for (_, _, prev), (start, wait, _) in zip(ag, ag[1:]):
        # chunk j's gather is in flight while chunk j-1's GEMMs run
        assert pos[start] < min(pos[m] for m in prev) and pos[wait] > max(pos[m] for m in prev)
    rs = _chunk_nodes(gm, "reduce_scatter")
    assert len(rs) == k and all(len(mms) == 2 for _, _, mms in rs)
    for (start, _, _), (_, _, nxt) in zip(rs, rs[1:]):
        assert pos[start] < min(pos[m] for m in nxt)  # chunk j's reduce-scatter runs under chunk j+1's GEMMs
    last_mm = max(pos[m] for _, _, mms in rs for m in mms)
    assert all(pos[w] > last_mm for _, w, _ in rs)
    check_waits(gm)


@pytest.mark.timeout(60)
def test_check_waits_rejects_a_wait_after_a_reader():
    gm = _trace(2, _shapes(4, 4, 8, 12))
    CM.rewrite(gm, tp_overlap=2)
    check_waits(gm)
    start, wait, _ = _chunk_nodes(gm, "all_gather")[1]
    reader = next(u for u in start.users if u is not wait)
    reader.append(wait)  # the wait moved after the node that reads the buffer
    with pytest.raises(OverlapError, match=f"read by {reader.name} before its wait"):
        check_waits(gm)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,k", [(2, 2), (4, 4)])
def test_batch_one_chunks_each_ranks_sequence_shard_and_equals_unrewritten(n, k):
    # at batch 1 the only dim to chunk is the gathered / scattered sequence: rank-strided chunks (the j-th block
    # of every rank's shard); a chunk from the wrong rank or block, or a wrong interleave, changes the result
    shapes = _shapes(1, 2 * n * k, 8, 12)
    ref, new = _trace(n, shapes), _trace(n, shapes)
    dec = CM.rewrite(new, tp_overlap=k)
    assert [(d.pattern, d.chunks) for d in dec] == [(CM.AG_MM, k), (CM.MM_RS, k)], [str(d) for d in dec]
    assert new.code.count("mcompile.start_all_gather.default(") == k
    assert new.code.count("mcompile.start_reduce_scatter.default(") == k
    # the permutes around the sequence gather only move the batch dim of size 1: no contiguous copy of a chunk
    assert not any(nd.target is aten.clone.default and nd.args[0].target is aten.permute.default
                   for nd in new.graph.nodes)
    check_waits(new)
    for want, got in _run(n, [ref, new], shapes):
        for w, g in zip(want, got):
            _close(g, w)


@pytest.mark.timeout(60)
def test_check_waits_rejects_a_wait_without_the_start_input():
    """The wait takes the start's input (mcompile.ir.ops): read there, it stays live and unwritten while the
    backend sends it; a wait without it lets a compiler reuse the memory (tests/test_codegen.py)."""
    gm = _trace(2, _shapes(4, 4, 8, 12))
    CM.rewrite(gm, tp_overlap=2)
    start, wait, _ = _chunk_nodes(gm, "reduce_scatter")[0]
    assert wait.args == (start, start.args[0])
    wait.args = (start, next(n for n in gm.graph.nodes if n.op == "placeholder"))
    with pytest.raises(OverlapError, match=f"its wait {wait.name} does not take the start's input"):
        check_waits(gm)


@pytest.mark.timeout(60)
def test_simulator_reads_a_started_input_at_its_wait():
    """runtime/sim.py runs a started collective at its wait, as NCCL may read the input until then: an
    input written over in flight is what gets sent (and recorded in ``sent``); the buffer is unwritten
    before the wait."""

    def rank(r):
        comm = ops.current()
        x = torch.full((4, 2), float(r + 1))
        buf = ops.STARTS["all_reduce"](x, "tp", 2)
        assert comm.log == [("all_reduce_sum", "tp", (4, 2))] and comm.sent == [None]  # issued, not yet read
        x.fill_(10.0 * (r + 1))  # what a reused buffer does
        ops.WAIT(buf, x)
        return buf, comm.sent[0]

    for r, (buf, sent) in enumerate(run_threads(ThreadedWorld(Mesh.parse("tp=2"), record_sent=True), rank)):
        assert torch.equal(buf, torch.full((4, 2), 30.0)) and torch.equal(sent, torch.full((4, 2), 10.0 * (r + 1)))


@pytest.mark.timeout(60)
def test_unchunkable_op_is_skipped_with_the_reason():
    gm = _trace(2, _shapes(1, 1, 8, 12))  # batch 1, one sequence row per rank: nothing to split
    dec = CM.rewrite(gm, tp_overlap=2)
    assert [d.chunks for d in dec] == [1, 1], dec
    assert all("no k >= 2 divides each rank's share" in d.reason for d in dec), [str(d) for d in dec]
    assert "start_" not in gm.code


# ---- llama3-tiny, tp=2, sequence parallel --------------------------------------------------------------------
_TRACE = threading.Lock()


# (sequence_parallel, batch) -> tp collectives rewritten in the forward, in the backward; skipped (reading no matmul)
_LLAMA_CASES = {
    # per layer (2) attention and MLP each gather in and reduce-scatter out, plus the LM head's gather: 9 rewritten;
    # the embedding's reduce-scatter (forward), its gradient's gather (backward) and the vocab-parallel loss's two
    # all-reduces (forward) touch no matmul. At batch 1 the same 9: the sequence, not the batch, is chunked
    # (rank-strided)
    (True, 2): (9, 9, 4),
    (True, 1): (9, 9, 4),
    # without SP: per layer attention and MLP each all-reduce their row-parallel output (4), and in backward the
    # input gradient of each block and of the LM head (5); the vocab-parallel embedding's and loss's all-reduces
    # (forward) read no matmul
    (False, 1): (4, 5, 3),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp,batch", list(_LLAMA_CASES))
def test_llama3_tiny_tp2_forward_and_backward_equal_unrewritten_and_single_device(sp, batch):
    from mcompile.passes.joint import partition, saved_for_policy, trace_joint

    _, _, c, _ = compiled("llama3-tiny", "tp=2", sp)  # the plan is symbolic in the batch: traced at this batch
    model, inputs = build("llama3-tiny", batch=batch)
    state = c.captured.state_values()
    per_rank = []
    for r in range(2):
        prog, args = rank_args(c, r, inputs, state)
        with _TRACE:
            jg = trace_joint(prog, args)
        saved = saved_for_policy(jg, "none")
        ref, new = partition(jg, saved), partition(jg, saved)
        dec = CM.rewrite(new.forward, tp_overlap=2, where="forward") + \
            CM.rewrite(new.backward, tp_overlap=2, where="backward")
        names = [n.name for n in prog.graph.nodes if n.op == "placeholder"]
        per_rank.append((args, jg, ref, new, dec, names))
    dec = per_rank[0][4]
    n_fwd, n_bwd, n_skipped = _LLAMA_CASES[sp, batch]
    done = {w: [d for d in dec if d.where == w and d.chunks == 2] for w in ("forward", "backward")}
    skipped = [d for d in dec if d.chunks == 1]
    assert (len(done["forward"]), len(done["backward"])) == (n_fwd, n_bwd), [str(d) for d in dec]
    assert len(skipped) == n_skipped and all("matmul" in d.reason for d in skipped), \
        [str(d) for d in skipped]
    assert {d.pattern for d in done["forward"] + done["backward"]} == ({CM.AG_MM, CM.MM_RS} if sp else {CM.MM_AR})
    code = per_rank[0][3].forward.code + per_rank[0][3].backward.code
    assert ("start_all_gather" in code and "start_reduce_scatter" in code) if sp else "start_all_reduce" in code

    def rank(r):
        args, jg, ref, new, _, _ = per_rank[r]
        a = [x.detach() for x in args] + jg.constants
        with torch.no_grad():
            f_ref, f_new = ref.forward(*a), new.forward(*a)
            n = jg.num_outputs
            tangents = [torch.ones_like(f_ref[i]) if j == 0 else torch.zeros_like(f_ref[i])
                        for j, i in enumerate(jg.diff_outputs)]
            g_ref = ref.backward(*f_ref[n:], *[a[i] for i in ref.bwd_primals], *tangents)
            # the rewritten backward reads the rewritten forward's saved tensors
            g_new = new.backward(*f_new[n:], *[a[i] for i in new.bwd_primals], *tangents)
        return f_ref, f_new, g_ref, g_new

    results = run_threads(ThreadedWorld(c.mesh), rank)
    for f_ref, f_new, g_ref, g_new in results:
        assert len(f_ref) == len(f_new) and len(g_ref) == len(g_new)
        for want, got in zip(f_ref, f_new):  # the loss and every saved tensor
            _close(got, want)
        assert sum(g is not None for g in g_ref) > 0
        for want, got in zip(g_ref, g_new):
            assert (want is None) == (got is None)
            if want is not None:
                _close(got, want)
    # and the single-device model's loss and gradients (tests/sim_harness.py's tolerance: fp32, another order)
    model.zero_grad()
    ref_loss = model(*inputs)
    ref_loss.backward()
    for _, f_new, _, _ in results:
        torch.testing.assert_close(f_new[0], ref_loss.detach(), rtol=1e-5, atol=0)
    grads = [{per_rank[r][5][i]: g for i, g in zip(per_rank[r][1].grad_primals, results[r][3])} for r in range(2)]
    full = combine_grads(c, grads)
    for fqn, p in model.named_parameters():
        want = p.grad
        torch.testing.assert_close(full[fqn], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# ---- the cost model and the fallbacks -----------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_auto_chunks_a_large_op_on_h100_and_skips_a_tiny_one():
    # a 70B-class block at tp=8 under SP: (b=8, s=4096, h=8192) bf16, gathered 512 MiB; GEMMs of ~0.5-2 TFLOP
    big = _trace(8, _shapes(8, 512, 8192, 3584), torch.bfloat16)
    dec = CM.rewrite(big, tp_overlap="auto", hardware="h100")
    assert [d.chunks for d in dec] in ([2, 2], [4, 4], [2, 4], [4, 2]), [str(d) for d in dec]
    assert all(d.saved_s > 0 and "cost model on h100-sxm" in d.reason for d in dec)
    assert "start_all_gather" in big.code
    # the same block at microbatch 1 (b=1, s=4096): rank-strided sequence chunks pay as well
    one = _trace(8, _shapes(1, 512, 8192, 3584), torch.bfloat16)
    dec = CM.rewrite(one, tp_overlap="auto", hardware="h100")
    assert all(d.chunks in (2, 4) and d.saved_s > 0 for d in dec), [str(d) for d in dec]
    tiny = _trace(2, _shapes(2, 4, 8, 12))
    dec = CM.rewrite(tiny, tp_overlap="auto")  # default profile: H100
    assert [d.chunks for d in dec] == [1, 1]
    assert all(d.saved_s < 0 and "predicted slower on h100-sxm" in d.reason for d in dec), [str(d) for d in dec]
    assert "start_" not in tiny.code
    # where comm cannot run beside compute (gloo on a CPU), chunking only adds latency
    cpu = _trace(8, _shapes(8, 512, 8192, 3584), torch.bfloat16)
    assert [d.chunks for d in CM.rewrite(cpu, tp_overlap="auto", hardware="cpu")] == [1, 1]


@pytest.mark.timeout(60)
def test_off_and_bad_values():
    gm = _trace(2, _shapes(4, 4, 8, 12))
    assert CM.rewrite(gm, tp_overlap="off") == [] and "start_" not in gm.code
    with pytest.raises(ValueError, match="number of chunks >= 2"):
        CM.rewrite(gm, tp_overlap=1)
    dec = CM.rewrite(gm, tp_overlap=3)  # clamped down to what divides the batch of 4
    assert [d.chunks for d in dec] == [2, 2] and "clamped to 2" in dec[0].reason


@pytest.mark.timeout(60)
def test_symm_mem_unavailable_warns_and_names_the_fallback():
    assert not CM.symm_mem_available()[0]
    big = _trace(8, _shapes(8, 512, 8192, 3584), torch.bfloat16)
    with pytest.warns(UserWarning, match="symm_mem.*falling back to the chunked decomposition"):
        dec = CM.rewrite(big, tp_overlap="symm_mem", hardware="h100")
    assert all(d.chunks > 1 for d in dec)  # the fallback did its work
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CM.rewrite(_trace(2, _shapes(4, 4, 8, 12)), tp_overlap=2)  # no warning when nothing is asked of symm_mem


# ---- the runtime's copies: all-reduce in place where nothing else reads the input; gathers off dim 0 ----------
def _two_all_reduces(n: int):
    def f(a, b, w):
        y1 = ops.OPS["all_reduce"](torch.mm(a, w).view(-1), "tp", n)  # the product is read by the all-reduce alone
        z = torch.mm(b, w)
        y2 = ops.OPS["all_reduce"](z, "tp", n)  # z is read again below: the all-reduce must not overwrite it
        return y1, y2 + z

    return f


@pytest.mark.timeout(60)
def test_all_reduce_in_place_only_where_nothing_else_reads_its_input():
    from mcompile.passes.dp.overlap import inplace_all_reduces

    shapes = [(4, 6), (4, 6), (6, 8)]
    with FakeTensorMode() as mode:
        args = [torch.empty(s) for s in shapes]
        with mode:
            ref, new = (make_fx(_two_all_reduces(2), tracing_mode="real")(*args) for _ in range(2))
    assert inplace_all_reduces(new) == 1
    inplace = [nd for nd in new.graph.nodes if nd.target is ops.ALL_REDUCE_INPLACE]
    assert len(inplace) == 1 and inplace[0].args[0].target is aten.view.default  # y1's, through its view
    assert sum(nd.target is ops.OPS["all_reduce"] for nd in new.graph.nodes) == 1  # y2's stays functional

    def rank(r):
        g = torch.Generator().manual_seed(r)
        xs = [torch.randn(s, generator=g) for s in shapes]
        return ref(*xs), new(*xs)

    for want, got in run_threads(ThreadedWorld(Mesh.parse("tp=2")), rank):
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def _fake_comm(monkeypatch, n: int = 2):
    """A DistCommunicator over a fake tp group of n ranks, rank 0: rank j holds this rank's input + 100 j
    (all-gather), or this rank's input times j + 1 (reduce-scatter, all-reduce). Records what each collective
    was handed."""
    from mcompile.runtime import comm as C

    seen = []

    def all_gather(out, x, group=None, async_op=False):
        seen.append(x)
        out.copy_(torch.cat([x + 100 * j for j in range(n)]))

    def reduce_scatter(out, x, group=None, async_op=False):
        seen.append(x)
        out.copy_((x * sum(range(1, n + 1))).chunk(n)[0])

    def all_reduce(x, op=None, group=None, async_op=False):
        seen.append(x)
        x.mul_(sum(range(1, n + 1)))

    monkeypatch.setattr(C, "_ALL_GATHER", all_gather)
    monkeypatch.setattr(C, "_REDUCE_SCATTER", reduce_scatter)
    monkeypatch.setattr(C.dist, "all_reduce", all_reduce)
    comm = object.__new__(C.DistCommunicator)
    comm.groups, comm.sizes, comm.ranks, comm.recorder = {"tp": None}, {"tp": n}, {"tp": 0}, None
    return comm, seen


@pytest.mark.timeout(60)
def test_dist_all_reduce_copies_only_when_not_in_place(monkeypatch):
    comm, seen = _fake_comm(monkeypatch)
    x = torch.randn(4, 8)
    x0 = x.clone()
    out = comm.all_reduce(x, "tp", "sum")
    assert seen[-1] is not x and torch.equal(x, x0) and torch.equal(out, 3 * x0)  # the input untouched
    out = comm.all_reduce(x, "tp", "sum", inplace=True)
    assert seen[-1] is x and out is x and torch.equal(x, 3 * x0)  # reduced where it lies: no copy


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape,dim", [((1, 8, 4), 1), ((3, 8, 4), 1), ((3, 4, 8), 2), ((8, 4), 0)])
def test_dist_gathers_off_dim_0_copy_at_most_once(monkeypatch, shape, dim):
    comm, seen = _fake_comm(monkeypatch)
    x = torch.randn(shape)
    lead_ones = all(s == 1 for s in shape[:dim])
    got = comm.all_gather(x, dim, "tp")
    torch.testing.assert_close(got, torch.cat([x, x + 100], dim), rtol=0, atol=0)
    assert seen[-1] is x  # the input is gathered as it lies (it was two transposing copies, in and out)
    assert got.is_contiguous() and (got._base is not None) == (dim != 0 and lead_ones)  # batch 1: a view, no copy
    got = comm.reduce_scatter(x, dim, "tp")
    torch.testing.assert_close(got, 3 * x.chunk(2, dim)[0], rtol=0, atol=0)
    assert got.is_contiguous() and got.shape == x.chunk(2, dim)[0].shape
    # each rank's block moved to the front: one copy of the input, none when every dim before it has size 1
    assert (seen[-1].data_ptr() == x.data_ptr()) == lead_ones
