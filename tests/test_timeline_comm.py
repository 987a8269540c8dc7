"""The communication track of the timeline (mcompile.ir.timeline): interval arithmetic and a gloo run.

- :func:`overlap_stats` on hand-made events, exact numbers (every time a multiple of 1/4: exact in
  binary, so the sums compare with ``==``);
- on four gloo processes, one recorded ``train_step`` without a pp axis: the saved trace has a comm
  track per rank whose collectives, by (kind, axis, asynchronous), are exactly those the rank's
  programs and buckets run — counted from the joint program's modules and the bucket layout, not
  from the recording.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from mcompile.ir.timeline import bubble, chrome_trace, overlap_stats, trace_events

from conftest import pool


def _ev(cat, start, end, rank=0, **kw):
    return {"rank": rank, "name": kw.pop("name", cat), "cat": cat, "start": start, "end": end, **kw}


def _comm(start, end, is_async, kind="all_reduce", axis="dp", nbytes=8, rank=0):
    return _ev("comm", start, end, rank, name=f"{kind} {axis}", kind=kind, axis=axis, bytes=nbytes,
               **{"async": is_async})


EVENTS = [
    _ev("F", 0.0, 4.0, mb=0), _ev("B", 5.0, 10.0, mb=0),
    _comm(1.0, 2.0, False, "all_gather", "tp", 16),  # synchronous, inside F: blocks, never hidden
    _comm(3.0, 6.0, True),  # launched in F, lands in B: hidden [3, 4] and [5, 6]
    _comm(5.5, 9.5, True, "reduce_scatter", "dp", 32),  # overlaps the one above: counted once
    _ev("wait", 8.0, 9.0, name="wait reduce_scatter dp"),  # the host waits for it: not compute
    _ev("F", 0.0, 1.0, rank=1, mb=0),  # a rank without communication
]


@pytest.mark.timeout(60)
def test_overlap_stats_exact():
    st = overlap_stats(EVENTS)
    r0 = st[0]
    # compute = [0,4] U [5,10] minus blocked [1,2] U [8,9] = [0,1] [2,4] [5,8] [9,10]: 7
    assert r0["compute_s"] == 7.0 and r0["blocked_s"] == 2.0
    # comm = [1,2] U [3,9.5] = 7.5; under compute: [3,4] + [5,8] + [9,9.5] = 4.5
    assert r0["comm_s"] == 7.5 and r0["hidden_s"] == 4.5 and r0["exposed_s"] == 3.0
    assert r0["hidden_fraction"] == 0.6
    assert r0["async_comm_s"] == 6.5 and r0["async_hidden_s"] == 4.5
    assert r0["comm_sum_s"] == 8.0 and r0["count"] == 3 and r0["bytes"] == 56
    assert r0["by_kind"] == {"all_gather": {"count": 1, "bytes": 16, "sum_s": 1.0},
                             "all_reduce": {"count": 1, "bytes": 8, "sum_s": 3.0},
                             "reduce_scatter": {"count": 1, "bytes": 32, "sum_s": 4.0}}
    assert st[1]["comm_s"] == 0.0 and st[1]["hidden_fraction"] == 0.0 and st[1]["compute_s"] == 1.0
    # a comm interval wholly under uninterrupted compute is wholly hidden; wholly outside, not at all
    assert overlap_stats([_ev("B", 0.0, 2.0), _comm(0.5, 1.5, True)])[0]["hidden_fraction"] == 1.0
    assert overlap_stats([_ev("B", 0.0, 2.0), _comm(2.0, 3.0, True)])[0]["hidden_s"] == 0.0


@pytest.mark.timeout(60)
def test_chrome_trace_comm_lanes_and_round_trip(tmp_path):
    trace = chrome_trace(EVENTS, {"layout": "dp=2"})
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    tids = {(e["pid"], e["name"], e["ts"]): e["tid"] for e in xs}
    assert tids[(0, "F", 0.0)] == 0 and tids[(0, "wait reduce_scatter dp", 8e6)] == 1
    # comm on thread 2; the reduce-scatter launched while the all-reduce flies gets a second lane
    assert tids[(0, "all_gather tp", 1e6)] == 2 and tids[(0, "all_reduce dp", 3e6)] == 2
    assert tids[(0, "reduce_scatter dp", 5.5e6)] == 3
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[(0, 2)] == "comm" and names[(0, 3)] == "comm 2" and names[(0, 0)] == "compute"
    ag = next(e for e in xs if e["name"] == "all_gather tp")
    assert ag["args"] == {"kind": "all_gather", "axis": "tp", "bytes": 16, "async": False}
    assert overlap_stats(trace) == overlap_stats(EVENTS)  # the trace keeps what the stats need
    assert len(trace_events(trace)) == len(EVENTS)
    assert bubble(trace) == {0: 1 - 9.0 / 10.0, 1: 1 - 1.0 / 10.0}  # comm and waits are not compute
    from mcompile.ir.timeline import draw

    assert draw(trace, tmp_path / "t.png").stat().st_size > 1000  # comm drawn as a strip under each row


# ---- a recorded step on gloo -------------------------------------------------------------------------------
def _kind(n):
    """(kind, axis, asynchronous) of a communicating node of a program module, else None."""
    from mcompile.ir import ops

    if n.op != "call_function" or getattr(n.target, "namespace", None) != "mcompile":
        return None
    name = n.target._opname
    if name.startswith("start_"):
        return name.removeprefix("start_"), n.args[1], True
    if name == "all_reduce_inplace":  # passes/overlap.inplace_all_reduces: the same collective without its copy
        return "all_reduce", n.args[1], False
    axis_arg = {"all_reduce": 1, "all_reduce_max": 1, "all_gather": 2, "reduce_scatter": 2}.get(name)
    if axis_arg is None:
        return None
    assert n.target is ops.OPS[name]
    return name, n.args[axis_arg], False


def recorded_step(rank, world, mesh, options, path):
    """Two steps, the second recorded; this rank's expected collectives, counted from its programs."""
    import mcompile as mc

    from conftest import build

    model, inputs = build("llama3-tiny", batch=4)
    pm = mc.parallelize(model, mc.Mesh.parse(mesh), inputs, **options)
    if pm._zero is not None:
        from mcompile.runtime.zero import DistributedOptimizer

        opt = DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm.train_step(*inputs)  # compiles the joint program: not recorded
    opt.step()
    opt.zero_grad()
    rec = pm.start_timeline()
    pm.train_step(*inputs)
    opt.step()  # ZeRO-1: its parameter all-gathers (publish) join this step's timeline
    opt.zero_grad()
    mine = rec.events()
    trace = pm.save_timeline(path)
    jp = pm._runner.last
    expected, waits = Counter(), 0
    for gm in (jp.forward, jp.backward):
        for n in gm.graph.nodes:
            k = _kind(n)
            if k is not None:
                expected[k] += pm.config.microbatches
            waits += n.op == "call_function" and n.target is torch.ops.mcompile.wait.default
    dp, tp = pm.mesh.size("dp"), pm.mesh.size("tp")
    if pm._zero is not None:  # ZeRO-1/2: one reduce-scatter and one all-gather (publish) per bucket
        expected[("reduce_scatter", "dp", True)] += len(pm._zero.buckets)
        expected[("all_gather", "dp", True)] += len(pm._zero.buckets)
    else:  # one all-reduce per bucket reduced over dp, launched by the step
        expected[("all_reduce", "dp", True)] += sum(b.reduce_dp for b in pm._leaves.buckets)
    if dp > 1:
        expected[("all_reduce", "dp", False)] += 1  # the loss sum and token count
    if tp > 1 and (pm._tp_partial or (pm._zero is not None and pm._zero._tp_partial)):
        expected[("all_reduce", "tp", False)] += 1  # sequence-parallel norm weights, coalesced
    got = Counter((e["kind"], e["axis"], e["async"]) for e in mine if e["cat"] == "comm")
    return {"expected": {k: v for k, v in expected.items() if v}, "got": dict(got),
            "waits": waits * pm.config.microbatches,
            "got_waits": sum(e["cat"] == "wait" for e in mine),
            "compute": sorted(e["name"] for e in mine if e["cat"] in "FB"),
            "incomplete": sum(bool(e.get("incomplete")) for e in mine),
            "saved": trace is not None}


