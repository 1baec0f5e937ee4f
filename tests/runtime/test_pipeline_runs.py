"""Multi-process pipelines on CPU (gloo): runs under an mpress plan must equal the plain
run bit for bit (`torch.equal` on every parameter and loss), dropout on."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mpress.errors import PlanError
from mpress.config.model_config import load_model_config
from mpress.config.vocabulary import SPLIT_BACKWARD_SCHEDULES
from mpress.contract.actions import stage_to_rank
from mpress.contract.plan import Plan, Stripe, TensorRule
from mpress.launcher.job import start_job
from mpress.runtime.trainer import JobSpec, PipelineJob
from tests.support.compare import assert_identical
from tests.support.jobs import run_steps
from tests.support.plans import op_level_recompute, pipeline_plan
from tests.support.spawn import spawn
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES, STEPS, batch, num_stages_of


def _job_worker(rank: int, world: int, plan_paths: list[str | None], schedule: str, num_microbatches: int):
    """Runs one job per plan (None = plain pipelining), one after the other, on one group."""
    spec = JobSpec(model=load_model_config(MODEL), schedule=schedule, ranges=RANGES[num_stages_of(schedule, world)],
                   microbatch_size=MICROBATCH_SIZE, num_microbatches=num_microbatches, seed=3)
    for plan_path in plan_paths:
        torch.manual_seed(7 + rank)  # dropout draws: per rank, the same in every run
        plan = Plan.load(plan_path) if plan_path else None
        job = start_job(spec, plan, torch.device("cpu"))  # with the peer pools a D2D plan needs
        yield run_steps(job, plan, lambda step: batch(step, num_microbatches), STEPS)
        job.close()


def run_jobs(world: int, schedule: str, num_microbatches: int, plans: list[Plan | None]) -> list[list[dict]]:
    """Per plan, per rank: losses, final state and counters, from one spawn of `world` processes."""
    spawned = spawn(_job_worker, world, plans, schedule, num_microbatches)
    assert not spawned.errors, spawned.errors
    return spawned.results


def run_job(world: int, schedule: str, num_microbatches: int, plan: Plan | None) -> list[dict]:
    return run_jobs(world, schedule, num_microbatches, [plan])[0]


_BASELINES: dict[tuple[int, str, int], list[dict]] = {}


def baseline(world: int, schedule: str, num_microbatches: int) -> list[dict]:
    key = (world, schedule, num_microbatches)
    if key not in _BASELINES:
        _BASELINES[key] = run_job(world, schedule, num_microbatches, None)
    return _BASELINES[key]


HOST = TensorRule(tensor="layers.*.**", technique="host")
RECOMPUTE_BLOCK = TensorRule(tensor="layers.0.**", technique="recompute")


@pytest.mark.slow
@pytest.mark.parametrize("world, schedule, rules", [
    (2, "1f1b", {0: [TensorRule(tensor="layers.0.**", technique="recompute"),
                     TensorRule(tensor="layers.1.**", technique="host")],
                 1: [TensorRule(tensor="layers.2.**", technique="host", microbatches="0-1"),
                     TensorRule(tensor="layers.2.**", technique="recompute", microbatches="2-3"),
                     TensorRule(tensor="head.**", technique="recompute")]}),
    (2, "gpipe", {0: [TensorRule(tensor="embed.**", technique="host"),
                      TensorRule(tensor="layers.*.**", technique="recompute")],
                  1: [TensorRule(tensor="*", technique="host")]}),
    (2, "interleaved", {0: [TensorRule(tensor="optim:*", technique="host"),
                            TensorRule(tensor="embed.**", technique="host")],
                        1: [TensorRule(tensor="layers.1.**", technique="recompute")],
                        2: [TensorRule(tensor="layers.2.**", technique="host", microbatches="0,3")],
                        3: [TensorRule(tensor="head.**", technique="recompute")]}),
    (4, "1f1b", {0: [TensorRule(tensor="optim:*", technique="host"), TensorRule(tensor="layers.0.**", technique="host")],
                 1: [TensorRule(tensor="layers.1.**", technique="recompute")],
                 2: [TensorRule(tensor="layers.2.**", technique="host", microbatches="1,3")],
                 3: [TensorRule(tensor="optim:*", technique="host"), TensorRule(tensor="head.**", technique="host")]}),
])
def test_mixed_plans_are_bit_identical_to_the_plain_run(world, schedule, rules):
    plain = baseline(world, schedule, 4)
    plan = pipeline_plan(schedule, world, 4, rules)
    mixed = run_job(world, schedule, 4, plan)
    assert_identical(plain, mixed)
    assert all(loss is not None for loss in mixed[-1]["losses"])
    swapped = sum(r["extra"]["swapped"] for r in mixed)
    recomputed = sum(r["extra"]["recomputed"] for r in mixed)
    assert swapped > 0 and recomputed > 0
    assert_ran_as_planned(plan, mixed)


def assert_ran_as_planned(plan: Plan, ranks: list[dict]) -> None:
    """Every rank executed its planned action list, and its device's measured peak (every
    byte, over the steps) is at most the predicted peak and at least 90% of it."""
    for r, result in enumerate(ranks):
        assert result["extra"]["log"] == plan.actions[r], f"rank {r} did not run its program"
        predicted = plan.stages[r].predicted_peak_bytes  # stage r runs on device r
        measured, during = max(result["peaks"])
        assert measured <= predicted, f"rank {r}: measured {measured} > predicted {predicted} (during {during})"
        assert measured >= 0.9 * predicted, f"rank {r}: measured {measured} < 90% of predicted {predicted}"


def test_plan_for_another_model_is_refused():
    plan = pipeline_plan("1f1b", 1, 2, {})
    bad = Plan(**{**plan.__dict__, "model_fingerprint": "0" * 16})
    from mpress.contract.plan_check import Shape, check_plan
    # what wrap_stage and PipelineJob give the one plan check
    with pytest.raises(PlanError, match="made for model 'gpt-tiny', not this one"):
        check_plan(bad, model_fingerprint=load_model_config(MODEL).fingerprint(), runtime=True)
    with pytest.raises(PlanError, match="made for 1f1b, 1 stages, 2 x 2 microbatches; this pipeline is 1f1b, 2 stages"):
        check_plan(plan, shape=Shape("1f1b", 2, 2, MICROBATCH_SIZE), runtime=True)
    with pytest.raises(PlanError, match="made for 1 ranks, this job has 4"):
        check_plan(plan, world_size=4, runtime=True)
    with pytest.raises(PlanError, match="stage 0 holds layers 0..5 in the plan, the stage module holds 2 layers"):
        check_plan(plan, stage_layers={0: ["embed", "layers.0"]}, runtime=True)


LAYERS = {
    2: {0: ["embed", "layers.0", "layers.1"], 1: ["layers.2", "layers.3", "head"]},
    4: {0: ["embed", "layers.0"], 1: ["layers.1"], 2: ["layers.2"], 3: ["layers.3", "head"]},
}
"""Layers of each stage, by number of stages (`tiny_pipeline.RANGES`)."""
PLANS_PER_SCHEDULE = 8
"""Random plans per schedule, each run against the plain run in one spawn."""
MIXED_MICROBATCHES = 4


def mixed_plan(rng: random.Random, schedule: str, world: int) -> Plan:
    """Per stage: one to three random layers, each with a technique (keep, recompute, host
    swap, D2D swap striped to the next rank's device, and op-level recompute where the
    schedule allows it) for a random set of microbatches, and optimizer offload (all
    layers or one, to the host or the next device) or not. The peer pools are the
    program's (`plan_from_rules` sizes them from its D2D slots). Drawn from a seeded
    `random.Random`: every plan differs, and a failure replays."""
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
        if stage == 0 or schedule not in SPLIT_BACKWARD_SCHEDULES:  # (see router: a split backward replays)
            techniques.append("op-level")
        for layer in rng.sample(layers, rng.randint(1, min(3, len(layers)))):
            mbs = rng.sample(range(MIXED_MICROBATCHES), rng.randint(1, MIXED_MICROBATCHES))
            selector = ",".join(map(str, sorted(mbs)))
            technique = rng.choice(techniques)
            if technique == "op-level":  # part of the layer recomputed: one of its profile's choices
                stage_rules += op_level_recompute(layer, rng.randint(0, 3), selector)
                continue
            stage_rules.append(TensorRule(tensor=f"{layer}.**", technique=technique, microbatches=selector,
                                          stripes=stripes if technique == "d2d" else []))
        rules[stage] = stage_rules
    return pipeline_plan(schedule, world, MIXED_MICROBATCHES, rules)


def _run_mixed(schedule: str, world: int, count: int) -> None:
    """`count` random plans: each bit-identical to the plain run, its program executed as
    listed on every rank, and each rank's measured peak (every byte) within [90%, 100%]
    of the emulator's prediction for the same program."""
    rng = random.Random(f"{schedule}/{world}")
    plans = [mixed_plan(rng, schedule, world) for _ in range(count)]
    assert len({tuple(p.actions) for p in plans}) == count  # drawn, not one plan repeated
    results = run_jobs(world, schedule, MIXED_MICROBATCHES, [None, *plans])
    for plan, result in zip(plans, results[1:]):
        assert_identical(results[0], result)
        assert_ran_as_planned(plan, result)
    assert sum(r["extra"]["swapped"] for result in results[1:] for r in result) > 0
    assert sum(r["extra"]["recomputed"] for result in results[1:] for r in result) > 0


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
def test_random_plans_run_as_planned_within_their_predicted_memory(schedule):
    _run_mixed(schedule, 2, PLANS_PER_SCHEDULE)


