"""Learning-rate schedules: pure functions of the step.

Steps count from 1 (the first optimizer step) to N = ``train.steps``; η is ``optimizer.lr`` (the
peak), η_min ``schedule.min_lr``, W ``schedule.warmup``. Every schedule starts with a linear warmup

    lr(s) = η · s / W                                   for s <= W

so that the first step already moves (lr(1) = η/W), and the warmup's last step is at the peak. Then:

- ``constant``: lr(s) = η.
- ``cosine`` (Loshchilov & Hutter 2017, SGDR, one cycle without restarts):
  lr(s) = η_min + (η − η_min) · (1 + cos(π · p)) / 2,  p = (s − W) / (N − W); lr(N) = η_min.
- ``wsd``, warmup-stable-decay (Hu et al. 2024, "MiniCPM: Unveiling the Potential of Small Language
  Models with Scalable Training Strategies", §4): η held until the decay phase, the last
  D = round(decay_fraction · N) steps (at most N − W), then a linear decay to η_min:
  lr(s) = η − (η − η_min) · (s − (N − D)) / D  for s > N − D; lr(N) = η_min.
  (MiniCPM decays exponentially; a linear decay is the common form since Hägele et al. 2024, "Scaling
  Laws and Compute-Optimal Training Beyond Fixed Training Durations", which found it as good.)
"""

from __future__ import annotations

import math

__all__ = ["lr_at", "warmup_cosine", "warmup_stable_decay", "warmup_constant"]


def _warm(step: int, lr: float, warmup: int) -> float | None:
    if step < 1:
        raise ValueError(f"steps count from 1; got step {step}")
    return lr * step / warmup if step <= warmup else None


def warmup_constant(step: int, *, lr: float, warmup: int = 0) -> float:
    w = _warm(step, lr, warmup)
    return lr if w is None else w


def warmup_cosine(step: int, *, lr: float, steps: int, warmup: int = 0, min_lr: float = 0.0) -> float:
    w = _warm(step, lr, warmup)
    if w is not None:
        return w
    p = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def wsd_decay_steps(steps: int, warmup: int, decay_fraction: float) -> int:
    """D: the steps of the decay phase."""
    return max(0, min(steps - warmup, round(decay_fraction * steps)))


def warmup_stable_decay(step: int, *, lr: float, steps: int, warmup: int = 0, decay_fraction: float = 0.2,
                        min_lr: float = 0.0) -> float:
    w = _warm(step, lr, warmup)
    if w is not None:
        return w
    d = wsd_decay_steps(steps, warmup, decay_fraction)
    start = steps - d
    if d == 0 or step <= start:
        return lr
    return lr - (lr - min_lr) * min(1.0, (step - start) / d)


def lr_at(step: int, cfg) -> float:
    """The learning rate of optimizer step ``step`` (1-based) under a TrainConfig."""
    s, lr, steps = cfg.schedule, cfg.optimizer.lr, cfg.train.steps
    if s.kind == "constant":
        return warmup_constant(step, lr=lr, warmup=s.warmup)
    if s.kind == "cosine":
        return warmup_cosine(step, lr=lr, steps=steps, warmup=s.warmup, min_lr=s.min_lr)
    if s.kind == "wsd":
        return warmup_stable_decay(step, lr=lr, steps=steps, warmup=s.warmup, decay_fraction=s.decay_fraction,
                                   min_lr=s.min_lr)
    raise ValueError(f"schedule.kind = {s.kind!r}: use 'cosine', 'wsd' or 'constant'")
