"""The device-mapping problem and the value of one mapping: what the mapper (`mapper.py`)
searches over. A mapping puts each pipeline stage on a distinct device; for one mapping
the best striping of every overflowing stage over its NVLink peers' spare memory is exact
(`maxflow.py`), and its value is (unplaced bytes, slowest swap time).

What a lender can give: each exporter process that opens a peer pool holds a CUDA
context on the lender's GPU (`DeviceSpec.peer_context_bytes`), so an idle GPU lends its usable
memory less those contexts (`idle_lendable_bytes`), not its whole memory.

Units: bytes, seconds, GB/s with GB = 1e9 bytes.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from mpress.d2d.static.cut_table import CutTable
from mpress.d2d.static.maxflow import (
    SwapNetwork,
    integer_stripes,
    solve_by_flow,
    stage_levels,
)
from mpress.d2d.static.ports import port_gbps_per_device
from mpress.errors import PlanError
from mpress.hardware.server import DEFAULT_PEER_CONTEXT_BYTES, Hardware

MAX_CUT_STAGES = 12
"""Above this many overflowing stages the cut tables (2^stages rows) are too big: the
search falls back to swaps evaluated by max-flow, and reports a bound instead of a proof."""
REL_TOL = 1e-9
"""Two slowest-swap times within this relative distance are a tie."""
PEER_CONTEXT_BYTES = DEFAULT_PEER_CONTEXT_BYTES
"""Default per-exporter context on a lender GPU (`DeviceSpec.peer_context_bytes`)."""
_GB = 1e9


@dataclass(kw_only=True, frozen=True)
class MappingProblem:
    """What the mapper needs to know; stage s is pipeline stage s, device d is GPU d."""

    link_gbps: tuple[tuple[float, ...], ...]
    """[i][j]: effective NVLink bandwidth from device i to device j, GB/s; 0 = no NVLink."""
    overflow_bytes: tuple[int, ...]
    """Per stage: bytes it must swap out beyond its device's capacity."""
    spare_bytes: tuple[int, ...]
    """Per stage: free bytes its device can lend to peers."""
    idle_spare_bytes: tuple[int, ...] = ()
    """Per device: bytes it lends when no stage runs on it (empty = 0 everywhere)."""
    port_gbps: tuple[float, ...] | None = None
    """Per device: limit on its total NVLink rate in each direction, shared by all its
    peers (NVSwitch); None = links are disjoint (a mesh), each at its own rate."""

    def __post_init__(self) -> None:
        n = len(self.link_gbps)
        rows = tuple(tuple(float(x) for x in row) for row in self.link_gbps)
        if n == 0 or any(len(row) != n for row in rows):
            raise PlanError(f"MappingProblem.link_gbps: must be a non-empty square matrix, got row lengths "
                            f"{[len(r) for r in rows]}")
        for i, j in itertools.product(range(n), repeat=2):
            x = rows[i][j]
            if not math.isfinite(x) or x < 0 or (i == j and x != 0):
                raise PlanError(f"MappingProblem.link_gbps[{i}][{j}]: must be finite and >= 0 (0 on the diagonal), got {x}")
            if (x > 0) != (rows[j][i] > 0):
                raise PlanError(f"MappingProblem.link_gbps[{i}][{j}]: a link must exist in both directions "
                                f"([{i}][{j}]={x}, [{j}][{i}]={rows[j][i]})")
        object.__setattr__(self, "link_gbps", rows)  # frozen: normalise lists to tuples once
        object.__setattr__(self, "idle_spare_bytes", tuple(self.idle_spare_bytes) or (0,) * n)
        for name in ("overflow_bytes", "spare_bytes", "idle_spare_bytes"):
            object.__setattr__(self, name, _byte_counts(name, getattr(self, name)))
        idle = self.idle_spare_bytes
        s = len(self.overflow_bytes)
        if len(self.spare_bytes) != s or s == 0:
            raise PlanError(f"MappingProblem: overflow_bytes and spare_bytes need one entry per stage "
                            f"(got {s} and {len(self.spare_bytes)}, at least 1)")
        if s > n or len(idle) != n:
            raise PlanError(f"MappingProblem: {s} stages do not fit on {n} devices (one stage per device)" if s > n
                            else f"MappingProblem.idle_spare_bytes: needs one entry per device ({n}), got {len(idle)}")
        if self.port_gbps is not None:
            ports = tuple(float(x) for x in self.port_gbps)
            if len(ports) != n or any(not x > 0 for x in ports):
                raise PlanError(f"MappingProblem.port_gbps: needs {n} positive numbers (GB/s), got {self.port_gbps}")
            object.__setattr__(self, "port_gbps", ports)

    @property
    def num_devices(self) -> int:
        return len(self.link_gbps)

    @property
    def num_stages(self) -> int:
        return len(self.overflow_bytes)

    @classmethod
    def from_hardware(cls, hw: Hardware, overflow_bytes: Sequence[int], spare_bytes: Sequence[int]) -> MappingProblem:
        """Links from `hw.nvlink_gbps`; on NVSwitch each GPU's links are one port shared by
        its peers. An idle device lends `idle_lendable_bytes`: its usable memory less the
        contexts of the exporters that may open its pool. `spare_bytes` are the caller's
        (a busy lender's exporter contexts are its to leave out, `exporter_context_bytes`)."""
        n = hw.num_devices
        exporters = sum(1 for b in overflow_bytes if b > 0)
        return cls(link_gbps=tuple(tuple(hw.nvlink_gbps(i, j) for j in range(n)) for i in range(n)),
                   overflow_bytes=tuple(overflow_bytes), spare_bytes=tuple(spare_bytes),
                   idle_spare_bytes=tuple(idle_lendable_bytes(hw, d, exporters) for d in range(n)),
                   port_gbps=port_gbps_per_device(hw))


