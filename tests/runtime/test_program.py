"""RankProgram: a rank's action list walked in step with the schedule (pure, no torch
schedule): memory actions issued exactly where the list puts them, inside actions
checked, the executed log equal to the list, and every mismatch a PlanError naming both
sides."""

from __future__ import annotations

import pytest

from mpress.contract.actions import Action, Kind, format_actions, parse_actions
from mpress.errors import PlanError
from mpress.contract.live_bytes import LiveBytes
from mpress.runtime.program import RankProgram

LIST = ("0F0 0SO0:0:a.**@r0 0DR0:0:b.**@r1 0F1 0SO1:0:a.**@r0 0DR1:0:b.**@r1 0SI0:0:a.**@r0 0B0 "
        "0RC0:0:b.**@r1 0SI1:0:a.**@r0 0B1 0RC1:0:b.**@r1 0OI:0:optim:a 0OPT:0:optim:a 0OO:0:optim:a "
        "0OPT:0:optim:b")


class Rank:
    """Drives a program as the stage and job do, recording what each handler saw and when."""

    def __init__(self, text: str = LIST) -> None:
        self.program = RankProgram(parse_actions(text), rank=0)
        self.events: list[str] = []
        for kind in (Kind.SI, Kind.OI, Kind.OO):
            self.program.on(kind, 0, lambda a: self.events.append(f"issue {a}"))
        self.program.on_release(lambda: self.events.append("release"))

    def compute(self, text: str, inside: str = "") -> None:
        action = Action.parse(text)
        self.program.begin(action)
        self.events.append(f"run {action}")
        for a in inside.split():
            self.program.record(Action.parse(a))
        self.program.end()

    def step(self) -> None:
        self.compute("0F0", "0SO0:0:a.**@r0 0DR0:0:b.**@r1")
        self.compute("0F1", "0DR1:0:b.**@r1 0SO1:0:a.**@r0")  # recorded in any order
        self.compute("0B0", "0RC0:0:b.**@r1")
        self.compute("0B1", "0RC1:0:b.**@r1")
        self.compute("0OPT:0:optim:a")
        self.compute("0OPT:0:optim:b")
        self.program.end_step()


def test_the_executed_log_is_the_list_and_actions_are_issued_where_it_puts_them():
    rank = Rank()
    rank.step()
    assert format_actions(rank.program.last_log) == LIST
    # each swap-in right before its backward, after the previous compute action's
    # inside actions; the release point waits after the issues it follows
    assert rank.events == [
        "release", "run 0F0", "release", "run 0F1",
        "issue 0SI0:0:a.**@r0", "release", "run 0B0",
        "issue 0SI1:0:a.**@r0", "release", "run 0B1",
        "issue 0OI:0:optim:a", "release", "run 0OPT:0:optim:a",
        "issue 0OO:0:optim:a", "release", "run 0OPT:0:optim:b",
        "release",  # the end of the step releases what the last compute action left
    ]
    rank.events.clear()
    rank.step()  # the next step starts from the top
    assert format_actions(rank.program.last_log) == LIST
    assert rank.events[:2] == ["release", "run 0F0"]


def test_trailing_actions_are_issued_at_the_end_of_the_step():
    rank = Rank("0F0 0B0 0OPT:0:optim:a 0OO:0:optim:a")
    rank.compute("0F0")
    rank.compute("0B0")
    rank.compute("0OPT:0:optim:a")
    assert rank.events[-1] == "run 0OPT:0:optim:a"
    rank.program.end_step()
    assert rank.events[-2:] == ["issue 0OO:0:optim:a", "release"]
    assert format_actions(rank.program.last_log) == "0F0 0B0 0OPT:0:optim:a 0OO:0:optim:a"


def test_a_schedule_that_runs_another_action_is_refused_naming_both():
    rank = Rank()
    rank.compute("0F0", "0SO0:0:a.**@r0 0DR0:0:b.**@r1")
    with pytest.raises(PlanError, match="rank 0: the plan's program runs 0F1 next, the schedule runs 0B0"):
        rank.compute("0B0")


def test_an_inside_action_that_did_not_run_is_refused():
    rank = Rank()
    rank.compute("0F0", "0SO0:0:a.**@r0")  # the drop of b never happened
    with pytest.raises(PlanError, match=r"runs 0DR0:0:b.\*\*@r1 inside 0F0, which did not execute it"):
        rank.compute("0F1")


def test_an_inside_action_the_list_does_not_have_there_is_refused():
    rank = Rank()
    rank.compute("0F0", "0SO0:0:a.**@r0 0DR0:0:b.**@r1 0SO0:0:c.**@r2")
    with pytest.raises(PlanError, match=r"0F0 executed 0SO0:0:c.\*\*@r2, which the program does not list there"):
        rank.compute("0F1")


def test_an_inside_action_of_another_microbatch_is_refused_at_once():
    rank = Rank()
    rank.program.begin(Action.parse("0F0"))
    with pytest.raises(PlanError, match="0SO1:0:a.\\*\\*@r0 ran outside the compute action it belongs to"):
        rank.program.record(Action.parse("0SO1:0:a.**@r0"))


def test_a_step_that_ends_early_is_refused():
    rank = Rank()
    rank.compute("0F0", "0SO0:0:a.**@r0 0DR0:0:b.**@r1")
    with pytest.raises(PlanError, match="the step ended before the program's 0F1"):
        rank.program.end_step()


def test_an_action_nothing_executes_is_refused():
    program = RankProgram(parse_actions("0F0 0F1 0SI0:0:a.**@r0 0B0 0B1"), rank=3)
    program.begin(Action.parse("0F0"))
    program.begin(Action.parse("0F1"))
    with pytest.raises(PlanError, match=r"rank 3: nothing on this rank executes 0SI0:0:a.\*\*@r0"):
        program.begin(Action.parse("0B0"))
    with pytest.raises(PlanError, match="run inside compute actions"):
        program.on(Kind.SO, 0, lambda a: None)


def test_what_the_list_compacts_per_microbatch():
    program = RankProgram(parse_actions(LIST), rank=0)
    assert program.compacted(0, 1) == {"0:a.**@r0": Kind.SO, "0:b.**@r1": Kind.DR}
    assert program.compacted(0, 2) == {}
    assert [str(a) for a in program.optimizer_actions()] == ["0OPT:0:optim:a", "0OPT:0:optim:b"]


def test_the_live_bytes_tracker_is_told_what_runs():
    live = LiveBytes(rank=0)
    rank = Rank()
    rank.program.live = live
    seen = []
    rank.program.on(Kind.SI, 0, lambda a: seen.append(live.context))
    rank.compute("0F0", "0SO0:0:a.**@r0 0DR0:0:b.**@r1")
    assert live.context == "0F0"
    rank.compute("0F1", "0SO1:0:a.**@r0 0DR1:0:b.**@r1")
    rank.compute("0B0", "0RC0:0:b.**@r1")
    assert seen == ["0SI0:0:a.**@r0"]  # an issued action's allocations are named after it
    assert live.context == "0B0"


def test_spans_cover_compute_and_issues_for_the_trace():
    rank = Rank()
    rank.step()
    spans = rank.program.spans
    assert [str(s.action) for s in spans] == LIST.split()
    for s in spans:
        assert s.end_s >= s.start_s
        if not s.action.is_compute:
            assert s.end_s == s.start_s
