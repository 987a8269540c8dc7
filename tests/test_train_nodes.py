"""``mcompile train`` on several nodes, and elastic restarts on fewer (mcompile/apps/train/elastic.py, cli.py).

- Launch settings (no processes): ``--nnodes`` / ``--node-rank`` / ``--rdzv-endpoint`` / ``--rdzv-id`` from the
  command line, the config's ``[launch]``, then Slurm's environment; Slurm host lists; each bad input an error
  that names the fix, before any process starts (a mesh that the nodes x processes do not make, a range of
  node counts a smaller world cannot be re-planned for).
- Re-planning (no processes): dp' = world / (tp x pp x cp x ep), the global batch and the microbatch size kept;
  the worlds that cannot keep the other axes, or the global batch, refused.
- Rendezvous failures (one CLI process each): an endpoint nobody answers at, and a rendezvous that never gets
  its second node, end in one plain error line within ``--rdzv-timeout`` — not a hang, not a traceback.
- Two nodes on this machine: two ``mcompile train`` agents (``--nnodes 2 --node-rank 0/1``, 2 processes each,
  one c10d rendezvous on 127.0.0.1) train the tiny Llama at dp=2 x tp=2 with SP; their losses equal the
  single-node 4-process run of the same config bit for bit (the same programs over the same 4 ranks).
- Slow: ``--nnodes 1:2``, node 1 lost at step 5 (its agent and processes SIGKILLed; node 1, not node 0, because
  node 0's agent hosts the rendezvous store, without which the others cannot meet again); node 0's agent
  restarts its processes, which re-plan to dp=1 x tp=2 with 2 microbatches, load the step-3 checkpoint and
  finish: the samples consumed and the losses follow the uninterrupted 4-process run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_cases import run_train, tiny_tree, toml_text

from mcompile.apps.train.config import ConfigError, LaunchConfig, parse_config
from mcompile.apps.train.elastic import first_slurm_host, fit_world, nproc_per_node, replan, resolve_nodes

from conftest import pool

TESTS = Path(__file__).resolve().parent


def _tree(tmp_path, name: str, **sections) -> dict:
    """The tiny Llama at dp=2 x tp=2 with SP, fp32 (exact comparisons), random samples with a learnable rule."""
    return tiny_tree(3, {"logging": {"jsonl": str(tmp_path / name / "metrics.jsonl")}}, **sections)


def _write(tmp_path, name: str, tree: dict) -> Path:
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    config = tmp_path / name / "run.toml"
    config.write_text(toml_text(tree))
    return config


def _cli(config: Path, *args: str) -> subprocess.Popen:
    """One ``mcompile train`` (one node's agent) in a session of its own: its process group is the node (a kill
    of the group takes the agent and its processes, as a lost machine does)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # one thread per process, as the pool's workers run the reference
    return subprocess.Popen([sys.executable, "-m", "mcompile.apps.train.cli", str(config), *args], cwd=config.parent,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each; on the timeout every process group is killed and the test fails."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        texts = [p.communicate() for p in procs]
        pytest.fail(f"the nodes did not finish within {timeout} s:\n" +
                    "\n".join(f"--- node {i}\n{o[-2000:]}\n{e[-3000:]}" for i, (o, e) in enumerate(texts)))
    return out


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _free_port() -> int:
    from mcompile.runtime.launch import free_port

    return free_port()


# ---------------------------------------------------------------------------------------------- launch settings
def test_nodes_from_the_command_line_the_config_and_slurm():
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
             "SLURM_JOB_NODELIST": "gpu[07-10],cpu1"}
    n = resolve_nodes(LaunchConfig(), environ=slurm)
    assert (n.min_nodes, n.max_nodes, n.node_rank, n.endpoint, n.run_id) == (4, 4, 2, "gpu07:29500", "4242")
    # MASTER_ADDR (the usual sbatch line) names the endpoint; a job step's own node count comes first
    n = resolve_nodes(LaunchConfig(), environ={**slurm, "MASTER_ADDR": "head", "MASTER_PORT": "6000",
                                               "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
                                               "SLURM_NODEID": "1"})
    assert (n.max_nodes, n.node_rank, n.endpoint) == (2, 1, "head:6000")
    # the config, then the command line, over Slurm
    n = resolve_nodes(LaunchConfig(nnodes="1:4", rdzv_endpoint="cfg:1", rdzv_id="cfg"), environ=slurm)
    assert (n.min_nodes, n.max_nodes, n.endpoint, n.run_id, n.elastic) == (1, 4, "cfg:1", "cfg", True)
    n = resolve_nodes(LaunchConfig(nnodes="1:4"), nnodes="2", node_rank=1, endpoint="cli", run_id="x", timeout=5,
                      environ=slurm)
    assert (n.max_nodes, n.node_rank, n.endpoint, n.run_id, n.timeout) == (2, 1, "cli:29500", "x", 5)
    # one node outside Slurm: a private rendezvous on this machine, as before
    n = resolve_nodes(LaunchConfig(), environ={})
    assert (n.max_nodes, n.endpoint, n.node_rank) == (1, None, None)
    assert [first_slurm_host(s) for s in ("node1", "a-b[001-004]", "x[3,5-7],y", "n1,n2")] == \
        ["node1", "a-b001", "x3", "n1"]


