"""The gloo workers' side of tests/test_bench_checkpoint_io.py: bench/checkpoint_io.py's per-rank function
(the workers' path leaves bench/ out, so the script is loaded from its file)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench():
    mod = sys.modules.get("checkpoint_io_bench")
    if mod is None:
        spec = importlib.util.spec_from_file_location("checkpoint_io_bench", BENCH / "checkpoint_io.py")
        mod = importlib.util.module_from_spec(spec)
        saved = sys.path[:]
        try:  # the script puts bench/ first on the path (for bench/_results.py): undone
            spec.loader.exec_module(mod)
        finally:
            sys.path[:] = saved
        sys.modules["checkpoint_io_bench"] = mod
    return mod


def measure(rank, world, *args):
    return bench().measure(rank, world, *args)
