"""Rules the test suite itself keeps, because breaking them fails only by chance.

Every pytest-xdist worker imports every test module while collecting, so a custom op that two test modules
register under one name is registered twice in each worker: the second definition replaces the first op's
kernels, and which one a test gets depends on import order and on which tests a worker ran before (a stale
``CustomOpDef`` then dispatched to freed kernels: CI saw ``std::bad_alloc`` from a plain ``clone``). Each
``torch.library`` name is made by one module only.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# custom_op("ns::name", ...), Library("ns", "DEF"/"FRAGMENT") then .define("name(...)")
_OP = re.compile(r"""custom_op\(\s*["']([\w.]+::[\w.]+)["']""")
_LIB = re.compile(r"""Library\(\s*["'](\w+)["']\s*,\s*["'](?:DEF|FRAGMENT)["']""")
_DEFINE = re.compile(r"""\.define\(\s*["'](\w+)\(""")


def _registered(path: Path) -> set[str]:
    text = path.read_text()
    names = set(_OP.findall(text))
    for ns in _LIB.findall(text):
        names |= {f"{ns}::{op}" for op in _DEFINE.findall(text)}
    return names


@pytest.mark.timeout(30)
def test_every_custom_op_name_is_registered_by_one_module():
    where = defaultdict(list)
    files = sorted(p for d in ("tests", "mcompile", "passes", "runtime", "kernels", "models", "bench", "examples")
                   if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)
    for path in files:
        for name in _registered(path):
            where[name].append(str(path.relative_to(ROOT)))
    assert len(where) >= 30, f"the scan found only {len(where)} op names: the patterns no longer match the code"
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"custom ops registered under one name by more than one module (rename one): {twice}"
