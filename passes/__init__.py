"""Graph passes, one module each. The order they run in is one list, ``mcompile.compiler.PASSES``, and the
compiler runs them (model passes in ``mcompile.compiler.plan_model``, rank passes in
``mcompile.compiler.rank_programs``, signature passes in ``mcompile.compiler.build_joint``); this package keeps
no list of its own. Re-exported here: the entry points the planner and the search call directly.
"""

from __future__ import annotations

from mcompile.passes.canonicalize import canonicalize
from mcompile.passes.loss import mean_loss_to_sum_count
from mcompile.passes.lower import AxisInfo, lower

__all__ = ["canonicalize", "lower_program", "mean_loss_to_sum_count", "AxisInfo"]


def lower_program(cap, axes, device=None):
    """The per-rank program of ``cap`` for the axes' placements and this rank's coordinates (passes/lower.py);
    returns (GraphModule, collective specs)."""
    gm, specs = lower(cap, axes, device)
    return gm, specs
