"""Schedule choice as part of the search (`mpress plan --schedule auto`): plan each
candidate schedule on the same ranks, model and batch, and take the fastest that fits
the memory budget.

Candidates, on R pipeline ranks (one per device by default): 1F1B (R stages), ZB-H1
(torch's interleaved zero bubble with one stage per rank), interleaved 1F1B and the two
V schedules, ZB-V and DualPipeV (2R stages, two per rank). A candidate the shape rules
out (DualPipeV needs M >= 2R microbatches; interleaved needs M to be a multiple of its
rounds; a model with fewer than 2R layers has no 2R stages) is skipped with its reason.
Each candidate is planned with the chosen strategy; the emulated iteration of its plan
decides, and every candidate's line says why it won or lost.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from mpress.config.units import fmt_bytes, fmt_seconds
from mpress.config.vocabulary import ScheduleName
from mpress.errors import MpressError
from mpress.static.plan.evaluate import PipelineSetup
from mpress.static.plan.planner import PlannerOptions, PlanResult, plan_strategy

CANDIDATES: tuple[tuple[str, ScheduleName, int], ...] = (
    ("1f1b", ScheduleName.ONE_F_ONE_B, 1),
    ("zb-h1", ScheduleName.INTERLEAVED_ZB, 1),
    ("interleaved", ScheduleName.INTERLEAVED, 2),
    ("zbv", ScheduleName.ZBV, 2),
    ("dualpipev", ScheduleName.DUALPIPEV, 2),
)
"""(label, schedule, stages per rank), in the order they are tried (ties go to the first)."""

SetupMaker = Callable[[ScheduleName, int, int], PipelineSetup]
"""(schedule, num_stages, num_ranks) -> the laid-out pipeline (raises `MpressError` for
a shape it cannot lay out)."""


@dataclass(frozen=True)
class Candidate:
    """One schedule tried: its plan, or why it could not be laid out."""

    label: str
    schedule: ScheduleName
    num_stages: int
    result: PlanResult | None
    error: str = ""

    @property
    def fits(self) -> bool:
        return self.result is not None and self.result.fits

    @property
    def iteration_s(self) -> float:
        return self.result.evaluation.result.iteration_s if self.fits else math.inf  # type: ignore[union-attr]


@dataclass(frozen=True)
class ScheduleChoice:
    """The candidates tried and the one chosen (None when none fits)."""

    candidates: tuple[Candidate, ...]
    chosen: Candidate | None

    def lines(self) -> list[str]:
        """One line per candidate: how fast it is and why it was or was not chosen."""
        best = self.chosen
        out = []
        for c in self.candidates:
            head = f"schedule {c.label} ({c.schedule}, {c.num_stages} stages)"
            if c.result is None:
                out.append(f"{head}: cannot be laid out: {c.error}")
                continue
            res = c.result.evaluation.result
            if not c.fits:
                out.append(f"{head}: does not fit: {c.result.reason}")
            elif c is best:
                out.append(f"{head}: chosen, the fastest that fits: iteration {fmt_seconds(res.iteration_s)}, "
                           f"peak {fmt_bytes(max(res.peak_bytes))}")
            else:
                out.append(f"{head}: fits, but iteration {fmt_seconds(res.iteration_s)} is "
                           f"{res.iteration_s / best.iteration_s:.2f}x the chosen one's")  # type: ignore[union-attr]
        if best is None:
            out.append("no candidate schedule fits the memory budget")
        return out


def choose_schedule(make_setup: SetupMaker, num_ranks: int, strategy: str,
                    options: PlannerOptions | None = None,
                    progress: Callable[[str], None] | None = None) -> ScheduleChoice:
    """Plan `strategy` under every candidate on `num_ranks` ranks; the fastest that fits."""
    tried: list[Candidate] = []
    for label, schedule, per_rank in CANDIDATES:
        stages = num_ranks * per_rank
        if progress:
            progress(f"schedule {label}: planning {strategy}")
        try:
            setup = make_setup(schedule, stages, num_ranks)
        except MpressError as e:
            tried.append(Candidate(label, schedule, stages, None, str(e)))
            continue
        tried.append(Candidate(label, schedule, stages, plan_strategy(setup, strategy, options)))
    fitting = [c for c in tried if c.fits]
    return ScheduleChoice(tuple(tried), min(fitting, key=lambda c: c.iteration_s) if fitting else None)
