"""Segmentation: which operators must be tiled, and the FT segments that contain them.

Following SFT: an operator whose output does not fit (bytes above a threshold; the
planner starts the threshold at the memory budget and lowers it while the plan does not
fit) *must tile*; other tileable operators *may tile*. A *checkpointable* tensor is one a
segment may start or end at: a tensor every path of the graph passes through (a cut:
the only tensor live between two consecutive operators of the topological order) no
larger than the threshold. The network's own input is always checkpointable (it is
kept anyway). From each must-tile operator a segment grows backwards and forwards, one
region between cuts at a time, until both ends are checkpointable; growing between cuts
is what makes a segment contain every post-dominator of its operators (a branch and its
join are never split). Growth stops at a region with an operator that cannot tile (that
boundary is then kept although it is large; the memory model decides whether it fits).
Overlapping segments merge. Finally the FT-compatible dimensions are intersected along
the segment: a dimension of the segment output survives if every operator carries it
from the segment input (through every input that depends on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mpress.tiling.graph import Graph

NodeClass = Literal["must", "may", "cannot"]
SPATIAL_DIMS = (2, 3)
"""H and W of an NCHW tensor: the dimensions the executor tiles."""


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Operators at `positions` (consecutive in the topological order) between two cuts."""

    positions: tuple[int, ...]
    input: str
    output: str
    dims: tuple[int, ...]
    """FT-compatible dimensions of the output that survive the whole segment."""
    must_tile: tuple[str, ...]
    """The must-tile operators this segment was grown from."""

    @property
    def tile_dims(self) -> tuple[int, ...]:
        """The spatial dimensions the segment can be tiled along."""
        return tuple(d for d in SPATIAL_DIMS if d in self.dims)


def cut_positions(graph: Graph) -> dict[int, str]:
    """Position p (0..len(nodes)) -> the tensor that is the only one live between node p-1
    and node p, where there is exactly one (p = 0: the graph input; last: its output)."""
    last_use: dict[str, int] = {graph.input: -1}
    for i, n in enumerate(graph.nodes):
        last_use.setdefault(n.output, i)
        for t in n.inputs:
            last_use[t] = max(last_use.get(t, -1), i)
    last_use[graph.output] = len(graph.nodes)
    produced_at = {graph.input: -1} | {n.output: i for i, n in enumerate(graph.nodes)}
    cuts = {}
    for p in range(len(graph.nodes) + 1):
        live = [t for t, at in produced_at.items() if at < p <= last_use.get(t, at)]
        if len(live) == 1:
            cuts[p] = live[0]
    return cuts


def classify(graph: Graph, threshold_bytes: int) -> dict[str, NodeClass]:
    """Per operator: "must" (tileable, output above the threshold), "may" (tileable) or
    "cannot" (not FT-compatible on the spatial dimensions; `spec.reason` says why)."""
    out: dict[str, NodeClass] = {}
    for n in graph.nodes:
        if not n.spec.tileable:
            out[n.name] = "cannot"
        else:
            out[n.name] = "must" if graph.tensors[n.output].nbytes > threshold_bytes else "may"
    return out


def surviving_dims(graph: Graph, positions: tuple[int, ...] | list[int],
                   losses: list[tuple[str, tuple[int, ...]]] | None = None) -> tuple[int, ...]:
    """Dimensions of the last operator's output that a tileable path carries from the
    segment input through every operator (intersection over the inputs of each one).
    `losses`, when given, receives (operator, spatial dimensions it drops) in order."""
    start = graph.nodes[positions[0]].inputs[0]
    carried: dict[str, set[int]] = {start: set(range(len(graph.tensors[start].shape)))}
    for i in positions:
        node = graph.nodes[i]
        derived = [(k, t) for k, t in enumerate(node.inputs) if t in carried]
        rank = len(graph.tensors[node.output].shape)
        out = set(range(rank))
        for k, t in derived:
            ok = {link.out_dim for link in node.spec.links() if link.input_index == k and link.in_dim in carried[t]}
            out &= ok
        if not node.spec.tileable:
            out = set()
        if losses is not None:
            before = set().union(*(carried[t] for _, t in derived)) if derived else set(range(rank))
            lost = tuple(d for d in SPATIAL_DIMS if d in before and d not in out)
            if lost:
                losses.append((node.name, lost))
        carried[node.output] = out
    return tuple(sorted(carried[graph.nodes[positions[-1]].output]))


def grow_segments(graph: Graph, threshold_bytes: int) -> list[Segment]:
    """The FT segments for a checkpoint threshold (see the module docstring), in order."""
    cuts = cut_positions(graph)
    bounds = sorted(cuts)
    regions = list(zip(bounds[:-1], bounds[1:]))
    classes = classify(graph, threshold_bytes)
    tileable = [all(classes[graph.nodes[i].name] != "cannot" for i in range(a, b)) for a, b in regions]

    def checkpointable(p: int) -> bool:
        return p == 0 or graph.tensors[cuts[p]].nbytes <= threshold_bytes

    grown: list[tuple[int, int, set[str]]] = []  # (first region, last region, must-tile names)
    for r, (a, b) in enumerate(regions):
        must = {graph.nodes[i].name for i in range(a, b) if classes[graph.nodes[i].name] == "must"}
        if not must or not tileable[r]:
            continue
        lo = hi = r
        while not checkpointable(regions[lo][0]) and lo > 0 and tileable[lo - 1]:
            lo -= 1
        while not checkpointable(regions[hi][1]) and hi + 1 < len(regions) and tileable[hi + 1]:
            hi += 1
        if grown and grown[-1][1] >= lo:  # overlaps the previous segment: merge
            plo, phi, pmust = grown.pop()
            lo, hi, must = plo, max(phi, hi), pmust | must
        grown.append((lo, hi, must))
    segments = []
    for lo, hi, must in grown:
        positions = tuple(range(regions[lo][0], regions[hi][1]))
        segments.append(Segment(positions=positions, input=cuts[regions[lo][0]], output=cuts[regions[hi][1]],
                                dims=surviving_dims(graph, positions),
                                must_tile=tuple(graph.nodes[i].name for i in positions
                                                if graph.nodes[i].name in must)))
    return segments


def may_tile_runs(graph: Graph, segments: list[Segment]) -> list[Segment]:
    """Maximal runs of tileable regions outside `segments` that hold a windowed operator:
    the may-tile operators a plan can also checkpoint (a segment of one tile) or tile."""
    taken = {i for s in segments for i in s.positions}
    return maximal_segments(graph, skip=taken)


def maximal_segments(graph: Graph, skip: set[int] | None = None) -> list[Segment]:
    """Every maximal run of tileable regions (none of whose operators is in `skip`) that
    holds a windowed operator (convolution or pooling): the segmentation when the tile
    count is fixed instead of planned."""
    skip = skip or set()
    cuts = cut_positions(graph)
    bounds = sorted(cuts)
    segments: list[Segment] = []
    run: list[int] = []
    for a, b in list(zip(bounds[:-1], bounds[1:])) + [(None, None)]:
        ok = a is not None and all(graph.nodes[i].spec.tileable and i not in skip for i in range(a, b))
        if ok:
            run += list(range(a, b))
            continue
        if run and any(graph.nodes[i].windowed for i in run):
            positions = tuple(run)
            segments.append(Segment(positions=positions, input=cuts[positions[0]], output=cuts[positions[-1] + 1],
                                    dims=surviving_dims(graph, positions), must_tile=()))
        run = []
    return segments
