"""D2D device mapper: exact spare assignment for one mapping, exact search over mappings.

Expected figures are derived by hand in the comments (GB = 1e9 bytes, GB/s = 1e9 B/s), or
come from independent methods: an LP (scipy) for one mapping, enumeration of every
mapping (`brute_force`) for the search.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpress.d2d.static.mapper import map_devices
from mpress.d2d.static.mapping import MappingProblem, assign_spare, mapping_value
from mpress.d2d.static.maxflow import SwapNetwork, solve_by_flow, solve_concave, stage_levels
from mpress.errors import PlanError, UserError
from mpress.hardware.server import load_hardware
from tests.support.mapper import brute_force, mesh16

GB = 10**9


def problem(link, overflow, spare, idle=(), ports=None) -> MappingProblem:
    return MappingProblem(link_gbps=link, overflow_bytes=[int(x * GB) for x in overflow],
                          spare_bytes=[int(x * GB) for x in spare],
                          idle_spare_bytes=[int(x * GB) for x in idle], port_gbps=ports)


def check_stripes(p: MappingProblem, a) -> None:
    """Stripes place each stage's bytes, fit every lender, use only links, meet the levels."""
    spare = list(p.idle_spare_bytes)
    for s, d in enumerate(a.mapping):
        spare[d] = p.spare_bytes[s]
    received = [0] * p.num_devices
    for s, stripes in a.stripes.items():
        assert sum(b for _, b in stripes) == p.overflow_bytes[s] - a.stage_unplaced_bytes[s]
        for d, b in stripes:
            bw = p.link_gbps[a.mapping[s]][d] * GB
            assert bw > 0, "stripe over a missing link"
            assert b / bw <= a.swap_s[s] + 1.0 / bw + 1e-12  # whole bytes: one byte of slack per link
            received[d] += b
    assert all(r <= sp for r, sp in zip(received, spare))
    assert sum(a.stage_unplaced_bytes) == a.unplaced_bytes
    assert max(a.swap_s, default=0.0) == pytest.approx(a.slowest_swap_s, rel=1e-12)


# -- one mapping, by hand ----------------------------------------------------------------------

# Three GPUs: 0-1 at 50 GB/s, 0-2 at 25 GB/s, 1-2 unlinked.
TRIANGLE = [[0, 50, 25], [50, 0, 0], [25, 0, 0]]


def test_stripes_follow_bandwidth_2_to_1():
    # 3 GB from GPU 0 over 50 + 25 GB/s with ample spare: T = 3/75 = 0.04 s,
    # stripes 50*0.04 = 2 GB and 25*0.04 = 1 GB.
    a = assign_spare(problem(TRIANGLE, [3, 0, 0], [0, 10, 10]), [0, 1, 2])
    assert a.slowest_swap_s == pytest.approx(0.04, rel=1e-12)
    assert a.stripes[0] == ((1, 2 * GB), (2, 1 * GB))
    assert a.unplaced_bytes == 0 and a.feasible


def test_spare_cap_forces_non_proportional_stripes():
    # GPU 1 lends only 1.5 GB: min(1.5, 50T) + 25T = 3 with 50T >= 1.5 gives T = 0.06 s;
    # stripes 1.5 GB and 25*0.06 = 1.5 GB (not 2:1).
    p = problem(TRIANGLE, [3, 0, 0], [0, 1.5, 10])
    a = assign_spare(p, [0, 1, 2])
    assert a.slowest_swap_s == pytest.approx(0.06, rel=1e-12)
    assert a.stripes[0] == ((1, 1_500_000_000), (2, 1_500_000_000))
    check_stripes(p, a)


def test_unreachable_overflow_is_unplaced():
    # GPU 0 reaches only GPU 1 (1 GB spare); GPU 2's 10 GB is out of reach:
    # 2 GB unplaced, the 1 GB placed takes 1/50 = 0.02 s.
    p = problem([[0, 50, 0], [50, 0, 25], [0, 25, 0]], [3, 0, 0], [0, 1, 10])
    a = assign_spare(p, [0, 1, 2])
    assert a.unplaced_bytes == 2 * GB and not a.feasible
    assert a.stage_unplaced_bytes == (2 * GB, 0, 0)
    assert a.slowest_swap_s == pytest.approx(0.02, rel=1e-12)
    assert a.stripes[0] == ((1, 1 * GB),)


