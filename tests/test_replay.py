"""scripts/replay.py, the process-replay check of compiler refactors (issue 39): it writes each rank's programs
for a case, and its comparison passes on identical folders and fails, naming the file, on a changed line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "replay.py"


def _run(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd, timeout=240)


@pytest.mark.timeout(300)
def test_replay_writes_programs_and_finds_a_changed_line(tmp_path):
    out = tmp_path / "a"
    r = _run("--out", str(out), "--only", "llama_tp2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["llama_tp2.rank0.py", "llama_tp2.rank1.py"]
    text = (out / files[0]).read_text()
    assert "all_reduce" in text and "backward" in text, text[:500]
    same = _run("--compare", str(out), str(out), cwd=tmp_path)
    assert same.returncode == 0 and "2 of 2 programs identical" in same.stdout
    changed = tmp_path / "b"
    changed.mkdir()
    for f in files:
        (changed / f).write_text((out / f).read_text())
    (changed / files[1]).write_text(text.replace("all_reduce", "all_gather", 1))
    diff = _run("--compare", str(out), str(changed), cwd=tmp_path)
    assert diff.returncode == 1 and f"{files[1]}: differs" in diff.stdout and "1 of 2" in diff.stdout
