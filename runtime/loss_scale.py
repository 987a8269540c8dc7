"""Dynamic loss scaling for fp16 compute (``Config(dtype=torch.float16)``).

fp16 holds magnitudes down to 6e-8 (subnormal) only, so the small gradients of a real model's
activations flush to zero in its backward. Loss scaling (Micikevicius et al. 2018, "Mixed Precision
Training", ICLR) multiplies the loss by ``S`` before the backward, so every gradient the backward
computes is ``S`` times larger, and divides the fp32 gradients by ``S`` afterwards. A fixed ``S``
either wastes range or overflows; the dynamic rule kept here is the one Megatron-LM's
``DynamicGradScaler`` follows (megatron/core/optimizer/grad_scaler.py; our own code):

- start at ``initial`` (2^16);
- a step whose gradients hold an inf or a NaN on ANY rank is skipped by EVERY rank (the flag is
  reduced with MAX over the whole job: dp, tp, pp, ep and cp ranks alike, so no rank updates
  its shard of the weights while another one does not), and the scale is multiplied by
  ``backoff`` (0.5), not below ``min_scale``; with ``hysteresis`` h > 1 only the h-th overflow in a
  row since the last growth halves it (Megatron's ``--hysteresis``);
- after ``growth_interval`` clean steps in a row the scale is multiplied by ``growth`` (2).

Where it acts (runtime/module.py ``train_step``): the loss's output gradient (the tangent of the
joint program, ``loss.backward``'s seed on the autograd path, the last pipeline stage's) is ``S / T``
instead of 1. mcompile's backward starts from each piece's token-loss *sum* (divided by the global
token count once, at the end), Megatron's from its *mean*; ``T``, the tokens per piece (one
microbatch of one data rank, a power of two: the last step's global count / (data ranks x
microbatches); before the first step estimated from the global batch's integer inputs; 1 for a loss
that is no token sum), makes ``S`` the scale of the mean, so 2^16 and the floor mean what they mean
in Megatron. With ``S`` on the sum, the first log2(tokens) steps of a run overflowed (3 of 3 for the
tiny Llama at 32 tokens per piece), and a floor of 1 could keep a large batch skipping for ever.

The gradients land scaled in the fp32 main-gradient buffers (runtime/leaves.py); the end of the
step divides them by ``S / T`` together with the token count (one multiply, before any clipping),
checks them for non-finite values, reduces that flag over every rank, and on an overflow sets every
gradient to None — so any torch optimizer's ``step()`` (and ``DistributedOptimizer.step``) leaves
every parameter and its state as they were — then updates the scale. Master weights stay fp32 (the
parameters under ZeRO 0, the fp32 master shards under ZeRO-1/2; only the compute copies are fp16).
The scaler's state is saved in and restored from checkpoints (runtime/checkpoint.py), so a resumed
run scales as the uninterrupted one.
"""

from __future__ import annotations

import math

import torch

from mcompile.ir.config import check_loss_scale

__all__ = ["DynamicLossScaler", "nonfinite"]


class DynamicLossScaler:
    """The scale and its counters (host numbers: the step's overflow flag is read on the host anyway,
    to skip the step). Powers of two by default, so scaling and unscaling are exact."""

    def __init__(self, initial: float = 2.0**16, *, growth_interval: int = 1000, min_scale: float = 1.0,
                 hysteresis: int = 1, growth: float = 2.0, backoff: float = 0.5):
        check_loss_scale(initial, growth_interval, min_scale, hysteresis, growth, backoff)
        self.scale = float(initial)
        self.growth_interval, self.min_scale, self.hysteresis = growth_interval, float(min_scale), hysteresis
        self.growth, self.backoff = float(growth), float(backoff)
        self.clean_steps = 0  # clean steps since the last overflow or growth
        self.hysteresis_left = hysteresis  # overflows still tolerated before the next backoff
        self.skipped_steps = 0  # overflowed steps in all (reported; saved)
        # tokens per piece (one microbatch of one data rank): mcompile's backward starts from a piece's token-loss
        # SUM, Megatron's from its mean; the sum's gradient is scale / tokens so that ``scale`` means what it
        # means in Megatron (a power of two: exact). Known after a step (its global count); before the first,
        # None: the runtime estimates it from the global batch's shapes (1 where it cannot)
        self.tokens_per_piece: float | None = None

    @classmethod
    def from_config(cls, config) -> DynamicLossScaler:
        return cls(config.initial_loss_scale, growth_interval=config.loss_scale_window,
                   min_scale=config.min_loss_scale, hysteresis=config.loss_scale_hysteresis)

    def sum_scale(self) -> float:
        """The gradient of a piece's loss sum that the backward starts from."""
        return self.scale / (self.tokens_per_piece or 1.0)

    def observe_tokens(self, tokens: float) -> None:
        """After a step: its tokens per piece (the global count over data ranks x microbatches), rounded to a
        power of two, for the next step's :meth:`sum_scale`."""
        self.tokens_per_piece = 2.0 ** round(math.log2(tokens)) if tokens >= 1 else 1.0

    def update(self, overflow: bool) -> None:
        """After a step: back off on an overflow (hysteresis permitting), grow after enough clean steps."""
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left,
                "skipped_steps": self.skipped_steps, "tokens_per_piece": self.tokens_per_piece}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        t = state.get("tokens_per_piece")
        self.tokens_per_piece = float(t) if t is not None else None

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.scale:g}, clean_steps={self.clean_steps}/{self.growth_interval}, "
                f"hysteresis_left={self.hysteresis_left}, skipped_steps={self.skipped_steps})")


def nonfinite(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """1.0 when any element of ``tensors`` is inf or NaN, else 0.0 (a float32 0-d tensor on ``device``,
    no host read): one read of each tensor (its max-norm: inf and NaN propagate)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(tensors, float("inf"))
    return (~torch.stack(norms).isfinite()).any().to(torch.float32)