def test_two_stages_share_one_lender_and_levels_fill_down():
    # GPUs 0 and 1 both reach only GPU 2 (25 GB/s each), which lends 2.5 GB; stages need
    # 2 and 1 GB. 0.5 GB cannot be placed. The slowest swap is least when stage 1 places
    # all of its 1 GB (1/25 = 0.04 s) and stage 0 places 1.5 GB (1.5/25 = 0.06 s).
    p = problem([[0, 0, 25], [0, 0, 25], [25, 25, 0]], [2, 1, 0], [0, 0, 2.5])
    a = assign_spare(p, [0, 1, 2])
    assert a.unplaced_bytes == GB // 2
    assert a.slowest_swap_s == pytest.approx(0.06, rel=1e-12)
    assert a.swap_s[:2] == pytest.approx((0.06, 0.04), rel=1e-12)
    assert a.stripes == {0: ((2, 1_500_000_000),), 1: ((2, 1 * GB),)}


def test_port_limit_shares_a_gpus_links():
    # NVSwitch-like: every pair at 100 GB/s but each GPU's port carries 100 GB/s in all.
    # 4 GB out of GPU 0 takes 4/100 = 0.04 s however it is striped (not 4/300).
    p = problem([[0, 100, 100, 100], [100, 0, 100, 100], [100, 100, 0, 100], [100, 100, 100, 0]],
                [4, 0, 0, 0], [0, 5, 5, 5], ports=[100] * 4)
    a = assign_spare(p, [0, 1, 2, 3])
    assert a.slowest_swap_s == pytest.approx(0.04, rel=1e-12)
    check_stripes(p, a)


def test_solve_concave_walks_breakpoints():
    # min(1, 2T) + min(10, T) = 3: at T = 0.5 the first term caps at 1, so 1 + T = 3, T = 2.
    assert solve_concave([(1, 2.0), (10, 1.0)], 3) == pytest.approx(2.0)
    assert solve_concave([(1, 2.0)], 3) == math.inf
    assert solve_concave([(1, 2.0)], 0) == 0.0


# -- one mapping, against an LP ----------------------------------------------------------------

def network(p: MappingProblem, mapping) -> SwapNetwork:
    """The flow network of one mapping, built here independently of the mapper."""
    spare = list(p.idle_spare_bytes)
    for s, d in enumerate(mapping):
        spare[d] = p.spare_bytes[s]
    port = [x * GB for x in p.port_gbps] if p.port_gbps else [math.inf] * p.num_devices
    return SwapNetwork(demand_bytes=p.overflow_bytes, spare_bytes=tuple(spare),
                       link_bps=tuple(tuple(x * GB for x in p.link_gbps[d]) for d in mapping),
                       egress_bps=tuple(port[d] for d in mapping), ingress_bps=tuple(port))


