"""mcompile: Megatron-style parallel training as a compiler over torch.export graphs.

    import mcompile as mc
    plan = mc.plan(model, mc.Mesh.fake(dp=64, tp=8), example_inputs=(tokens, targets))
    print(plan)
"""

from mcompile.api import compile_plan, parallelize, plan
from mcompile.capture import CaptureError
from mcompile.config import Config
from mcompile.cost import Estimate, Layout, Workload, estimate
from mcompile.mesh import Mesh
from mcompile.plan import Plan
from mcompile.propagate import PlanError
from mcompile.search import search

__version__ = "0.1.0"
__all__ = ["CaptureError", "Config", "Estimate", "Layout", "Mesh", "Plan", "PlanError", "Workload", "compile_plan",
           "estimate", "parallelize", "plan", "search", "__version__"]
