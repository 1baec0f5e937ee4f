"""A layer's working parameters and gradients in pinned host memory (`param:LAYER`,
`grad:LAYER` host rules, `static/plan/layer_data.py`): the contract refuses what the
scheme does not cover in one line, the program lists a fetch and an eviction around each
forward and backward and a drain after each backward, and the emulator frees the bytes
and costs the copies at the hardware's PCIe bandwidth.

gpt-tiny (bf16) in 2 stages on cpu-local, both stepping on the host (the scheme's
premise), as `test_host_optimizer_step.py` builds it.
"""

from __future__ import annotations

import dataclasses

import pytest

from mpress.contract.actions import Kind, UnitId, UnitKind
from mpress.contract.plan import StagePlan, Stripe, TensorRule, pattern_matches
from mpress.contract.plan_check import check_plan
from mpress.errors import ConfigError, PlanError, UserError
from mpress.static.emulate.channels import pcie_down, pcie_up
from mpress.static.plan.rewriter import host_step_pinned_bytes, offloaded_optim_bytes
from mpress.config.units import ALIGNMENT_BYTES, round_up
from tests.static.plan.test_host_optimizer_step import CPU_LOCAL, NUM_MICROBATCHES, plan_and_eval
from tests.support.plans import one_line

PARAMS = TensorRule(tensor="param:*", technique="host")
GRADS = TensorRule(tensor="grad:*", technique="host")
BOTH = {0: [PARAMS, GRADS], 1: [PARAMS, GRADS]}


def data_actions(plan, rank: int, unit: UnitKind, kind: Kind):
    return [a for a in plan.program(rank) if a.kind is kind and a.microbatch is not None
            and a.tensor and UnitId.parse(a.tensor).kind is unit]


# -- contract -------------------------------------------------------------------------------

@pytest.mark.parametrize("technique", ["d2d", "recompute"])
def test_only_keep_or_host(technique):
    stripes = [Stripe(device=1, fraction=1.0)] if technique == "d2d" else []
    with pytest.raises(ConfigError) as info:
        TensorRule(tensor="param:layers.0", technique=technique, stripes=stripes)  # type: ignore[arg-type]
    assert "param:layers.0" in one_line(info.value)


def test_one_copy_for_every_microbatch():
    with pytest.raises(ConfigError) as info:
        TensorRule(tensor="grad:*", technique="host", microbatches="0-1")
    assert "use all" in one_line(info.value)


def test_host_rule_needs_a_host_step():
    with pytest.raises(ConfigError) as info:
        StagePlan(stage=0, device=0, first_layer=0, end_layer=2, rules=[PARAMS])
    assert "optimizer_step: host" in one_line(info.value)
    StagePlan(stage=0, device=0, first_layer=0, end_layer=2, rules=[PARAMS], optimizer_step="host")
    StagePlan(stage=0, device=0, first_layer=0, end_layer=2, rules=[TensorRule(tensor="param:*", technique="keep")])


def test_patterns_name_model_data_only():
    assert pattern_matches("param:*", "param:layers.3")
    assert pattern_matches("grad:layers.3", "grad:layers.3")
    assert not pattern_matches("*", "param:layers.3")
    assert not pattern_matches("param:*", "grad:layers.3")
    assert not pattern_matches("layers.3.**", "param:layers.3")


def test_runtime_runs_it_but_not_under_weight_stashing():
    """The runtime carries the scheme out (`tests/runtime/test_layer_data_runs.py`); a plan
    whose schedule stashes weights (edited, as the planner refuses to make one) is refused
    in one line naming the rule."""
    _setup, plan, _ev = plan_and_eval(host_step=(0, 1), rules=BOTH)
    check_plan(plan, runtime=True)
    with pytest.raises(PlanError) as info:
        check_plan(dataclasses.replace(plan, schedule="pipedream"), runtime=True)
    assert "stages[0].rules[0].tensor" in one_line(info.value) and "pipedream" in one_line(info.value)


def test_refused_under_weight_stashing():
    with pytest.raises(UserError) as info:
        plan_and_eval(host_step=(0, 1), rules=BOTH, schedule="pipedream")
    assert "weight stashing" in one_line(info.value)


# -- program --------------------------------------------------------------------------------

def test_program_fetches_evicts_and_drains_every_layer():
    setup, plan, _ev = plan_and_eval(host_step=(0, 1), rules=BOTH)
    for rank, costs in enumerate(setup.costs):
        n, m = len(costs.layers), NUM_MICROBATCHES
        last_stage = rank == len(setup.costs) - 1
        # every layer fetched for each forward and backward; the last stage's last layer
        # stays between a forward and the backward right after it
        kept = m if last_stage else 0
        assert len(data_actions(plan, rank, UnitKind.PARAMS, Kind.SI)) == 2 * n * m - kept
        assert len(data_actions(plan, rank, UnitKind.PARAMS, Kind.SO)) == 2 * n * m - kept
        assert len(data_actions(plan, rank, UnitKind.GRADS, Kind.SO)) == n * m
        # each fetch comes before the compute action that reads it, in the same pass
        program = plan.program(rank)
        for a in data_actions(plan, rank, UnitKind.PARAMS, Kind.SI):
            at = program.index(a)
            nxt = next(x for x in program[at:] if x.is_compute or x.stage != a.stage
                       or (x.microbatch == a.microbatch and x.kind is Kind.SO))
            assert nxt.kind in (Kind.F, Kind.B) or nxt.microbatch == a.microbatch


