"""What keeps mcompile importable across the torch versions it claims and without its optional packages.

* **torch**: ``pyproject.toml`` claims ``torch>=2.11``; the CI tier runs the pinned version
  (``scripts/env.sh``), the compat run (``scripts/compat.sh``, docs/testing.md) torch 2.11. An API newer
  than the oldest claimed torch is imported here, once, with a fallback that behaves the same on the
  older one; modules import the name from here.
* **Optional packages** (HiGHS, Transformer Engine, transformers, TensorBoard, matplotlib, ...) are
  imported where a feature uses them, through :func:`require`, never at module level: a missing one
  fails only the feature that needs it, with an error that names the package, the feature and how to
  install it. ``tests/test_compat.py`` imports every module with each of :data:`OPTIONAL` blocked.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

__all__ = ["MissingDependency", "OPTIONAL", "optimization_hint", "require", "size_hints"]

# packages the default path (capture, plan, lower, joint execution, the runtime) must import without:
# module -> the pip requirement that provides it
OPTIONAL = {
    "highspy": "highspy",
    "transformer_engine": "transformer-engine[pytorch]",
    "triton": "triton",
    "transformers": "transformers",
    "tensorboard": "tensorboard",
    "matplotlib": "matplotlib",
    "tiktoken": "tiktoken",
    "sentencepiece": "sentencepiece",
}


class MissingDependency(ImportError):
    """An optional package a feature needs is not importable (the message says which and how to install it)."""


def require(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """``import module`` for ``feature`` (words naming the option that needs it), or
    :class:`MissingDependency` naming the package, the feature and the pip command (``extra``:
    mcompile's optional-dependency group that installs it)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        req = OPTIONAL.get(top, top)
        how = f"pip install '{req}'" + (f" (or pip install 'mcompile[{extra}]')" if extra else "")
        raise MissingDependency(f"{feature} needs the Python package {req!r}, which is not importable here ({e}): "
                                f"{how}") from e


# torch.fx.experimental.symbolic_shapes.optimization_hint (a hint for a symbolic size, adding no guard)
# is newer than torch 2.11, whose equivalent for the backed sizes mcompile asks about (batch, seq: every
# size of a capture has a hint) is size_hint
try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch 2.11
    from torch.fx.experimental.symbolic_shapes import size_hint as _size_hint

    def optimization_hint(a: torch.SymInt | int, fallback: int | None = None) -> int:
        return _size_hint(a, fallback)


def size_hints(shape_env) -> dict:
    """{symbol: example value} of a ShapeEnv: ``backed_var_to_val`` where torch has it (``var_to_val`` is
    deprecated for it), else ``var_to_val``."""
    hints = getattr(shape_env, "backed_var_to_val", None)
    return hints if hints is not None else shape_env.var_to_val


def quiet_highs(feature: str):
    """A HiGHS instance without its banner (printed from C on the first construction); ``feature``: what
    needs it, named by the error when HiGHS is not installed."""
    import os
    import sys

    highspy = require("highspy", feature)

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)
    return h
