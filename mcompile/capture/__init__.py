"""Capture: a PyTorch model to one torch.export graph (export), the capture cache (cache), autograd.Function
wrapping, loops, gradient regions, checks and values.

Layer: capture. It may import the IR, the kernels, the models and the runtime (tests/test_layers.py).

The names of the old module mcompile.capture (its __all__) load from mcompile.capture.export on
first use: ``from mcompile.capture import capture`` keeps working.
"""

import importlib

_WHERE = {
    "CaptureError": "mcompile.capture.export",
    "CaptureWarning": "mcompile.capture.export",
    "Captured": "mcompile.capture.export",
    "OutputWarning": "mcompile.capture.export",
    "capture": "mcompile.capture.export",
    "warn_unless_loss": "mcompile.capture.export",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    """The old modules' names, from their new modules on first use."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__})
