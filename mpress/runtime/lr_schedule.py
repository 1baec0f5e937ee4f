"""The learning rate of each optimizer step: a pure function of the step's index.

Every rank computes the same rate from the same step index, and a resumed job continues
exactly where an uninterrupted one would be (nothing about the schedule is saved: the
step index says it all). Steps are numbered from 0; `total_steps` is the job's `steps`.

    warmup (step < warmup_steps):  lr * (step + 1) / (warmup_steps + 1)
        a straight line from 0 (the step before the first) that reaches lr at step
        warmup_steps, so no step runs at rate 0 and none repeats lr;
    decay  (step >= warmup_steps): progress p = (step - warmup_steps) / (last - warmup_steps),
        last = total_steps - 1 (p = 1 when the decay has no room), clamped to [0, 1]:
        constant  lr
        linear    min_lr + (lr - min_lr) * (1 - p)
        cosine    min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2
    so the first step after warmup runs at lr and the last step at min_lr.

The rate is applied as torch's `LambdaLR` applies it, `base_lr * factor(step)`, so a run
driven by `LambdaLR(optimizer, schedule.factor)` sets the same float in every group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

ScheduleKind = Literal["constant", "cosine", "linear"]
SCHEDULE_KINDS: tuple[str, ...] = ("constant", "cosine", "linear")


@dataclass(frozen=True, kw_only=True)
class LrSchedule:
    """A learning-rate schedule over a job of `total_steps` optimizer steps."""

    kind: ScheduleKind = "constant"
    """Shape of the decay after warmup (see the module docstring)."""
    lr: float
    """Peak learning rate (the optimizer's base rate)."""
    total_steps: int
    """Optimizer steps of the whole job (the config's `steps`); the last runs at `min_lr`."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 up to `lr`."""
    min_lr: float = 0.0
    """Rate at the last step (cosine, linear); ignored by constant after warmup."""

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(f"schedule kind must be one of {', '.join(SCHEDULE_KINDS)}, got {self.kind!r}")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr {self.lr}, min_lr {self.min_lr}")
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"need total_steps >= 1 and warmup_steps >= 0, got {self.total_steps}, "
                             f"{self.warmup_steps}")

    def factor(self, step: int) -> float:
        """The multiplier of `lr` at 0-based `step` (a `LambdaLR` lambda)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.kind == "constant":
            return 1.0
        floor = self.min_lr / self.lr
        room = self.total_steps - 1 - self.warmup_steps
        progress = 1.0 if room <= 0 else min(1.0, (step - self.warmup_steps) / room)
        if self.kind == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * shape

    def rate(self, step: int) -> float:
        """The learning rate of 0-based `step`, as `LambdaLR` computes it: `lr * factor(step)`."""
        return self.lr * self.factor(step)

    def apply(self, optimizer: torch.optim.Optimizer, step: int, base_lrs: list[float]) -> None:
        """Set every parameter group's rate for `step`: `base_lrs[i] * factor(step)` in
        group i (torch's `LambdaLR` formula, bit for bit)."""
        factor = self.factor(step)
        for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
            group["lr"] = base * factor


__all__ = ["SCHEDULE_KINDS", "LrSchedule", "ScheduleKind"]
