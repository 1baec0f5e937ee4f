"""The tiny Llama (configs/train/llama-tiny-mixed.yaml) on 4 CPU ranks (gloo): its start-up
plan and a hand-mixed plan (activation host swaps and recompute per microbatch, optimizer
states on the host) train bit for bit as plain pipelining does (`torch.equal` on every
loss, parameter and optimizer state), each rank running its planned program within its
predicted peak."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mpress.launcher.job import start_job
from mpress.launcher.startup import plan_for
from mpress.contract.plan import Plan, StagePlan, TensorRule
from mpress.runtime.data import batches, build_dataset
from mpress.runtime.train_config import load_train_config, model_config
from mpress.runtime.trainer import JobSpec
from tests.runtime.test_pipeline_runs import assert_ran_as_planned
from tests.support.compare import assert_identical
from tests.support.jobs import run_steps
from tests.support.plans import with_program
from tests.support.spawn import spawn
from tests.support.tiny_pipeline import POOL_BYTES

CONFIG = "llama-tiny-mixed"
WORLD = 4
STEPS = 3


def _config(attention: str = "eager"):
    """The train config and its model, with `attention` (the preset's is eager)."""
    cfg = load_train_config(CONFIG)
    return cfg, dataclasses.replace(model_config(cfg), attention=attention)


def test_the_llama_config_plans_a_mix_under_its_budget():
    cfg, model = _config()
    assert model.family == "llama" and model.kv_heads < model.num_heads
    start = plan_for(cfg, model, WORLD, WORLD)
    plain = plan_for(dataclasses.replace(cfg, plan="none"), model, WORLD, WORLD)
    budget = cfg.device_memory_bytes
    assert all(peak > budget for peak in plain.predicted_peak_bytes), plain.predicted_peak_bytes
    assert start.plan is not None and start.plan.fits
    assert all(peak <= budget for peak in start.predicted_peak_bytes), start.predicted_peak_bytes
    techniques = {(r.tensor.split(":")[0] if ":" in r.tensor else "activation", r.technique)
                  for sp in start.plan.stages for r in sp.rules}
    assert ("optim", "host") in techniques and ("activation", "recompute") in techniques


def _hand_mixed(plan: Plan, model) -> Plan:
    """Activation host swaps and recompute, per layer and per microbatch, and optimizer
    offload, on every stage of the start-up plan's pipeline."""
    rules = {
        0: [TensorRule(tensor="optim:*", technique="host"), TensorRule(tensor="layers.0.**", technique="host")],
        1: [TensorRule(tensor="layers.1.**", technique="recompute", microbatches="0-3"),
            TensorRule(tensor="layers.1.**", technique="host", microbatches="4-7")],
        2: [TensorRule(tensor="layers.2.**", technique="host", microbatches="1,3,5"),
            TensorRule(tensor="layers.2.attn_norm", technique="recompute")],
        3: [TensorRule(tensor="optim:*", technique="host"), TensorRule(tensor="layers.3.**", technique="recompute"),
            TensorRule(tensor="head.**", technique="host")],
    }
    stages = [StagePlan(stage=sp.stage, device=sp.device, first_layer=sp.first_layer, end_layer=sp.end_layer,
                        rules=rules[sp.stage], pinned_host_bytes=POOL_BYTES) for sp in plan.stages]
    return with_program(dataclasses.replace(plan, strategy="test", stages=stages), model)


def _worker(rank: int, world: int, plan_paths: list[str | None], attention: str, ranges: list[tuple[int, int]],
            steps: int):
    """One job per plan (None = plain pipelining), one after the other, on the config's data."""
    cfg, model = _config(attention)
    spec = JobSpec(model=model, schedule=cfg.schedule, ranges=ranges, microbatch_size=cfg.microbatch_size,
                   num_microbatches=cfg.num_microbatches, seed=cfg.seed, lr=cfg.optimizer.lr)
    dataset = build_dataset(cfg.data, model, seed=cfg.seed)
    for plan_path in plan_paths:
        torch.manual_seed(7 + rank)
        plan = Plan.load(plan_path) if plan_path else None
        job = start_job(spec, plan, torch.device("cpu"))
        yield run_steps(job, plan, lambda step: batches(dataset, microbatch_size=cfg.microbatch_size,
                                                        num_microbatches=cfg.num_microbatches, step=step), steps)
        job.close()


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["eager", "sdpa"])  # they save different tensors
def test_llama_tiny_trains_on_4_ranks_under_mixed_plans_as_plain_pipelining(attention):
    cfg, model = _config(attention)
    start = plan_for(cfg, model, WORLD, WORLD)
    assert start.plan is not None
    hand = _hand_mixed(start.plan, model)
    spawned = spawn(_worker, WORLD, [None, start.plan, hand], attention, start.ranges, STEPS)
    assert not spawned.errors, spawned.errors
    plain, auto, mixed = spawned.results
    losses = plain[-1]["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    for plan, run in [(start.plan, auto), (hand, mixed)]:
        assert_identical(plain, run)
        assert sum(r["extra"]["recomputed"] for r in run) > 0
        assert [r["extra"]["log"] for r in run] == plan.actions  # every rank ran its program
    assert sum(r["extra"]["swapped"] for r in mixed) > 0  # activations went to the host and back
    assert_ran_as_planned(start.plan, auto)
    # measured peaks within [90%, 100%] of the predicted ones; under SDPA, host-swapping a
    # layer swaps SDPA's (B, heads, T, hd) output, which the output projection saves
    # again as another view of its storage: rebuilt over the fetched tensor, not kept
    assert_ran_as_planned(hand, mixed)
