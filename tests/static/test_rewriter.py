"""mpress.static.rewriter: where a plan's memory actions land in per-rank action lists,
and what they do to memory once lowered and emulated.

Expected action strings below are derived by hand from the rewriter's placement rules
(its module docstring); the memory figures from the toy profile's literal sizes and the
lowering's accounting (`mpress.static.memory.lower_action`). With fast copies:

- F(s, m) takes all of microbatch m's saved bytes when it starts (minus what recompute
  never stores); a swap-out gives its bytes back when the copy ends, so when two
  forwards run back to back, the first one's swap-out is still in flight when the
  second one takes its bytes;
- a swap-in takes its bytes when it starts, which is where the rewriter placed it
  (`prefetch_lead` compute actions ahead of the backward).

The toy profile and `Case` are in tests.support.rewriter; optimizer states and PipeDream's
stashed weights are tested in test_rewriter_model_data.py.
"""

from __future__ import annotations

import pytest

from mpress.actions import Kind
from mpress.errors import PlanError
from mpress.plan import Stripe, TensorRule
from mpress.static.emulator import emulate
from mpress.static.lowering import TensorInfo
from mpress.static.memory import stage_costs
from mpress.static.rewriter import offloaded_optim_bytes, rewrite, stash_offloaded
from mpress.static.schedules import build_schedule
from tests.support.plans import rule
from tests.support.rewriter import (
    DGX1,
    FAST,
    FWD,
    MB,
    Case,
    bytes_at,
    expand,
    make_plan,
    toy_profile,
)

# -- host swap ---------------------------------------------------------------------------------


def test_host_swap_of_one_layer_in_every_microbatch() -> None:
    # 1F1B, 2 stages x 4 microbatches; rank 0 runs 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3 0OPT.
    # SO right after each F; SI before the compute action just ahead of the B (lead 1),
    # but never before the F that produced it: for B0 that is F1, for B3 it is B2.
    case = Case("1f1b", [(0, 2), (2, 4)], 4, {0: [rule("layers.0.**")]})
    assert case.rank(0) == expand("""
        0F0 0SO0:{T} 0SI0:{T} 0F1 0SO1:{T} 0B0 0SI1:{T} 0F2 0SO2:{T} 0B1 0SI2:{T} 0F3 0SO3:{T}
        0SI3:{T} 0B2 0B3 0OPT""", T="0:layers.0.**@r0")
    assert case.rank(1) == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1OPT"
    # the unit is the whole layer: fc#0 + fc#1 + act#0 = 4 + 1 + 1 MB
    assert case.rw.tensors == {"0:layers.0.**@r0": TensorInfo(bytes=6 * MB)}
    assert case.rw.schedule.name == "1f1b" and case.rw.schedule.stage_to_rank == (0, 1)


def test_prefetch_lead_moves_swap_ins_earlier() -> None:
    # GPipe, one stage: 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0OPT; lead 2: the SI for B(m)
    # goes before the compute action two ahead of B(m): F2, F3, B0, B1.
    case = Case("gpipe", [(0, 4)], 4, {0: [rule("layers.1.**", prefetch_lead=2)]})
    assert case.rank(0) == expand("""
        0F0 0SO0:{T} 0F1 0SO1:{T} 0SI0:{T} 0F2 0SO2:{T} 0SI1:{T} 0F3 0SO3:{T} 0SI2:{T} 0B0 0SI3:{T} 0B1
        0B2 0B3 0OPT""", T="0:layers.1.**@r0")
    assert case.rw.tensors == {"0:layers.1.**@r0": TensorInfo(bytes=7 * MB)}


def test_swap_in_never_before_its_swap_out() -> None:
    # lead 3 would put every SI before the F that produced its tensor: each one is clamped
    # to right after that F's swap-out instead
    case = Case("1f1b", [(0, 2), (2, 4)], 4, {0: [rule("layers.0.**", prefetch_lead=3)]})
    assert case.rank(0) == expand("""
        0F0 0SO0:{T} 0SI0:{T} 0F1 0SO1:{T} 0SI1:{T} 0B0 0F2 0SO2:{T} 0SI2:{T} 0B1 0F3 0SO3:{T} 0SI3:{T}
        0B2 0B3 0OPT""", T="0:layers.0.**@r0")


