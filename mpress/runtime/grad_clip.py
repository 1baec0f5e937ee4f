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
the run after `max_skipped` of them. A non-finite loss is skipped and counted the same
way, with or without clipping (`check_step`): under clipping the last stage's rank makes
its sum of squares nan, so the one reduction of the norm carries it (the step's norm reads
nan); without clipping one flag is reduced over the pipeline. With data-parallel replicas
the verdict is also reduced over the replicas (a loss is each replica's own), so every
replica skips alike. Only on a skip does a second reduction find which stages had a
non-finite loss or gradient, for the line that stops the run. The counts are part of the
job's state (`StepGuard.state_dict`), so a resumed run counts on as if uninterrupted.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
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
                     group: dist.ProcessGroup | None = None, skip: Collection[int] = (),
                     poisoned: bool = False) -> torch.Tensor:
    """The 2-norm of every gradient of the pipeline (fp32 scalar tensor on `device`): this
    rank's sum of squares, summed over `group` (None: the default group; no reduction
    where torch.distributed is not initialized). poisoned: this rank's sum is nan instead
    (its loss is not finite), so the norm is nan on every rank."""
    total = local_sum_of_squares(params, device, skip=skip)
    if poisoned:
        total.fill_(math.nan)
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
    """Counts optimizer steps skipped for a non-finite gradient norm or loss.

    max_skipped: consecutive skips after which a skip stops the run (a `UserError`)."""

    max_skipped: int
    skipped_total: int = 0
    """Steps skipped in this run (a resume carries them on)."""
    consecutive: int = 0
    """Skips since the last step taken."""
    skipped_steps: list[int] = field(default_factory=list)
    """The indices of the skipped steps."""

    def taken(self) -> None:
        """A step went ahead: the run of skips is over."""
        self.consecutive = 0

    def skip(self, step: int, what: str) -> None:
        """Count step `step` as skipped for `what` (a clause: "the loss is nan on stage
        3"); the `max_skipped`-th skip in a row raises `UserError` naming the step."""
        self.skipped_total += 1
        self.consecutive += 1
        self.skipped_steps.append(step)
        if self.consecutive >= self.max_skipped:
            raise UserError(f"step {step}: {what}, {self.consecutive} steps in a row "
                            f"(steps {', '.join(map(str, self.skipped_steps[-self.consecutive:]))} skipped); "
                            f"stopping (lower optimizer.lr, or raise optimizer.max_skipped_steps)")

    def state_dict(self) -> dict[str, object]:
        """The counts, for the job's checkpoint (`mpress.runtime.job_state`)."""
        return {"skipped_total": self.skipped_total, "consecutive": self.consecutive,
                "skipped_steps": list(self.skipped_steps)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.skipped_total = int(state["skipped_total"])  # type: ignore[call-overload]
        self.consecutive = int(state["consecutive"])  # type: ignore[call-overload]
        self.skipped_steps = [int(s) for s in state["skipped_steps"]]  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StepPlace:
    """Where the check of a step runs: this rank's stages and its process groups."""

    device: torch.device
    stage_ids: list[int]
    """This rank's stages."""
    num_stages: int
    group: dist.ProcessGroup | None = None
    """The pipeline's group (None: the default group)."""
    dp_group: dist.ProcessGroup | None = None
    """This rank's stage replicas, when the job runs several replicas of the pipeline."""


def check_step(guard: StepGuard, step: int, place: StepPlace, modules: Sequence[torch.nn.Module],
               losses: Sequence[torch.Tensor], *, max_norm: float | None,
               skip: Collection[int] = ()) -> tuple[float | None, bool]:
    """After the backward passes of step `step`: (the global gradient norm under clipping,
    else None; whether the step is skipped). The same on every rank of the job. Clips the
    gradients in place when the step goes ahead under clipping; counts a skip in `guard`
    (which raises after too many in a row). `modules`: this rank's stage modules, in
    `place.stage_ids` order; `losses`: the last stage's microbatch losses ([] elsewhere);
    skip: ids of parameters left out of the norm (tied copies)."""
    loss_bad = bool(losses) and not bool(torch.stack([x.detach() for x in losses]).isfinite().all())
    params = [p for m in modules for p in m.parameters()]
    norm_value: float | None = None
    with torch.profiler.record_function("mpress:check_step"):
        if max_norm:
            norm = global_grad_norm(params, place.device, group=place.group, skip=skip, poisoned=loss_bad)
            norm_value = float(norm)
            bad = not math.isfinite(norm_value)
        else:
            flag = torch.tensor([float(loss_bad)], device=place.device)
            if dist.is_initialized():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=place.group)
            bad = bool(flag[0])
        if place.dp_group is not None:
            verdict = torch.tensor([float(bad)], device=place.device)
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=place.dp_group)
            bad = bool(verdict[0])
        if not bad:
            guard.taken()
            if max_norm:
                clip_by_norm(params, norm, float(max_norm))
            return norm_value, False
        guard.skip(step, _what_went_wrong(place, modules, loss_bad, norm_value))
    return norm_value, True


def _what_went_wrong(place: StepPlace, modules: Sequence[torch.nn.Module], loss_bad: bool,
                     norm: float | None) -> str:
    """The clause naming the stages with a non-finite loss or gradient: one reduction of
    a flag per stage over the job, made only for a step that is skipped."""
    flags = torch.zeros(2, place.num_stages, device=place.device)
    for s, module in zip(place.stage_ids, modules):
        flags[0, s] = float(loss_bad and s == place.num_stages - 1)
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        flags[1, s] = float(not all(bool(torch.isfinite(g).all()) for g in grads))
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=place.group)
        if place.dp_group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=place.dp_group)
    lossy = [s for s in range(place.num_stages) if flags[0, s]]
    grads_bad = [s for s in range(place.num_stages) if flags[1, s]]
    parts = []
    if lossy:
        parts.append(f"the loss is not finite on stage {lossy[0]}")
    if norm is not None and not lossy:  # with a bad loss its rank made the norm nan itself
        parts.append(f"the gradient norm is {norm}")
    if grads_bad:
        parts.append(f"non-finite gradients on stage{'s' if len(grads_bad) > 1 else ''} "
                     f"{', '.join(map(str, grads_bad))}")
    return ", ".join(parts) if parts else "a non-finite value"


__all__ = ["CLIP_EPS", "StepGuard", "StepPlace", "check_step", "clip_by_norm", "global_grad_norm",
           "local_sum_of_squares"]
