"""The best use of peers' spare memory for ONE stage->device mapping: a parametric max-flow.

With the mapping fixed, D2D swap is a transport problem. Stage s must place
`demand_bytes[s]` on NVLink peers; stripe x[s][d] travels over the link s->d at
`link_bps[s][d]`, stripes move in parallel, so stage s needs max_d x[s][d] / link_bps[s][d]
seconds. A time T is achievable iff this network carries every demand:

    source -> stage s      capacity demand[s]
    stage s -> out_s       capacity T * egress[s]    (only where a port limit is set)
    out_s   -> device d    capacity T * link[s][d]   (linked pairs only)
    device d -> in_d       capacity T * ingress[d]   (only where a port limit is set)
    in_d    -> sink        capacity spare[d]

Two exact ways to find the least such T (tests check them against each other and an LP):

- Cut families (`cut_table.CutTable`, fast for few overflowing stages; the search uses it). A min
  cut is fixed by the set C of stages whose middle arcs it crosses, so T is feasible iff
  for every C:
      sum_{s not in C} min(demand_s, T egress_s) + sum_d min(spare_d, T min(link_C(d), ingress_d)) >= demand
  with link_C(d) = sum_{s in C} link[s][d]. Each left side is concave and piecewise linear
  in T, so its root is exact by walking its breakpoints; T* is the largest root. Cost
  2^|overflowing stages| x devices.
- Newton on min cuts (`solve_by_flow`, `stage_levels`; scales): start at T = 0; while the
  max flow at T falls short, its min cut is a line a + b T that bounds the max flow from
  above, so T jumps to where that line meets the demand. Every step is a lower bound on
  T* and the steps visit distinct cuts, so it ends on T* (to float rounding) in a few
  max-flows.

When spare is short everywhere, the least number of unplaced bytes U comes first (the max
flow at T = infinity, in integers) and T* is the least time that still places all
but U bytes.

Units: bytes, bytes per second, seconds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

INF = math.inf
_MAX_NEWTON_STEPS = 200
"""Newton visits each cut at most once; real networks need a handful of steps."""


class FlowGraph:
    """Directed graph with arc capacities and Dinic's max-flow.

    Integer capacities give exact integer flows; float capacities treat residuals at or
    below `eps` as saturated. Arc e's reverse is e ^ 1.
    """

    def __init__(self, num_nodes: int) -> None:
        self._adj: list[list[int]] = [[] for _ in range(num_nodes)]
        self._head: list[int] = []
        self._residual: list[float] = []
        self._capacity: list[float] = []

    def add_arc(self, tail: int, head: int, capacity: float) -> int:
        """Add an arc; returns its id (for `flow`)."""
        arc = len(self._head)
        self._head += [head, tail]
        self._residual += [capacity, 0]
        self._capacity += [capacity, 0]
        self._adj[tail].append(arc)
        self._adj[head].append(arc + 1)
        return arc

    def flow(self, arc: int) -> float:
        """Flow on an arc after `max_flow`."""
        return self._capacity[arc] - self._residual[arc]

    def _levels(self, source: int, eps: float) -> list[int]:
        level = [-1] * len(self._adj)
        level[source] = 0
        queue = deque([source])
        while queue:
            u = queue.popleft()
            for arc in self._adj[u]:
                v = self._head[arc]
                if level[v] < 0 and self._residual[arc] > eps:
                    level[v] = level[u] + 1
                    queue.append(v)
        return level

    def _augment(self, u: int, sink: int, limit: float, level: list[int], nxt: list[int], eps: float) -> float:
        if u == sink:
            return limit
        adj = self._adj[u]
        while nxt[u] < len(adj):
            arc = adj[nxt[u]]
            v = self._head[arc]
            if self._residual[arc] > eps and level[v] == level[u] + 1:
                got = self._augment(v, sink, min(limit, self._residual[arc]), level, nxt, eps)
                if got > eps:
                    self._residual[arc] -= got
                    self._residual[arc ^ 1] += got
                    return got
            nxt[u] += 1
        return 0

    def max_flow(self, source: int, sink: int, eps: float = 0.0) -> float:
        """Push a maximum flow from source to sink; returns its value."""
        total: float = 0
        while True:
            level = self._levels(source, eps)
            if level[sink] < 0:
                return total
            nxt = [0] * len(self._adj)
            while (got := self._augment(source, sink, INF, level, nxt, eps)) > eps:
                total += got

    def source_side(self, source: int, eps: float = 0.0) -> set[int]:
        """Nodes reachable from source in the residual graph (the source side of a min cut)."""
        level = self._levels(source, eps)
        return {u for u, lv in enumerate(level) if lv >= 0}


@dataclass(kw_only=True, frozen=True)
class SwapNetwork:
    """One fixed mapping in flow terms: index s is a stage, index d a device."""

    demand_bytes: tuple[int, ...]
    """Overflow of each stage (0 for a stage that only lends)."""
    link_bps: tuple[tuple[float, ...], ...]
    """[s][d]: bytes/s from stage s's device to device d; 0 = no NVLink (and s's own device)."""
    spare_bytes: tuple[int, ...]
    """Spare memory of each device: its stage's spare, or its idle spare."""
    egress_bps: tuple[float, ...]
    """Per stage: limit on the total rate out of its device (math.inf = no limit)."""
    ingress_bps: tuple[float, ...]
    """Per device: limit on the total rate into it (math.inf = no limit)."""

    @property
    def total_demand_bytes(self) -> int:
        return sum(self.demand_bytes)


