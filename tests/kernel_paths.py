"""The fused ops on their PyTorch references instead of their Triton kernels in the interpreter.

The test suite sets TRITON_INTERPRET=1 for every process (conftest.py), so on CPU tensors every fused op runs its
Triton kernel through Triton's interpreter: correct, and 10-100x slower than the reference. Tests about what runs
*around* the kernels (a composition of layouts, pipeline stages, checkpoints, FP8 recipes) run the references inside
:func:`reference_kernels`; the kernels themselves are held to their references by the kernel tests
(tests/test_kernels_norms.py, test_kernels_pointwise.py, test_kernels_grouped_gemm.py, test_fp8.py's cast tests), and
a fused program through the interpreter end to end by tests/test_fuse.py::test_fused_program_runs_the_triton_kernels
and tests/test_runtime.py's fused llama3-tiny case on 4 ranks.
"""

from __future__ import annotations

import contextlib
import importlib

KERNELS = ("norms", "activations", "rope", "cross_entropy", "fp8", "grouped_gemm")


@contextlib.contextmanager
def reference_kernels(*names: str):
    """Within the block, the kernel modules ``names`` (default: every one of :data:`KERNELS`) dispatch to their
    PyTorch reference on CPU tensors (their ``uses_triton("cpu")`` is False); restored afterwards."""
    modules = [importlib.import_module(f"mcompile.kernels.{n}") for n in names or KERNELS]
    before = [m._INTERPRETED for m in modules]
    for m in modules:
        m._INTERPRETED = False
    try:
        yield
    finally:
        for m, b in zip(modules, before, strict=True):
            m._INTERPRETED = b
