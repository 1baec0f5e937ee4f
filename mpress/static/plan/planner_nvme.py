"""The planner's drive step: optimizer data to the local drive when host memory is the bound.

MPress sends a stage's optimizer data (Adam states and fp32 masters) to the pinned pool
when its device overflows (`planner.shed`); on a big model the pinned pools together can
then need more than the server may pin, and the plan does not fit although every device
does. Where the server states a local drive (`Hardware.has_nvme`), this step moves that
data from the pinned pool to the drive (`nvme` rules: `mpress/runtime/swap/nvme.py`),
the stages with the most of it first, one stage at a time, each move emulated (the
drive's bandwidth costs its copies: `channels.drive_transfers`), until the pins fit.
It moves nothing the drive cannot hold (`Hardware.nvme_bytes`, less what is already
there), nothing while the pins fit (host memory is faster than any drive), and no stage
whose move would not lower the pins: each stage on the drive pins its store's staging
buffers (`mpress.contract.plan_check.NVME_STAGING_BYTES` each way), more than a small
stage's share of the pool.

Optimizer data the search kept on a device stays there: the drive frees host memory,
the device's overflow is the search's to solve.
"""

from __future__ import annotations

from mpress.config.vocabulary import Strategy, Technique
from mpress.static.plan.evaluate import Evaluation
from mpress.static.plan.plan_draft import Draft
from mpress.static.plan.planner_layer_data import plan_pinned_bytes


def drive_bytes(planner, d: Draft) -> int:
    """Optimizer data draft `d` keeps on the drive, bytes."""
    return sum(c.optimizer_data_bytes for s, c in enumerate(planner.costs) if d.optim[s] is Technique.NVME)


def optimizer_to_drive(planner, d: Draft, ev: Evaluation) -> tuple[Draft, Evaluation]:
    """`d` (emulated as `ev`) with stages' optimizer data moved from the pinned pool to
    the drive while its pins exceed what the server may pin (see the module docstring);
    `d` itself when there is no drive, nothing to move, or the planner is not mpress or
    not allowed the drive (`PlannerOptions.drive`). Returns the draft and its emulation;
    `Draft.drive_full` says whether the drive's capacity stopped it."""
    hw = planner.hw
    if planner.strategy is not Strategy.MPRESS or not planner.options.drive or not hw.has_nvme:
        return d, ev
    pins = _pinned(planner, d, ev)
    if pins <= hw.pinnable_bytes:
        return d, ev
    room = hw.nvme_bytes - drive_bytes(planner, d)
    order = sorted((s for s in range(len(planner.costs)) if d.optim[s] is Technique.HOST and not d.host_step[s]),
                   key=lambda s: -planner.costs[s].optimizer_data_bytes)
    moved, best = d.copy(), ev
    for s in order:
        nbytes = planner.costs[s].optimizer_data_bytes
        if nbytes > room:
            moved.drive_full = True
            continue
        trial = moved.copy()
        trial.optim[s] = Technique.NVME
        trial_ev = planner.evaluate(trial)
        trial_pins = _pinned(planner, trial, trial_ev)
        if trial_pins >= pins:  # the drive's staging buffers pin more than the stage's pool gave back
            continue
        moved, best, pins = trial, trial_ev, trial_pins
        room -= nbytes
        planner.progress(f"{planner.strategy}: stage {s}'s optimizer data to the drive, iteration "
                         f"{best.result.iteration_s:.3f} s")
        if pins <= hw.pinnable_bytes:
            break
    return moved, best


def _pinned(planner, d: Draft, ev: Evaluation) -> int:
    """Host memory the plan of draft `d` (emulated as `ev`) pins: pools, host steps' slabs
    and drive staging buffers."""
    return plan_pinned_bytes(planner.writer.to_plan(d, ev), planner.costs)