def test_rule_on_one_tensor_moves_only_that_tensor() -> None:
    # a unit is what one rule decides in one layer: two rules on layer 3 make two units
    case = Case("1f1b", [(0, 2), (2, 4)], 1, {1: [rule("layers.3.fc#0"), rule("layers.3.*#*", "host")]})
    assert case.rank(1) == expand("1F0 1SO0:{A} 1SO0:{B} 1SI0:{A} 1SI0:{B} 1B0 1OPT",
                                  A="1:layers.3.**@r0", B="1:layers.3.**@r1")
    assert case.rw.tensors == {"1:layers.3.**@r0": TensorInfo(bytes=4 * MB),
                               "1:layers.3.**@r1": TensorInfo(bytes=5 * MB)}


def test_host_swap_peak_gpipe() -> None:
    # GPipe, one stage of 4 layers (30 MB saved per microbatch), 6 microbatches, layer 1
    # (L = 7 MB) to host. Peak at F5's start: mb 0 is back (its SI sits before F5), mbs
    # 1-3 are on the host, mb 4's SO was issued the instant F5 started and has not
    # finished, mb 5 is taken in full: 6 x 30 - 3 x 7 MB of activations.
    case = Case("gpipe", [(0, 4)], 6, {0: [rule("layers.1.**")]}, hardware=FAST)
    base, res = case.emulate(rewritten=False), case.emulate()
    static = case.program().static_bytes[0]
    assert static == case.program(rewritten=False).static_bytes[0]
    assert base.peak_bytes[0] == static + 6 * 30 * MB
    assert res.peak_bytes[0] == static + 6 * 30 * MB - 3 * 7 * MB
    assert res.timeline[0][-1][1] == static  # everything came back and was freed


def test_host_swap_peak_1f1b_first_stage() -> None:
    # 1F1B, 4 stages of one layer, 8 microbatches, stage 0 (layer 0, S = L = 6 MB, 4 in
    # flight) to host. Warm-up peak at F3's start: mb 0 back (its SI sits before F3), mb 1
    # on the host, mb 2's SO still in flight (F2 and F3 run back to back), mb 3 taken:
    # 4 S - L. In the steady state (F(m+3) after B(m-1)) two microbatches are on the host.
    case = Case("1f1b", [(0, 1), (1, 2), (2, 3), (3, 4)], 8, {0: [rule("layers.0.**")]}, hardware=FAST)
    base, res = case.emulate(rewritten=False), case.emulate()
    static = case.program().static_bytes[0]
    assert base.peak_bytes[0] == static + 4 * 6 * MB
    assert res.peak_bytes[0] == static + 4 * 6 * MB - 6 * MB
    assert res.peak_bytes[1:4] == base.peak_bytes[1:4]  # the other stages are untouched
    # right after F4 (steady state: mbs 1 and 2 on the host, mb 3 and 4 on the device)
    f4 = [str(t.action) for t in case.program().ranks[0]].index("0F4")
    t = res.task_start_s[0][f4]
    assert bytes_at(res, 0, t) == static + 4 * 6 * MB - 2 * 6 * MB


# -- D2D swap -----------------------------------------------------------------------------------

D2D_STRIPES = [Stripe(device=2, fraction=1 / 3), Stripe(device=3, fraction=2 / 3)]
"""GPU 0 of a DGX-1 has 1 NVLink to GPU 2 and 2 to GPU 3: stripes in proportion."""


def test_d2d_swap_with_stripes() -> None:
    case = Case("1f1b", [(0, 2), (2, 4)], 2, {0: [rule("layers.1.**", "d2d", stripes=D2D_STRIPES)]})
    assert case.rank(0) == expand("0F0 0DO0:{T} 0DI0:{T} 0F1 0DO1:{T} 0DI1:{T} 0B0 0B1 0OPT",
                                  T="0:layers.1.**@r0")
    assert case.rw.tensors == {"0:layers.1.**@r0": TensorInfo(bytes=7 * MB, stripes=((2, 1 / 3), (3, 2 / 3)))}
    lowered = {str(t.action): t for t in case.program().ranks[0]}
    assert [(x.channel, x.bytes) for x in lowered["0DO0:0:layers.1.**@r0"].transfers] == [
        ("nvlink:0->2", round(7 * MB / 3)), ("nvlink:0->3", round(14 * MB / 3))]
    assert [x.channel for x in lowered["0DI1:0:layers.1.**@r0"].transfers] == ["nvlink:2->0", "nvlink:3->0"]


