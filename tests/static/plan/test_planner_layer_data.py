"""The planner steps a stage's optimizer on the host, and then moves layers' parameters
and gradients there, only when compacting activations and optimizer data is not enough
(`planner_layer_data.py`), and what it writes is a plan the emulator finds fitting where
the same plan without those rules does not.

gpt-tiny (bf16) in 2 stages under 1F1B on cpu-local: before this step the mpress plan
fit no device of 2 MB (it peaked at 2.31 MB); now 1.5 MB takes the host step alone, 1 MB
takes parameters and gradients off the device too, 1 GB takes neither.
"""

from __future__ import annotations

import dataclasses

import pytest

from mpress.config.model_config import load_model_config
from mpress.contract.plan import LAYER_DATA_PREFIXES
from mpress.hardware.server import load_hardware
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.plan_eval import evaluate_plan
from mpress.static.plan.balance_choice import minimum_need_bytes
from mpress.static.plan.planner import PlannerOptions, plan_strategy

LAYER_DATA = PlannerOptions(layer_data=True)
"""The size studies' planner: layers' parameters and gradients may go to the host."""
from mpress.static.plan.planner_layer_data import layer_data_candidates
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES

CFG = dataclasses.replace(load_model_config(MODEL), precision="bf16")


def setup_at(memory_bytes: int, pcie_gbps: float | None = None, host_bytes: int | None = None):
    hw = dataclasses.replace(load_hardware("cpu-local", num_devices=2, memory_bytes=memory_bytes),
                             host_memory_gbps=20.0)
    if host_bytes is not None:
        hw = dataclasses.replace(hw, host_memory_bytes=host_bytes, pinnable_host_bytes=None)
    if pcie_gbps is not None:
        hw = dataclasses.replace(hw, pcie_h2d_gbps=pcie_gbps, pcie_d2h_gbps=pcie_gbps)
    return setup_pipeline(CFG, hw, schedule="1f1b", num_stages=2, microbatch_size=MICROBATCH_SIZE,
                          num_microbatches=4, ranges=RANGES[2])


def layer_rules(plan):
    return [[r.tensor for r in sp.rules if r.tensor.startswith(LAYER_DATA_PREFIXES)] for sp in plan.stages]


@pytest.fixture(scope="module")
def tight():
    setup = setup_at(1_000_000)
    return setup, plan_strategy(setup, "mpress", LAYER_DATA)


def test_a_tight_device_fits_with_layers_on_the_host(tight):
    setup, res = tight
    assert res.fits, res.reason
    assert max(res.evaluation.result.peak_bytes[:2]) <= setup.hardware.usable_memory_bytes
    rules = layer_rules(res.plan)
    assert any(rules)
    for sp, named in zip(res.plan.stages, rules):
        assert str(sp.optimizer_step) == "host" or not named


def test_the_host_step_alone_comes_first():
    setup = setup_at(1_500_000)
    res = plan_strategy(setup, "mpress", LAYER_DATA)
    assert res.fits, res.reason
    assert layer_rules(res.plan) == [[], []]
    assert any(str(sp.optimizer_step) == "host" for sp in res.plan.stages)


def test_without_those_rules_the_plan_does_not_fit(tight):
    setup, res = tight
    stages = [dataclasses.replace(sp, rules=[r for r in sp.rules if not r.tensor.startswith(LAYER_DATA_PREFIXES)])
              for sp in res.plan.stages]
    stripped = dataclasses.replace(res.plan, stages=stages, actions=[])
    ev = evaluate_plan(setup, stripped)
    assert not ev.result.fits
    assert max(ev.result.peak_bytes[:2]) > setup.hardware.usable_memory_bytes


def test_a_roomy_device_moves_no_layer():
    res = plan_strategy(setup_at(1 << 30), "mpress", LAYER_DATA)
    assert res.fits
    assert layer_rules(res.plan) == [[], []]
    assert all(str(sp.optimizer_step) == "device" for sp in res.plan.stages)


