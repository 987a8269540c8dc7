"""mcompile.runtime: executing per-rank programs (torch.distributed; threads for the simulator)."""

from mcompile.runtime import launch

__all__ = ["launch"]
