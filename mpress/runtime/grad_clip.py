"""Gradient clipping by the global norm over every stage of the pipeline.

torch's `clip_grad_norm_` sees one process's parameters; a pipeline's parameters are
spread over its ranks. So, after the backward passes (and the sum of tied copies) and
before any optimizer step:

1. each rank sums the squared fp32 norms of its stages' gradients (a tied weight counted
   once, on its first stage: `TiedGrads.repeated`);
2. one `all_reduce` (sum) over the pipeline's process group; the global norm is its
   square root, the same float on every rank;
3. every rank scales every gradient in place by `min(1, max_norm / (norm + 1e-6))`, the
   coefficient and the multiplication `torch.nn.utils.clip_grad_norm_` uses.

Data-parallel replicas need no second reduction: DDP has averaged each stage's gradients
over the replicas during the backward (`mpress.runtime.data_parallel`), so every replica
holds the same gradients and the pipeline's norm is the global one (summing over the
replicas too would count each gradient dp times).

Gradients are on their parameters (`param.grad`, on the device) until the optimizer step
takes them -- also for stages whose step runs on the host or whose optimizer data is
offloaded (`MasterWeights` copies them in at its step) -- so clipping them here clips
what every optimizer path steps.

A non-finite norm (an inf or nan gradient anywhere in the pipeline) is the same on every
rank, so every rank skips the same step: `StepGuard` counts consecutive skips and stops
the run after `max_skipped` of them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mpress.errors import UserError

CLIP_EPS = 1e-6
"""Added to the norm before dividing (torch's `clip_grad_norm_`)."""


def local_sum_of_squares(params: Iterable[torch.Tensor], device: torch.device, *,
                         skip: Collection[int] = ()) -> torch.Tensor:
    """Sum over `params`' gradients of their squared 2-norms, each norm taken in fp32
    (`torch.linalg.vector_norm(..., dtype=float32)`, which upcasts inside the reduction:
    no gradient-sized temporary, so clipping takes no device memory the plan did not
    count), as a 1-element fp32 tensor on `device`; parameters without a gradient, or
    whose id is in `skip`, add 0."""
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for p in params:
        if p.grad is None or id(p) in skip:
            continue
        norm = torch.linalg.vector_norm(p.grad.detach(), 2, dtype=torch.float32)
        total += norm * norm
    return total


def global_grad_norm(params: Iterable[torch.Tensor], device: torch.device, *,
                     group: dist.ProcessGroup | None = None, skip: Collection[int] = ()) -> torch.Tensor:
    """The 2-norm of every gradient of the pipeline (fp32 scalar tensor on `device`): this
    rank's sum of squares, summed over `group` (None: the default group; no reduction
    where torch.distributed is not initialized)."""
    total = local_sum_of_squares(params, device, skip=skip)
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return torch.sqrt(total[0])


def clip_by_norm(params: Iterable[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient of `params` in place by `min(1, max_norm / (norm + 1e-6))`,
    as `torch.nn.utils.clip_grad_norm_` does with the norm it computed."""
    coef = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.device))


@dataclass
class StepGuard:
    """Counts optimizer steps skipped for a non-finite gradient norm.

    max_skipped: consecutive skips after which `check` stops the run (a `UserError`)."""

    max_skipped: int
    skipped_total: int = 0
    """Steps skipped in this run."""
    consecutive: int = 0
    """Skips since the last step taken."""
    skipped_steps: list[int] = field(default_factory=list)
    """The indices of the skipped steps."""

    def check(self, step: int, norm: float) -> bool:
        """Whether step `step` (0-based) may run given its global gradient norm; a
        non-finite norm is counted as a skip, and the `max_skipped`-th in a row raises
        `UserError` naming the step."""
        if math.isfinite(norm):
            self.consecutive = 0
            return True
        self.skipped_total += 1
        self.consecutive += 1
        self.skipped_steps.append(step)
        if self.consecutive >= self.max_skipped:
            raise UserError(f"step {step}: the gradient norm is {norm}, {self.consecutive} steps in a row "
                            f"(steps {', '.join(map(str, self.skipped_steps[-self.consecutive:]))} skipped); "
                            f"stopping (lower optimizer.lr, or raise optimizer.max_skipped_steps)")
        return False


__all__ = ["CLIP_EPS", "StepGuard", "clip_by_norm", "global_grad_norm", "local_sum_of_squares"]
