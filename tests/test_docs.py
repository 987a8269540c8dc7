"""The Python examples of docs/guide.md and docs/training.md run as written (one namespace per page, in order)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide.md"


@pytest.mark.timeout(300)  # the guide's examples plan and run several models (MoE over ep too), all in one process
def test_guide_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) >= 3
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), ns)  # noqa: S102 - our own documentation


@pytest.mark.timeout(180)
def test_training_page_python_examples_run(monkeypatch):
    page = ROOT / "docs" / "training.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert len(blocks) >= 5
    monkeypatch.chdir(ROOT)  # the examples name files relative to the repository (examples/train/...)
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(page), "exec"), ns)  # noqa: S102 - our own documentation


@pytest.mark.timeout(60)
def test_every_test_docs_testing_names_exists_in_the_ci_tier():
    """docs/testing.md maps each capability to the CI tests that prove it: every test it names must exist, and not
    be marked slow as a whole (a function or a file marked slow would leave the capability without a CI case;
    a parametrized test keeps the cases its own marks leave in the CI tier). Any test id in brackets must be one
    of that test's parameter ids."""
    import ast
    import subprocess
    import sys

    page = (ROOT / "docs" / "testing.md").read_text()
    named = sorted(set(re.findall(r"`(tests/test_\w+\.py)(?:::(\w+)(\[[^\]`]*\])?)?`", page)))
    assert len(named) >= 40, named
    with_ids = []
    for path, func, ids in named:
        tree = ast.parse((ROOT / path).read_text())
        module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                          and "slow" in ast.unparse(n.value) for n in tree.body)
        assert not module_slow, f"{path} is marked slow as a whole"
        if not func:
            continue
        defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert func in defs, f"docs/testing.md names {path}::{func}, which does not exist"
        marks = [ast.unparse(d) for d in defs[func].decorator_list]
        assert not any(m.endswith("mark.slow") for m in marks), f"{path}::{func} is marked slow as a whole"
        if ids:
            with_ids.append(f"{path}::{func}{ids}")
    if with_ids:  # the parametrized cases named: collected in the CI tier (its markers deselect slow ones)
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              *with_ids], cwd=ROOT, capture_output=True, text=True, timeout=50)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        for node in with_ids:
            assert node in out.stdout, f"{node} is not in the CI tier"
