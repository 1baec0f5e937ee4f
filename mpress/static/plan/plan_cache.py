"""What one planning run has already worked out, so that it is worked out once.

The planner emulates a draft after each step, and its strategies and seeds often arrive
at the same draft: every strategy starts from the uncompacted pipeline, a fit round that
sheds nothing leaves the draft as it was, and the D2D-only strategy asks the device
mapper the same question each round. A `PlanCache` is made for one `PipelineSetup` and
handed to every strategy planned on it (`plan_strategy(..., cache=)`); it answers a plan
it has emulated before, and a mapping problem it has solved before, from memory.

A plan is known by everything it says but the strategy that wrote it (the emulation does
not read that); the evaluation is the one object `evaluate_plan` returned (frozen, read
only). A mapping problem is a frozen dataclass: it is its own key.
"""

from __future__ import annotations

from dataclasses import fields

from mpress.contract.plan import Plan
from mpress.d2d.static.mapper import MapperResult, map_devices
from mpress.d2d.static.mapping import MappingProblem
from mpress.static.plan.evaluate import Evaluation, PipelineSetup
from mpress.static.plan.plan_eval import evaluate_plan


class PlanCache:
    """Evaluations and device mappings of one pipeline setup, by plan and by problem."""

    def __init__(self, setup: PipelineSetup) -> None:
        self.setup = setup
        self._evaluations: dict[tuple[str, ...], Evaluation] = {}
        self._mappings: dict[tuple[MappingProblem, float | None], MapperResult] = {}
        self.hits = 0
        """Answers given from memory (for tests and benchmarks)."""

    def evaluate(self, setup: PipelineSetup, plan: Plan) -> Evaluation:
        """`evaluate_plan(setup, plan)`, emulated once per plan; `setup` must be the cache's."""
        if setup is not self.setup:
            return evaluate_plan(setup, plan)
        key = tuple(repr(getattr(plan, f.name)) for f in fields(plan) if f.name != "strategy")
        found = self._evaluations.get(key)
        if found is None:
            found = self._evaluations[key] = evaluate_plan(setup, plan)
        else:
            self.hits += 1
        return found

    def map_devices(self, problem: MappingProblem, *, work_budget: int) -> MapperResult:
        """`mapper.map_devices(problem, work_budget=...)`, solved once per problem."""
        key = (problem, work_budget)
        found = self._mappings.get(key)
        if found is None:
            found = self._mappings[key] = map_devices(problem, work_budget=work_budget)
        else:
            self.hits += 1
        return found
