"""Every Triton kernel compiles for sm_90 (H100/H200) at the benchmark's widths, without a GPU, and
spills no registers (bench/kernels_sm90.py: the real Triton compiler and ptxas, which the tests'
interpreter never runs — a kernel it rejects or that spills passes every other CPU test).

Widths 8192 and 16384: the widest rows of the one-kernel norm backward and of the forward's single
block (the register-heaviest launches), and, at 16384, the split dx + dw backward. A compile
property, not a timing: deterministic for a given Triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
triton = pytest.importorskip("triton")
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _kernels(recorded_only: bool = False) -> set[str]:
    from mcompile.kernels import activations, cross_entropy, fp8, grouped_gemm, norms, rope

    modules = (norms, activations, rope, cross_entropy, fp8) + (() if recorded_only else (grouped_gemm,))
    return {n for m in modules for n in vars(m) if n.endswith("_kernel")}


@pytest.mark.timeout(30)
def test_the_committed_sm90_record_covers_every_kernel_without_spills():
    """The CI tier reads bench/results/kernels_sm90.json (written by bench/kernels_sm90.py --write, which the
    slow test below runs): every kernel of the six modules compiled, none spilling. A kernel added without
    recompiling the record fails here. Not yet in the record: the grouped GEMM's kernels (issue 15), which
    the slow test compiles; bench/kernels_sm90.py did not finish within 15 minutes on the 2-core machine
    when the record was to be regenerated — regenerate it where it does, then drop ``recorded_only``."""
    d = json.loads((ROOT / "bench" / "results" / "kernels_sm90.json").read_text())
    assert d["errors"] == [] and d["spilling"] == [], (d["errors"], d["spilling"])
    assert {r["kernel"] for r in d["launches"]} == _kernels(recorded_only=True)
    for r in d["launches"]:
        assert r["local"] == r["stack"] == 0 and 0 < r["reg"] <= 255, r
        assert r["reg"] * 32 * r["num_warps"] <= 65536, r


# ~280 s on the 2-core CI machine (the grouped GEMM's tiles take ptxas minutes): the slow tier; the committed
# record is checked in CI (above)
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not (TOOLS / "cuobjdump").exists(), reason="this triton wheel ships no NVIDIA tools")
def test_every_kernel_compiles_for_sm90_without_spills(tmp_path):
    from mcompile.kernels import activations, cross_entropy, fp8, grouped_gemm, norms, rope

    out = tmp_path / "sm90.json"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_sm90.py"), "--widths", "8192,16384",
                           "--out", str(out)], capture_output=True, text=True, timeout=880, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["errors"] == [] and d["spilling"] == [], (d["errors"], d["spilling"])
    # every kernel of the six modules was launched by some case, so every one was compiled
    modules = (norms, activations, rope, cross_entropy, fp8, grouped_gemm)
    kernels = {n for m in modules for n in vars(m) if n.endswith("_kernel")}
    assert {r["kernel"] for r in d["launches"]} == kernels
    for r in d["launches"]:
        assert r["local"] == r["stack"] == 0 and 0 < r["reg"] <= 255, r
        # registers a thread x threads a program must fit one SM's 64K registers
        assert r["reg"] * 32 * r["num_warps"] <= 65536, r
