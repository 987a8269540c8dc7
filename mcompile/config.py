"""Options of a parallel run, typed and validated on construction (CONVENTIONS 6)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch


class Inputs(StrEnum):
    GLOBAL = "global"  # every rank passes the whole batch (single-device semantics); the default
    LOCAL = "local"  # every rank passes its own data-parallel slice, as a data loader does


@dataclass(kw_only=True, frozen=True)
class Config:
    sequence_parallel: bool = False
    microbatches: int = 1  # gradient accumulation steps inside one train_step
    dtype: torch.dtype = torch.float32  # compute dtype; parameters, gradients and their reduction stay fp32
    inputs: Inputs = Inputs.GLOBAL
    overrides: dict = field(default_factory=dict)  # placement overrides, see mcompile.planner
    bucket_mb: float = 25.0  # data-parallel gradient buckets (MB of fp32 gradients)
    vocab_pad_multiple: int = 1
    fuse: bool = False  # run RMSNorm / SwiGLU through mcompile's fused kernels (mcompile.passes.fuse)
    recompute: str = "none"  # "none" | "full" | "selective" (attention core), mcompile.passes.recompute
    recompute_method: str = "uniform"  # full recompute: "uniform" (groups of layers) or "block" (first layers)
    recompute_num_layers: int = 1

    def __post_init__(self):
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches={self.microbatches!r} must be a positive integer")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype={self.dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
        object.__setattr__(self, "inputs", Inputs(self.inputs))
        if self.recompute not in ("none", "full", "selective"):
            raise ValueError(f"recompute={self.recompute!r}: use 'none', 'full' or 'selective'")
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_method={self.recompute_method!r}: use 'uniform' or 'block'")
        if self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers={self.recompute_num_layers} must be >= 1")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb={self.bucket_mb} must be positive")
