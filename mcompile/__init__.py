"""mcompile: Megatron-style parallel training as a compiler over torch.export graphs.

    import mcompile as mc
    plan = mc.plan(model, mc.Mesh.fake(dp=64, tp=8), example_inputs=(tokens, targets))
    print(plan)

The names below are imported on first use, so ``import mcompile.apps.cli`` (the ``mcompile`` command's
``--help`` and argument errors) imports neither torch nor the compiler.
"""

import importlib
import importlib.util
import sys
import types

__version__ = "0.1.0"
_WHERE = {"compile_plan": "mcompile.api", "parallelize": "mcompile.api", "plan": "mcompile.api",
          "CaptureError": "mcompile.capture.export", "CaptureWarning": "mcompile.capture.export",
          "OutputWarning": "mcompile.capture.export", "Config": "mcompile.ir.config", "Estimate": "mcompile.cost.model",
          "Layout": "mcompile.cost.model", "Workload": "mcompile.cost.workload", "estimate": "mcompile.cost.workload",
          "Mesh": "mcompile.ir.mesh", "Plan": "mcompile.ir.plan", "PlanError": "mcompile.ir.plan",
          "search": "mcompile.search"}
__all__ = ["CaptureError", "CaptureWarning", "OutputWarning", "Config", "Estimate", "Layout", "Mesh", "Plan",
           "PlanError", "Workload", "compile_plan", "estimate", "parallelize", "plan", "search", "__version__"]


def lazy_exports(namespace: dict, where: dict[str, str]) -> None:
    """Give a package (its ``globals()``) the names of ``where`` (name -> the module defining it), each imported on
    first use: ``mcompile.capture`` and ``mcompile.cost`` keep their former modules' public names this way."""

    def __getattr__(name: str):
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
            namespace[name] = value  # once: later lookups are plain attribute reads
            return value
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")

    def __dir__():
        return sorted({*namespace, *where})

    namespace.update(__getattr__=__getattr__, __dir__=__dir__, __all__=list(where))


def _load(name: str):
    return getattr(importlib.import_module(_WHERE[name]), name)


class _Package(types.ModuleType):
    """``mcompile.search`` names a submodule and a function (``mcompile.plan`` did, before the Plan IR moved to
    ``mcompile.ir.plan``): the function wins (a property of the package's class outranks the attribute the import
    system sets for a submodule)."""

    plan = property(lambda self: _load("plan"), lambda self, value: None)
    search = property(lambda self: _load("search"), lambda self, value: None)

    def __getattr__(self, name: str):
        if name in _WHERE:
            value = _load(name)
            setattr(self, name, value)  # once: later lookups are plain attribute reads
            return value
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")  # a submodule: mc.cost, mc.models, ...
        raise AttributeError(f"module 'mcompile' has no attribute {name!r}")

    def __dir__(self):
        return sorted({*super().__dir__(), *_WHERE})


sys.modules[__name__].__class__ = _Package
