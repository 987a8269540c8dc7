"""The compat run: does mcompile import, and does each capability keep parity, on this Python environment's torch?

``pyproject.toml`` claims ``torch>=2.11``; the CI tier runs the pinned torch only. This script, run by
another environment's Python (``scripts/compat.sh`` builds one with torch 2.11 and runs it), records:

1. **imports**: every module of the package — the packages ``pyproject.toml`` lists
   (``[tool.setuptools] packages``) and every module in each, as installed — imported one after another
   in this process; ``--block a,b`` first makes those packages unimportable (``sys.modules[name] = None``),
   as on a machine without them (``tests/test_compat.py`` blocks :data:`mcompile.ir.compat.OPTIONAL`);
2. **tests**: a parity case of each capability (:data:`TESTS`, existing CI-tier tests), run by pytest
   under this Python, each test's outcome read from pytest's JUnit XML.

The JSON (torch / triton / Python versions, per module ``"ok"`` or the error's first line, per test
``passed`` / ``failed`` / ``error`` / ``skipped`` with seconds and the failure's first line) is rewritten
after each part. ``--write`` records ``bench/results/compat_torch<major><minor>.json``.

    python bench/compat.py --imports-only --block highspy   # the import walk alone
    bash scripts/compat.sh                                  # torch 2.11 in /tmp/venv211, both parts, --write
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path


def _bench_module(name: str):
    """bench/<name>.py, loaded from its file: putting bench/ on sys.path would shadow installed packages
    for the whole process (its kernels.py is also the name of the Hub's `kernels`, which transformers imports
    once it finds one: tests/conftest.py), and tests/test_compat.py loads this script in-process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"mcompile_bench_{name}", Path(__file__).resolve().parent /
                                                  f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_results = _bench_module("_results")
RESULTS, ROOT, commit, machine = _results.RESULTS, _results.ROOT, _results.commit, _results.machine

__all__ = ["TESTS", "import_all", "module_names", "source_modules"]

