"""The schedules torch added after interleaved 1F1B, on CPU ranks under random mixed
plans: zero bubble (ZB-H1, torch's `ScheduleInterleavedZeroBubble` with one stage per
rank), ZB-V, DualPipeV (backwards split into an input-gradient half I and a
weight-gradient half W) and looped BFS. Each plan's run must equal plain torch
pipelining with the same schedule bit for bit (`torch.equal` on every parameter, optimizer
state and loss, dropout on), execute its program as listed on every rank, and measure
within [90%, 100%] of its predicted peak (not yet met by the split backward: see
`test_a_split_backward_measures_within_its_predicted_peak`)."""

from __future__ import annotations

import random

import pytest
import torch

from mpress.config.vocabulary import SPLIT_BACKWARD_SCHEDULES
from mpress.contract.actions import Kind, parse_actions, stage_to_rank
from mpress.contract.plan import Plan, Stripe, TensorRule
from mpress.errors import PlanError
from tests.runtime.test_pipeline_runs import LAYERS, assert_ran_as_planned, run_jobs
from tests.support.compare import assert_identical
from tests.support.plans import one_line, op_level_recompute, pipeline_plan
from tests.support.spawn import spawn
from tests.support.tiny_pipeline import num_stages_of

MICROBATCHES = 4
PLANS = 5
"""Random plans per schedule, each run against the plain run in one spawn."""


def mixed_plan(rng: random.Random, schedule: str, world: int) -> Plan:
    """Per stage: up to three random layers, each with a technique (keep, recompute, host
    swap, D2D swap striped to the next rank's device, and op-level recompute where a
    split backward allows it) for a random set of microbatches, and optimizer offload (all
    layers or one, to the host or the next device) or not. The peer pools are the
    program's (`plan_from_rules` sizes them from its D2D slots)."""
    n = num_stages_of(schedule, world)
    ranks = stage_to_rank(schedule, n, world)
    rules: dict[int, list[TensorRule]] = {}
    for stage, layers in LAYERS[n].items():
        stripes = [Stripe(device=(ranks[stage] + 1) % world, fraction=1.0)]
        stage_rules = []
        optim = rng.choice(["none", "all", "one"])
        if optim != "none":
            where = rng.choice(["host", "d2d"])
            stage_rules.append(TensorRule(tensor=f"optim:{'*' if optim == 'all' else rng.choice(layers)}",
                                          technique=where, stripes=stripes if where == "d2d" else []))
        techniques = ["host", "recompute", "keep", "d2d"]
        if stage == 0 or schedule not in SPLIT_BACKWARD_SCHEDULES:  # see test_partial_recompute_...
            techniques.append("op-level")
        for layer in rng.sample(layers, rng.randint(1, min(3, len(layers)))):
            selector = ",".join(map(str, sorted(rng.sample(range(MICROBATCHES), rng.randint(1, MICROBATCHES)))))
            technique = rng.choice(techniques)
            if technique == "op-level":
                stage_rules += op_level_recompute(layer, rng.randint(0, 3), selector)
                continue
            stage_rules.append(TensorRule(tensor=f"{layer}.**", technique=technique, microbatches=selector,
                                          stripes=stripes if technique == "d2d" else []))
        rules[stage] = stage_rules
    return pipeline_plan(schedule, world, MICROBATCHES, rules)


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
@pytest.mark.xfail(strict=True, reason="the memory model composes a split backward from per-layer probes; a "
                   "stage's I holds 1-3% more than their sum at its peak (ZB-H1's last stage: 4459544 B measured, "
                   "4398100 B predicted)")
def test_a_split_backward_measures_within_its_predicted_peak():
    plan = pipeline_plan("interleaved-zb", 2, MICROBATCHES, {})
    assert_ran_as_planned(plan, run_jobs(2, "interleaved-zb", MICROBATCHES, [plan])[0])


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
