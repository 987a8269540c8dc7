"""What one FP8 linear costs besides its GEMMs: aten ops counted per forward and backward (issue 38 item 7).

One ``fp8_linear`` (x (M, K), an fp32 weight parameter (N, K), M = 32 tokens, K = 64, N = 128) runs two
optimizer steps of two microbatches each (forward, backward; an in-place weight update between the steps,
as an optimizer's); the second step is counted, per microbatch (under delayed scaling the first step is
the empty history's current-scaling fallback). The steps run inside ``step_cache`` where the module has
it, as ``ParallelModule.train_step`` runs them. A ``TorchDispatchMode`` on CPU counts every aten op
inside the FP8 ops (PyTorch reference path: this script does not set TRITON_INTERPRET, so no Triton
kernel runs) into:

- ``fp8_casts``: conversions to an FP8 dtype (``to`` / ``_to_copy``);
- ``amax``: full reductions ``amax`` / ``max`` of an operand (each a read of the whole tensor);
- ``copies``: ``clone``, ``copy_``, ``cat``, ``constant_pad_nd``, ``contiguous`` of FP8 data (layout
  copies: transposes, pads);
- ``gemms``: ``_scaled_mm``, ``mm``, ``addmm``, ``matmul``;
- ``history_max``, ``other_copies``: the same ops on a delayed-scaling history (its rows' max for a scale,
  the push in backward: L values each);
- ``ops``: every aten op (also the scale arithmetic on 0-d tensors).

Two layouts: ``cpu`` as CPU's ``torch._scaled_mm`` runs (it takes any strides), and ``cuda``: the same
code with CUDA's layout rule applied on CPU (cuBLASLt's FP8 GEMM takes a row-major, b column-major — the
copies a CUDA run makes). ``--before REV``: the same counts for ``kernels/fp8.py`` as of git revision REV
(loaded from ``git show``, its ops renamed into another namespace), e.g. the commit before issue 38 item 7.

    python bench/fp8_ops.py [--before 24f43cb] [--write | --out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

M, K, N = 32, 64, 128
RECIPES = ("current", "delayed")
LAYOUTS = ("cpu", "cuda")
aten = torch.ops.aten
_GEMMS = {aten._scaled_mm.default, aten.mm.default, aten.addmm.default, aten.matmul.default}
_COPIES = {aten.clone, aten.copy_, aten.cat, aten.constant_pad_nd, aten.contiguous}
_CASTS = {aten.to, aten._to_copy}
_AMAX = {aten.amax.default, aten.max.default}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
CATEGORIES = ("fp8_casts", "amax", "copies", "gemms", "history_max", "other_copies", "ops")


class OpCounter(TorchDispatchMode):
    """Counts aten ops by category; custom ops of ``namespaces`` are entered: their Python implementation
    runs under the mode, so it sees every op they call (composite ones such as ``to`` and ``contiguous``
    too, before they decompose)."""

    def __init__(self, namespaces=("mcompile",)):
        super().__init__()
        self.namespaces = set(namespaces)
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in self.namespaces:
            opdef = torch._library.custom_ops._maybe_get_opdef(func)
            with self:
                return opdef._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        if func.namespace == "aten":
            self.counts["ops"] += 1
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            packet = func.overloadpacket
            # not a no-op returning its input (``copy_`` returns its destination: always a copy)
            fresh = isinstance(out, torch.Tensor) and (out is not src or packet is aten.copy_)
            if func in _GEMMS:
                self.counts["gemms"] += 1
            elif packet in _CASTS and fresh and out.dtype in _FP8 and src is not None and src.dtype not in _FP8:
                self.counts["fp8_casts"] += 1
            elif packet in _COPIES and fresh:
                # FP8 data moved (a transpose, a pad), or other (the delayed history's bookkeeping)
                self.counts["copies" if out.dtype in _FP8 + (torch.uint8,) else "other_copies"] += 1
            elif func in _AMAX:
                # a whole operand read (2-d), or a delayed-scaling history row (1-d: L values)
                self.counts["amax" if src.dim() >= 2 else "history_max"] += 1
        return out


@contextlib.contextmanager
def counting(namespace: str = "mcompile"):
    """Counts the block's aten ops (inside the ``namespace`` custom ops too): a dict of
    :data:`CATEGORIES`, filled when the block ends."""
    mode, counts = OpCounter((namespace,)), {}
    with mode:
        yield counts
    counts.update({k: mode.counts.get(k, 0) for k in CATEGORIES})


def measure(fp8, recipe: str, layout: str, namespace: str = "mcompile") -> dict:
    """{"microbatch 1": {"forward": counts, "backward": counts}, "microbatch 2": ...} of the second step."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(N, K) / K ** 0.5)
    history = fp8.new_amax_history(4) if recipe == "delayed" else None
    saved = set(fp8.KMAJOR_DEVICES)
    fp8.KMAJOR_DEVICES.clear()
    fp8.KMAJOR_DEVICES.update({"cuda"} | ({"cpu"} if layout == "cuda" else set()))
    step = getattr(fp8, "step_cache", contextlib.nullcontext)  # a revision without the cache: every call casts
    out = {}
    try:
        for s in range(2):
            with step():
                for mb in (1, 2):
                    x, dy = torch.randn(M, K, requires_grad=True), torch.randn(M, N)
                    with counting(namespace) as f:
                        y = fp8.fp8_linear(x, weight) if history is None else fp8.fp8_linear_delayed(x, weight, history)
                    with counting(namespace) as b:
                        y.backward(dy)
                    if s == 1:
                        out[f"microbatch {mb}"] = {"forward": f, "backward": b}
            with torch.no_grad():
                weight.add_(weight.grad, alpha=-1e-2)  # the optimizer step: a new weight, the cast redone
                weight.grad = None
    finally:
        fp8.KMAJOR_DEVICES.clear()
        fp8.KMAJOR_DEVICES.update(saved)
    return out


