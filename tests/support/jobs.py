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


def resumed(job, make: Callable[[], object], step: int):
    """`job` stopped before `step` and resumed as the launcher resumes: its state and the
    RNG saved, the job closed, a new one made by `make()` and loaded, its next step set
    (the learning rate's index) and the RNG restored. Returns the new job."""
    saved, rng = job.state(), torch.get_rng_state()
    job.close()
    job = make()
    job.load_state(saved)
    job.next_step = step
    del saved  # the loaded states may share its storages: gone, as in the launcher
    torch.set_rng_state(rng)
    return job