def exporter_context_bytes(hw: Hardware, device: int, num_exporters: int) -> int:
    """Device memory that exporters' CUDA contexts take on lender `device`: one
    `PEER_CONTEXT_BYTES` per exporter process that may open its pool, i.e. per overflowing
    stage (`num_exporters`), at most one per NVLink peer of `device` (no other GPU stripes
    to it). An upper bound for any mapping: which stages end up next to it is the mapper's
    choice. Bytes."""
    peers = sum(1 for e in range(hw.num_devices) if hw.nvlink_gbps(device, e) > 0)
    return min(num_exporters, peers) * hw.device.peer_context_bytes


def idle_lendable_bytes(hw: Hardware, device: int, num_exporters: int) -> int:
    """What `device` may lend when no stage runs on it: its usable memory (memory less
    the hardware reserve, kept as on every device) less its exporters' contexts
    (`exporter_context_bytes`). The pool's
    holder, the lowest exporter rank, allocates it from a process whose own GPU is
    another one: no process runs on an idle GPU, so someone's context must hold the
    allocation, and the holder's context there is one of those counted. Bytes, >= 0."""
    return max(0, hw.usable_memory_bytes - exporter_context_bytes(hw, device, num_exporters))


def _byte_counts(name: str, values: Sequence[int]) -> tuple[int, ...]:
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise PlanError(f"MappingProblem.{name}[{i}]: must be a whole number of bytes >= 0, got {v!r}")
    return tuple(int(v) for v in values)


@dataclass(kw_only=True, frozen=True)
class Assignment:
    """A mapping and the best use of spare memory under it."""

    mapping: tuple[int, ...]
    """Device of each stage."""
    stripes: dict[int, tuple[tuple[int, int], ...]]
    """Per overflowing stage: (device, bytes) stripes, by device; whole bytes."""
    slowest_swap_s: float
    """Least possible time of the slowest stage's swap-out (exact, see `maxflow.py`)."""
    swap_s: tuple[float, ...]
    """Per stage: its swap time (each as low as the slower stages allow); the stripes
    meet these to within one byte per link."""
    unplaced_bytes: int
    """Overflow that no peer can take under this mapping (least possible)."""
    stage_unplaced_bytes: tuple[int, ...]
    """Per stage: its share of `unplaced_bytes`."""

    @property
    def feasible(self) -> bool:
        return self.unplaced_bytes == 0


@dataclass(kw_only=True, frozen=True)
class MapperResult:
    """Outcome of `map_devices`."""

    assignment: Assignment
    """The best mapping found, with its spare assignment."""
    exact: bool
    """True when the mapping is proved optimal (to `REL_TOL`)."""
    lower_bound_s: float
    """No mapping that leaves at most `assignment.unplaced_bytes` unplaced swaps faster."""
    lower_bound_unplaced_bytes: int
    """No mapping leaves fewer bytes unplaced."""
    mappings_examined: int
    """Complete mappings whose value was computed (greedy, swaps and search)."""
    nodes_visited: int
    """Partial mappings bounded by the search."""
    search_s: float
    """Wall time of the whole call."""
    skipped_symmetric: bool
    """True when the topology is symmetric and the identity mapping was taken."""
    num_automorphisms: int
    """Size of the topology's symmetry group used to prune (1 = none found)."""

    @property
    def gap(self) -> float:
        """Relative optimality gap (0 when exact)."""
        value = self.assignment.slowest_swap_s
        return 0.0 if value <= 0 else max(0.0, (value - self.lower_bound_s) / value)


