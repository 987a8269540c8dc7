"""`bench/kernels.py --smoke` runs on CPU in seconds and writes the JSON the GPU run writes.

What is checked: the script end to end (Triton's interpreter for the kernels, no torch.compile) and
the shape of its results — every op at every width, forward and forward + backward, with times,
bandwidths and speed-ups, the copy bandwidth they are scored against, the GEMM rows, versions and
commit. Not checked: any timing (DESIGN §8: no timing assertions in tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPS = {"rms_norm", "layer_norm", "add_rms_norm", "swiglu", "gelu_bias", "rope", "cross_entropy"}


@pytest.mark.timeout(90)
def test_kernel_benchmark_smoke_writes_its_json(tmp_path):
    out = tmp_path / "kernels_smoke.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["benchmark"] == "kernels" and d["mode"] == "smoke" and d["errors"] == []
    assert d["commit"] and d["versions"]["torch"] and "triton" in d["versions"]
    assert {"platform", "python", "cpus", "device"} <= set(d["machine"])
    assert isinstance(d["settings"]["torch_compile"], str)  # skipped in --smoke, and it says so
    assert d["copy_bandwidth_gbps"] > 0
    widths = d["settings"]["widths"]
    assert len(widths) == 2
    assert {(k["op"], k["width"]) for k in d["kernels"]} == {(op, w) for op in OPS for w in widths}
    for k in d["kernels"]:
        assert k["triton"] is (d["versions"]["triton"] is not None), k["op"]  # the interpreter ran the kernels
        # bf16 outputs of size O(1..8): eager rounds after every op, the kernels once — a few ulps of
        # 2^-5; a wrong kernel is off by O(1)
        assert k["max_abs_diff_vs_eager"] < 0.1, (k["op"], k["max_abs_diff_vs_eager"])
        for phase in ("fwd", "fwd_bwd"):
            res = k[phase]
            assert res["bytes"] > 0
            for key in ("fused_s", "eager_s", "fused_gbps", "fused_pct_of_copy", "eager_gbps", "speedup_vs_eager"):
                assert res[key] > 0, (k["op"], phase, key)
            assert "compiled_s" not in res
        assert k["fwd_bwd"]["bytes"] > k["fwd"]["bytes"]
    (gemm,) = d["gemm"]
    assert gemm["bf16_tflops"] > 0 and ("fp8_tflops" in gemm or "fp8_skipped" in gemm)
