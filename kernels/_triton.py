"""What every kernel module needs from Triton, in one place: the optional import, ``jit`` that
degrades to the plain function where Triton is absent, the power-of-two block size, and the
dispatch rule (Triton on CUDA, and on CPU when the kernels were built for the interpreter)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux-only dependency; the references run elsewhere
    triton = tl = None

__all__ = ["jit", "pow2", "runs_triton", "tl", "triton"]


def jit(fn):
    return triton.jit(fn) if triton is not None else fn


def pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def runs_triton(device: torch.device | str, interpreted: bool) -> bool:
    """Triton kernels on CUDA, and on CPU when they were built for Triton's interpreter
    (``TRITON_INTERPRET=1`` when the module was imported: Triton reads the switch in ``triton.jit``)."""
    device = torch.device(device)
    return triton is not None and (device.type == "cuda" or (device.type == "cpu" and interpreted))
