"""The Python examples of docs/guide.md run as written (one namespace, in order)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"


@pytest.mark.timeout(120)
def test_guide_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) >= 3
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), ns)  # noqa: S102 - our own documentation