def test_d2d_swap_peak_gpipe() -> None:
    # GPipe, 2 stages, 4 microbatches; stage 0 holds layers 0-1 (13 MB per microbatch),
    # layer 1 (7 MB) goes to GPUs 2 and 3. As with host swap, at F3's start mb 0 is back,
    # mb 1 is away and mb 2's DO is in flight: 4 x 13 - 7 MB.
    case = Case("gpipe", [(0, 2), (2, 4)], 4, {0: [rule("layers.1.**", "d2d", stripes=D2D_STRIPES)]},
                hardware=FAST)
    base, res = case.emulate(rewritten=False), case.emulate()
    static = case.program().static_bytes[0]
    assert base.peak_bytes[0] == static + 4 * 13 * MB
    assert res.peak_bytes[0] == static + 4 * 13 * MB - 7 * MB
    assert res.peak_bytes[2:4] == base.peak_bytes[2:4]  # no peer pool was planned: the peers hold nothing
    assert res.timeline[0][-1][1] == static


# -- recompute ------------------------------------------------------------------------------------

def test_recompute_drops_after_forward_and_restores_before_backward() -> None:
    case = Case("1f1b", [(0, 2), (2, 4)], 4, {0: [rule("layers.1.**", "recompute")]})
    assert case.rank(0) == expand("""
        0F0 0DR0:{T} 0F1 0DR1:{T} 0RC0:{T} 0B0 0F2 0DR2:{T} 0RC1:{T} 0B1 0F3 0DR3:{T} 0RC2:{T} 0B2
        0RC3:{T} 0B3 0OPT""", T="0:layers.1.**@r0")
    # layer 1 keeps its input (layer 0's 0.1 MB output) and re-runs its 1.1 ms forward
    assert case.rw.tensors == {"0:layers.1.**@r0": TensorInfo(bytes=7 * MB - 100_000, compute_s=1.1e-3)}


@pytest.mark.parametrize("layers, expected", [
    # stage 1 holds layers 1-3; each recomputed layer keeps its own input
    ([1], {1: 7 * MB - 100_000}),
    ([1, 3], {1: 7 * MB - 100_000, 3: 9 * MB - 300_000}),
    ([1, 2, 3], {1: 7 * MB - 100_000, 2: 8 * MB - 200_000, 3: 9 * MB - 300_000}),
])
def test_recompute_units_keep_their_input(layers: list[int], expected: dict[int, int]) -> None:
    rules = [rule(f"layers.{j}.**", "recompute") for j in layers]
    case = Case("1f1b", [(0, 1), (1, 4)], 1, {1: rules})
    names = {j: f"1:layers.{j}.**@r{r}" for r, j in enumerate(layers)}
    assert case.rw.tensors == {names[j]: TensorInfo(bytes=b, compute_s=FWD[j]) for j, b in expected.items()}
    # drops in layer order after F, recomputes in forward order right before B
    drops = " ".join(f"1DR0:{names[j]}" for j in layers)
    recomputes = " ".join(f"1RC0:{names[j]}" for j in layers)
    assert case.rank(1) == f"1F0 {drops} {recomputes} 1B0 1OPT"


def test_recompute_of_the_first_layer_keeps_nothing() -> None:
    # the model's first layer takes the token ids: its whole saved set is dropped
    case = Case("1f1b", [(0, 2), (2, 4)], 1, {0: [rule("layers.*", "recompute")]})
    assert case.rw.tensors == {"0:layers.0.**@r0": TensorInfo(bytes=6 * MB, compute_s=1.0e-3),
                               "0:layers.1.**@r0": TensorInfo(bytes=7 * MB - 100_000, compute_s=1.1e-3)}


def test_catch_all_recompute_rule_leaves_model_data_alone() -> None:
    # `*` names every saved activation of the stage, not its optimizer states or stash
    case = Case("pipedream", [(0, 2), (2, 4)], 1, {0: [rule("*", "recompute")]})
    assert case.rank(0) == expand("0F0 0DR0:{A} 0DR0:{B} 0RC0:{A} 0RC0:{B} 0B0 0OPT",
                                  A="0:layers.0.**@r0", B="0:layers.1.**@r0")
    assert offloaded_optim_bytes(case.plan, case.costs) == [0, 0]
    assert stash_offloaded(case.plan, case.costs) == [False, False]