@pytest.mark.parametrize("option", [0, 1, 2])
def test_op_level_recompute_of_every_layer_is_bit_identical_and_within_its_predicted_memory(option):
    """Every layer of both stages recomputes one of its profile's op-level choices in
    every microbatch (dropout on): bit-identical to the plain run, the program run as
    listed, each rank's measured peak within [90%, 100%] of the prediction."""
    plan = pipeline_plan("1f1b", 2, 4, {s: [r for layer in layers for r in op_level_recompute(layer, option)]
                                        for s, layers in LAYERS[2].items()})
    assert any(r.technique == "keep" for sp in plan.stages for r in sp.rules)  # part of layers, not all
    plain, ran = run_jobs(2, "1f1b", 4, [None, plan])
    assert_identical(plain, ran)
    assert_ran_as_planned(plan, ran)
    assert sum(r["extra"]["recomputed"] for r in ran) == 6 * 4 * STEPS


@pytest.mark.slow
def test_random_plans_on_four_ranks_run_as_planned():
    """The same on 4 ranks (1F1B, one layer or two per stage)."""
    _run_mixed("1f1b", 4, 5)


def _faulty_worker(rank: int, world: int, plan_paths: list[str | None]):
    """Rank 0's swap-in worker thread fails on microbatch 2; every rank must end with an
    error, none may hang."""
    message = "finished without error"
    try:
        spec = JobSpec(model=load_model_config(MODEL), schedule="1f1b", ranges=RANGES[world],
                       microbatch_size=MICROBATCH_SIZE, num_microbatches=4, seed=3)
        job = PipelineJob(spec, Plan.load(plan_paths[0]), torch.device("cpu"))
        if rank == 0:
            def fault(key, direction):
                if direction == "in" and key.microbatch == 2:
                    raise OSError("injected copy failure")
            job.stage.runtime.engine._fault = fault  # the engine's test hook
        x, y = batch(0, 4)
        job.step(x, y)
    except Exception as exc:  # what the launcher prints, in one line
        from mpress.launcher.control import root_cause
        message = root_cause(exc)
    yield message