def test_program_is_what_plan_says():
    """The plan carries the program; evaluating it again from its rules gives the same one."""
    from mpress.static.plan.plan_eval import evaluate_plan
    setup, plan, ev = plan_and_eval(host_step=(0, 1), rules=BOTH)
    again = evaluate_plan(setup, plan)
    assert again.result.peak_bytes == ev.result.peak_bytes


# -- memory and time ------------------------------------------------------------------------

def test_parameters_leave_the_static_bytes_and_pin_a_slab():
    setup, plan, _ev = plan_and_eval(host_step=(0, 1), rules={0: [PARAMS]})
    c = setup.costs[0]
    offloaded = offloaded_optim_bytes(plan, setup.costs)
    assert offloaded[0] == c.optim_bytes + c.master_bytes + c.param_bytes
    assert offloaded[1] == setup.costs[1].optim_bytes + setup.costs[1].master_bytes
    pinned = host_step_pinned_bytes(plan, setup.costs)
    assert pinned[0] == 2 * round_up(c.param_bytes, ALIGNMENT_BYTES)
    assert pinned[1] == round_up(setup.costs[1].param_bytes, ALIGNMENT_BYTES)


def test_peak_falls_by_what_leaves():
    _s, _p, plain = plan_and_eval(host_step=(0, 1))
    _s, _p, params = plan_and_eval(host_step=(0, 1), rules={0: [PARAMS], 1: [PARAMS]})
    _s, _p, both = plan_and_eval(host_step=(0, 1), rules=BOTH)
    for dev in (0, 1):
        assert params.result.peak_bytes[dev] < plain.result.peak_bytes[dev]
        assert both.result.peak_bytes[dev] < params.result.peak_bytes[dev]


def test_copies_cost_the_host_link():
    """Each fetch moves the layer's parameter bytes on the device's PCIe downlink and each
    drain its gradient bytes on the uplink; a slower link makes the iteration slower. A
    layer's parameters have one device copy, which every pass holding them shares (the
    runtime refills the parameters' own storages): a fetch while another pass holds it
    (one layer ahead, the next microbatch's) moves and allocates nothing, and an eviction
    frees it only when the last pass lets it go."""
    setup, _plan, ev = plan_and_eval(host_step=(0, 1), rules=BOTH)
    layers = {layer.name: layer for c in setup.costs for layer in c.layers}
    seen = set()
    for rank, tasks in enumerate(ev.program.ranks):
        holders: dict[str, int] = {}
        for t in tasks:
            if t.action.microbatch is None or not t.action.tensor or t.action.kind not in (Kind.SI, Kind.SO):
                continue
            unit = UnitId.parse(t.action.tensor)
            held = holders.get(t.action.tensor, 0)
            if unit.kind is UnitKind.PARAMS and t.action.kind is Kind.SI:
                holders[t.action.tensor] = held + 1
                moved = {x.channel: x.bytes for x in t.transfers}
                if held:
                    assert moved == {} and t.alloc_bytes == 0
                    seen.add("shared fetch")
                    continue
                assert moved[pcie_down(CPU_LOCAL, rank)] == layers[unit.layer].param_bytes
                assert t.alloc_bytes == layers[unit.layer].param_bytes
                seen.add("fetch")
            elif unit.kind is UnitKind.PARAMS:
                holders[t.action.tensor] = held - 1
                assert t.transfers == () and t.free_bytes == (layers[unit.layer].param_bytes if held == 1 else 0)
                seen.add("evict")
            elif unit.kind is UnitKind.GRADS:
                moved = {x.channel: x.bytes for x in t.transfers}
                assert moved[pcie_up(CPU_LOCAL, rank)] == layers[unit.layer].grad_bytes
                assert t.free_bytes == layers[unit.layer].grad_bytes
                seen.add("drain")
    assert seen == {"fetch", "shared fetch", "evict", "drain"}
    slow = dataclasses.replace(CPU_LOCAL, pcie_h2d_gbps=CPU_LOCAL.pcie_h2d_gbps / 100,
                               pcie_d2h_gbps=CPU_LOCAL.pcie_d2h_gbps / 100)
    _s, _p, slow_ev = plan_and_eval(host_step=(0, 1), rules=BOTH, hardware=slow)
    _s, _p, plain_fast = plan_and_eval(host_step=(0, 1))
    _s, _p, plain_slow = plan_and_eval(host_step=(0, 1), hardware=slow)
    added_fast = ev.result.iteration_s - plain_fast.result.iteration_s
    added_slow = slow_ev.result.iteration_s - plain_slow.result.iteration_s
    assert added_slow > 10 * max(added_fast, 0.0)


def test_peak_breakdown_follows_the_copies():
    """At each device's peak the categories sum to the emulated peak; parameters there are
    at most the two largest layers' (the one running and the one fetched ahead) where
    every layer's live on the host, and no more than without the rules otherwise."""
    from mpress.static.emulate.breakdown import PARAMS, peak_breakdown
    setup, _plan, plain = plan_and_eval(host_step=(0, 1))
    _s, _p, both = plan_and_eval(host_step=(0, 1), rules=BOTH)
    before = peak_breakdown(plain.result, setup.costs, weight_stashing=False)
    after = peak_breakdown(both.result, setup.costs, weight_stashing=False)
    for dev, c in enumerate(setup.costs):
        assert sum(after[dev].values()) == both.result.peak_bytes[dev]
        two = sum(sorted((x.param_bytes for x in c.layers), reverse=True)[:2])
        assert 0 < after[dev][PARAMS] <= two < before[dev][PARAMS]
