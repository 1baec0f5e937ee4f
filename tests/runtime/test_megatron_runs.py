"""A `megatron-selective` plan, as the planner writes it, runs: gpt-tiny on 2 gloo ranks
(1F1B, dropout on), every block's attention core recomputed in every microbatch, equals
plain pipelining bit for bit and runs the program the plan lists."""

from __future__ import annotations

from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.planner import plan_strategy
from mpress.config.vocabulary import Strategy, Technique
from tests.runtime.test_pipeline_runs import assert_ran_as_planned, run_jobs
from tests.support.compare import assert_identical
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES, STEPS

NUM_MICROBATCHES = 4


def test_a_megatron_selective_plan_is_bit_identical_to_plain_pipelining():
    cfg = load_model_config(MODEL)
    setup = setup_pipeline(cfg, load_hardware("cpu-local", num_devices=2, memory_bytes=1 << 30), schedule="1f1b",
                           num_stages=2, microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES,
                           ranges=RANGES[2])
    result = plan_strategy(setup, Strategy.MEGATRON_SELECTIVE)
    assert result.fits, result.reason
    plan = result.plan
    blocks = [r for sp in plan.stages for r in sp.rules if r.technique == Technique.RECOMPUTE]
    assert [r.tensor for r in blocks] == [f"layers.{i}.**" for i in range(cfg.num_layers)]
    assert any(r.technique == Technique.KEEP for sp in plan.stages for r in sp.rules)  # part of each block
    plain, ran = run_jobs(2, "1f1b", NUM_MICROBATCHES, [None, plan])
    assert_identical(plain, ran)
    assert_ran_as_planned(plan, ran)
    assert sum(r["extra"]["recomputed"] for r in ran) == cfg.num_layers * NUM_MICROBATCHES * STEPS
