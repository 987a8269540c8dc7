"""`bench/kernels.py --smoke` runs on CPU in seconds and writes the JSON the GPU run writes.

What is checked: the script end to end (Triton's interpreter for the kernels, no torch.compile) and
the shape of its results — every op at every width, forward and forward + backward, with times,
bandwidths and speed-ups, the copy bandwidth they are scored against, the GEMM rows, the FP8 layer
rows (three linear shapes and a Llama MLP block, bf16 vs FP8: seconds, TFLOP/s, speed-ups, relative
errors, which GEMM ran), the run's bookkeeping (complete, timeline, skipped), versions and commit;
and that a spent --budget skips the remaining items and says so. Not checked: any timing (DESIGN §8:
no timing assertions in tests).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPS = {"rms_norm", "layer_norm", "add_rms_norm", "swiglu", "gelu_bias", "rope", "cross_entropy"}


def _smoke(out, *extra):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py"), "--smoke", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)


@pytest.mark.slow  # the CI tier keeps the cheaper checks of this capability (README: -m slow)
@pytest.mark.timeout(90)
def test_kernel_benchmark_smoke_writes_its_json(tmp_path):
    out = tmp_path / "kernels_smoke.json"
    proc = _smoke(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["benchmark"] == "kernels" and d["mode"] == "smoke" and d["errors"] == []
    assert d["complete"] is True and d["status"] == "complete" and d["skipped"] == []
    assert not out.with_name(out.name + ".tmp").exists()
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

    linears = [r for r in d["layers"] if r["layer"] == "linear"]
    (mlp,) = [r for r in d["layers"] if r["layer"] == "llama_mlp"]
    assert [[r["in_features"], r["out_features"]] for r in linears] == d["settings"]["layer_shapes_kxn"]
    assert len(linears) == 3 and [[mlp["hidden"], mlp["intermediate"]]] == d["settings"]["mlp_hxf"]
    for r in d["layers"]:
        assert r["tokens"] == d["settings"]["tokens"] and r["dtype"] == "bfloat16"
        assert r["fp8_gemm"] and r["fp8_gemm_hw"] is False  # CPU: never FP8 hardware, and the row says which path
        impls = ("bf16", "fp8", "fp8_delayed") if r["layer"] == "linear" else ("bf16", "fp8")
        assert "fp8_error" not in r and "fp8_delayed_error" not in r, r
        assert r["fwd_bwd"]["flops"] == 3 * r["fwd"]["flops"] > 0
        for phase in ("fwd", "fwd_bwd"):
            res = r[phase]
            for impl in impls:
                assert res[f"{impl}_s"] > 0 and res[f"{impl}_tflops"] > 0, (r["layer"], phase, impl)
                assert r[f"{impl}_first_call_s"] > 0
                if impl != "bf16":
                    assert res[f"{impl}_speedup_vs_bf16"] > 0
        grads = ["dx", "dw"] if r["layer"] == "linear" else ["dx", "dw_gate", "dw_up", "dw_down"]
        for impl in impls[1:]:
            errs = r[f"{impl}_rel_err"]
            assert set(errs) == {"y", *grads}
            # E4M3 operands (3 mantissa bits) and E5M2 gradients: a few percent; a wrong op is off by O(1)
            assert all(0 < e < 0.3 for e in errs.values()), (r["layer"], impl, errs)
    items = [t["item"] for t in d["timeline"]]
    assert items[0] == "copy bandwidth" and items[-1].startswith("llama_mlp")
    assert all(t["outcome"] == "ok" for t in d["timeline"])
    # the kernels come first, then the GEMM, then the layers
    kinds = [i.split()[0] for i in items[1:]]
    assert kinds == sorted(kinds, key=["kernel", "gemm", "linear", "llama_mlp"].index)


@pytest.mark.timeout(60)
def test_kernel_benchmark_spent_budget_skips_and_says_so(tmp_path):
    out = tmp_path / "k.json"
    proc = _smoke(out, "--budget", "0.001", "--sections", "gemm,layers")
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["complete"] is False and "budget" in d["status"] and d["timeline"] == []
    assert [s["item"] for s in d["skipped"]][:2] == ["copy bandwidth", "gemm n=64"]
    assert all("--budget" in s["reason"] for s in d["skipped"]) and d["layers"] == [] and d["gemm"] == []


@pytest.mark.timeout(90)
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_gpu_run_script_writes_json_and_log_into_out(tmp_path):
    """bench/gpu_run.sh, the one command for a lent GPU machine, end to end with --smoke passed
    through (one op, one width): its versions header, the package view it imports mcompile from
    (the GPU machine has the tree, not an install), and the JSON and log written into $OUT."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, OMP_NUM_THREADS="1", MCOMPILE_COMMIT="abc1234")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh"), "--smoke", "--sections", "kernels",
                           "--only", "rms_norm", "--widths", "64"], capture_output=True, text=True, timeout=80,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "kernels.log").read_text()
    assert "== bench/gpu_run.sh" in log and "torch._scaled_mm:" in log and "package view:" in log
    assert "mcompile.kernels from" in log and "bench/kernels.py exited 0" in log
    d = json.loads((out / "kernels.json").read_text())
    assert d["complete"] and d["commit"] == "abc1234" and [k["op"] for k in d["kernels"]] == ["rms_norm"]
