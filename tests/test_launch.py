"""Launching for real: torchrun, and the demo (the README's main command)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_torchrun_example_trains_and_matches_one_device():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "train_tiny.py"), "--steps", "4", "--sp"],
        capture_output=True, text=True, timeout=280, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 4
    # the same four steps on one device
    import torch

    from mcompile.demo import _train, batches
    from mcompile.models import get_preset

    torch.manual_seed(0)
    model = get_preset("llama3-tiny").build()
    single = _train(model, batches(4, batch=4, seq=64), 3e-3, False)
    assert losses == pytest.approx(single, rel=1e-5)


@pytest.mark.timeout(300)
def test_demo_command():
    proc = subprocess.run([sys.executable, "-m", "mcompile.cli", "demo", "--steps", "4"], capture_output=True,
                          text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "largest difference from one device over 4 steps" in proc.stdout
    assert "Plan for Llama" in proc.stdout