def load_before(rev: str, root: Path):
    """kernels/fp8.py as of ``rev``, its ops renamed mcompile_before::*, with a KMAJOR_DEVICES set standing
    for its ``a8.device.type == "cuda"`` layout branch (a revision with the set keeps its own)."""
    src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:kernels/fp8.py"], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    src = src.replace("mcompile::", "mcompile_before::").replace("torch.ops.mcompile.", "torch.ops.mcompile_before.")
    if "KMAJOR_DEVICES" not in src:
        src = src.replace('if a8.device.type == "cuda":', "if a8.device.type in KMAJOR_DEVICES:")
        src += '\nKMAJOR_DEVICES = {"cuda"}\n'
    path = Path(tempfile.mkdtemp(prefix="mcompile-fp8-before-")) / "fp8_before.py"  # triton.jit reads a file
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("mcompile_fp8_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def counts(fp8, namespace: str = "mcompile") -> dict:
    return {r: {lay: measure(fp8, r, lay, namespace) for lay in LAYOUTS} for r in RECIPES}


def _bench_module(name: str):
    """bench/<name>.py loaded from its file (bench/ on sys.path would shadow packages: bench/compat.py)."""
    spec = importlib.util.spec_from_file_location(f"mcompile_bench_{name}", Path(__file__).resolve().parent /
                                                  f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    results = _bench_module("_results")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=None, help="also count kernels/fp8.py as of this git revision")
    results.add_arguments(ap, "fp8_ops")
    args = ap.parse_args(argv)
    from mcompile.kernels import fp8

    result = {"benchmark": "fp8_ops", "shape": {"M": M, "K": K, "N": N}, "torch": torch.__version__,
              "counted": "the second of two steps of two microbatches; per microbatch, forward and backward",
              "after": counts(fp8)}
    if args.before:
        result["before_rev"] = args.before
        result["before"] = counts(load_before(args.before, results.ROOT), "mcompile_before")
    results.save("fp8_ops", result, args.write, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
