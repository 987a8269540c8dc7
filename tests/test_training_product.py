"""docs/training.md's sequence from a fresh clone, run as written: preprocess the shipped corpus, train the tiny
Llama on 4 CPU processes through ``mcompile train`` (stopped at step 100 with a checkpoint, resumed to 200),
evaluate under another layout, generate (issue 17, acceptance 1).

The commands are read from the documentation's bash block and run in a copy of the folders they read
(``examples/train``), ``mcompile`` being this interpreter's ``-m mcompile.apps.cli``."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "training.md"
LOSS_BOUND = 1.2  # the doc's stated value: 0.70 (train) / 0.80 (held out) at step 200 when it was written


# what `bash scripts/env.sh dev` installs beyond the README's `bash scripts/env.sh` (the dev, data and hf extras),
# by import name: the sequence runs with these hidden, as a user's plain set-up has none of them
OPTIONAL = ("tensorboard", "tiktoken", "sentencepiece", "transformers", "hypothesis")
_HIDE = """import importlib.machinery, sys
class _Path(importlib.machinery.PathFinder):  # as if not installed: find_spec gives None, import raises
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in {names!r} else super().find_spec(name, path, target)
sys.meta_path[:] = [_Path if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def without_optional_packages(folder: Path) -> dict:
    """The environment for a subprocess in which the optional packages cannot be imported (a sitecustomize on
    PYTHONPATH; the worker processes inherit it)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_HIDE.format(names=set(OPTIONAL)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH", "")) if p)
    return env


def documented_commands() -> list[list[str]]:
    text = DOC.read_text()
    block = re.search(r"<!-- the test reads this block -->\n```bash\n(.*?)```", text, flags=re.S)
    assert block, "docs/training.md lost its tested bash block"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    commands = [shlex.split(line, comments=True) for line in lines if line.strip()]
    assert all(c[0] == "mcompile" for c in commands), commands
    return [[sys.executable, "-m", "mcompile.apps.cli", *c[1:]] for c in commands]


# ~260 s on the 2-core CI machine (200 steps on 4 processes, then eval and generate): the slow tier. Each step
# keeps its CI test: tests/test_train.py (train, resume, a killed rank), test_evaluate.py, test_generate.py.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_documented_sequence_trains_resumes_evaluates_and_generates(tmp_path):
    shutil.copytree(ROOT / "examples/train", tmp_path / "examples/train")
    commands = documented_commands()
    assert [c[3] for c in commands] == ["preprocess", "train", "train", "eval", "generate"]
    env = without_optional_packages(tmp_path / "site")
    out = []
    for cmd in commands:
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, f"{shlex.join(cmd[3:])} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        out.append(proc.stdout + proc.stderr)
    preprocess, first, second, evaluate, generate = out
    assert "1400 documents" in preprocess, preprocess
    ckpt = tmp_path / "runs/llama3-tiny/ckpt"
    assert "step 100/200" in first and "step 200/200" not in first, first
    assert "resumed from" in second and "(step 100," in second, second
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-0000150", "step-0000200"]  # keep = 2
    # the metrics of both runs: every step's loss once (the resumed run starts at 101), falling below the bound
    lines = [json.loads(line) for line in (tmp_path / "runs/llama3-tiny/metrics.jsonl").read_text().splitlines()]
    train_steps = [d["step"] for d in lines if "loss" in d]
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == 200
    first_loss = next(d["loss"] for d in lines if "loss" in d)
    last = [d for d in lines if d["step"] == 200]
    final_loss = next(d["loss"] for d in last if "loss" in d)
    final_eval = next(d["eval_loss"] for d in last if "eval_loss" in d)
    assert first_loss > 4.5 and final_loss < LOSS_BOUND and final_eval < LOSS_BOUND, (first_loss, final_loss,
                                                                                      final_eval)
    # eval reads the step-200 checkpoint (saved at dp=2 x tp=2) under tp=2: the same held-out batches give the
    # training run's own eval loss at step 200
    m = re.search(r"step-0000200 under tp=2: valid loss ([0-9.]+), perplexity ([0-9.]+)", evaluate)
    assert m, evaluate
    assert float(m.group(1)) == pytest.approx(final_eval, rel=1e-4)
    acc = re.search(r"last-word accuracy ([0-9.]+) \((\d+) of (\d+)", evaluate)
    assert acc and int(acc.group(3)) == 298, evaluate
    assert float(acc.group(1)) > 0.05, evaluate  # 53 of 298 when written; a 20-step model gets none right
    prompt = commands[-1][commands[-1].index("--prompt") + 1]
    text = [line for line in generate.splitlines() if line.startswith(prompt)]
    assert text and len(text[0]) > len(prompt), generate


@pytest.mark.timeout(120)
def test_the_documented_preprocess_runs_without_the_optional_packages(tmp_path):
    """The CI-tier part of the sequence above: its environment really hides the optional packages (an import
    fails), and the first documented command runs in it. The training commands' needs are checked by
    tests/test_train_hf.py::test_shipped_examples_need_only_what_the_readme_set_up_installs."""
    shutil.copytree(ROOT / "examples/train", tmp_path / "examples/train")
    env = without_optional_packages(tmp_path / "site")
    for name in OPTIONAL:
        proc = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True)
        assert proc.returncode != 0 and f"No module named '{name}'" in proc.stderr, (name, proc.stderr)
    preprocess = documented_commands()[0]
    assert preprocess[3] == "preprocess"
    proc = subprocess.run(preprocess, cwd=tmp_path, capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1400 documents" in proc.stdout + proc.stderr
