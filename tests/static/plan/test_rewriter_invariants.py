"""mpress.static.plan.rewriter over every schedule with every technique at once: where the
memory actions land (the placement rules of the rewriter's module docstring, and of
`placement.place_by_capacity` under the `capacity` swap-in policy), and the rewritten
iteration emulated to its end.

The toy pipeline is tests.support.rewriter's, 4 stages of 2 layers, 8 microbatches.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mpress.contract.actions import Action, Kind, UnitId
from mpress.contract.plan import Stripe, TensorRule
from mpress.static.emulate.program import walk_peaks
from mpress.static.plan.rewriter import offloaded_optim_bytes
from tests.support.plans import rule
from tests.support.rewriter import Case


def mixed_rules() -> dict[int, list[TensorRule]]:
    return {
        0: [rule("optim:*"), rule("stash:*"),
            rule("layers.0.**", microbatches="0-3", prefetch_lead=2),
            rule("layers.0.**", "recompute"),
            rule("layers.1.**", "d2d", stripes=[Stripe(device=3, fraction=0.5), Stripe(device=4, fraction=0.5)])],
        1: [rule("layers.2.**", "recompute"), rule("layers.3.act#0", microbatches="1,3,5")],
        2: [rule("layers.*", "recompute", microbatches="0-3")],
        3: [rule("optim:layers.7", prefetch_lead=3), rule("layers.7.**", prefetch_lead=4)],
    }


SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("pipedream", {}), ("interleaved", {"num_ranks": 2})]
POLICIES = ["layer-ahead", "capacity"]
OUTS = {Kind.SO: Kind.SI, Kind.DO: Kind.DI}
INS = {Kind.SI: Kind.SO, Kind.DI: Kind.DO}
STEPS = (Kind.F, Kind.B, Kind.OPT)
"""Compute actions the placement counts (a recompute is inside its backward)."""


def mixed_case(name: str, kw: dict) -> Case:
    return Case(name, [(0, 2), (2, 4), (4, 6), (6, 8)], 8, mixed_rules(), **kw)


def step_index(actions: Sequence[Action], i: int) -> int:
    """How many compute actions (F, B, OPT) come before position `i`."""
    return sum(a.kind in STEPS for a in actions[:i])


def _layer(case: Case, a: Action) -> int:
    names = [x.name for x in case.costs[a.stage].layers]
    return names.index(UnitId.parse(a.tensor or "").layer)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name, kw", SCHEDULES)
def test_placement_invariants(name: str, kw: dict, policy: str) -> None:
    case = mixed_case(name, kw)
    placed = case.evaluation(policy=policy).schedule
    if policy == "layer-ahead":
        assert placed == case.rw.schedule
    offloaded = offloaded_optim_bytes(case.plan, case.costs)
    swapped = 0
    for r, (old, new) in enumerate(zip(case.schedule.ranks, placed.ranks)):
        # the compute actions are the original ones, with each offloading stage's OPT
        # streamed per chunk
        plain = [a for a in new if a.kind in (Kind.F, Kind.B) or (a.kind is Kind.OPT and a.tensor is None)]
        assert plain == [a for a in old if a.kind in (Kind.F, Kind.B) or
                         (a.kind is Kind.OPT and not offloaded[a.stage])]
        # the capacity policy only moves swap-ins
        assert [a for a in new if a.kind not in INS] == [a for a in case.rw.schedule.ranks[r] if a.kind not in INS]
        where = {(a.kind, a.stage, a.microbatch, a.tensor): i for i, a in enumerate(new)}
        old_steps = [a for a in old if a.kind in STEPS]
        outs = {(a.kind, a.stage, a.microbatch, a.tensor) for a in new if a.kind in OUTS}
        ins = {(INS[a.kind], a.stage, a.microbatch, a.tensor) for a in new if a.kind in INS}
        # every unit swapped out is swapped in (once), and nothing else is
        assert outs == ins and len(ins) == sum(a.kind in INS for a in new), r
        swapped += len(outs)
        for i, a in enumerate(new):
            if a.kind in OUTS or a.kind is Kind.DR:
                # right after its F: only its F's other memory actions in between
                f = where[(Kind.F, a.stage, a.microbatch, None)]
                assert f < i and all(x.kind in (Kind.SO, Kind.DO, Kind.DR) and (x.stage, x.microbatch) ==
                                     (a.stage, a.microbatch) for x in new[f + 1:i]), (r, str(a))
            if a.kind in OUTS:
                # never when the F's next compute action is its B
                k = old_steps.index(Action(a.stage, Kind.F, a.microbatch))
                assert old_steps[k + 1] != Action(a.stage, Kind.B, a.microbatch), (r, str(a))
            elif a.kind in INS:
                f = where[(Kind.F, a.stage, a.microbatch, None)]
                b = where[(Kind.B, a.stage, a.microbatch, None)]
                p, k, at = step_index(new, f), step_index(new, b), step_index(new, i)
                # after its swap-out's release point (the compute action after the F: p + 1)
                # and before its backward
                assert p + 2 <= at <= k, (r, str(a))
                lead = case.plan.stages[a.stage].rules[UnitId.parse(a.tensor or "").rule].prefetch_lead
                # the rewriter: lead compute actions ahead of B; capacity (the toy fits
                # many times over): as early as the release point allows
                assert at == (max(k - lead, p + 2) if policy == "layer-ahead" else p + 2), (r, str(a))
            elif a.kind is Kind.RC:
                # inside its backward, right after it, last layer first
                b = where[(Kind.B, a.stage, a.microbatch, None)]
                assert b < i and all(x.kind is Kind.RC and (x.stage, x.microbatch) == (a.stage, a.microbatch)
                                     for x in new[b + 1:i]), (r, str(a))
                if new[i - 1].kind is Kind.RC:
                    assert _layer(case, new[i - 1]) > _layer(case, a), (r, str(a))
                assert where[(Kind.DR, a.stage, a.microbatch, a.tensor)] < b
        drops = {(a.stage, a.microbatch, a.tensor) for a in new if a.kind is Kind.DR}
        assert drops == {(a.stage, a.microbatch, a.tensor) for a in new if a.kind is Kind.RC}
        # each tensor a memory action names is described
        assert {a.tensor for a in new if a.tensor} <= set(case.rw.tensors)
    assert swapped > 0  # the rules do swap something in every schedule


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name, kw", SCHEDULES)
def test_rewritten_iteration_runs_to_the_end(name: str, kw: dict, policy: str) -> None:
    case = mixed_case(name, kw)
    ev = case.evaluation(policy=policy)  # emulating raises ScheduleError on a deadlock
    program, res = ev.program, ev.result
    assert res.iteration_s > 0
    assert len(set(program.rank_device)) == len(program.rank_device)  # a device per rank
    for r, device in enumerate(program.rank_device):
        assert res.task_end_s[r][-1] > 0
        static = program.static_bytes[r]
        # the emulated memory is the walk of the rank's list, whatever the timing
        assert res.peak_bytes[device] == max(walk_peaks(program.ranks[r], static))
        # everything taken during the iteration was given back: the gradients of each
        # stage's input too (at the end of the backward in which torch's schedule drops
        # the send holding them); the toy has no loss to keep
        assert res.timeline[device][-1][1] == static