# one parity case (or more) of each capability: existing CI-tier tests, the fastest that prove it
TESTS = [
    # capture of keyword inputs (an HF padding mask kept as a tensor) at tp=2, parity
    "tests/test_capture_and_errors.py::test_keyword_inputs",
    # causal masks as is_causal=True on every mesh (HF Llama / Qwen3 / GPT-2)
    "tests/test_attention_canonical.py",
    # tp + SP + microbatches; dp; HF Llama at tp=2 (real gloo processes)
    "tests/test_runtime.py::test_parity_presets[llama3-tiny-tp=2-sequence_parallel=True-microbatches=2]",
    "tests/test_runtime.py::test_parity_presets[gpt2-tiny-dp=2-]",
    "tests/test_runtime.py::test_parity_hugging_face[hf-llama-tp=2]",
    # pipeline parallelism
    "tests/test_pipeline.py::test_pipeline_parity[llama3-tiny-pp=2-microbatches=2]",
    # ZeRO-1, ZeRO-3
    "tests/test_zero.py::test_zero1_parity[dp=2,tp=2-]",
    "tests/test_fsdp.py::test_zero3_parity[llama3-tiny-dp=2-microbatches=2]",
    # context parallelism (ring; a 4-layer HF Llama from two captured layers)
    "tests/test_cp.py::test_cp_parity[llama3-tiny-cp=2-cp_attention=ring]",
    "tests/test_cp.py::test_repeated_rope_models_train_at_parity_in_threads[hf-llama-4l-cp=2]",
    # expert parallelism
    "tests/test_moe_parallel.py::test_expert_parallel_parity[mixtral-ep=2]",
    # recompute (named policies, to the bit) and the joint forward + backward programs
    "tests/test_recompute.py::test_recompute_saves_less_for_backward",
    "tests/test_joint.py::test_every_policy_gives_autograd_gradients_to_the_bit[llama3-tiny-tp=2]",
    "tests/test_joint.py::test_joint_runtime_equals_the_autograd_fallback_and_zbh1_equals_1f1b",
    # automatic recompute (the HiGHS integer program)
    "tests/test_remat.py::test_solve_matches_exhaustive_and_is_monotone",
    # tp communication overlap (collective matmul)
    "tests/test_collective_matmul.py::test_llama3_tiny_tp2_forward_and_backward_equal_unrewritten_and_single_device",
    # fusion and its kernels
    "tests/test_fuse.py::test_fuse_every_occurrence_and_keep_loss_and_gradients[llama3-tiny-tp2+sp]",
    # FP8 linears
    "tests/test_fp8.py::test_runtime_applies_fp8",
    # resharding checkpoints
    "tests/test_checkpoint_reshard.py::test_save_dp2_tp2_resume_pp_tp_and_zero1",
    # Inductor codegen; started collectives under Inductor (the wait holds the start's input)
    "tests/test_codegen.py::test_llama_forward_backward_graphs_match_eager",
    "tests/test_codegen.py::test_started_collectives_under_inductor_send_the_eager_bytes_and_stay_overlapped",
    # cp attention through the fused flash kernel (its log-sum-exp; memory linear in the chunk)
    "tests/test_cp_attention.py::test_attention_bf16",
    "tests/test_cp_attention.py::test_attention_memory_is_linear_in_the_chunk",
    # the grouped GEMM through torch._grouped_mm; FP8 op counts per linear (tests/test_host_reads.py is skipped
    # before torch 2.12: its counter needs torch.overrides.redispatch_function, and says so)
    "tests/test_kernels_grouped_gemm.py::test_op_on_the_grouped_mm_path_matches_the_loop",
    "tests/test_fp8.py::test_fp8_op_counts_per_linear",
    # the first GPU user's script, its CPU smoke mode
    "tests/test_gpu_step.py",
    # the import walk itself, with the optional packages blocked (not the check of this run's own record)
    *(f"tests/test_compat.py::{t}" for t in (
        "test_the_import_walk_covers_every_module_of_the_checkout",
        "test_every_module_imports_without_the_optional_packages",
        "test_the_joint_path_solves_its_saved_set_without_highs",
        "test_a_missing_optional_package_names_the_feature_and_the_install_line",
        "test_optimization_hint_gives_the_hint_of_a_symbolic_size",
        "test_canonicalize_keeps_batch_and_seq_symbolic", "test_product_values_have_the_ops_sizes")),
]


def _packages() -> list[str]:
    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def module_names() -> list[str]:
    """Every module of the installed package: each package ``pyproject.toml`` lists and its modules."""
    names = []
    for pkg in _packages():
        names.append(pkg)
        try:
            mod = importlib.import_module(pkg)
        except BaseException:  # noqa: BLE001 - import_all records the package's own error
            continue
        names += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(mod.__path__) if not m.ispkg]
    return names


