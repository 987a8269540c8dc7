"""Where a benchmark's JSON goes: nowhere committed unless asked.

``bench/results/*.json`` are the committed records that the guide and some tests quote, so a
benchmark run for a look must not overwrite them. Every bench script that makes one:

- prints the JSON and writes nothing by default (a long run that rewrites its file as it goes
  writes into a temporary folder instead, and says where);
- ``--write``: writes ``bench/results/<name>.json``, the record;
- ``--out PATH``: writes PATH (a test, a lent machine's $OUT).

:func:`save` also records the machine and the commit (unless the script did already).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

__all__ = ["add_arguments", "commit", "destination", "machine", "save"]


def add_arguments(ap: argparse.ArgumentParser, name: str) -> None:
    """``--write`` (record ``bench/results/<name>.json``) and ``--out PATH``."""
    ap.add_argument("--write", action="store_true",
                    help=f"write the record bench/results/{name}.json (default: print the JSON, write nothing)")
    ap.add_argument("--out", default=None, help="write the JSON to this path instead")


def destination(name: str, write: bool, out: str | Path | None = None, *, temporary: bool = False) -> Path | None:
    """The path to write: ``out``; else the record when ``write``; else a fresh temporary file when
    ``temporary`` (scripts that rewrite their JSON during a long run), else None (print only)."""
    if out:
        return Path(out)
    if write:
        return RESULTS / f"{name}.json"
    if temporary:
        return Path(tempfile.mkdtemp(prefix=f"mcompile-bench-{name}-")) / f"{name}.json"
    return None


def commit() -> str:
    """The commit measured (``+dirty`` for uncommitted changes to tracked files); ``MCOMPILE_COMMIT``
    wins (a copy of the tree without .git, e.g. on a lent GPU machine)."""
    if os.environ.get("MCOMPILE_COMMIT"):
        return os.environ["MCOMPILE_COMMIT"]
    git = ["git", "-C", str(ROOT)]
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")  # read-only: no index refresh
    try:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, env=env).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty else "") if head.returncode == 0 else "unknown"


def machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}


def save(name: str, result: dict, write: bool, out: str | Path | None = None) -> Path | None:
    """Record ``result`` (with ``machine`` and ``commit`` added where missing): to ``out``, or to
    ``bench/results/<name>.json`` when ``write``; otherwise print it and write nothing. The path
    written, or None."""
    result.setdefault("machine", machine())
    result.setdefault("commit", commit())
    text = json.dumps(result, indent=1, default=str) + "\n"
    path = destination(name, write, out)
    if path is None:
        print(text)
        print(f"(not written: --write records it as bench/results/{name}.json, --out PATH writes it elsewhere)",
              file=sys.stderr)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a kill leaves the old file or the new one, never half of one
    print(f"wrote {path}", file=sys.stderr)
    return path
