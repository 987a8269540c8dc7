"""Graph passes, one module each, run from one flat list (CONVENTIONS 1).

Before planning (on the captured graph):   canonicalize, mean_loss_to_sum_count (runtime only)
After planning (per rank):                  lower
Later passes (pipeline split, recompute, overlap, fusion, fp8, verify) join the second list.
"""

from __future__ import annotations

from mcompile.passes.canonicalize import canonicalize
from mcompile.passes.loss import mean_loss_to_sum_count
from mcompile.passes.lower import AxisInfo, lower

__all__ = ["canonicalize", "lower_program", "mean_loss_to_sum_count", "AxisInfo", "PRE_PLAN", "PER_RANK"]

PRE_PLAN = [canonicalize]
PER_RANK = [lower]


def lower_program(cap, axes, device=None):
    """Run the per-rank pipeline; returns (GraphModule, collective specs)."""
    gm, specs = lower(cap, axes, device)
    return gm, specs