def source_modules() -> list[str]:
    """Every module in the checkout's source folders (``[tool.setuptools.package-dir]`` maps a package to
    its folder), found from the files, not from imports: what :func:`module_names` must cover."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg.get("package-dir", {})

    def folder_of(pkg: str) -> Path:
        """As setuptools resolves it: the longest mapped prefix's folder, then the rest as subfolders
        (``mcompile.passes.cp`` is ``passes/cp``)."""
        parts = pkg.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in dirs:
                return ROOT / dirs[".".join(parts[:i])] / "/".join(parts[i:])
        return ROOT / pkg.replace(".", "/")

    names = []
    for pkg in cfg["packages"]:
        folder = folder_of(pkg)
        names.append(pkg)
        names += [f"{pkg}.{p.stem}" for p in sorted(folder.glob("*.py")) if p.stem != "__init__"]
    # a folder of modules that is no listed package would be missing from an install
    listed = {folder_of(p).resolve() for p in cfg["packages"]}
    for pkg in cfg["packages"]:
        for sub in folder_of(pkg).iterdir():
            if sub.is_dir() and (sub / "__init__.py").exists() and sub.resolve() not in listed:
                names.append(f"{pkg}.{sub.name}")
    return names


def import_all(block: list[str] = ()) -> dict[str, str]:
    """{module: "ok" or the error's first line}; ``block``: packages made unimportable first."""
    for name in block:
        sys.modules[name] = None  # import name -> ImportError, as when not installed
    out = {}
    for name in module_names():
        try:
            importlib.import_module(name)
            out[name] = "ok"
        except BaseException as e:  # noqa: BLE001 - recorded, the walk goes on
            out[name] = (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0]
    return out


def _versions() -> dict:
    v = {"python": sys.version.split()[0]}
    try:
        import torch

        v["torch"] = torch.__version__
    except ImportError as e:
        v["torch"] = f"not importable: {e}"
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    return v


def run_tests(tests: list[str], timeout: float) -> dict[str, dict]:
    """pytest on ``tests`` with this Python; {test id: {"outcome", "seconds", "message"}}."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        # -m: the tests named run even where marked slow (the CI tier deselects those)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not bench", f"--junitxml={xml}",
               *tests]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        except subprocess.TimeoutExpired:
            return {"<pytest>": {"outcome": "timeout", "seconds": time.time() - t0, "message": f"over {timeout} s"}}
        if not xml.exists():
            return {"<pytest>": {"outcome": "error", "seconds": time.time() - t0, "message": tail[0]}}
        out = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            tid = f"{path}::{case.get('name')}"
            outcome, message = "passed", ""
            for kind in ("failure", "error", "skipped"):
                el = case.find(kind)
                if el is not None:
                    outcome = {"failure": "failed"}.get(kind, kind)
                    message = (el.get("message") or el.text or "").strip().splitlines()[:1]
                    message = message[0][:300] if message else ""
                    break
            out[tid] = {"outcome": outcome, "seconds": round(float(case.get("time", 0)), 2), "message": message}
        if not out:
            out["<pytest>"] = {"outcome": "error", "seconds": time.time() - t0, "message": tail[0]}
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true",
                    help="write the record bench/results/compat_torch<major><minor>.json")
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--block", default="", help="comma-separated packages made unimportable for the import walk")
    ap.add_argument("--imports-only", action="store_true", help="the import walk alone (no tests)")
    ap.add_argument("--tests", nargs="*", default=None, help="test ids to run instead of the capability list")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the whole pytest run")
    args = ap.parse_args(argv)
    block = [b for b in args.block.split(",") if b]
    result = {"name": "compat", **_versions(), "machine": machine(), "commit": commit(), "blocked": block}
    major, minor = (result["torch"].split("+")[0].split(".") + ["0"])[:2]
    name = f"compat_torch{major}{minor}"
    path = _results.destination(name, args.write, args.out)

    def save():  # after each part: a run cut short keeps what it measured
        if path is not None:
            _results.save(name, result, write=args.write, out=args.out)

    t0 = time.time()
    result["modules"] = import_all(block)
    failed_imports = sorted(k for k, v in result["modules"].items() if v != "ok")
    result["imports"] = {"modules": len(result["modules"]), "failed": failed_imports,
                         "seconds": round(time.time() - t0, 1)}
    save()
    failed_tests = []
    if not args.imports_only:
        result["tests"] = run_tests(args.tests if args.tests is not None else TESTS, args.timeout)
        failed_tests = sorted(k for k, v in result["tests"].items() if v["outcome"] not in ("passed", "skipped"))
        result["summary"] = {"tests": len(result["tests"]), "failed": failed_tests,
                             "passed": sum(v["outcome"] == "passed" for v in result["tests"].values()),
                             "seconds": round(sum(v["seconds"] for v in result["tests"].values()), 1)}
        save()
    print(json.dumps({k: result[k] for k in ("torch", "python", "triton", "imports", "summary") if k in result},
                     indent=1))
    if path is not None:
        print(f"wrote {path}", file=sys.stderr)
    return 1 if failed_imports or failed_tests else 0


if __name__ == "__main__":
    # run as a script, bench/ is first on sys.path: off it, before the walk imports anything (conftest says why)
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.exit(main())