def network(problem: MappingProblem, mapping: Sequence[int]) -> SwapNetwork:
    spare = list(problem.idle_spare_bytes)
    for s, d in enumerate(mapping):
        spare[d] = problem.spare_bytes[s]
    ports = [p * _GB for p in problem.port_gbps or (math.inf,) * problem.num_devices]
    return SwapNetwork(demand_bytes=problem.overflow_bytes, spare_bytes=tuple(spare),
                       link_bps=tuple(tuple(g * _GB for g in problem.link_gbps[d]) for d in mapping),
                       egress_bps=tuple(ports[d] for d in mapping), ingress_bps=tuple(ports))


def check_mapping(problem: MappingProblem, mapping: Sequence[int]) -> tuple[int, ...]:
    m = tuple(int(d) for d in mapping)
    n = problem.num_devices
    if len(m) != problem.num_stages or len(set(m)) != len(m) or any(not 0 <= d < n for d in m):
        raise PlanError(f"mapping {list(m)}: needs {problem.num_stages} distinct devices in 0..{n - 1}")
    return m


def assign_spare(problem: MappingProblem, mapping: Sequence[int]) -> Assignment:
    """Exact best use of spare memory for a fixed mapping (stage s on device mapping[s])."""
    m = check_mapping(problem, mapping)
    net = network(problem, m)
    unplaced, levels = stage_levels(net)
    x = integer_stripes(net, levels, unplaced)
    stripes = {s: tuple((d, b) for d, b in enumerate(x[s]) if b > 0)
               for s in range(problem.num_stages) if problem.overflow_bytes[s] > 0}
    return Assignment(mapping=m, stripes=stripes, slowest_swap_s=max(levels), swap_s=tuple(levels),
                      unplaced_bytes=unplaced,
                      stage_unplaced_bytes=tuple(problem.overflow_bytes[s] - sum(x[s]) for s in range(len(m))))


def byte_rates(problem: MappingProblem) -> tuple[list[list[float]], list[float]]:
    """(link rates, port rates) in bytes/s."""
    ports = [p * _GB for p in problem.port_gbps or (math.inf,) * problem.num_devices]
    return [[g * _GB for g in row] for row in problem.link_gbps], ports


def cut_table(problem: MappingProblem, demand: Sequence[int], spare: Sequence[int], pool: bool,
               rates: tuple[list[list[float]], list[float]] | None = None) -> CutTable:
    link, ports = rates or byte_rates(problem)
    return CutTable(link_bps=link, egress_bps=ports, ingress_bps=ports, demand_bytes=demand, spare_bytes=spare,
                    idle_spare_bytes=problem.idle_spare_bytes, pool=pool)


def mapping_value(problem: MappingProblem, mapping: Sequence[int], *,
                  rates: tuple[list[list[float]], list[float]] | None = None) -> tuple[int, float]:
    """(least unplaced bytes, least slowest swap time in s) of one mapping, without stripes
    (rates: `byte_rates(problem)` precomputed, for callers that try many mappings)."""
    m = check_mapping(problem, mapping)
    if sum(1 for b in problem.overflow_bytes if b > 0) > MAX_CUT_STAGES:
        return solve_by_flow(network(problem, m))
    t = cut_table(problem, problem.overflow_bytes, problem.spare_bytes, False, rates)
    for s, d in enumerate(m):
        t.place(s, d)
    u = t.unplaced_bound()
    return u, t.time_bound(u)


def is_better(a: tuple[int, float], b: tuple[int, float]) -> bool:
    """a beats b: fewer unplaced bytes, or as many and faster by more than REL_TOL."""
    return a[0] < b[0] or (a[0] == b[0] and a[1] < b[1] * (1 - REL_TOL))


def reaches(value: tuple[int, float], best: tuple[int, float]) -> bool:
    """value is a tie with (or beats) the optimum `best`."""
    return value[0] < best[0] or (value[0] == best[0] and value[1] <= best[1] * (1 + REL_TOL))