def test_recompute_peak_and_overhead() -> None:
    # GPipe, one stage (30 MB per microbatch), 4 microbatches, layers 2 and 3 recomputed:
    # D2 = 8 - 0.2 MB and D3 = 9 - 0.3 MB are never kept by the forward; the backward
    # holds one layer's recomputed tensors at a time (the larger, D3) while it runs.
    d2, d3 = 8 * MB - 200_000, 9 * MB - 300_000
    case = Case("gpipe", [(0, 4)], 4, {0: [rule("layers.2.**", "recompute"), rule("layers.3.**", "recompute")]},
                hardware=FAST)
    base, res = case.emulate(rewritten=False), case.emulate()
    static = case.program().static_bytes[0]
    assert base.peak_bytes[0] == static + 4 * 30 * MB
    assert res.peak_bytes[0] == static + 4 * (30 * MB - d2 - d3) + d3
    # each microbatch re-runs the forwards of layers 2 and 3 (1.2 + 1.3 ms)
    assert res.busy_s_by_cost["recompute"] == pytest.approx(4 * (1.2e-3 + 1.3e-3))
    assert res.iteration_s == pytest.approx(base.iteration_s + 4 * 2.5e-3)
    assert res.timeline[0][-1][1] == static


# -- per-microbatch techniques ---------------------------------------------------------------------

def test_different_techniques_per_microbatch() -> None:
    # microbatches 0-1 of layer 0 go to host (rule 0), the others are recomputed (rule 1)
    case = Case("1f1b", [(0, 2), (2, 4)], 4,
                {0: [rule("layers.0.**", "host", microbatches="0-1"), rule("layers.0.**", "recompute")]})
    assert case.rank(0) == expand("""
        0F0 0SO0:{H} 0SI0:{H} 0F1 0SO1:{H} 0B0 0SI1:{H} 0F2 0DR2:{R} 0B1 0F3 0DR3:{R} 0RC2:{R} 0B2
        0RC3:{R} 0B3 0OPT""", H="0:layers.0.**@r0", R="0:layers.0.**@r1")
    assert case.rw.tensors == {"0:layers.0.**@r0": TensorInfo(bytes=6 * MB),
                               "0:layers.0.**@r1": TensorInfo(bytes=6 * MB, compute_s=1.0e-3)}
    res = case.emulate()
    assert res.busy_s_by_cost["recompute"] == pytest.approx(2 * 1.0e-3)  # mbs 2 and 3 only


def test_keep_rules_and_unmatched_tensors_change_nothing() -> None:
    case = Case("1f1b", [(0, 2), (2, 4)], 4, {0: [rule("layers.0.**", "keep"), rule("optim:*", "keep")],
                                              1: [rule("layers.9.**", "host")]})
    assert case.rw.schedule == case.schedule
    assert case.rw.tensors == {}
    assert offloaded_optim_bytes(case.plan, case.costs) == [0, 0]

# -- refusals -------------------------------------------------------------------------------------


def test_recompute_of_part_of_a_layer_is_refused() -> None:
    with pytest.raises(PlanError) as info:
        Case("1f1b", [(0, 2), (2, 4)], 2, {0: [rule("layers.0.fc#*", "recompute")]})
    msg = str(info.value)
    assert "\n" not in msg
    assert "stage 0 rule 0 (layers.0.fc#*)" in msg and "use layers.0.**" in msg and "2 of 3 tensors" in msg


@pytest.mark.parametrize("rules, mb", [
    # first match wins: an earlier rule takes part of the layer the recompute rule names
    ([rule("layers.0.fc#0", "host"), rule("layers.0.**", "recompute")], 0),
    ([rule("layers.0.act#0", "keep"), rule("layers.0.**", "recompute")], 0),
    ([rule("layers.0.fc#1", "host", microbatches="1"), rule("layers.0.**", "recompute")], 1),
])
def test_recompute_shadowed_by_an_earlier_rule_is_refused(rules: list[TensorRule], mb: int) -> None:
    with pytest.raises(PlanError) as info:
        Case("1f1b", [(0, 2), (2, 4)], 2, {0: rules})
    msg = str(info.value)
    assert "\n" not in msg and f"stage 0 microbatch {mb}" in msg and "tensors of layers.0" in msg
    assert "recompute must cover whole layers" in msg


