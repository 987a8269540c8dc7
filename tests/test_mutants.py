"""bench/mutants.py, the mutation-testing runner, and bench/mutant_list.py, its mutants.

What is isolated: that every mutant still applies to the tree (its snippet exactly once: a moved or
doubled snippet would otherwise only show when someone runs the whole list) and names tests that
exist; and the runner end to end on one cheap mutant — it plants the bug in a copy of the tree,
imports that copy (not the editable install of the working tree), reports the bug caught by the
test meant to catch it, and leaves the working tree as it was.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# bench/ only while its two modules are imported: left on sys.path, the worker pools (started later, with this
# process's path in front of theirs) import bench/kernels.py for any `import kernels` (transformers probes it)
sys.path.insert(0, str(ROOT / "bench"))
try:
    import mutants  # noqa: E402
    from mutant_list import MUTANTS  # noqa: E402
finally:
    sys.path[:] = [p for p in sys.path if p != str(ROOT / "bench")]  # bench/mutants.py adds it once more

# a pure-arithmetic mutant whose target is one fast single-process test
CHEAP = "memory-fp32-master-counted-for-fp32-params"


def test_every_mutant_applies_once_and_names_existing_tests():
    assert len(MUTANTS) >= 30
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    for m in MUTANTS:
        mutants.check_mutant(m, ROOT)  # raises unless the old snippet occurs exactly once
        assert m.description.strip() and "\n" not in m.description, m.name
        assert m.targets, m.name
        for text in m.targets:
            reason = mutants.Target.parse(text).missing_reason(ROOT)
            assert reason is None, (m.name, reason)


def test_a_rotten_or_missing_mutant_is_reported_not_run(tmp_path):
    from mutant_list import Mutant

    (tmp_path / "a.py").write_text("x = 1\nx = 1\n")
    twice = Mutant("twice", "a.py", "x = 1", "x = 2", "doubled snippet", ("tests/test_a.py",))
    with pytest.raises(mutants.MutantError, match="occurs 2 times in a.py"):
        mutants.check_mutant(twice, tmp_path)
    with pytest.raises(mutants.MutantError, match="occurs 0 times"):
        mutants.check_mutant(Mutant("gone", "a.py", "y = 1", "y = 2", "moved", ("tests/test_a.py",)), tmp_path)
    target = mutants.Target.parse("tests/test_not_written_yet.py -k something")
    assert target.keyword == "something" and "does not exist" in target.missing_reason(ROOT)
    assert "defines no test_nothing" in mutants.Target.parse("tests/test_mutants.py::test_nothing[x]").missing_reason(
        ROOT)
    status = {target.text: mutants.TargetStatus("missing", target.missing_reason(ROOT))}
    m = Mutant("future", "a.py", "x = 1", "x = 2", "its test is being written", (target.text,))
    res = mutants.run_mutant(None, m, status, None)  # nothing to run: no workspace needed
    assert res.outcome == "target missing" and res.caught_by is None
    assert (tmp_path / "a.py").read_text() == "x = 1\nx = 1\n"


@pytest.mark.timeout(120)
def test_runner_end_to_end_on_one_mutant(tmp_path):
    """Measured ~20 s on 2 cores: the copy, one import check, the target once unmutated, once mutated."""
    (m,) = [m for m in MUTANTS if m.name == CHEAP]
    path = ROOT / m.file
    before, mtime = path.read_bytes(), path.stat().st_mtime_ns
    out = tmp_path / "mutants.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "mutants.py"), "--only", CHEAP, "--out", str(out)],
                          capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (r,) = report["mutants"]
    assert r["name"] == CHEAP and r["outcome"] == "caught", r
    assert r["caught_by"] == m.targets[0] and r["caught_how"] == "a test failed"
    assert report["baseline"]["targets"][m.targets[0]]["status"] == "pass"
    assert report["totals"]["caught"] == 1 and report["survivors"] == []
    # the tests imported the copy: every subpackage from the copied tree's own folder
    assert report["imported_from_copy"] == {"mcompile": "mcompile/__init__.py", "mcompile.passes": "passes/__init__.py",
                                            "mcompile.runtime": "runtime/__init__.py",
                                            "mcompile.kernels": "kernels/__init__.py",
                                            "mcompile.models": "models/__init__.py"}
    assert report["machine"]["cpu_count"] and report["torch"] and len(report["commit"]["head"]) >= 7
    # the working tree was never touched
    assert path.read_bytes() == before and path.stat().st_mtime_ns == mtime
    assert m.new.encode() not in path.read_bytes()
