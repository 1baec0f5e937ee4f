"""Stage->device mapping for D2D swap: put pipeline stages on GPUs so that the slowest
stage's swap to its NVLink peers' spare memory is as fast as possible (MPress's device
mapping, PAPERS.md section 1).

A mapping puts each stage on a distinct device. A stage with overflow stripes it over
linked devices with spare memory; stripes move in parallel, so its swap takes the longest
stripe time. For one mapping the best striping is exact (`maxflow.py`). Over mappings
(`map_devices`): on a symmetric topology every mapping is a relabelling of the identity,
so the search is skipped; otherwise an exact branch and bound (`_Search`), which a budget
may cut short, and then the result carries a lower bound so the gap is known. The budget
is time or work (bound evaluations): a work budget cuts the search at the same node on
every machine, so the planner's mappings, and hence its plans, do not depend on how
fast or how loaded the machine is.
Objective: fewest unplaced bytes, then the least slowest swap time; ties (within
`REL_TOL`) go to the identity, then to the lexicographically smallest mapping.

Units: bytes, seconds, GB/s with GB = 1e9 bytes.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Sequence

from mpress.d2d.static.cut_table import CutTable
from mpress.d2d.static.mapping import (
    MAX_CUT_STAGES,
    REL_TOL,
    MapperResult,
    MappingProblem,
    assign_spare,
    byte_rates,
    cut_table,
    is_better,
    mapping_value,
    reaches,
)

DEFAULT_TIME_BUDGET_S = 10.0
"""Search time when the caller gives none; the search stops sooner once it has proved optimality."""
HEURISTIC_SHARE = 0.3
"""Most of the budget (time or work) that the greedy-and-swaps seeding may take."""
_MAX_AUTOMORPHISMS = 20_000


def _automorphisms(problem: MappingProblem, colour: Sequence[object]) -> list[tuple[int, ...]]:
    """Device permutations that keep every link rate and colour (ports, idle spare):
    mapping values are invariant under them. [identity] when there are too many."""
    n, bw = problem.num_devices, problem.link_gbps
    key = [(colour[d], tuple(sorted(bw[d])), tuple(sorted(bw[e][d] for e in range(n)))) for d in range(n)]
    perm, used, found = [-1] * n, [False] * n, []

    def extend(i: int) -> bool:
        if i == n:
            found.append(tuple(perm))
            return len(found) <= _MAX_AUTOMORPHISMS
        for v in range(n):
            if not used[v] and key[v] == key[i] and all(
                    bw[i][j] == bw[v][perm[j]] and bw[j][i] == bw[perm[j]][v] for j in range(i)):
                perm[i], used[v] = v, True
                ok = extend(i + 1)
                perm[i], used[v] = -1, False
                if not ok:
                    return False  # too many: give up on symmetry
        return True

    return found if extend(0) else [tuple(range(n))]


class _Search:
    """Branch and bound over stage placements.

    - Order: overflowing stages (largest first) and lenders (most spare first), the scarcer
      kind first, then stages that neither need nor lend. When idle spares are all equal,
      devices left without a stage get pseudo-stages lending that spare, so a mapping is
      a permutation and the spares still to place form a pool.
    - Bound of a partial mapping: `CutTable`, the exact fixed-mapping optimum of a
      relaxation (waiting overflowing stages dropped, pooled spares placed best per cut
      family), plus what waiting stages must leave unplaced.
    - Symmetry: the first block of the order only takes orbit representatives of the
      topology's automorphisms (stabiliser chain); interchangeable stages in the rest
      take increasing devices.
    - Incumbent: pairwise swaps from the identity and from a greedy placement; children
      are explored best bound first. Ties are settled afterwards by `first_optimal`.
    """

    def __init__(self, problem: MappingProblem, deadline: float, work_limit: float = math.inf) -> None:
        n, s = problem.num_devices, problem.num_stages
        idle = problem.idle_spare_bytes
        pseudo = n - s if len(set(idle)) == 1 else 0
        self.problem, self.deadline, self.num_real = problem, deadline, s
        self.work, self.work_limit = 0, work_limit
        """Bound evaluations so far, and the most the search may make."""
        self.demand = list(problem.overflow_bytes) + [0] * pseudo
        self.spare = list(problem.spare_bytes) + [idle[0]] * pseudo
        self.pool = len(self.demand) == n
        self.rates = byte_rates(problem)
        self.link = self.rates[0]
        ports = problem.port_gbps or (math.inf,) * n
        self.group = _automorphisms(problem, [(ports[d], 0 if self.pool else idle[d]) for d in range(n)])
        overflowing = sorted((st for st, b in enumerate(self.demand) if b > 0), key=lambda st: (-self.demand[st], st))
        lenders = sorted((st for st, b in enumerate(self.demand) if b == 0 and self.spare[st] > 0),
                         key=lambda st: (-self.spare[st], st))
        fillers = [st for st, b in enumerate(self.demand) if b == 0 and self.spare[st] == 0]
        self.greedy_order = overflowing + lenders + fillers
        # The scarcer kind goes first: its placements constrain the bound most. The first
        # block is reduced by the automorphisms, the rest by interchangeable stages.
        first, second = (lenders, overflowing) if len(lenders) < len(overflowing) else (overflowing, lenders)
        self.order = first + second + fillers
        self.chain_depth = len(first)
        self.by_cuts = len(overflowing) <= MAX_CUT_STAGES
        # No mapping places more than the n largest spares can hold.
        self.least_unplaced = max(0, sum(self.demand) - sum(sorted(self.spare + ([] if self.pool else list(idle)))[-n:]))
        self.best: tuple[int, float] = (sys.maxsize, math.inf)
        self.best_mapping: list[int] = []
        self.examined = self.nodes = 0
        self.frontier: list[tuple[list[tuple[int, int]], tuple[int, float] | None]] = []
        """Open nodes when the deadline struck: (placements, key if known)."""

    def table(self, placed: Sequence[tuple[int, int]] = ()) -> CutTable:
        t = cut_table(self.problem, self.demand, self.spare, self.pool, self.rates)
        for st, d in placed:
            t.place(st, d)
        return t

    def spent(self, deadline: float | None = None, work_limit: float | None = None) -> bool:
        """The budget (default: the whole search's) is used up, in time or in work."""
        return (self.work >= (self.work_limit if work_limit is None else work_limit)
                or time.perf_counter() > (self.deadline if deadline is None else deadline))

    def key(self, t: CutTable, ref: tuple[int, float] | None = None) -> tuple[int, float]:
        """Bound of t's completions against ref (default: the incumbent); exact when t is
        complete and beats ref."""
        self.work += 1
        ref_u, ref_t = ref or self.best
        stop = ref_t * (1 - REL_TOL)
        if ref_u == 0:
            return 0, t.time_bound(0, stop)
        u = max(t.unplaced_bound(), self.least_unplaced)
        return u, t.time_bound(u, stop if u == ref_u else math.inf)

    def value(self, mapping: Sequence[int], ref: tuple[int, float] = (sys.maxsize, math.inf)) -> tuple[int, float]:
        """Value of a complete mapping (pseudo-stages included), exact when it beats ref."""
        self.examined += 1
        if not self.by_cuts:
            self.work += 1
            return mapping_value(self.problem, mapping[:self.num_real])
        return self.key(self.table(list(enumerate(mapping))), ref)

    def consider(self, value: tuple[int, float], mapping: Sequence[int]) -> bool:
        better = is_better(value, self.best)
        if better:
            self.best, self.best_mapping = value, list(mapping)
        return better

    def greedy(self) -> list[int]:
        """Overflowing stages where most links stay free; lenders next to the most demand."""
        device_of = [-1] * len(self.demand)
        for st in self.greedy_order:
            free = [d for d in range(len(self.link)) if d not in device_of]
            placed = [(o, d) for o, d in enumerate(device_of) if d >= 0 and self.demand[o] > 0]
            score = {d: sum(self.link[d][e] for e in free) if self.demand[st] > 0
                     else sum(self.demand[o] * self.link[v][d] for o, v in placed) for d in free}
            device_of[st] = max(free, key=lambda d: (score[d], -d))
        return device_of

    def improve(self, mapping: list[int], until: float, work_until: float) -> None:
        """Pairwise swaps of device contents until none helps (first improvement) or the
        seeding's share of the budget (`until` in time, `work_until` in work) is spent."""
        current, value = list(mapping), self.value(mapping)
        self.consider(value, current)
        improved = True
        while improved:
            improved = False
            for i, j in itertools.combinations(range(len(self.link)), 2):
                trial = [j if d == i else i if d == j else d for d in current]
                if trial == current:
                    continue  # both devices idle
                if self.spent(until, work_until):
                    return
                trial_value = self.value(trial, value)
                if is_better(trial_value, value):
                    current, value, improved = trial, trial_value, True
                    self.consider(value, current)

    def candidates(self, t: CutTable, depth: int, group: list[tuple[int, ...]]) -> list[int]:
        st = self.order[depth]
        free = [d for d, occupant in enumerate(t.stage_on) if occupant < 0]
        if depth < self.chain_depth:  # orbit representatives under the stabiliser of the placed devices
            return [d for d in free if all(g[d] >= d for g in group)]
        prev = self.order[depth - 1]
        if depth > self.chain_depth and (self.demand[prev], self.spare[prev]) == (self.demand[st], self.spare[st]):
            return [d for d in free if d > t.device_of[prev]]  # interchangeable stages
        return free

    def branch(self, t: CutTable, depth: int, group: list[tuple[int, ...]]) -> bool:
        """Depth-first search below t; True when the deadline stopped it."""
        placed = [(st, t.device_of[st]) for st in self.order[:depth]]
        if self.spent():
            self.frontier.append((placed, None))
            return True
        st = self.order[depth]
        last = depth == len(self.order) - 1
        children = []
        for d in self.candidates(t, depth, group):
            t.place(st, d)
            self.nodes += 1
            key = self.key(t)
            if last:
                self.examined += 1
                self.consider(key, t.device_of)
            elif is_better(key, self.best):
                children.append((key, d))
            t.unplace(st)
        children.sort()
        for i, (key, d) in enumerate(children):
            if not is_better(key, self.best):
                break  # sorted: the rest cannot beat the new incumbent either
            t.place(st, d)
            stopped = self.branch(t, depth + 1, [g for g in group if g[d] == d] if depth < self.chain_depth else group)
            t.unplace(st)
            if stopped:
                self.frontier += [(placed + [(st, d2)], key2) for key2, d2 in children[i + 1:]]
                return True
        return False

    def first_optimal(self, t: CutTable, depth: int, limit: float) -> list[int] | None:
        """Lexicographically first mapping with value <= (best unplaced, limit)."""
        if self.spent():
            raise TimeoutError
        same = [i for i in range(depth) if (self.demand[i], self.spare[i]) == (self.demand[depth], self.spare[depth])]
        low = t.device_of[same[-1]] if same else -1  # identical stages take increasing devices
        stop = math.nextafter(limit, math.inf)
        for d in range(low + 1, len(self.link)):
            if t.stage_on[d] >= 0:
                continue
            t.place(depth, d)
            self.nodes += 1
            prefix = t.device_of[:depth + 1]
            found = None
            self.work += 1
            if not any(_smaller(g, prefix) for g in self.group) and t.time_bound(self.best[0], stop) <= limit:
                if depth == len(self.demand) - 1:
                    self.examined += 1
                    found = list(t.device_of)
                else:
                    found = self.first_optimal(t, depth + 1, limit)
            t.unplace(depth)
            if found is not None:
                return found
        return None

    def lower_bounds(self) -> tuple[int, float]:
        """(unplaced bytes, time) bounds: the least relaxation bound over the unexplored
        frontier and the incumbent, and the bound from each overflowing stage alone."""
        u = self.best[0]
        floor = self.table().single_stage_bound(u)
        least_u, rest = u, self.best[1]
        for placed, key in self.frontier:
            if key is None or key[0] < u:  # its time bound allows fewer unplaced bytes than u: recompute
                t = self.table(placed)
                key = (max(t.unplaced_bound(), self.least_unplaced), t.time_bound(u))
            least_u = min(least_u, key[0])
            rest = min(rest, key[1] if key[0] <= u else math.inf)
        return least_u, max(floor, rest)


def _smaller(g: tuple[int, ...], prefix: Sequence[int]) -> bool:
    """The automorphism g maps the prefix to a lexicographically smaller one."""
    return next((g[d] < d for d in prefix if g[d] != d), False)


def map_devices(problem: MappingProblem, *, time_budget_s: float | None = None,
                work_budget: int | None = None) -> MapperResult:
    """Best stage->device mapping for D2D swap, with its spare assignment.

    Objective: fewest unplaced bytes, then the least slowest swap time; ties go to the
    identity, then to the lexicographically smallest mapping. Exact (proved by branch
    and bound) unless the budget runs out first: `work_budget` bound evaluations (the
    same cut on every machine) or else `time_budget_s` seconds (default
    `DEFAULT_TIME_BUDGET_S`); `exact` says which, and `lower_bound_s` bounds the optimum
    either way.
    """
    start = time.perf_counter()
    if work_budget is not None:
        if work_budget < 1:
            raise ValueError(f"work_budget must be >= 1, got {work_budget}")
        budget, work = math.inf, float(work_budget)
    else:
        budget, work = (DEFAULT_TIME_BUDGET_S if time_budget_s is None else time_budget_s), math.inf
    n, s = problem.num_devices, problem.num_stages
    off_diagonal = {problem.link_gbps[i][j] for i in range(n) for j in range(n) if i != j}
    if (len(off_diagonal) <= 1 and len(set(problem.port_gbps or (0.0,))) == 1
            and (n == s or len(set(problem.idle_spare_bytes)) == 1)):
        a = assign_spare(problem, range(s))
        return MapperResult(assignment=a, exact=True, lower_bound_s=a.slowest_swap_s,
                            lower_bound_unplaced_bytes=a.unplaced_bytes, mappings_examined=1,
                            nodes_visited=0, search_s=time.perf_counter() - start, skipped_symmetric=True,
                            num_automorphisms=math.factorial(n))
    search = _Search(problem, start + budget, work)
    identity = list(range(len(search.demand)))
    identity_value = search.value(identity)
    # Seed the incumbent: swaps from the identity and from a greedy placement, within a
    # share of the budget so that the bound search has time to prove or to bound.
    heuristic_end, heuristic_work = start + HEURISTIC_SHARE * budget, HEURISTIC_SHARE * work
    search.improve(identity, heuristic_end, heuristic_work)
    search.improve(search.greedy(), heuristic_end, heuristic_work)
    exact = search.by_cuts and not search.branch(search.table(), 0, search.group)
    if not search.by_cuts:
        search.frontier.append(([], None))  # no search: the whole tree is still open
    mapping = search.best_mapping
    if exact and reaches(identity_value, search.best):
        mapping = identity
    elif exact:
        try:
            mapping = search.first_optimal(search.table(), 0, search.best[1] * (1 + REL_TOL)) or mapping
        except TimeoutError:
            pass  # still optimal, only the tie-break toward small mappings is lost
    a = assign_spare(problem, mapping[:s])
    least_u, bound = (a.unplaced_bytes, a.slowest_swap_s) if exact else search.lower_bounds()
    return MapperResult(assignment=a, exact=exact, lower_bound_s=min(bound, a.slowest_swap_s),
                        lower_bound_unplaced_bytes=min(least_u, a.unplaced_bytes), mappings_examined=search.examined,
                        nodes_visited=search.nodes, search_s=time.perf_counter() - start, skipped_symmetric=False,
                        num_automorphisms=len(search.group))