@pytest.mark.parametrize("kwargs,env,match", [
    ({"nnodes": "2:1"}, {}, r"1 <= MIN <= MAX"),
    ({"nnodes": "two"}, {}, r"give the number of nodes N, or MIN:MAX"),
    ({"nnodes": "2"}, {}, r"needs the rendezvous endpoint .* pass --rdzv-endpoint HOST:PORT"),
    ({"nnodes": "2", "node_rank": 2, "endpoint": "h:1"}, {}, r"node rank 2 is outside the 2 node\(s\)"),
    ({"nnodes": "2", "endpoint": "h:port"}, {}, r"write HOST:PORT"),
    ({"timeout": 0}, {}, r"--rdzv-timeout = 0: give a number of seconds >= 1"),
    ({}, {"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]",
          "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "16"}, r"run one task per node"),
])
def test_bad_node_settings(kwargs, env, match):
    with pytest.raises(ConfigError, match=match):
        resolve_nodes(LaunchConfig(), environ=env, **kwargs)


def test_replan_keeps_the_other_axes_the_global_batch_and_the_microbatch_size():
    assert replan("dp=2,tp=2", 1, 8, 4) == ("dp=2,tp=2", 1)  # the full world: as written
    assert replan("dp=2,tp=2", 1, 8, 2) == ("dp=1,tp=2", 2)  # dp halves, microbatches double: 4 per microbatch
    assert replan("dp=4", 2, 16, 2) == ("dp=2", 4)
    assert replan("dp=2,pp=2,tp=2", 4, 16, 4) == ("dp=1,pp=2,tp=2", 8)
    assert replan("tp=2", 1, 8, 4) == ("dp=2,tp=2", 1)  # dp first where the mesh did not name it
    assert replan("dp=2,tp=2", 1, 8, 2, eval_needs_one=True) == ("dp=1,tp=2", 1)  # eval: each microbatch grows
    assert replan("dp=4", 1, 12, 3) == ("dp=3", 1)  # 4 -> 3 per microbatch: the batch, not its size, is kept
    with pytest.raises(ConfigError, match=r"3 processes do not divide by 2 \(= tp=2, the axes kept\)"):
        replan("dp=2,tp=2", 1, 8, 3)
    with pytest.raises(ConfigError, match=r"global_batch = 8 does not divide by dp=3"):
        replan("dp=4", 1, 8, 3)


def test_fit_world_needs_an_elastic_launch_and_keeps_the_checkpoints(tmp_path):
    tree = _tree(tmp_path, "fit")
    cfg = parse_config(tree)
    assert fit_world(cfg, 4) == (cfg, None)
    with pytest.raises(ConfigError, match=r"has 4 ranks but the world has 2 processes: .*launch.nnodes = \"MIN:MAX\""):
        fit_world(cfg, 2)
    elastic = parse_config({**tree, "launch": {"nnodes": "1:2"}, "checkpoint": {"dir": "ck"}})
    shrunk, note = fit_world(elastic, 2)
    assert (shrunk.parallel.mesh, shrunk.parallel.microbatches) == ("dp=1,tp=2", 2) and "dp=1,tp=2" in note
    with pytest.raises(ConfigError, match=r"do not divide by 2 .* its checkpoints in ck are kept"):
        fit_world(elastic, 3)
    with pytest.raises(ConfigError, match=r"launch.nnodes = '1-2' in test: give the number of nodes"):
        parse_config({**tree, "launch": {"nnodes": "1-2"}}, "test")


EP = ["--rdzv-endpoint", "127.0.0.1:1"]


@pytest.mark.parametrize("args,match", [
    (["--nnodes", "2", "--nproc", "4", *EP], r"has 4 ranks but --nnodes 2 runs 2 node\(s\) x 4 processes = 8: make "
                                             r"them equal \(--nproc 2 per node"),
    (["--nnodes", "3", *EP], r"has 4 ranks, which 3 nodes \(--nnodes 3\) cannot share equally"),
    (["--nnodes", "1:4", "--set", "parallel.mesh=tp=4", "--nproc", "1", *EP],
     r"--nnodes 1:4: the run could not go on with 1 node\(s\): 1 process does not divide by 4 .*these do: 4"),
    (["--nnodes", "1:4", "--nproc", "1", "--set", "parallel.mesh=dp=4", *EP],
     r"could not go on with 3 node\(s\): train.global_batch = 8 does not divide by dp=3 .*these do: 1, 2, 4"),
    (["--nnodes", "1:2"], r"needs the rendezvous endpoint"),
])
def test_cli_refuses_a_launch_that_cannot_run_before_any_process(tmp_path, capsys, args, match):
    import re

    from mcompile.apps.train.cli import main

    config = _write(tmp_path, "bad", _tree(tmp_path, "bad"))
    assert main([str(config), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mcompile train: error:") and re.search(match, err), err


def test_nproc_per_node_defaults_to_the_mesh_over_the_nodes():
    nodes = resolve_nodes(LaunchConfig(), nnodes="1:2", endpoint="h:1", environ={})
    assert nproc_per_node("dp=2,tp=2", 0, nodes, global_batch=8, microbatches=1, eval_needs_one=False) == 2
    assert nproc_per_node("auto", 3, nodes, global_batch=8, microbatches=1, eval_needs_one=False) == 3


# ---------------------------------------------------------------------------------------------- rendezvous failures
@pytest.mark.timeout(120)
def test_unreachable_endpoint_and_missing_node_fail_plainly_within_the_timeout(tmp_path):
    """Node 1 of 2 with an endpoint nobody answers at, and node 0 of 2 whose node 1 never comes: each ends with
    one 'error:' line naming the endpoint, the timeout and what to do, after ~``--rdzv-timeout`` (3 s) of waiting
    (the default, 600 s, would hang the test into its timeout) and with no traceback."""
    config = _write(tmp_path, "rdzv", _tree(tmp_path, "rdzv"))
    common = ["--nnodes", "2", "--rdzv-timeout", "3"]
    lonely = _cli(config, *common, "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}")
    alone = _cli(config, *common, "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}")
    (rc1, _, err1), (rc0, _, err0) = _finish([lonely, alone], timeout=110)
    assert rc1 == 1 and "Traceback" not in err1, err1[-3000:]
    assert "error: could not reach the rendezvous at 127.0.0.1:" in err1 and "--rdzv-timeout 3 s" in err1, err1
    waited = float(err1.split("(waited ")[1].split(" s)")[0])
    assert 3.0 <= waited < 15.0, err1  # connection attempts until the timeout (not torch's 60 s), then the error
    assert rc0 == 1 and "Traceback" not in err0, err0[-3000:]
    assert "did not gather all 2 nodes within --rdzv-timeout 3 s" in err0, err0[-3000:]


# ---------------------------------------------------------------------------------------------- two nodes
@pytest.mark.timeout(280)
def test_two_nodes_train_as_one(tmp_path):
    """Two agents of 2 processes each (node ranks 0 and 1, one c10d rendezvous on 127.0.0.1) against the same config
    run by 4 processes of one node: the same losses, bit for bit (the same programs over the same 4 ranks; which
    node's processes get ranks 0-1 is the rendezvous's choice, and either gives the same mesh)."""
    reference = pool(4).run(run_train, _tree(tmp_path, "one"))[0]
    config = _write(tmp_path, "two", _tree(tmp_path, "two"))
    common = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "two-nodes",
              "--rdzv-timeout", "120"]
    results = _finish([_cli(config, *common, "--node-rank", str(r)) for r in (0, 1)], timeout=260)
    for rc, out, err in results:
        assert rc == 0, out[-2000:] + err[-4000:]
    stdout = "".join(out for _, out, _ in results)
    assert "on Mesh(dp=2, tp=2), 4 processes" in stdout, stdout[-2000:]
    rows = _rows(tmp_path / "two" / "metrics.jsonl")
    assert [(r["step"], r["world_size"], r["consumed_samples"]) for r in rows] == [(1, 4, 8), (2, 4, 16), (3, 4, 24)]
    assert [(r["step"], r["loss"]) for r in rows] == [tuple(x) for x in reference["losses"]]


# ---------------------------------------------------------------------------------------------- a node lost
@pytest.mark.slow  # 246 s on 2 shared cores (load ~25): the rendezvous waits ~15 s to call node 1 dead and 15 s more
@pytest.mark.timeout(600)  # (last call) before node 0 goes on alone, then the restarted processes compile again
def test_node_lost_the_run_goes_on_at_half_dp_from_the_checkpoint(tmp_path):
    """--nnodes 1:2, --max-restarts 1: node 1 (its agent and both its processes) is SIGKILLed at the start of step 5
    (debug.kill_node: the first attempt only); the step-3 checkpoint exists. Node 0's processes fail at their next
    collective, its agent restarts them on the rendezvous that remains (1 node: a world of 2), they re-plan
    dp=2 x tp=2 -> dp=1 x tp=2 with 2 microbatches of the same 4 samples (global batch 8 kept), load the step-3
    checkpoint resharded and finish.

    Checked against the uninterrupted 4-process run: the samples consumed after every step (8 x step: none lost or
    repeated), the checkpoints' records, and the losses of steps 4-7 after the restart to 1e-5 relative — DESIGN
    §7's fp32 bound: the gradient of the same 8 samples is summed as 2 microbatches on one rank instead of over 2
    data ranks, another order of fp32 additions and nothing else (measured: equal to the last bit). The final
    weights to 1e-4 / 1e-5, as tests/test_train.py compares layouts after 6 AdamW steps (Adam divides by the
    root of the second moment: a rounding difference in a tiny gradient moves its weight by up to ~lr)."""
    base = dict(train={"steps": 7}, checkpoint={"interval": 3, "dir": "ckpt", "final_state_dict": "final.pt"})
    ref_tree = _tree(tmp_path, "ref", **base)
    ref_tree["checkpoint"] = {"dir": str(tmp_path / "ref" / "ckpt"), "interval": 3,
                              "final_state_dict": str(tmp_path / "ref" / "final.pt")}
    reference = pool(4).run(run_train, ref_tree)[0]
    tree = _tree(tmp_path, "lost", **base, debug={"kill_step": 5, "kill_node": 1})
    config = _write(tmp_path, "lost", tree)
    common = ["--nnodes", "1:2", "--max-restarts", "1", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
              "--rdzv-id", "lost", "--rdzv-timeout", "300", "--rdzv-last-call", "15"]
    node0, node1 = (_cli(config, *common, "--node-rank", str(r)) for r in (0, 1))
    (rc0, out0, err0), (rc1, out1, err1) = _finish([node0, node1], timeout=560)
    assert rc1 == -signal.SIGKILL, (rc1, out1[-2000:], err1[-3000:])  # node 1 was lost (its agent killed)
    assert rc0 == 0, out0[-3000:] + err0[-5000:]
    assert "re-planned for 2 processes (parallel.mesh = 'dp=2,tp=2' has 4): mesh dp=1,tp=2, microbatches 2" in out0
    assert "resumed from ckpt/step-0000003 (step 3, 24 samples consumed)" in out0, out0[-3000:]
    rows = _rows(tmp_path / "lost" / "metrics.jsonl")
    first = [(r["step"], r["world_size"]) for r in rows if r["restart"] == 0]
    after = [r for r in rows if r["restart"] == 1]
    assert first == [(1, 4), (2, 4), (3, 4), (4, 4)]  # lost at the start of step 5
    assert [(r["step"], r["world_size"], r["consumed_samples"]) for r in after] == \
        [(s, 2, 8 * s) for s in (4, 5, 6, 7)]  # from the step-3 checkpoint: every sample once, in order
    ref = dict(reference["losses"])
    assert [r["loss"] for r in rows if r["restart"] == 0] == [ref[s] for s in (1, 2, 3, 4)]
    assert [r["loss"] for r in after] == pytest.approx([ref[s] for s in (4, 5, 6, 7)], rel=1e-5)
    meta = {p.name: json.loads((p / "mcompile_plan.json").read_text())
            for p in (tmp_path / "lost" / "ckpt").iterdir() if (p / "mcompile_plan.json").is_file()}
    assert meta["step-0000003"]["mesh"] == {"dp": 2, "tp": 2} and meta["step-0000007"]["mesh"] == {"dp": 1, "tp": 2}
    assert [meta[f"step-000000{s}"]["extra"]["consumed_samples"] for s in (3, 6, 7)] == [24, 48, 56]
    assert reference["consumed_samples"] == 56
    got, want = torch.load(tmp_path / "lost" / "final.pt"), torch.load(tmp_path / "ref" / "final.pt")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)
