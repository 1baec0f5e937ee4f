"""Live intervals of activations, read off an emulated iteration.

A layer's saved activations of microbatch m are produced when the layer's forward ends
and needed when its backward starts; in between they only take memory. That gap, the
live interval, decides whether a swap can hide: a round trip shorter than it costs
nothing. The emulator runs a stage's forward (backward) as one task, so layer times are
placed inside it in proportion: layer j's forward ends after the forwards of layers
0..j, its backward starts after the backwards of the layers after j.
Units: seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpress.contract.actions import Kind
from mpress.static.emulate.emulator import EmulatorResult
from mpress.static.memory.stage_costs import StageCosts


@dataclass(frozen=True)
class StageTimes:
    """When each microbatch's forward ended and backward started on one stage."""

    forward_start_s: tuple[float, ...]
    forward_end_s: tuple[float, ...]
    backward_start_s: tuple[float, ...]
    backward_end_s: tuple[float, ...]


def stage_times(result: EmulatorResult, num_stages: int, num_microbatches: int) -> list[StageTimes]:
    """Per stage, F/B start and end times of every microbatch in an emulated iteration."""
    nan = float("nan")
    table = {k: [[nan] * num_microbatches for _ in range(num_stages)] for k in ("fs", "fe", "bs", "be")}
    for r, tasks in enumerate(result.program.ranks):
        for t, start, end in zip(tasks, result.task_start_s[r], result.task_end_s[r]):
            a = t.action
            if a.kind is Kind.F and a.microbatch is not None:
                table["fs"][a.stage][a.microbatch] = start
                table["fe"][a.stage][a.microbatch] = end
            elif a.kind in (Kind.B, Kind.I) and a.microbatch is not None:  # an I starts a split backward
                table["bs"][a.stage][a.microbatch] = start
                table["be"][a.stage][a.microbatch] = end
    return [StageTimes(tuple(table["fs"][s]), tuple(table["fe"][s]), tuple(table["bs"][s]), tuple(table["be"][s]))
            for s in range(num_stages)]


def layer_live_intervals(times: StageTimes, costs: StageCosts) -> list[list[float]]:
    """[layer within stage][microbatch] -> seconds between the layer's forward end and
    its backward start."""
    fwd = [x.forward_time_s for x in costs.layers]
    bwd = [x.backward_time_s for x in costs.layers]
    out = []
    done_fwd = 0.0
    for j in range(len(costs.layers)):
        done_fwd += fwd[j]
        later_bwd = sum(bwd[j + 1:])
        out.append([
            (bs + later_bwd) - (fs + done_fwd)
            for fs, bs in zip(times.forward_start_s, times.backward_start_s)
        ])
    return out
