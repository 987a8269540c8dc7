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