def test_plan_for_another_pipeline_shape_is_refused() -> None:
    profile = toy_profile()
    sched = build_schedule("1f1b", 2, 4)
    plan = make_plan({}, [(0, 2), (2, 4)], build_schedule("1f1b", 2, 8))
    with pytest.raises(PlanError, match="plan is for 2 stages x 8 microbatches, schedule has 2 x 4"):
        rewrite(plan, sched, stage_costs(profile, [(0, 2), (2, 4)]), DGX1)


# -- every schedule, every technique: placement invariants and a full emulation ----------------------

def mixed_rules() -> dict[int, list[TensorRule]]:
    return {
        0: [rule("optim:*"), rule("stash:*"),
            rule("layers.0.**", microbatches="0-3", prefetch_lead=2),
            rule("layers.0.**", "recompute"),
            rule("layers.1.**", "d2d", stripes=[Stripe(device=3, fraction=0.5), Stripe(device=4, fraction=0.5)])],
        1: [rule("layers.2.**", "recompute"), rule("layers.3.act#0", microbatches="1,3,5")],
        3: [rule("optim:layers.7", prefetch_lead=3), rule("layers.7.**", prefetch_lead=4)],
    }


SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("pipedream", {}), ("interleaved", {"num_ranks": 2})]


@pytest.mark.parametrize("name, kw", SCHEDULES)
def test_placement_invariants(name: str, kw: dict) -> None:
    case = Case(name, [(0, 2), (2, 4), (4, 6), (6, 8)], 8, mixed_rules(), **kw)
    outs = {Kind.SO, Kind.DO, Kind.DR}
    for r, (old, new) in enumerate(zip(case.schedule.ranks, case.rw.schedule.ranks)):
        # the compute actions are the original ones, with each rewritten OPT streamed per chunk
        plain = [a for a in new if a.kind in (Kind.F, Kind.B) or (a.kind is Kind.OPT and a.tensor is None)]
        assert plain == [a for a in old if a.kind in (Kind.F, Kind.B) or
                         (a.kind is Kind.OPT and not offloaded_optim_bytes(case.plan, case.costs)[a.stage])]
        where = {(a.kind, a.stage, a.microbatch, a.tensor): i for i, a in enumerate(new)}
        for i, a in enumerate(new):
            if a.kind in outs:
                # right after its F: only other memory actions in between
                f = where[(Kind.F, a.stage, a.microbatch, None)]
                assert f < i and not any(x.is_compute for x in new[f + 1:i]), (r, str(a))
            elif a.kind in (Kind.SI, Kind.DI):
                out_kind = Kind.SO if a.kind is Kind.SI else Kind.DO
                assert where[(out_kind, a.stage, a.microbatch, a.tensor)] < i < where[
                    (Kind.B, a.stage, a.microbatch, None)], (r, str(a))
            elif a.kind is Kind.RC:
                b = where[(Kind.B, a.stage, a.microbatch, None)]
                assert where[(Kind.DR, a.stage, a.microbatch, a.tensor)] < i < b
                assert all(x.kind in (Kind.RC, Kind.SI, Kind.DI, Kind.OI) for x in new[i + 1:b]), (r, str(a))
        # each tensor a memory action names is described
        assert {a.tensor for a in new if a.tensor} <= set(case.rw.tensors)


@pytest.mark.parametrize("policy", ["capacity", "layer-ahead"])
@pytest.mark.parametrize("name, kw", SCHEDULES)
def test_rewritten_iteration_runs_to_the_end(name: str, kw: dict, policy: str) -> None:
    case = Case(name, [(0, 2), (2, 4), (4, 6), (6, 8)], 8, mixed_rules(), **kw)
    program = case.program(policy=policy)
    res = emulate(program)  # raises ScheduleError on a deadlock
    assert res.iteration_s > 0
    for r, device in enumerate(program.rank_device):
        assert res.task_end_s[r][-1] > 0
        # everything taken during the iteration was given back
        assert res.timeline[device][-1][1] == program.static_bytes[r]
