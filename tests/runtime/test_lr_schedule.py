"""The learning-rate schedule (pure): warmup, each decay shape, min_lr, the boundaries,
and torch's `LambdaLR` setting the same floats."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mpress.runtime.lr_schedule import LrSchedule

LR = 1e-3


def rates(kind: str, *, total: int, warmup: int = 0, min_lr: float = 0.0) -> list[float]:
    s = LrSchedule(kind=kind, lr=LR, total_steps=total, warmup_steps=warmup, min_lr=min_lr)
    return [s.rate(k) for k in range(total)]


def test_constant_without_warmup_is_lr_at_every_step():
    assert rates("constant", total=5) == [LR] * 5


def test_warmup_is_a_straight_line_from_zero_that_reaches_lr_after_warmup_steps():
    r = rates("constant", total=8, warmup=3)
    assert r[:3] == pytest.approx([LR / 4, 2 * LR / 4, 3 * LR / 4])
    assert r[3:] == [LR] * 5
    assert all(a < b for a, b in itertools.pairwise(r[:4]))  # no step at 0, none repeats lr


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_decay_starts_at_lr_after_warmup_and_ends_at_min_lr_on_the_last_step(kind):
    r = rates(kind, total=10, warmup=2, min_lr=1e-4)
    assert r[2] == LR
    assert r[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in itertools.pairwise(r[2:]))  # strictly decreasing


def test_linear_and_cosine_values_in_between():
    lin = rates("linear", total=5, min_lr=0.0)
    assert lin == pytest.approx([LR, 0.75 * LR, 0.5 * LR, 0.25 * LR, 0.0])
    cos = rates("cosine", total=5, min_lr=0.0)
    assert cos == pytest.approx([LR * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)])
    assert cos[2] == pytest.approx(LR / 2)


def test_no_room_to_decay_runs_the_last_step_at_min_lr():
    assert rates("cosine", total=3, warmup=2, min_lr=1e-5) == pytest.approx([LR / 3, 2 * LR / 3, 1e-5])
    assert rates("linear", total=1, min_lr=2e-4) == pytest.approx([2e-4])


def test_steps_past_the_end_stay_at_min_lr():
    s = LrSchedule(kind="cosine", lr=LR, total_steps=4, min_lr=1e-5)
    assert s.rate(10) == pytest.approx(1e-5)


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
def test_apply_sets_what_torch_lambda_lr_sets_bit_for_bit(kind):
    s = LrSchedule(kind=kind, lr=3e-4, total_steps=12, warmup_steps=4, min_lr=3e-5 if kind != "constant" else 0.0)
    p = torch.nn.Parameter(torch.zeros(1))
    a = torch.optim.AdamW([{"params": [p]}, {"params": []}], lr=3e-4)
    b = torch.optim.AdamW([{"params": [p]}, {"params": []}], lr=3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(b, s.factor)
    for k in range(12):
        s.apply(a, k, [3e-4, 3e-4])
        assert [g["lr"] for g in a.param_groups] == [g["lr"] for g in b.param_groups], k
        b.step()
        sched.step()


@pytest.mark.parametrize("kwargs", [{"kind": "step"}, {"min_lr": 2e-3}, {"total_steps": 0},
                                    {"warmup_steps": -1}])
def test_bad_schedules_are_refused(kwargs):
    with pytest.raises(ValueError):
        LrSchedule(**{"kind": "cosine", "lr": LR, "total_steps": 5, **kwargs})
    with pytest.raises(ValueError):
        LrSchedule(kind="cosine", lr=LR, total_steps=5).factor(-1)
