"""``mcompile train``: the config schema and its errors, the LR schedules, the loop, resuming and restarts.

- Config: an unknown key names the key, the file and the nearest valid key; a wrong type names the key and
  the type expected; ``--set`` parses TOML values and refuses a malformed override. No processes.
- Schedules: warmup + cosine, WSD and constant against their formulas at hand-computed points.
- The loop on 4 gloo processes (dp=2 x tp=2, SP; the pool's workers, stand-in data with SampleDataset's
  interface): a run cut at step 3 (``train.stop_at``) and resumed from its checkpoint takes steps 4..6 with
  the losses and ends with the weights of the uninterrupted run, exactly (fp32; the same programs on the
  same data in the same order: any lost, repeated or reordered sample, a learning rate or an optimizer
  state not restored changes them). JSONL metrics have the documented keys.
- Acceptance (issue 17, #3): ``python -m mcompile.apps.train.cli`` starts 4 processes under torch's elastic
  agent; rank 1 SIGKILLs itself at step 7 (a checkpoint of step 5 exists); the agent restarts every
  rank, the run resumes from step 5 and ends with weights equal to an uninterrupted run's, exactly.
- Acceptance (issue 17, #1, the train part): the tiny Llama trains 200 steps on the shipped corpus
  through ``mcompile train`` on 4 processes, cut at step 100 and resumed; the loss falls below 1.2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_cases import run_train, toml_text

from mcompile.apps.train import schedule as S
from mcompile.apps.train.config import ConfigError, load_config, parse_config, parse_override

from conftest import pool

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

BASE = """
[model]
preset = "llama3-tiny"
[data]
factory = "train_cases:random_samples"
[train]
steps = 6
"""


def _cfg(tmp_path, text: str, overrides=()):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_config(path, overrides)


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("text,key,nearest", [
    (BASE + "lr = 3e-4\n", "train.lr", "optimizer.lr"),  # a key of another table
    (BASE + "stpes = 3\n", "train.stpes", "train.steps"),  # a misspelt key
    (BASE.replace("[train]", "[trian]"), "trian", "train"),  # a misspelt table
    (BASE + "[optimizer]\nweight_deacy = 0.1\n", "optimizer.weight_deacy", "optimizer.weight_decay"),
    (BASE.replace('preset = "llama3-tiny"', 'preset = "llama3-tiny"\noverrides = { n_layer = 4 }'),
     "model.overrides.n_layer", "n_layers"),  # a field of the preset's config
])
def test_unknown_key_names_it_the_file_and_the_nearest(tmp_path, text, key, nearest):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, text)
    msg = str(e.value)
    assert f"'{key}'" in msg and str(tmp_path / "run.toml") in msg and f"did you mean '{nearest}'" in msg, msg


def test_unknown_key_from_set(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'schedule.warmpu'.*did you mean 'schedule.warmup'"):
        _cfg(tmp_path, BASE, ["schedule.warmpu=10"])


@pytest.mark.parametrize("table,line,expected", [
    ("train", 'steps = "ten"', "an integer"),
    ("train", "steps = true", "an integer"),  # a bool is no integer
    ("train", "steps = 2.5", "an integer"),
    ("optimizer", 'lr = "fast"', "a number"),
    ("parallel", "sequence_parallel = 1", "a boolean"),
    ("optimizer", "betas = 0.9", "a list of numbers"),
    ("data", "tokenize = 3", "a list of strings"),
])
def test_wrong_type_names_key_and_type(tmp_path, table, line, expected):
    text = BASE.replace("steps = 6\n", "")
    text = text.replace(f"[{table}]\n", f"[{table}]\n{line}\n") if f"[{table}]" in text else \
        text + f"[{table}]\n{line}\n"
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, text)
    key = f"{table}.{line.split(' =')[0]}"
    assert key in str(e.value) and f"expected {expected}" in str(e.value), str(e.value)


@pytest.mark.parametrize("override,match", [
    ("train.steps", "expected KEY=VALUE"),
    ("=3", "expected KEY=VALUE"),
    ("train..steps=3", "expected KEY=VALUE"),
    ("steps=3", "names a table and a key"),
    ("train.steps=", "no value"),
    ("train.steps=1e3x", "expected an integer"),  # not TOML: a bare string, which the type check refuses
])
def test_bad_set(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, BASE, [override])


def test_set_parses_toml_values(tmp_path):
    cfg = _cfg(tmp_path, BASE, ["optimizer.betas=[0.8, 0.9]", "optimizer.lr=1e-3", "parallel.mesh=dp=2,tp=2",
                                'model.preset="gpt2-tiny"', "parallel.sequence_parallel=true", "train.steps=9"])
    assert cfg.optimizer.betas == [0.8, 0.9] and cfg.optimizer.lr == 1e-3 and cfg.parallel.mesh == "dp=2,tp=2"
    assert cfg.model.preset == "gpt2-tiny" and cfg.parallel.sequence_parallel is True and cfg.train.steps == 9
    assert "parallel.mesh" in cfg.explicit and "parallel.zero" not in cfg.explicit
    assert parse_override("data.sources=[['a', 0.7], ['b', 0.3]]") == (["data", "sources"], [["a", 0.7], ["b", 0.3]])


@pytest.mark.parametrize("extra,match", [
    (["parallel.mesh=dp=2,tq=2"], "axis=size pairs"),
    (["schedule.kind=cosin"], "did you mean 'cosine'"),
    (["model.preset=llama3-tin"], "did you mean 'llama3-tiny'"),
    (["model.hf=x"], "set exactly one of model.preset, model.factory, model.hf"),
    (["checkpoint.interval=5"], "needs checkpoint.dir"),
    (["schedule.warmup=60"], "exceeds train.steps"),
    (["data.sources=x"], "data.sources or data.factory, not both"),
])
def test_cross_field_errors(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, BASE, extra)


def test_example_config_and_cli_error(tmp_path, capsys):
    cfg = load_config(ROOT / "examples" / "train" / "llama3-tiny.toml")
    assert cfg.model.preset == "llama3-tiny" and cfg.train.steps == 200 and cfg.parallel.mesh == "dp=2,tp=2"
    from mcompile.apps.train.cli import main

    (tmp_path / "bad.toml").write_text(BASE + "lr = 1\n")
    assert main([str(tmp_path / "bad.toml")]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'train.lr'" in err and "did you mean 'optimizer.lr'" in err


# ---------------------------------------------------------------------------------------------- schedules
def test_schedules_against_their_formulas():
    lr, lo = 1.0, 0.1
    # warmup: linear from lr/W at step 1 to lr at step W
    assert [S.warmup_constant(s, lr=lr, warmup=4) for s in (1, 2, 4, 5, 100)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    # cosine over N - W = 100 steps after a warmup of 10: p = 1/4, 1/2, 3/4, 1
    cos = lambda s: S.warmup_cosine(s, lr=lr, steps=110, warmup=10, min_lr=lo)  # noqa: E731
    assert cos(5) == pytest.approx(0.5)
    assert cos(10) == pytest.approx(1.0)
    assert cos(35) == pytest.approx(lo + (lr - lo) * (1 + 2 ** -0.5) / 2)
    assert cos(60) == pytest.approx((lr + lo) / 2)
    assert cos(85) == pytest.approx(lo + (lr - lo) * (1 - 2 ** -0.5) / 2)
    assert cos(110) == pytest.approx(lo)
    # WSD: N = 100, W = 10, D = 20: stable at lr through step 80, linear to min_lr at 100
    wsd = lambda s: S.warmup_stable_decay(s, lr=lr, steps=100, warmup=10, decay_fraction=0.2, min_lr=lo)  # noqa
    assert [wsd(s) for s in (5, 10, 50, 80)] == pytest.approx([0.5, 1.0, 1.0, 1.0])
    assert wsd(90) == pytest.approx((lr + lo) / 2) and wsd(85) == pytest.approx(lr - (lr - lo) / 4)
    assert wsd(100) == pytest.approx(lo)
    with pytest.raises(ValueError, match="count from 1"):
        S.warmup_constant(0, lr=lr)


def test_lr_at_follows_the_config(tmp_path):
    cfg = _cfg(tmp_path, BASE.replace("steps = 6", "steps = 100") + '[schedule]\nkind = "wsd"\nwarmup = 10\n'
               "decay_fraction = 0.5\nmin_lr = 0.0\n[optimizer]\nlr = 2.0\n")
    assert [S.lr_at(s, cfg) for s in (1, 10, 50, 75, 100)] == pytest.approx([0.2, 2.0, 2.0, 1.0, 0.0])


# ---------------------------------------------------------------------------------------------- the loop
def _tree(tmp_path, name: str, **sections) -> dict:
    from train_cases import tiny_tree

    return tiny_tree(6, {"checkpoint": {"dir": str(tmp_path / name / "ckpt"), "interval": 3,
                                        "final_state_dict": str(tmp_path / name / "final.pt")}}, **sections)


def _state(path) -> dict:
    return torch.load(path, map_location="cpu")


def _assert_equal_states(a: dict, b: dict):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ: {different[:5]}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """6 steps at dp=2 x tp=2 with SP, checkpoints at 3 and 6, eval every 3 steps, metrics to JSONL."""
    tmp = tmp_path_factory.mktemp("train")
    tree = _tree(tmp, "full", eval={"interval": 3, "batches": 2},
                 logging={"jsonl": str(tmp / "full" / "metrics.jsonl")})
    summaries = pool(4).run(run_train, tree)
    return tmp, tree, summaries


def test_resume_without_fault_equals_uninterrupted(uninterrupted):
    tmp, full_tree, full = uninterrupted
    tree = _tree(tmp, "cut", train={"stop_at": 3})
    first = pool(4).run(run_train, tree)[0]
    assert [s for s, _ in first["losses"]] == [1, 2, 3] and first["consumed_samples"] == 24
    assert sorted(p.name for p in (tmp / "cut" / "ckpt").iterdir()) == ["step-0000003"]
    tree["train"]["stop_at"] = 0
    second = pool(4).run(run_train, tree)[0]
    assert second["resumed_from"].endswith("step-0000003") and second["start_step"] == 3
    assert [s for s, _ in second["losses"]] == [4, 5, 6] and second["consumed_samples"] == 48
    # the same steps: losses bit for bit (the schedule, the data position and the optimizer state restored)
    assert first["losses"] + second["losses"] == full[0]["losses"]
    _assert_equal_states(_state(tmp / "cut" / "final.pt"), _state(tmp / "full" / "final.pt"))
    assert full[0]["losses"][-1][1] < full[0]["losses"][0][1]  # it trains (the data has a learnable rule)


def test_jsonl_metrics(uninterrupted):
    tmp, tree, full = uninterrupted
    rows = [json.loads(line) for line in (tmp / "full" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in eval_rows] == [3, 6]
    for r in train_rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s"} <= r.keys()
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["grad_norm"] > 0
    assert [r["loss"] for r in train_rows] == pytest.approx([v for _, v in full[0]["losses"]], rel=1e-6)
    assert [r["lr"] for r in train_rows] == pytest.approx([S.lr_at(s, parse_config(tree)) for s in range(1, 7)])
    assert eval_rows[-1]["eval_loss"] == pytest.approx(full[0]["eval_loss"]) and eval_rows[0]["eval_tokens"] == 256
    assert full[0]["hardware"] == "cpu-gloo"
    assert sorted(p.name for p in (tmp / "full" / "ckpt").iterdir()) == ["step-0000003", "step-0000006"]


@pytest.mark.parametrize("parallel", [
    {"mesh": "dp=4", "zero": 1, "sequence_parallel": False},  # mcompile's DistributedOptimizer and its clipping
    pytest.param({"mesh": "pp=2,tp=2", "microbatches": 2}, marks=pytest.mark.slow),
    pytest.param({"mesh": "tp=4", "sequence_parallel": False}, marks=pytest.mark.slow),
])
def test_same_run_on_another_layout(uninterrupted, parallel):
    """The model is initialised per tensor name (not per rank or layout) and the data is the global batch, so
    the same config on another mesh takes the same steps: losses and eval loss equal up to fp32 rounding of
    other reduction orders (1e-5 relative over 6 steps)."""
    tmp, tree, full = uninterrupted
    name = parallel["mesh"].replace(",", "-").replace("=", "")
    other = _tree(tmp, name, parallel=parallel, eval={"interval": 3, "batches": 2})
    got = pool(4).run(run_train, other)[0]
    assert [s for s, _ in got["losses"]] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in got["losses"]] == pytest.approx([v for _, v in full[0]["losses"]], rel=1e-5)
    assert got["eval_loss"] == pytest.approx(full[0]["eval_loss"], rel=1e-5)
    _assert_close_states(_state(tmp / name / "final.pt"), _state(tmp / "full" / "final.pt"))


def _assert_close_states(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:  # AdamW's first steps move every weight by ~lr: a wrong update is far outside 1e-4
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


# ---------------------------------------------------------------------------------------------- restarts
def _run_cli(config: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    # one thread per process, as the pool's workers run the reference: the same float sums
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "mcompile.apps.train.cli", str(config), *extra], cwd=config.parent,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_killed_rank_restarts_and_resumes_exactly(tmp_path):
    """Acceptance 3: a rank killed mid-run; the elastic agent restarts all; the weights equal an
    uninterrupted run's. On 2 processes (dp=2: each rank its own slice of the data to resume at): what is
    proven is the restart and the exact resume, not the layout (the same loop at dp=2 x tp=2 with SP resumes
    bit for bit in test_resume_without_fault_equals_uninterrupted), and every start of the CLI is 2 fresh
    processes instead of 4 on the CI's 2 cores (177 s -> 25 s, each measured alone on this 2-core machine)."""
    base = dict(train={"steps": 9, "seq_len": 16}, checkpoint={"interval": 5}, schedule={"warmup": 2},
                parallel={"mesh": "dp=2", "sequence_parallel": False})
    reference = pool(2).run(run_train, _tree(tmp_path, "ref", **base))[0]
    tree = _tree(tmp_path, "killed", **base, launch={"max_restarts": 1}, debug={"kill_step": 7, "kill_rank": 1},
                 logging={"jsonl": str(tmp_path / "killed" / "metrics.jsonl")})
    (tmp_path / "killed").mkdir()
    config = tmp_path / "killed" / "run.toml"
    config.write_text(toml_text(tree))
    out = _run_cli(config)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "resumed from" in out.stdout and "step-0000005" in out.stdout, out.stdout[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["restart"] == 0] == [1, 2, 3, 4, 5, 6]  # killed at the start of 7
    assert [r["step"] for r in rows if r["restart"] == 1] == [6, 7, 8, 9]  # resumed from 5
    assert [r["loss"] for r in rows if r["restart"] == 1] == [v for s, v in reference["losses"] if s >= 6]
    _assert_equal_states(_state(tmp_path / "killed" / "final.pt"), _state(tmp_path / "ref" / "final.pt"))


@pytest.mark.slow  # ~140 s on 2 shared cores: two starts of 4 processes, 200 steps
def test_200_steps_of_tiny_llama_through_mcompile_train(tmp_path):
    """Acceptance 1 (train): the shipped corpus and tokenizer, dp=2 x tp=2 with SP, 200 steps cut at 100 and
    resumed; the loss falls from ~ln(256) = 5.55 below 1.2 (measured: 0.70 at step 200, eval 0.80)."""
    example = ROOT / "examples" / "train" / "llama3-tiny.toml"
    config = tmp_path / "llama3-tiny.toml"
    config.write_text(example.read_text())
    sets = ["--set", "logging.tensorboard=''", "--set", "eval.interval=100", "--set", "checkpoint.interval=0",
            "--set", "logging.progress='off'"]
    first = _run_cli(config, *sets, "--set", "train.stop_at=100")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    second = _run_cli(config, *sets)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert "resumed from" in second.stdout and "step-0000100" in second.stdout
    rows = [json.loads(line) for line in (tmp_path / "runs" / "llama3-tiny" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert sorted(losses) == list(range(10, 201, 10))
    assert losses[10] > 4.5 and losses[200] < 1.2 and evals[200] < 1.2, (losses, evals)
