"""Zero-bubble, V-shaped and looped-BFS schedules as data: the same compute order as
torch 2.13's own schedule classes, and the split backward (I, then W) checked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpress.config.vocabulary import ScheduleName
from mpress.contract.actions import Action, Kind, Schedule, parse_actions
from mpress.errors import ScheduleError
from mpress.static.schedules import (
    build_schedule,
    held_input_grads,
    max_in_flight,
    validate_schedule,
)

S_ = pytest.importorskip("torch.distributed.pipelining.schedules")
_CT = S_._ComputationType
_CODE = {_CT.FORWARD: "F", _CT.FULL_BACKWARD: "B", _CT.BACKWARD_INPUT: "I", _CT.BACKWARD_WEIGHT: "W"}


def torch_compute(actions: list) -> list[tuple[int, str, int]]:
    """(stage, F|B|I|W, microbatch) of torch's compute actions; an OVERLAP_F_B runs its
    sub-actions one after the other, so it reads as them."""
    out: list[tuple[int, str, int]] = []
    for a in actions:
        if a is None:
            continue
        if a.computation_type == _CT.OVERLAP_F_B:
            out += torch_compute(list(a.sub_actions))
        elif a.computation_type in _CODE:
            out.append((a.stage_index, _CODE[a.computation_type], a.microbatch_index))
    return out


def ours(schedule: Schedule, rank: int) -> list[tuple[int, str, int]]:
    return [(a.stage, a.kind.value, a.microbatch) for a in schedule.ranks[rank] if a.kind is not Kind.OPT]


def stub_stages(num_ranks: int, stage_indices: list[int], num_stages: int) -> list[SimpleNamespace]:
    # the constructors read group size/rank, num_stages and submod (torch.compile check)
    # and set the stage->rank map; the lowered order needs nothing else
    return [SimpleNamespace(group_size=num_ranks, group_rank=0, num_stages=num_stages, stage_index=s, submod=None)
            for s in stage_indices]


LOOPED = [(ScheduleName.INTERLEAVED_ZB, "ScheduleInterleavedZeroBubble"), (ScheduleName.LOOPED_BFS, "ScheduleLoopedBFS")]
V = [(ScheduleName.ZBV, "ScheduleZBVZeroBubble"), (ScheduleName.DUALPIPEV, "ScheduleDualPipeV")]


def _compare(name: ScheduleName, torch_sched: object, mine: Schedule, shape: tuple) -> None:
    for r in range(mine.num_ranks):
        assert ours(mine, r) == torch_compute(torch_sched.pipeline_order[r]), (name, shape, r)
        # lowering to communication must not reorder compute
        assert ours(mine, r) == torch_compute(torch_sched.pipeline_order_with_comms[r]), (name, shape, r)


@pytest.mark.parametrize(("name", "torch_cls"), LOOPED)
def test_looped_schedules_match_torch(name: ScheduleName, torch_cls: str) -> None:
    compared = refused = 0
    for R in range(1, 6):
        for stages_per_rank in (1, 2, 3):
            for M in range(1, 17):
                try:
                    theirs = getattr(S_, torch_cls)(stub_stages(R, [v * R for v in range(stages_per_rank)], R * stages_per_rank), M,
                                                    loss_fn=lambda out, target: out)
                except ValueError:
                    with pytest.raises(ScheduleError):  # torch and mpress refuse the same shapes
                        build_schedule(name, R * stages_per_rank, M, num_ranks=R)
                    refused += 1
                    continue
                mine = build_schedule(name, R * stages_per_rank, M, num_ranks=R)
                _compare(name, theirs, mine, (R, stages_per_rank, M))
                compared += 1
    assert compared >= 180
    assert (refused > 0) == (name is ScheduleName.INTERLEAVED_ZB)


@pytest.mark.parametrize(("name", "torch_cls"), V)
def test_v_schedules_match_torch(name: ScheduleName, torch_cls: str) -> None:
    compared = refused = 0
    for R in range(1, 7):
        for M in range(1, 21):
            try:
                theirs = getattr(S_, torch_cls)(stub_stages(R, [0, 2 * R - 1], 2 * R), M, loss_fn=lambda out, target: out)
            except ValueError:
                with pytest.raises(ScheduleError):
                    build_schedule(name, 2 * R, M)
                refused += 1
                continue
            mine = build_schedule(name, 2 * R, M)
            assert mine.stage_to_rank == tuple(theirs.stage_index_to_group_rank[s] for s in range(2 * R))
            _compare(name, theirs, mine, (R, M))
            compared += 1
    assert compared >= 60
    assert (refused > 0) == (name is ScheduleName.DUALPIPEV)  # DualPipeV needs M >= 2R


def test_split_backward_is_in_the_data() -> None:
    zbv = build_schedule(ScheduleName.ZBV, 4, 4)
    kinds = {a.kind for acts in zbv.ranks for a in acts}
    assert {Kind.I, Kind.W} <= kinds and Kind.B not in kinds
    # DualPipeV mixes full backwards and split ones
    dual = {a.kind for acts in build_schedule(ScheduleName.DUALPIPEV, 4, 8).ranks for a in acts}
    assert {Kind.B, Kind.I, Kind.W} <= dual
    # the text form round-trips
    text = " ".join(str(a) for a in zbv.ranks[1])
    assert [str(a) for a in parse_actions(text)] == text.split()


def test_in_flight_lasts_until_w() -> None:
    # ZB-H1 (one stage per rank) on rank 0 runs each W right after its I: 1F1B's depth;
    # a W delayed past later forwards keeps that microbatch in flight
    sched = build_schedule(ScheduleName.INTERLEAVED_ZB, 4, 8, num_ranks=4)
    assert max_in_flight(sched, 0) == 4
    late = Schedule(ScheduleName.INTERLEAVED_ZB, 1, 2, (0,), (tuple(parse_actions("0F0 0I0 0F1 0I1 0W0 0W1 0OPT")),))
    early = Schedule(ScheduleName.INTERLEAVED_ZB, 1, 2, (0,), (tuple(parse_actions("0F0 0I0 0W0 0F1 0I1 0W1 0OPT")),))
    validate_schedule(late)
    validate_schedule(early)
    assert (max_in_flight(late, 0), max_in_flight(early, 0)) == (2, 1)


@pytest.mark.parametrize(("text", "error"), [
    ("0F0 0W0 0I0 0OPT", "W before its I"),
    ("0F0 0I0 0OPT", "is missing"),
    ("0F0 0B0 0I0 0W0 0OPT", "runs twice"),
    ("0I0 0F0 0W0 0OPT", "backward before its forward"),
    ("0F0 0I0 0OPT 0W0", "after the optimizer step"),
])
def test_split_backward_checked(text: str, error: str) -> None:
    bad = Schedule(ScheduleName.ZBV, 1, 1, (0,), (tuple(parse_actions(text)),))
    with pytest.raises(ScheduleError, match=error):
        validate_schedule(bad)


def test_i_feeds_the_stage_before() -> None:
    # stage 0 on rank 0 waits for stage 1's input gradient, which its I makes: a rank 1
    # list whose only W precedes nothing of stage 0's would deadlock if W were awaited
    two = Schedule(ScheduleName.INTERLEAVED_ZB, 2, 1, (0, 1), (
        tuple(parse_actions("0F0 0I0 0W0 0OPT")), tuple(parse_actions("1F0 1I0 1W0 1OPT"))))
    validate_schedule(two)
    stuck = Schedule(ScheduleName.INTERLEAVED_ZB, 2, 1, (0, 1), (
        tuple(parse_actions("0F0 0I0 0W0 0OPT")), tuple(parse_actions("1I0 1F0 1W0 1OPT"))))
    with pytest.raises(ScheduleError):
        validate_schedule(stuck)
    # the input gradient of stage 1 is made by its I and held to the rank's last backward
    assert held_input_grads(two) == {(1, 0): (1, 0)}
    assert Action.parse("3W12") == Action(3, Kind.W, 12)


@pytest.mark.parametrize(("name", "stages", "ranks", "error"), [
    (ScheduleName.ZBV, 5, None, "two stages per rank"),
    (ScheduleName.DUALPIPEV, 4, 3, "two stages per rank"),
    (ScheduleName.DUALPIPEV, 8, None, "must be >= 8"),
    (ScheduleName.LOOPED_BFS, 4, None, "needs num_ranks"),
    (ScheduleName.INTERLEAVED_ZB, 6, 4, "multiple of num_ranks"),
])
def test_bad_shapes_are_one_line(name: ScheduleName, stages: int, ranks: int | None, error: str) -> None:
    with pytest.raises(ScheduleError, match=error) as info:
        build_schedule(name, stages, 4, num_ranks=ranks)
    assert "\n" not in str(info.value)
