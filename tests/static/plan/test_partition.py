"""Layer-to-stage partitioning: hand-worked cases, brute-force optimality, errors."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpress.errors import ScheduleError, UserError
from mpress.static.plan.partition import (
    layer_costs,
    partition_layers,
    partition_profile,
)
from mpress.static.profile.profile import LayerProfile, Profile, SavedTensor


def all_splits(n: int, m: int) -> list[list[tuple[int, int]]]:
    """Every split of n layers into m non-empty contiguous ranges."""
    out = []
    for cuts in itertools.combinations(range(1, n), m - 1):
        bounds = (0, *cuts, n)
        out.append([(bounds[i], bounds[i + 1]) for i in range(m)])
    return out


def bottleneck(costs: list[float], ranges: list[tuple[int, int]]) -> float:
    return max(sum(costs[a:b]) for a, b in ranges)


def check_shape(ranges: list[tuple[int, int]], n: int, m: int) -> None:
    assert len(ranges) == m
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c
    assert all(a < b for a, b in ranges)


# ---------------------------------------------------------------- hand-worked cases

@pytest.mark.parametrize(("costs", "m", "expected"), [
    ([1, 1, 1, 1], 2, [(0, 2), (2, 4)]),
    # one heavy layer alone; the rest together also cost 5
    ([5, 1, 1, 1, 1, 1], 2, [(0, 1), (1, 6)]),
    # tie (bottleneck 2 either way): the later stage takes the extra layer
    ([1, 1, 1], 2, [(0, 1), (1, 3)]),
    ([3, 1, 1, 1, 3], 3, [(0, 1), (1, 4), (4, 5)]),
    # 1..9 into 3: limits 15 and 16 need 4 stages, 17 needs 3 (15 | 6+7 | 8+9);
    # from the back: 8+9=17 (adding 7 exceeds), then 6+7=13 (adding 5 exceeds), then 1..5
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [(0, 5), (5, 7), (7, 9)]),
    ([2, 7, 3], 3, [(0, 1), (1, 2), (2, 3)]),
    ([4, 4, 4], 1, [(0, 3)]),
    # all zero: any split ties; later stages take all but one layer each before them
    ([0, 0, 0, 0], 2, [(0, 1), (1, 4)]),
])
def test_literal(costs: list[float], m: int, expected: list[tuple[int, int]]) -> None:
    assert partition_layers([float(c) for c in costs], m) == expected


@pytest.mark.parametrize(("n", "m"), [(3, 4), (0, 1), (5, 0), (5, -1)])
def test_cannot_split(n: int, m: int) -> None:
    with pytest.raises(ScheduleError, match=f"cannot split {n} layers into {m} stages") as info:
        partition_layers([1.0] * n, m)
    assert isinstance(info.value, UserError)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_cost(bad: float) -> None:
    with pytest.raises(ScheduleError, match="layer 1 has cost"):
        partition_layers([1.0, bad, 1.0], 2)


# ---------------------------------------------------------------- brute force

@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=20), min_size=1, max_size=9), st.data())
def test_optimal_against_brute_force(costs: list[int], data: st.DataObject) -> None:
    n = len(costs)
    m = data.draw(st.integers(min_value=1, max_value=n))
    fcosts = [float(c) for c in costs]  # integers: sums are exact, so ties are real ties
    got = partition_layers(fcosts, m)
    check_shape(got, n, m)
    splits = all_splits(n, m)
    best = min(bottleneck(fcosts, s) for s in splits)
    assert bottleneck(fcosts, got) == best
    # tie rule: among optimal splits, the last stage has the most layers, then the one before...
    optimal = [s for s in splits if bottleneck(fcosts, s) == best]
    assert got == max(optimal, key=lambda s: [b - a for a, b in reversed(s)])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e3, allow_nan=False), min_size=1, max_size=8), st.data())
def test_optimal_with_float_costs(costs: list[float], data: st.DataObject) -> None:
    n = len(costs)
    m = data.draw(st.integers(min_value=1, max_value=n))
    got = partition_layers(costs, m)
    check_shape(got, n, m)
    best = min(bottleneck(costs, s) for s in all_splits(n, m))
    assert bottleneck(costs, got) == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_many_layers_is_fast_and_balanced() -> None:
    costs = [1.0] * 96 + [3.0]  # a GPT-ish stack with a heavier head
    got = partition_layers(costs, 8)
    check_shape(got, 97, 8)
    # 99 units over 8 stages: 13 is the best possible bottleneck (8 * 12 < 99)
    assert bottleneck(costs, got) == 13.0


# ---------------------------------------------------------------- profiles

def layer(name: str, fwd_s: float, bwd_s: float, saved_bytes: int, param_bytes: int) -> LayerProfile:
    return LayerProfile(
        name=name, forward_flops=0.0, backward_flops=0.0, forward_time_s=fwd_s, backward_time_s=bwd_s,
        saved=[SavedTensor(module=name, index=0, bytes=saved_bytes)], param_bytes=param_bytes,
        grad_bytes=param_bytes, optim_bytes=2 * param_bytes,
    )


def profile() -> Profile:
    # compute is heavy at the end, memory at the start
    layers = [
        layer("embed", 0.1, 0.1, 100, 1000),  # compute 0.2, memory 100 + 4*1000 = 4100
        layer("layers.0", 0.1, 0.1, 100, 10),  # 0.2, 140
        layer("layers.1", 0.1, 0.1, 100, 10),  # 0.2, 140
        layer("head", 0.3, 0.3, 100, 10),  # 0.6, 140
    ]
    return Profile(model="toy", model_fingerprint="x", source="analytic", device="cpu", dtype="fp32",
                   microbatch_size=1, layers=layers)


def test_layer_costs() -> None:
    p = profile()
    assert layer_costs(p, "compute") == pytest.approx([0.2, 0.2, 0.2, 0.6])
    assert layer_costs(p, "memory") == [4100.0, 140.0, 140.0, 140.0]
    with pytest.raises(ScheduleError, match="unknown balance"):
        layer_costs(p, "speed")  # type: ignore[arg-type]


def test_partition_profile_compute_vs_memory() -> None:
    p = profile()
    # compute: best bottleneck 0.6 = head alone (0.2*3 = 0.6 on the other side too)
    assert partition_profile(p, 2) == [(0, 3), (3, 4)]
    # memory: embed alone (4100) is the bottleneck whatever the split; the rest goes later
    assert partition_profile(p, 2, "memory") == [(0, 1), (1, 4)]