def lp_value(net: SwapNetwork) -> tuple[float, float]:
    """(unplaced GB, least slowest time in s) by two linear programs (scipy)."""
    from scipy import optimize  # a dev dependency: the cross-check always runs
    stages = [s for s, b in enumerate(net.demand_bytes) if b > 0]
    n = len(net.spare_bytes)
    arcs = [(s, d) for s in stages for d in range(n) if net.link_bps[s][d] > 0]
    if not arcs:
        return sum(net.demand_bytes) / GB, 0.0
    nv = len(arcs) + 1  # stripes (GB), then T (s)
    a_ub, b_ub = [], []
    for d in range(n):  # a lender holds at most its spare
        a_ub.append([1.0 if dd == d else 0.0 for _, dd in arcs] + [0.0])
        b_ub.append(net.spare_bytes[d] / GB)
    for s in stages:  # a stage places at most its overflow
        a_ub.append([1.0 if ss == s else 0.0 for ss, _ in arcs] + [0.0])
        b_ub.append(net.demand_bytes[s] / GB)
    bounds = [(0, None)] * nv
    placed = optimize.linprog([-1.0] * len(arcs) + [0.0], A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    most = -placed.fun
    for k, (s, d) in enumerate(arcs):  # stripe time <= T
        row = [0.0] * nv
        row[k], row[-1] = 1.0, -net.link_bps[s][d] / GB
        a_ub.append(row)
        b_ub.append(0.0)
    for s in stages:  # egress ports
        if math.isfinite(net.egress_bps[s]):
            a_ub.append([1.0 if ss == s else 0.0 for ss, _ in arcs] + [-net.egress_bps[s] / GB])
            b_ub.append(0.0)
    for d in range(n):  # ingress ports
        if math.isfinite(net.ingress_bps[d]):
            a_ub.append([1.0 if dd == d else 0.0 for _, dd in arcs] + [-net.ingress_bps[d] / GB])
            b_ub.append(0.0)
    fastest = optimize.linprog([0.0] * len(arcs) + [1.0], A_ub=a_ub, b_ub=b_ub,
                               A_eq=[[1.0] * len(arcs) + [0.0]], b_eq=[most], bounds=bounds, method="highs")
    return sum(net.demand_bytes) / GB - most, fastest.fun


def test_fixed_mapping_cuts_flow_and_lp_agree():
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(2, 6)
        rates = [[0.0] * n for _ in range(n)]
        for i, j in itertools.combinations(range(n), 2):
            if rng.random() < 0.6:
                rates[i][j] = rng.choice([10.0, 25.0, 50.0])
                rates[j][i] = rng.choice([rates[i][j], 10.0])
        s = rng.randint(1, n)
        overflow = [rng.choice([0, 0, 1, 2, 5]) for _ in range(s)]
        p = problem(rates, overflow, [0 if o else rng.choice([0, 1, 3, 8]) for o in overflow],
                    idle=[rng.choice([0, 2])] * n, ports=rng.choice([None, None, [40.0] * n]))
        mapping = rng.sample(range(n), s)
        net = network(p, mapping)
        unplaced, slowest = mapping_value(p, mapping)  # cut families
        lp_unplaced, lp_slowest = lp_value(net)
        assert unplaced / GB == pytest.approx(lp_unplaced, abs=1e-6)
        assert slowest == pytest.approx(lp_slowest, rel=1e-6, abs=1e-12)
        assert solve_by_flow(net) == (unplaced, pytest.approx(slowest, rel=1e-9, abs=1e-15))
        flow_unplaced, levels = stage_levels(net)
        assert flow_unplaced == unplaced
        assert max(levels, default=0.0) == pytest.approx(slowest, rel=1e-9, abs=1e-15)
        check_stripes(p, assign_spare(p, mapping))


# -- search over mappings ----------------------------------------------------------------------

def test_search_moves_the_overflowing_stage_to_the_middle_of_a_path():
    # Path 0-1-2 at 25 GB/s. Stage 0 (2 GB) on GPU 0 reaches only GPU 1 (1 GB spare):
    # 1 GB unplaced. On GPU 1 it reaches both lenders: T = 2/50 = 0.04 s. Mappings with
    # stage 0 on GPU 1 are (1,0,2) and (1,2,0); the tie goes to the smaller.
    p = problem([[0, 25, 0], [25, 0, 25], [0, 25, 0]], [2, 0, 0], [0, 1, 1])
    assert mapping_value(p, [0, 1, 2]) == (GB, pytest.approx(0.04))
    r = map_devices(p)
    assert r.exact and not r.skipped_symmetric
    assert r.assignment.mapping == (1, 0, 2)
    assert r.assignment.slowest_swap_s == pytest.approx(0.04, rel=1e-12)
    assert r.assignment == brute_force(p)


def test_ties_go_to_the_identity():
    # Path 0-1-2, stage 1 in the middle already: the identity is optimal, as is (2,1,0).
    p = problem([[0, 25, 0], [25, 0, 25], [0, 25, 0]], [0, 2, 0], [1, 0, 1])
    assert map_devices(p).assignment.mapping == (0, 1, 2)


def test_more_devices_than_stages_uses_idle_spare():
    # 4 GPUs in a path 0-1-2-3 (25 GB/s), idle GPUs lend 1 GB, one stage with 2 GB:
    # it must sit between two GPUs (1 or 2) to place everything, T = 2/50 = 0.04 s.
    p = problem([[0, 25, 0, 0], [25, 0, 25, 0], [0, 25, 0, 25], [0, 0, 25, 0]], [2], [0], idle=[1] * 4)
    r = map_devices(p)
    assert r.assignment.mapping == (1,)
    assert r.assignment.slowest_swap_s == pytest.approx(0.04, rel=1e-12)


@st.composite
def small_problems(draw) -> MappingProblem:
    n = draw(st.integers(2, 6))
    s = draw(st.integers(1, n))
    rates = st.sampled_from([0.0, 0.0, 22.5, 45.0, 50.0])
    link = [[0.0] * n for _ in range(n)]
    for i, j in itertools.combinations(range(n), 2):
        link[i][j] = draw(rates)
        link[j][i] = draw(st.sampled_from([link[i][j], link[i][j] / 2])) if link[i][j] else 0.0
    overflow = draw(st.lists(st.sampled_from([0, 0, 1, 2, 3, 8]), min_size=s, max_size=s))
    spare = [0 if o else draw(st.sampled_from([0, 1, 2, 5, 9])) for o in overflow]
    idle = draw(st.sampled_from([[0] * n, [2] * n, [draw(st.sampled_from([0, 1, 4])) for _ in range(n)]]))
    ports = draw(st.sampled_from([None, None, None, [60.0] * n]))
    return problem(link, overflow, spare, idle, ports)


@settings(max_examples=60, deadline=None)
@given(small_problems())
def test_search_matches_brute_force(p):
    r = map_devices(p)
    b = brute_force(p)
    assert r.exact
    assert r.assignment.unplaced_bytes == b.unplaced_bytes
    assert r.assignment.slowest_swap_s == pytest.approx(b.slowest_swap_s, rel=1e-9, abs=1e-15)
    assert r.assignment.mapping == b.mapping  # same tie-break: identity, then smallest
    assert r.lower_bound_s <= r.assignment.slowest_swap_s
    check_stripes(p, r.assignment)


@settings(max_examples=25, deadline=None)
@given(small_problems(), st.sampled_from([0.0, 0.001, 0.003]))
def test_bounds_hold_when_the_budget_runs_out(p, budget_s):
    # Wherever the deadline stops the search, the bounds must hold (the stop point varies
    # with machine speed; the property does not).
    b = brute_force(p)
    r = map_devices(p, time_budget_s=budget_s)
    assert r.lower_bound_unplaced_bytes <= b.unplaced_bytes <= r.assignment.unplaced_bytes
    if r.assignment.unplaced_bytes == b.unplaced_bytes:
        assert r.lower_bound_s <= b.slowest_swap_s * (1 + 1e-9)
    assert 0.0 <= r.gap <= 1.0


def test_symmetric_topology_skips_the_search():
    p = problem([[0 if i == j else 50 for j in range(5)] for i in range(5)], [3, 2, 0, 0, 0], [0, 0, 1, 4, 2])
    r = map_devices(p)
    assert r.skipped_symmetric and r.exact and r.assignment.mapping == (0, 1, 2, 3, 4)
    b = brute_force(p)
    assert r.assignment.slowest_swap_s == pytest.approx(b.slowest_swap_s, rel=1e-12)
    assert r.assignment.unplaced_bytes == b.unplaced_bytes


def test_nvswitch_hardware_is_symmetric_and_port_limited():
    # DGX A100: every GPU has one 12 x 25 x 0.9 = 270 GB/s port; 8 GB out of stage 0
    # takes 8/270 s whatever the peers (lenders have ample spare).
    hw = load_hardware("dgx-a100")
    p = MappingProblem.from_hardware(hw, [8 * GB, 6 * GB, 0, 0, 0, 0, 0, 0], [0, 0] + [20 * GB] * 6)
    r = map_devices(p)
    assert r.skipped_symmetric
    assert r.assignment.slowest_swap_s == pytest.approx(8 / 270, rel=1e-12)
    check_stripes(p, r.assignment)


DGX1_OVERFLOW = [8 * GB, 6 * GB, 4 * GB, 2 * GB, 0, 0, 0, 0]
DGX1_SPARE = [0, 0, 0, 0, 3 * GB, 6 * GB, 9 * GB, 12 * GB]


def test_dgx1_search_is_exact_and_beats_the_identity():
    p = MappingProblem.from_hardware(load_hardware("dgx1-v100"), DGX1_OVERFLOW, DGX1_SPARE)
    r = map_devices(p)
    assert r.exact and not r.skipped_symmetric
    assert r.num_automorphisms > 1  # the cube-mesh has symmetries to prune with
    assert r.assignment.feasible
    # Identity: GPUs 0-3 overflow and each reaches exactly one lender, over 0-4 (2 links),
    # 1-5 (2), 2-6 (1), 3-7 (1). GPU 0 (8 GB) finds 3 GB on GPU 4: 5 GB stranded; GPU 2
    # sends 4 GB over one link (22.5 GB/s effective): 4/22.5 s.
    assert mapping_value(p, range(8)) == (5 * GB, pytest.approx(4 / 22.5, rel=1e-12))
    # Any mapping: stage 0's 8 GB leave over at most 6 links = 135 GB/s.
    assert 8 / 135 <= r.assignment.slowest_swap_s < 4 / 22.5
    assert r.mappings_examined < 40320
    check_stripes(p, r.assignment)


def test_dgx1_interrupted_search_bounds_the_optimum():
    p = MappingProblem.from_hardware(load_hardware("dgx1-v100"), DGX1_OVERFLOW, DGX1_SPARE)
    best = map_devices(p).assignment.slowest_swap_s
    for budget_s in (0.0, 0.002, 0.005):
        r = map_devices(p, time_budget_s=budget_s)
        assert r.lower_bound_s <= best * (1 + 1e-9) <= r.assignment.slowest_swap_s * (1 + 2e-9)


@settings(max_examples=25, deadline=None)
@given(small_problems(), st.sampled_from([1, 3, 10, 40]))
def test_a_work_budget_cuts_the_search_at_the_same_point_every_time(p, work):
    # A work budget (bound evaluations, not seconds) stops the search at one node whatever
    # the machine's speed or load, so the planner's mappings are reproducible; the
    # bounds hold as under a time budget.
    first, again = map_devices(p, work_budget=work), map_devices(p, work_budget=work)
    assert (first.assignment, first.exact, first.lower_bound_s, first.nodes_visited) == \
        (again.assignment, again.exact, again.lower_bound_s, again.nodes_visited)
    b = brute_force(p)
    assert first.lower_bound_unplaced_bytes <= b.unplaced_bytes <= first.assignment.unplaced_bytes
    if first.assignment.unplaced_bytes == b.unplaced_bytes:
        assert first.lower_bound_s <= b.slowest_swap_s * (1 + 1e-9)


def test_dgx1_work_budget_stops_the_search_and_bounds_the_optimum():
    p = MappingProblem.from_hardware(load_hardware("dgx1-v100"), DGX1_OVERFLOW, DGX1_SPARE)
    full = map_devices(p)
    cut = map_devices(p, work_budget=20)
    assert full.exact and not cut.exact
    assert cut.nodes_visited < full.nodes_visited
    assert cut.lower_bound_s <= full.assignment.slowest_swap_s * (1 + 1e-9) <= cut.assignment.slowest_swap_s * (1 + 2e-9)
    with pytest.raises(ValueError, match="work_budget"):
        map_devices(p, work_budget=0)


@pytest.mark.slow
def test_dgx1_search_equals_enumerating_all_8_factorial_mappings():
    p = MappingProblem.from_hardware(load_hardware("dgx1-v100"), DGX1_OVERFLOW, DGX1_SPARE)
    r = map_devices(p)
    b = brute_force(p)
    assert r.assignment.mapping == b.mapping
    assert r.assignment.slowest_swap_s == pytest.approx(b.slowest_swap_s, rel=1e-9)




def test_16_gpus_heuristic_reports_a_valid_bound():
    p = problem(mesh16(1), [10, 9, 8, 7, 6, 5, 4, 3] + [0] * 8, [0] * 8 + [4, 5, 6, 7, 8, 9, 10, 11])
    r = map_devices(p, time_budget_s=0.5)
    a = r.assignment
    assert a.feasible and sorted(a.mapping) == list(range(16))
    assert mapping_value(p, a.mapping) == (0, pytest.approx(a.slowest_swap_s, rel=1e-9))
    assert 0 < r.lower_bound_s <= a.slowest_swap_s
    # Each stage alone on the best-linked GPU is a valid floor: the 10 GB stage needs at
    # least 10 GB / (that GPU's total link rate).
    best_rate = max(sum(row) for row in p.link_gbps)
    assert r.lower_bound_s >= 10 / best_rate * (1 - 1e-12)
    check_stripes(p, a)


# -- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    ({"link_gbps": [[0, 1], [1, 0], [0, 0]]}, "square"),
    ({"link_gbps": [[0, 1], [0, 0]]}, "both directions"),
    ({"link_gbps": [[1, 1], [1, 0]]}, "diagonal"),
    ({"link_gbps": [[0, -1], [-1, 0]]}, ">= 0"),
    ({"overflow_bytes": [-1, 0]}, "overflow_bytes[0]"),
    ({"spare_bytes": [0, 1.5]}, "whole number"),
    ({"overflow_bytes": [0, 0, 0], "spare_bytes": [0, 0, 0]}, "do not fit"),
    ({"spare_bytes": [0]}, "one entry per stage"),
    ({"idle_spare_bytes": [1]}, "idle_spare_bytes"),
    ({"port_gbps": [0, 1]}, "port_gbps"),
])
def test_bad_input_is_a_one_line_user_error(kwargs, words):
    base = {"link_gbps": [[0, 1], [1, 0]], "overflow_bytes": [1, 0], "spare_bytes": [0, 1]}
    with pytest.raises(PlanError) as err:
        MappingProblem(**{**base, **kwargs})
    assert isinstance(err.value, UserError)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_bad_mapping_is_rejected():
    p = problem(TRIANGLE, [1, 0, 0], [0, 1, 1])
    for bad in ([0, 0, 1], [0, 1], [0, 1, 3]):
        with pytest.raises(PlanError, match="distinct devices"):
            assign_spare(p, bad)
