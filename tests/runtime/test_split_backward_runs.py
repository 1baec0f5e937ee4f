"""The schedules torch added after interleaved 1F1B, on CPU ranks under random mixed
plans: zero bubble (ZB-H1, torch's `ScheduleInterleavedZeroBubble` with one stage per
rank), ZB-V, DualPipeV (backwards split into an input-gradient half I and a
weight-gradient half W) and looped BFS. Each plan's run must equal plain torch
pipelining with the same schedule bit for bit (`torch.equal` on every parameter, optimizer
state and loss, dropout on), execute its program as listed on every rank, and measure
within [90%, 100%] of its predicted peak (`test_a_split_backward_measures_within_its_predicted_peak`)."""

from __future__ import annotations

import random

import pytest
import torch

from mpress.config.vocabulary import SPLIT_BACKWARD_SCHEDULES
from mpress.contract.actions import Kind, parse_actions
from mpress.contract.plan import Plan
from mpress.errors import PlanError
from tests.runtime.test_pipeline_runs import MIXED_MICROBATCHES as MICROBATCHES
from tests.runtime.test_pipeline_runs import assert_ran_as_planned, mixed_plan, run_jobs
from tests.support.compare import assert_identical
from tests.support.plans import one_line, op_level_recompute, pipeline_plan
from tests.support.spawn import spawn

PLANS = 5
"""Random plans per schedule, each run against the plain run in one spawn."""


V_NEEDS = pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 12),
    reason="torch 2.11's schedules send a V's turning stage's shapes to the rank itself at start-up (its stages "
           "R-1 and R share rank R-1), which gloo refuses: plain torch fails the same way")


@pytest.mark.slow
@pytest.mark.parametrize("schedule, world", [
    ("interleaved-zb", 2), pytest.param("zbv", 2, marks=V_NEEDS), pytest.param("dualpipev", 2, marks=V_NEEDS),
    ("looped-bfs", 2), ("interleaved-zb", 4)])
def test_random_mixed_plans_match_plain_torch_and_run_their_program(schedule, world):
    rng = random.Random(f"{schedule}/{world}")
    plans = [mixed_plan(rng, schedule, world) for _ in range(PLANS)]
    kinds = {a.kind for p in plans for r in p.actions for a in parse_actions(r)}
    assert {Kind.SO, Kind.DO, Kind.DR} <= kinds  # every technique is among the plans' programs
    if schedule in SPLIT_BACKWARD_SCHEDULES:
        assert {Kind.I, Kind.W} <= kinds
    results = run_jobs(world, schedule, MICROBATCHES, [None, *plans])
    for plan, result in zip(plans, results[1:]):
        assert_identical(results[0], result)
        if schedule in SPLIT_BACKWARD_SCHEDULES:  # the peaks: see the test below
            assert all(r["extra"]["log"] == plan.actions[k] for k, r in enumerate(result))
        else:
            assert_ran_as_planned(plan, result)
    assert sum(r["extra"]["swapped"] for result in results[1:] for r in result) > 0
    assert sum(r["extra"]["recomputed"] for result in results[1:] for r in result) > 0


@pytest.mark.slow
@pytest.mark.parametrize("schedule, world", [
    ("interleaved-zb", 2), pytest.param("zbv", 2, marks=V_NEEDS), pytest.param("dualpipev", 2, marks=V_NEEDS),
    ("interleaved-zb", 4)])
def test_a_split_backward_measures_within_its_predicted_peak(schedule, world):
    """A stage's I holds everything its forward kept until the whole stage's I ends (one
    pass of the engine over the stage's graph), on top of what each layer's I makes: the
    memory model composes it so (`stage_memory.split_backward_steps`)."""
    plan = pipeline_plan(schedule, world, MICROBATCHES, {})
    assert_ran_as_planned(plan, run_jobs(world, schedule, MICROBATCHES, [plan])[0])


def test_partial_recompute_under_a_split_backward_is_refused_in_one_line():
    """torch's selective checkpoint serves each cached output once, and a split backward
    replays a recomputed layer in its I and again in its W: a plan recomputing part of a
    layer there is refused when the stage is wrapped (the first stage runs its whole
    backward in its I, so it may)."""
    plan = pipeline_plan("zbv", 1, MICROBATCHES, {1: op_level_recompute("layers.2", 0)})
    spawned = spawn(_wrap_worker, 1, [plan])
    assert not spawned.errors, spawned.errors
    assert spawned.results[0][0] == ("PlanError: stage 1 microbatch 0 layer layers.2: the plan recomputes part of "
                                     "the layer, which a split backward (I and W) cannot run: recompute it whole")


def _wrap_worker(rank: int, world: int, plan_paths: list[str]):
    """Builds the job of a plan: its refusal, in one line."""
    from mpress.config.model_config import load_model_config
    from mpress.runtime.trainer import JobSpec, PipelineJob
    from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES
    plan = Plan.load(plan_paths[0])
    spec = JobSpec(model=load_model_config(MODEL), schedule=plan.schedule, ranges=RANGES[plan.num_stages],
                   microbatch_size=MICROBATCH_SIZE, num_microbatches=MICROBATCHES, seed=3)
    try:
        PipelineJob(spec, plan, torch.device("cpu"))
    except PlanError as exc:
        yield f"PlanError: {one_line(exc)}"