LAYOUTS = {
    "dp2tp2-sp-zero3-overlap": ("dp=2,tp=2", {"sequence_parallel": True, "zero": 3, "overlap": True, "tp_overlap": 2}),
    "dp4-zero1-sync": ("dp=4", {"zero": 1, "overlap": False}),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_comm_track_counts_the_programs_collectives(layout, tmp_path):
    mesh, options = LAYOUTS[layout]
    path = tmp_path / "trace.json"
    res = pool(4).run(recorded_step, mesh, options, str(path), timeout=540)
    assert [r["saved"] for r in res] == [True, False, False, False]  # rank 0 writes the file
    trace = json.loads(path.read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank, r in enumerate(res):
        assert r["got"] == r["expected"], (rank, r)
        assert r["got_waits"] == r["waits"] and r["incomplete"] == 0
        assert r["compute"] == ["B0.0", "F0.0"]
        comm = [e for e in xs if e["pid"] == rank and e["cat"] == "comm"]
        assert comm and all(e["tid"] >= 2 for e in comm)  # the comm track, apart from compute (tid 0)
        assert Counter((e["args"]["kind"], e["args"]["axis"], e["args"]["async"]) for e in comm) == r["expected"]
        assert all(e["args"]["bytes"] > 0 for e in comm)
    if options.get("overlap"):  # something is launched asynchronously and lands: it has a length
        assert any(e["args"]["async"] and e["dur"] > 0 for e in xs if e["cat"] == "comm")
    stats = overlap_stats(trace)
    assert sorted(stats) == [0, 1, 2, 3]
    for s in stats.values():
        assert 0.0 <= s["hidden_s"] <= s["comm_s"] + 1e-12 and 0.0 <= s["hidden_fraction"] <= 1.0
    assert trace["otherData"]["layout"] == mesh