def solve_concave(terms: list[tuple[float, float]], need: float) -> float:
    """Least T >= 0 with sum over terms of min(cap, T * slope) >= need (math.inf if none).

    terms: (cap, slope) pairs with cap >= 0, slope > 0. Exact: the root lies between two
    breakpoints cap/slope, where the sum is linear.
    """
    if need <= 0:
        return 0.0
    if len(terms) == 1:  # the search's common case: the steps below, for one term
        cap, slope = terms[0]
        if cap < need:
            return INF
        t = need / slope
        return t if t * slope <= cap or t <= cap / slope else cap / slope
    if sum(cap for cap, _ in terms) < need:
        return INF
    total_slope = sum(slope for _, slope in terms)
    t = need / total_slope
    if all(t * slope <= cap for cap, slope in terms):
        return t  # no cap binds: the common case, no sort
    terms = sorted(terms, key=lambda term: term[0] / term[1])
    # Suffix sums of slopes: subtracting from a running total would lose precision.
    suffix = [0.0] * (len(terms) + 1)
    for i in range(len(terms) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + terms[i][1]
    capped: float = 0
    for i, (cap, slope) in enumerate(terms):
        t = (need - capped) / suffix[i]
        if t <= cap / slope:
            return t
        capped += cap
    return terms[-1][0] / terms[-1][1]


# -- Newton on the flow network --------------------------------------------------------------

class _Arc(NamedTuple):
    tail: int
    head: int
    const: float
    slope: float
    owner: int
    """Stage whose time scales this arc, or -1."""
    scaled: bool
    """Capacity is a time x a rate (const = fixed time x rate, or slope = rate)."""


def _arcs(net: SwapNetwork, levels: list[float | None], ingress_s: float | None) -> tuple[int, list[_Arc]]:
    """Nodes and arcs of the network. A stage with levels[s] = None is free (its arcs scale
    with T); others are fixed at their level. ingress_s fixes the ingress arcs at that time."""
    num_stages, num_devices = len(net.demand_bytes), len(net.spare_bytes)
    source, sink = 0, 1
    stage_node = [2 + s for s in range(num_stages)]
    device_node = [2 + num_stages + d for d in range(num_devices)]
    nodes = 2 + num_stages + num_devices
    arcs: list[_Arc] = []

    def add_timed(tail: int, head: int, rate: float, s: int) -> None:
        level = levels[s]
        arcs.append(_Arc(tail, head, 0.0, rate, s, True) if level is None
                    else _Arc(tail, head, level * rate, 0.0, s, True))

    for s in range(num_stages):
        if net.demand_bytes[s] <= 0:
            continue
        arcs.append(_Arc(source, stage_node[s], net.demand_bytes[s], 0.0, s, False))
        out = stage_node[s]
        if math.isfinite(net.egress_bps[s]):
            out, nodes = nodes, nodes + 1
            add_timed(stage_node[s], out, net.egress_bps[s], s)
        for d in range(num_devices):
            if net.link_bps[s][d] > 0:
                add_timed(out, device_node[d], net.link_bps[s][d], s)
    for d in range(num_devices):
        into = device_node[d]
        if math.isfinite(net.ingress_bps[d]):
            into, nodes = nodes, nodes + 1
            rate = net.ingress_bps[d]
            arcs.append(_Arc(device_node[d], into, 0.0, rate, -1, True) if ingress_s is None
                        else _Arc(device_node[d], into, ingress_s * rate, 0.0, -1, True))
        arcs.append(_Arc(into, sink, net.spare_bytes[d], 0.0, -1, False))
    return nodes, arcs


def _eps(net: SwapNetwork) -> float:
    """Residual below which a float arc counts as saturated: far below one byte."""
    return max(1.0, float(net.total_demand_bytes)) * 1e-13


def unplaced_bytes(net: SwapNetwork) -> int:
    """Least bytes that no time can place (exact, integer max-flow with unbounded links)."""
    nodes, arcs = _arcs(net, [None] * len(net.demand_bytes), None)
    graph = FlowGraph(nodes)
    for a in arcs:
        graph.add_arc(a.tail, a.head, INF if a.scaled else int(a.const))
    return net.total_demand_bytes - int(graph.max_flow(0, 1))


def _newton(net: SwapNetwork, levels: list[float | None], ingress_s: float | None,
            target: float) -> tuple[float, set[int]]:
    """Least T at which the network carries `target` bytes, and the stages whose arcs
    cross the min cut that fixes it (the stages that cannot finish sooner)."""
    nodes, arcs = _arcs(net, levels, ingress_s)
    eps = _eps(net)
    t, critical = 0.0, set()
    for _ in range(_MAX_NEWTON_STEPS):
        graph = FlowGraph(nodes)
        for a in arcs:
            graph.add_arc(a.tail, a.head, a.const + a.slope * t)
        if graph.max_flow(0, 1, eps) >= target - 16 * eps:
            return t, critical
        side = graph.source_side(0, eps)
        crossing = [a for a in arcs if a.tail in side and a.head not in side]
        const = sum(a.const for a in crossing)
        slope = sum(a.slope for a in crossing)
        if slope <= 0:
            break  # unreachable when target <= max flow at infinity
        t_next = (target - const) / slope
        critical = {a.owner for a in crossing if a.slope > 0}
        if t_next <= t:
            return t, critical  # float rounding: the cut already met the target
        t = t_next
    raise RuntimeError(f"internal: parametric max-flow did not converge (target {target} bytes)")


def solve_by_flow(net: SwapNetwork) -> tuple[int, float]:
    """(least unplaced bytes, least slowest swap time in s) by Newton's method on min cuts.

    Same answer as `CutTable` (to float rounding), in a few max-flows whatever the
    number of overflowing stages.
    """
    unplaced = unplaced_bytes(net)
    levels: list[float | None] = [None if b > 0 else 0.0 for b in net.demand_bytes]
    if all(level is not None for level in levels):
        return unplaced, 0.0
    slowest, _ = _newton(net, levels, None, net.total_demand_bytes - unplaced)
    return unplaced, slowest


def stage_levels(net: SwapNetwork) -> tuple[int, list[float]]:
    """(least unplaced bytes, per-stage swap time in s), lexicographically optimal.

    The first level is T*, the least slowest swap time. Stages not held to T* by a tight
    cut are then pushed down as far as the others allow, and so on ("water filling"):
    a stage's stripes then follow link bandwidth wherever its peers' spare allows. Port
    (ingress) limits are held at T* after the first round.
    """
    unplaced = unplaced_bytes(net)
    target = net.total_demand_bytes - unplaced
    levels: list[float | None] = [None if b > 0 else 0.0 for b in net.demand_bytes]
    first: float | None = None
    while any(level is None for level in levels):
        t, critical = _newton(net, levels, first, target)
        first = t if first is None else first
        free = {s for s, level in enumerate(levels) if level is None}
        fix = (critical & free) if t > 0 else free
        for s in fix or free:  # no free stage on the cut (ingress-bound): fix all of them
            levels[s] = t
    return unplaced, [float(level) for level in levels]


def _whole_bytes_above(num_bytes: float) -> int:
    """ceil, except that a float within rounding of a whole number is that number."""
    nearest = round(num_bytes)
    return nearest if abs(num_bytes - nearest) <= 1e-12 * num_bytes + 1e-6 else math.ceil(num_bytes)


def integer_stripes(net: SwapNetwork, levels: list[float], unplaced: int) -> list[list[int]]:
    """Whole-byte stripes x[s][d] that place all but `unplaced` bytes with every stage
    within its level (to one byte per link): an integer max-flow with link capacities
    ceil(level x rate), which is exact by the integrality of max-flows."""
    slowest = max(levels, default=0.0)
    for pad in (0, 1, 2):
        nodes, arcs = _arcs(net, list(levels), slowest)
        graph = FlowGraph(nodes)
        ids = []
        for a in arcs:
            cap = _whole_bytes_above(a.const) + pad if a.scaled else int(a.const)
            ids.append(graph.add_arc(a.tail, a.head, cap))
        if graph.max_flow(0, 1) >= net.total_demand_bytes - unplaced:
            break
    else:
        raise RuntimeError("internal: integer stripes could not realise the optimal levels")
    num_stages, num_devices = len(net.demand_bytes), len(net.spare_bytes)
    device_of_node = {2 + num_stages + d: d for d in range(num_devices)}
    stripes = [[0] * num_devices for _ in range(num_stages)]
    for a, arc in zip(arcs, ids):
        if a.owner >= 0 and a.head in device_of_node:
            stripes[a.owner][device_of_node[a.head]] += int(graph.flow(arc))
    return stripes
