"""One job's run as the multi-process runtime tests record it, per rank."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mpress.contract.actions import format_actions
from mpress.contract.plan import Plan


def run_steps(job, plan: Plan | None, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
              steps: int) -> dict:
    """`steps` steps of `job` on `batch(step)`: losses, final state, peaks (every byte, and
    when), and under a plan what its routers did and the program's executed log."""
    losses, peaks = [], []
    for step in range(steps):
        result = job.step(*batch(step))
        losses.append(result.loss)
        peaks.append((result.peak_bytes, result.peak_context))
    extra = {}
    if plan is not None:
        extra = {"swapped": sum(rt.router.tensors_swapped for rt in job.runtimes),
                 "recomputed": sum(rt.router.layers_recomputed for rt in job.runtimes),
                 "log": format_actions(job.program.last_log)}
    return {"losses": losses, "state": job.state(), "extra": extra, "peaks": peaks}