def test_the_host_must_hold_the_host_steps(tight):
    """The host steps' pageable fp32 copies and Adam states count against the host's
    memory beside what is pinned: a host that holds the pinned bytes but not those fails
    the plan, and `maxsize` calls the bound host RAM."""
    from mpress.static.plan.planner_layer_data import plan_pinned_bytes
    from mpress.static.plan.rewriter import host_step_host_bytes
    from mpress.static.studies.maxsize import Bound, plan_bound
    setup, res = tight
    pinned = plan_pinned_bytes(res.plan, setup.costs)
    pageable = sum(host_step_host_bytes(res.plan, setup.costs))
    assert pageable > 0
    small = setup_at(1_000_000, host_bytes=pinned + pageable // 2)
    res = plan_strategy(small, "mpress", LAYER_DATA)
    assert not res.fits
    assert res.reason.startswith("host memory"), res.reason
    assert plan_bound(small.hardware, res) is Bound.HOST_RAM


def test_other_strategies_keep_parameters_on_the_device(tight):
    setup, _res = tight
    res = plan_strategy(setup, "host-swap")
    assert layer_rules(res.plan) == [[], []]


def test_floor_is_two_layers_of_parameters_and_gradients():
    setup = setup_at(2_000_000)
    plain, layered = minimum_need_bytes(setup), minimum_need_bytes(setup, layer_data=True)
    for m, c, a, b in zip(setup.memory, setup.costs, plain, layered):
        assert a - b == m.param_bytes + m.grad_bytes - 2 * max(x.param_bytes + x.grad_bytes for x in c.layers)
        assert b < a


def test_candidates_weigh_traffic_against_bytes():
    """On a fast link (1 TB/s) a block's traffic hides behind its compute (cost 0); on a
    slow one (10 MB/s) it shows, per byte, for parameters (two copies per microbatch)
    twice what it does for gradients of the same bytes (one). Cheapest first, the larger
    first among equals."""
    fast = setup_at(2_000_000, pcie_gbps=1000.0)
    c = fast.costs[0]
    j = len(c.layers) - 1  # a transformer block, after another one
    found = layer_data_candidates(c, fast.hardware, 4, 1, set(), set())
    assert found == sorted(found)
    by = {(what, i): score for score, _b, what, i in found}
    assert by[("param", j)] == 0 and by[("grad", j)] == 0
    slow = setup_at(2_000_000, pcie_gbps=0.01)
    found = layer_data_candidates(slow.costs[0], slow.hardware, 4, 1, set(), set())
    by = {(what, i): score for score, _b, what, i in found}
    assert c.layers[j].param_bytes == c.layers[j].grad_bytes
    assert by[("grad", j)] > 0
    assert by[("param", j)] == pytest.approx(2 * by[("grad", j)], rel=0.05)
    taken = layer_data_candidates(slow.costs[0], slow.hardware, 4, 1, {j}, {j})
    assert not {(what, i) for _s, _b, what, i in taken} & {("param", j), ("grad", j)}


def test_interleaved_stages_share_a_rank():
    """Two stages per rank (interleaved 1F1B): at 1 MB per device the plan fits with
    layers on the host, and the peak breakdown of each device sums to its peak."""
    from mpress.static.emulate.breakdown import peak_breakdown
    hw = dataclasses.replace(load_hardware("cpu-local", num_devices=2, memory_bytes=1_000_000), host_memory_gbps=20.0)
    setup = setup_pipeline(CFG, hw, schedule="interleaved", num_stages=4, num_ranks=2, microbatch_size=2,
                           num_microbatches=4)
    res = plan_strategy(setup, "mpress", LAYER_DATA)
    assert res.fits, res.reason
    assert any(layer_rules(res.plan))
    parts = peak_breakdown(res.evaluation.result, setup.costs, weight_stashing=False)
    assert [sum(p.values()) for p in parts[:2]] == list(res.evaluation.result.peak_bytes[:2])


def test_plans_to_train_keep_every_layers_parameters_and_gradients_on_the_device(tight):
    """The runtime does not carry out param:/grad: rules yet: the planner's default (what
    `mpress plan` and `mpress train` use) never writes one, even where it then does not fit."""
    setup, _ = tight
    res = plan_strategy(setup, "mpress")
    assert not [r.tensor for sp in res.plan.stages for r in sp.rules if r.tensor.startswith(("param:", "grad:"))]
