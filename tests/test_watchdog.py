"""The hang watchdog (mcompile.runtime.watchdog): a rank that never issues a collective is named, with the op, the
group and the sequence number, by the ranks that wait for it, seconds after the hang instead of at the process
group's timeout; a normal run reports nothing.

The planted hangs use a hang timeout of 1 s under a gloo timeout of 120 s (the pool's, launch.DEFAULT_TIMEOUT), so
only the watchdog can speak first. The late-rank test releases its hang itself (the planted rank issues its
collective once the report is out): the shared worker pool lives on. The abort test's ranks end their processes,
so they are processes of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcompile.ir.config import Config
from mcompile.runtime.watchdog import EXIT_CODE, CollectiveHang, CollectiveLog, HangSettings, diagnose

from conftest import pool

HERE = Path(__file__).resolve().parent


def _seq(pattern: str, text: str) -> int:
    import re

    m = re.search(pattern, text)
    assert m, (pattern, text)
    return int(m.group(1))


@pytest.mark.xdist_group("processes")
@pytest.mark.timeout(180)
def test_late_rank_is_named_by_the_ranks_that_wait(tmp_path):
    """dp=2 x tp=2, each step an all-reduce over tp then one over dp; rank 1 holds back its second tp all-reduce.
    Rank 0 waits in all_reduce #N on tp[0,1] and names rank 1 (never issued it; last issued #N-1, completed; in no
    collective); rank 3 waits for rank 1 over dp[1,3]; rank 2 waits over dp[0,2] for rank 0, which it says waits in
    tp[0,1]; rank 1 says it is in no collective. Afterwards, and after every other kind of call of the
    communicator (started collectives and their waits, ring steps, a bucket's launch), no rank holds an unfinished
    entry."""
    from watchdog_cases import late_rank

    reports = pool(4).run(late_rank, str(tmp_path), 1.0, timeout=150)
    text = {r: t for r, (t, _) in enumerate(reports)}
    assert all(clean for _, clean in reports), "an entry stayed unfinished after the hang was released"
    # sequence numbers count per process group since the process made it: the shared pool's groups have served
    # earlier tests, so the test reads each group's number from the report and checks how they relate
    r0 = text[0]
    tp = _seq(r"rank 0: all_reduce #(\d+) on tp\[0,1\] has not completed after", r0)
    assert f"rank 1 has not arrived: it never issued all_reduce #{tp} on tp[0,1]; it last issued all_reduce " \
           f"#{tp - 1} (completed); it is in no collective" in r0, r0
    dp13 = _seq(r"rank 3: all_reduce #(\d+) on dp\[1,3\] has not completed", text[3])
    assert f"rank 1 has not arrived: it never issued all_reduce #{dp13} on dp[1,3]" in text[3], text[3]
    dp02 = _seq(r"rank 2: all_reduce #(\d+) on dp\[0,2\] has not completed", text[2])
    assert f"rank 0 has not arrived: it never issued all_reduce #{dp02} on dp[0,2]" in text[2], text[2]
    assert f"it waits in all_reduce #{tp} on tp[0,1]" in text[2], text[2]
    assert "rank 1: a hang was reported" in text[1] and "this rank is in no collective" in text[1], text[1]
    assert "has not completed" not in text[1], text[1]  # the planted rank waited in nothing


@pytest.mark.xdist_group("processes")
@pytest.mark.timeout(180)
def test_hang_abort_ends_the_waiting_rank_with_collective_hang(tmp_path):
    """tp=2 on two processes of its own, rank 1 skips the second all-reduce and leaves once rank 0 has reported:
    rank 0 (hang_abort) exits with EXIT_CODE, its stderr's last line CollectiveHang naming rank 1, the op, the
    group and the sequence number."""
    from mcompile.runtime.launch import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    code = f"import watchdog_cases; watchdog_cases.abort_main({str(tmp_path)!r}, 1.0)"
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(r)}, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    (_, err0), (_, err1) = outs
    assert procs[1].returncode == 0, err1[-3000:]  # 3: rank 0's report never came
    assert procs[0].returncode == EXIT_CODE, err0[-3000:]
    last = [line for line in err0.splitlines() if line.strip()][-1]
    assert last.startswith("CollectiveHang: rank 0: all_reduce #2 on tp[0,1] has not completed"), err0[-3000:]
    assert "rank 1 has not arrived: it never issued all_reduce #2 on tp[0,1]; it last issued all_reduce #1" in last
    assert (tmp_path / "rank0.txt").exists()


@pytest.mark.xdist_group("processes")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh,options", [
    ("pp=2,dp=2", {"microbatches": 2}),
    # the program's collectives and ZeRO-3's started gathers (start / wait); the CI tier has the pp layout's
    # started messages and buckets, and the late-rank test the communicator's synchronous collectives
    pytest.param("dp=2,tp=2", {"zero": 3}, marks=pytest.mark.slow),
])
def test_normal_run_reports_nothing(tmp_path, mesh, options):
    """Two train steps and a forward of the tiny Llama, the watchdog at 20 s: every entry finished (the program's
    collectives, the dp buckets launched inside the backward, the step's own; under pp the pipeline's messages),
    each group's collectives counted, the watchdog ticking, no incident and no report."""
    from watchdog_cases import normal_run

    out = pool(4).run(normal_run, mesh, options, str(tmp_path / "hangs"))
    for rank, o in enumerate(out):
        assert o["unfinished"] == [] and o["reports"] == [] and o["incidents"] == 0, (rank, o)
        assert o["ticks"] >= 2, (rank, o)
        counted = o["issued"]
        if "tp" in mesh:
            assert any(k.startswith("tp[") and n >= 4 for k, n in counted.items()), (rank, counted)
        else:  # each rank sends and receives per microbatch, forward and backward
            assert any(k.startswith("send to") for k in counted) and any(k.startswith("recv from") for k in counted)
        assert any(k.startswith(("dp[", "data[")) for k in counted), (rank, counted)


def test_settings_resolve_config_then_environment_then_default(monkeypatch):
    monkeypatch.delenv("MCOMPILE_HANG_TIMEOUT", raising=False)
    monkeypatch.delenv("MCOMPILE_HANG_DIR", raising=False)
    assert HangSettings.resolve().timeout_s == 300.0
    monkeypatch.setenv("MCOMPILE_HANG_TIMEOUT", "7.5")
    monkeypatch.setenv("MCOMPILE_HANG_DIR", "/tmp/x-hangs")
    assert HangSettings.resolve() == HangSettings(timeout_s=7.5, dump_dir="/tmp/x-hangs")
    assert HangSettings.resolve(timeout_s=2, dump_dir="d", abort=True) == \
        HangSettings(timeout_s=2.0, dump_dir="d", abort=True)
    monkeypatch.setenv("MCOMPILE_HANG_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MCOMPILE_HANG_TIMEOUT='soon'"):
        HangSettings.resolve()
    with pytest.raises(ValueError, match="hang_timeout_s=-1"):
        Config(hang_timeout_s=-1)
    with pytest.raises(ValueError, match="below collective_timeout_s"):
        Config(hang_timeout_s=600, collective_timeout_s=300)
    assert Config(hang_timeout_s=0).hang_timeout_s == 0


def _state(rank, keys, unfinished=(), latest=None):
    return {"rank": rank, "keys": {k: {"issued": list(i), "completed": list(c), "group": ""}
                                   for k, (i, c) in keys.items()},
            "unfinished": list(unfinished), "latest": latest}


def test_diagnose_names_order_mismatch_messages_and_silence():
    """The cases the planted runs do not reach: another op issued as the same number, a message whose receive
    was never posted, a rank that did not answer."""
    hung = {"rank": 0, "key": "tp[0,1]", "seq": 5, "op": "all_reduce", "group": "tp[0,1]", "peer": None, "age": 3.0}
    other = {"key": "tp[0,1]", "seq": 5, "op": "all_gather", "group": "tp[0,1]", "peer": None, "age": 3.0}
    lines = diagnose(hung, [1, 2], {1: _state(1, {"tp[0,1]": ((5, "all_gather"), (4, "all_reduce"))}, [other])})
    assert "rank 1 issued all_gather as #5 on tp[0,1] where rank 0 issued all_reduce" in lines[0]
    assert lines[1].startswith("rank 2 did not answer")
    send = {"rank": 2, "key": "send to 3", "seq": 7, "op": "send", "group": "pp", "peer": 3, "age": 3.0}
    waiting = {"key": "recv from 4", "seq": 1, "op": "recv", "group": "pp", "peer": 4, "age": 9.0}
    (line,) = diagnose(send, [3], {3: _state(3, {"recv from 2": ((6, "recv"), (6, "recv"))}, [waiting])})
    assert line == ("rank 3 has not arrived: it never issued recv #7 from rank 2 (pp); it last issued recv #6 "
                    "(completed); it waits in recv #1 from rank 4 (pp) for 9.0 s")
    (line,) = diagnose(send, [3], {3: _state(3, {"recv from 2": ((7, "recv"), (6, "recv"))},
                                             [{**waiting, "key": "recv from 2", "seq": 7, "peer": 2}])})
    assert line == "arrived and waiting too: rank 3"


class _Work:
    """A started collective's work: ``is_completed`` as ``done`` says (gloo's reduce-scatter never says so)."""

    def __init__(self, done=False):
        self.done = done

    def is_completed(self):
        return self.done

    def wait(self):
        return True


def test_log_numbers_per_group_and_peer_and_finishes_by_return_work_or_wait():
    log = CollectiveLog(0)
    with log.collective("all_reduce", "tp[0,1]"):
        pass
    with log.collective("all_gather", "tp[0,1]"):
        pass
    with log.collective("reduce_scatter", "dp[0,2]") as e:  # started: finished by its wait, not its work
        rs = e.started(_Work(done=False))
    ag_work = _Work(done=False)
    with log.collective("all_gather", "dp[0,2]") as e:  # started: finished when its work completes
        e.started(ag_work)
    with log.messages([("send", 1), ("recv", 1), ("send", 1)], "pp") as batch:
        batch.started(_Work(done=True))
    assert [u["key"] for u in log.state()["unfinished"]] == ["dp[0,2]", "dp[0,2]"]
    assert log.oldest_unfinished().what() == "reduce_scatter #1 on dp[0,2]"
    rs.wait()
    assert log.oldest_unfinished().what() == "all_gather #2 on dp[0,2]"
    ag_work.done = True
    assert log.oldest_unfinished() is None
    keys = log.state()["keys"]
    assert keys["tp[0,1]"]["issued"] == [2, "all_gather"] and keys["tp[0,1]"]["completed"] == [2, "all_gather"]
    assert keys["send to 1"]["issued"] == [2, "send"] and keys["recv from 1"]["issued"] == [1, "recv"]
    assert not log._open  # every entry retired, its work let go


def test_on_nccl_a_returned_call_is_finished_when_the_stream_passes_it(monkeypatch):
    """NCCL returns from a collective once it is enqueued: the entry waits for a CUDA event recorded after it
    (a fake event here: no GPU), also after the host's wait for a started one."""
    import torch

    events = []

    class Event:
        def __init__(self):
            self.passed = False
            events.append(self)

        def record(self):
            pass

        def query(self):
            return self.passed

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    log = CollectiveLog(0, device_events=True)
    with log.collective("all_reduce", "tp[0,1]"):
        pass
    assert log.oldest_unfinished().what() == "all_reduce #1 on tp[0,1]"
    events[0].passed = True
    assert log.oldest_unfinished() is None
    with log.collective("all_gather", "tp[0,1]") as e:
        w = e.started(_Work(done=False))
    w.wait()  # orders the stream only
    assert log.oldest_unfinished().what() == "all_gather #2 on tp[0,1]"
    events[1].passed = True
    assert log.oldest_unfinished() is None


def test_a_reported_call_that_fails_raises_collective_hang_from_the_process_groups_error():
    log = CollectiveLog(0)
    with pytest.raises(CollectiveHang, match="rank 1 has not arrived") as info:
        with log.collective("all_reduce", "tp[0,1]") as e:
            e.report = "rank 0: all_reduce #1 on tp[0,1] has not completed after 300.0 s\n  rank 1 has not arrived"
            raise RuntimeError("[gloo] Timed out waiting 1800000ms")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="unreported"):  # an error before any report: as it is
        with log.collective("all_reduce", "tp[0,1]"):
            raise RuntimeError("unreported")
    assert log.oldest_unfinished() is None


def test_train_config_passes_the_watchdog_options():
    from mcompile.apps.train.config import parse_config
    from mcompile.apps.train.loop import _options

    base = {"model": {"preset": "llama3-tiny"}, "data": {"sources": "x"}, "parallel": {"mesh": "dp=2"}}
    hang = lambda cfg: {k: v for k, v in _options(parse_config(cfg)).items() if k.startswith("hang")}  # noqa: E731
    assert hang(base) == {}  # $MCOMPILE_HANG_TIMEOUT, else 300, when the config leaves it
    assert hang({**base, "debug": {"hang_timeout_s": 60, "hang_abort": True}, "checkpoint": {"dir": "/r/ck"}}) == \
        {"hang_timeout_s": 60.0, "hang_dump_dir": "/r/ck/hangs", "hang_abort": True}
    assert hang({**base, "debug": {"hang_dir": "/r/hangs"}}) == {"hang_dump_dir": "/r/hangs"}