@pytest.mark.slow
def test_a_failing_swap_worker_stops_every_rank_with_the_tensor_named():
    plan = pipeline_plan("1f1b", 2, 4, {0: [TensorRule(tensor="layers.1.**", technique="host")]})
    spawned = spawn(_faulty_worker, 2, [plan])
    assert not spawned.errors, spawned.errors
    messages, elapsed = spawned.results[0], spawned.elapsed_s
    # the failed swap is named by its unit (layer 1's tensors under rule 0) and its tensors
    assert messages[0].startswith("SwapError: swap-in failed: rank 0 stage 0 microbatch 2 tensor 0:layers.1.**@r0 "
                                  "(tensors layers.1."), messages
    assert "injected copy failure" in messages[0]
    assert messages[1] != "finished without error"  # the peer notices instead of waiting forever
    assert elapsed < 120


def test_plan_for_another_schedule_or_microbatching_is_refused():
    from mpress.contract.plan_check import Shape, check_plan
    shape = Shape("1f1b", 2, 4, 2)  # what a 1F1B job of 2 stages, 4 microbatches of 2 gives the check
    check_plan(pipeline_plan("1f1b", 2, 4, {}), shape=shape, runtime=True)
    with pytest.raises(PlanError, match="made for gpipe, 2 stages, 4 x 2 microbatches; this pipeline is 1f1b"):
        check_plan(pipeline_plan("gpipe", 2, 4, {}), shape=shape, runtime=True)
    with pytest.raises(PlanError, match="8 x 2 microbatches"):
        check_plan(pipeline_plan("1f1b", 2, 8, {}), shape=shape, runtime=True)
    pipedream = dataclasses.replace(pipeline_plan("1f1b", 2, 4, {}), schedule="pipedream")
    check_plan(pipedream, shape=shape, runtime=True)  # torch runs PipeDream's order as 1F1B
    stash = pipeline_plan("1f1b", 2, 4, {0: [TensorRule(tensor="stash:*", technique="host")]})
    with pytest.raises(PlanError, match=r"stage 0 rule 0 \(stash:\*\) moves stashed weight versions"):
        check_plan(stash, shape=shape, runtime=True)
