"""Action strings: parsing, printing and validation."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpress.contract.actions import Action, B, F, Kind, Schedule, format_actions, parse_actions
from mpress.errors import ScheduleError


def test_torch_style_strings():
    assert str(F(0, 3)) == "0F3"
    assert str(B(2, 1)) == "2B1"
    assert str(Action(1, Kind.SO, 4, "layers.3.mlp.fc1#0")) == "1SO4:layers.3.mlp.fc1#0"
    assert str(Action(3, Kind.OPT)) == "3OPT"
    assert str(Action(0, Kind.OO, None, "optim:stage0")) == "0OO:optim:stage0"


def test_parse_inverts_format():
    text = "0F0 0F1 0SO0:layers.0.attn#2 0B0 0SI1:layers.0.attn#2 0B1 0OPT 0OO:optim:*"
    assert format_actions(parse_actions(text)) == text
    assert parse_actions("0F0,1B2") == [F(0, 0), B(1, 2)]


@pytest.mark.parametrize("bad", ["F0", "0X1", "0F", "0OPT3", "0SO1", "0F1:x", "-1F0", "0F1 x"])
def test_malformed_actions_raise(bad):
    with pytest.raises(ScheduleError):
        Action.parse(bad)


def test_kind_is_part_of_identity():
    assert F(0, 1) != B(0, 1)
    assert len({F(0, 1), B(0, 1), F(0, 1)}) == 2


@given(stage=st.integers(0, 99), mb=st.integers(0, 999),
       kind=st.sampled_from([Kind.F, Kind.B, Kind.SO, Kind.SI, Kind.DO, Kind.DI, Kind.DR, Kind.RC]),
       tensor=st.from_regex(r"[a-z][a-z0-9_.#:*]{0,20}", fullmatch=True))
def test_round_trip(stage, mb, kind, tensor):
    a = Action(stage, kind, mb, tensor if kind not in (Kind.F, Kind.B) else None)
    assert Action.parse(str(a)) == a


def test_schedule_text_round_trip():
    sched = Schedule("gpipe", 2, 2, (0, 1), ((F(0, 0), F(0, 1), B(0, 0), B(0, 1)), (F(1, 0), B(1, 0), F(1, 1), B(1, 1))))
    lines = sched.to_text().splitlines()
    assert [tuple(parse_actions(line.partition(":")[2])) for line in lines] == list(sched.ranks)
    assert sched.stages_of_rank(1) == [1]
