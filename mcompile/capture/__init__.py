"""Capture: a PyTorch model to one torch.export graph (export), the capture cache (cache), autograd.Function
wrapping, loops, gradient regions, checks and values.

Layer: capture. It may import the IR, the kernels, the models and the runtime (tests/test_layers.py).

The names of the old module mcompile.capture (its __all__) load from mcompile.capture.export on
first use: ``from mcompile.capture import capture`` keeps working.
"""

from mcompile import lazy_exports

_WHERE = {
    "CaptureError": "mcompile.capture.export",
    "CaptureWarning": "mcompile.capture.export",
    "Captured": "mcompile.capture.export",
    "OutputWarning": "mcompile.capture.export",
    "capture": "mcompile.capture.export",
    "warn_unless_loss": "mcompile.capture.export",
}
lazy_exports(globals(), _WHERE)
