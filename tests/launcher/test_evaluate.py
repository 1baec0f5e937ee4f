"""Validation through the pipeline (`mpress.launcher.evaluate`): on 2 CPU ranks under a
plan that offloads optimizer states and recomputes layers, after a training step, the
forward-only validation loss equals a plain forward of the same model (the stages'
parameters put together in one module) on the same batches, and evaluating leaves the
training that follows unchanged."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpress.config.model_config import load_model_config
from mpress.contract.plan import Plan, TensorRule
from mpress.errors import UserError
from mpress.launcher.evaluate import EvalResult, eval_batch_count, evaluate
from mpress.launcher.job import start_job
from mpress.models import build_stage, lm_loss
from mpress.runtime.data import batches
from mpress.runtime.text.packing import TextWindows
from mpress.runtime.trainer import JobSpec
from tests.support.plans import pipeline_plan
from tests.support.spawn import spawn
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES, batch

NUM_MICROBATCHES = 2
EVAL_BATCHES = 3


def held_out() -> TextWindows:
    """A fixed 'validation set': windows over a seeded random token stream."""
    cfg = load_model_config(MODEL)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, 2000).astype(np.uint16)
    return TextWindows(tokens, cfg.seq_len)


def _worker(rank: int, world: int, plan_paths: list[str | None], evaluate_between: list[bool]):
    spec = JobSpec(model=load_model_config(MODEL), schedule="1f1b", ranges=RANGES[world],
                   microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES, seed=3)
    val = held_out()
    for plan_path, between in zip(plan_paths, evaluate_between):
        torch.manual_seed(7 + rank)
        plan = Plan.load(plan_path) if plan_path else None
        job = start_job(spec, plan, torch.device("cpu"))
        first = job.step(*batch(0, NUM_MICROBATCHES))
        result = None
        if between:
            result = evaluate(job, val, microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES,
                              num_batches=EVAL_BATCHES)
        second = job.step(*batch(1, NUM_MICROBATCHES))
        params = {name: p.detach().clone() for m in job.modules for name, p in m.named_parameters()}
        yield {"eval": result, "losses": (first.loss, second.loss), "params_after_eval": params}
        job.close()


def plain_forward_loss(params_by_rank: list[dict]) -> float:
    """The mean microbatch loss of the whole model (one module) over the eval batches."""
    cfg = load_model_config(MODEL)
    model = build_stage(cfg, 0, RANGES[1][0][1], seed=3, device=torch.device("cpu"))
    merged = {k: v for params in params_by_rank for k, v in params.items()}
    model.load_state_dict(merged, strict=False)
    assert set(merged) == {n for n, _ in model.named_parameters()}
    model.eval()
    val = held_out()
    losses = []
    with torch.no_grad():
        for j in range(EVAL_BATCHES):
            x, y = batches(val, microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES, step=j)
            for xm, ym in zip(x.tensor_split(NUM_MICROBATCHES), y.tensor_split(NUM_MICROBATCHES)):
                losses.append(float(lm_loss(model(xm), ym)))
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_evaluating_between_steps_changes_no_training():
    rules = {0: [TensorRule(tensor="optim:*", technique="host"), TensorRule(tensor="layers.0.**",
                                                                            technique="recompute")],
             1: [TensorRule(tensor="layers.2.**", technique="recompute")]}
    plan = pipeline_plan("1f1b", 2, NUM_MICROBATCHES, rules)
    spawned = spawn(_worker, 2, [plan, plan], [True, False], timeout_s=300)
    assert not spawned.errors, spawned.errors
    with_eval, without = spawned.results
    results: list[EvalResult] = [r["eval"] for r in with_eval]
    assert results[0] == results[1]  # every rank gets the same figure
    # no dropout draw, no gradient, no optimizer state moved: the next step is the same
    assert [r["losses"] for r in with_eval] == [r["losses"] for r in without]
    for a, b in zip(with_eval, without):
        assert all(torch.equal(a["params_after_eval"][k], b["params_after_eval"][k]) for k in a["params_after_eval"])
    assert math.isfinite(results[0].loss) and results[0].num_batches == EVAL_BATCHES


def _eval_only_worker(rank: int, world: int, plan_paths: list[str | None], schedule: str):
    stages = 2 * world if schedule == "interleaved" else world
    spec = JobSpec(model=load_model_config(MODEL), schedule=schedule, ranges=RANGES[stages],
                   microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES, seed=3)
    plan = Plan.load(plan_paths[0]) if plan_paths[0] else None
    job = start_job(spec, plan, torch.device("cpu"))
    job.step(*batch(0, NUM_MICROBATCHES))
    result = evaluate(job, held_out(), microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES,
                      num_batches=EVAL_BATCHES)
    params = {name: p.detach().clone() for m in job.modules for name, p in m.named_parameters()}
    yield {"eval": result, "params": params, "training": [m.training for m in job.modules]}
    job.close()


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_pipeline_validation_equals_a_plain_forward_of_the_same_parameters(schedule):
    """Under 1F1B (a stage per rank) and interleaved 1F1B (two per rank: activations also
    pass within a rank), after a training step under a plan."""
    last = 1 if schedule == "1f1b" else 2
    rules = {0: [TensorRule(tensor="optim:*", technique="host"), TensorRule(tensor="layers.0.**",
                                                                            technique="recompute")],
             last: [TensorRule(tensor="layers.2.**", technique="recompute")]}
    plan = pipeline_plan(schedule, 2, NUM_MICROBATCHES, rules)
    spawned = spawn(_eval_only_worker, 2, [plan], schedule, timeout_s=300)
    assert not spawned.errors, spawned.errors
    ranks = spawned.results[0]
    expected = plain_forward_loss([r["params"] for r in ranks])
    assert ranks[0]["eval"].loss == ranks[1]["eval"].loss
    assert ranks[0]["eval"].loss == expected  # the same operators on the same tensors, in fp32
    assert ranks[0]["eval"].perplexity == pytest.approx(math.exp(expected), rel=1e-5)
    assert all(all(r["training"]) for r in ranks)  # back in training mode (dropout on)


def test_eval_batch_count_caps_at_the_held_out_set():
    val = held_out()  # (2000 - 1) // 32 = 62 windows
    assert eval_batch_count(val, batch_size=8, wanted=100) == 7
    assert eval_batch_count(val, batch_size=8, wanted=3) == 3
    with pytest.raises(UserError, match="holds 62 windows, fewer than one batch of 64.*raise val_fraction"):
        eval_batch_count(val, batch_size=64, wanted=1)
