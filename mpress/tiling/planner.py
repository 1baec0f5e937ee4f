"""Planning fused-tiled execution against a memory budget.

For a chain (`nn.Sequential`):
1. If plain training fits the budget (peak.PeakModel with no segments), nothing is tiled.
2. Otherwise candidate segmentations are grown (segments.grow_segments) for checkpoint
   thresholds from the budget (SFT's rule: an operator whose output does not fit must
   tile) down through the sizes of the network's tensors: a lower threshold makes more
   operators must-tile and moves segment ends to smaller tensors, so fewer and smaller
   activations are kept whole. Each threshold gives two candidates: the grown segments
   alone, and with the remaining may-tile runs made segments too (checkpointed, or tiled
   where they must be), which sheds the saved activations of long untiled stretches.
3. For each segment the number of tiles per spatial dimension is the smallest that fits
   the budget in that segment's phases (found by doubling then bisection, since the
   peak falls as tiles shrink), then the one with the least halo overhead among it and
   the next few counts. Phases of different segments do not overlap in time, so each
   segment's count is chosen on its own.
4. Of the candidates that fit, the one with the least estimated work wins (`step_cost`:
   recompute and halos). If none fits, the verdict `OutOfMemory` carries the numbers:
   the budget, plain training's peak, the closest plan's peak and the phase where it
   peaks.

For a DAG traced with torch.fx (`plan_dag`), segmentation and FT dimensions are the
same; memory is estimated from the propagated tile sizes (every tile tensor of the
segment plus its gradient, plus the segment's boundary tensors and their gradients).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpress.errors import TilingError
from mpress.tiling.graph import Graph
from mpress.tiling.peak import PeakModel, PeakPrediction, SegmentLayout
from mpress.tiling.segments import (
    NodeClass,
    Segment,
    classify,
    grow_segments,
    maximal_segments,
    may_tile_runs,
    surviving_dims,
)
from mpress.tiling.tiles import (
    DimTiling,
    TileSizes,
    halo_overhead,
    op_work,
    propagate,
    split,
    tile_dim,
)
from mpress.config.units import fmt_bytes

MAX_TILES = 1024
"""Most tiles per dimension the search considers."""
LEAST_OVERHEAD_WINDOW = 4
"""Tile counts above the smallest fitting one that compete on halo overhead."""


@dataclass(frozen=True, kw_only=True)
class SegmentPlan:
    """A segment and how it is tiled."""

    segment: Segment
    num_tiles: tuple[int, int]
    """Tiles along H and W."""
    tilings: dict[int, DimTiling]
    halo_overhead: float
    """Extra work of the tiles' halos over the untiled segment (fraction)."""
    sizes: TileSizes
    """Propagated tile sizes of the largest tile."""

    @property
    def layout(self) -> SegmentLayout:
        return SegmentLayout(positions=self.segment.positions, tilings=self.tilings)


@dataclass(frozen=True, kw_only=True)
class TilingPlan:
    """Segments with tile counts, and the predicted peak of a training step."""

    graph: Graph = field(repr=False)
    segments: list[SegmentPlan]
    prediction: PeakPrediction
    plain_peak_bytes: int
    """Predicted peak of plain (untiled) training of the same network and input."""
    budget_bytes: int | None
    threshold_bytes: int | None
    """Checkpoint threshold the segments were grown for (None: no segments or fixed tiles)."""
    classes: dict[str, NodeClass]

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.prediction.peak_bytes <= self.budget_bytes


@dataclass(frozen=True, kw_only=True)
class OutOfMemory:
    """The verdict when no segmentation fits: the numbers behind it."""

    budget_bytes: int
    plain_peak_bytes: int
    best_peak_bytes: int
    best_phase: str
    reason: str

    def message(self) -> str:
        return (f"does not fit: budget {fmt_bytes(self.budget_bytes)}, plain training needs "
                f"{fmt_bytes(self.plain_peak_bytes)}, the best tiling needs {fmt_bytes(self.best_peak_bytes)} "
                f"(peak in {self.best_phase}){': ' + self.reason if self.reason else ''}")


def tile_segment(graph: Graph, segment: Segment, num_tiles: tuple[int, int]) -> SegmentPlan:
    """`segment` tiled `num_tiles` (H, W) ways (1 along a dimension that does not survive)."""
    positions = list(segment.positions)
    out_shape = graph.tensors[segment.output].shape
    counts = tuple(num_tiles[j] if d in segment.tile_dims else 1 for j, d in enumerate((2, 3)))
    tilings = {d: tile_dim(graph, positions, d, counts[j]) for j, d in enumerate((2, 3))}
    largest = {d: max(hi - lo for lo, hi in split(out_shape[d], counts[j])) for j, d in enumerate((2, 3))}
    return SegmentPlan(segment=segment, num_tiles=(tilings[2].num_tiles, tilings[3].num_tiles), tilings=tilings,
                       halo_overhead=halo_overhead(graph, positions, [tilings[2], tilings[3]]),
                       sizes=propagate(graph, positions, (2, 3), largest))


def _check_chain(graph: Graph) -> None:
    if not graph.is_chain():
        raise TilingError("tiled execution needs a chain of layers (nn.Sequential); plan DAGs with plan_dag")
    if len(graph.tensors[graph.input].shape) != 4:
        raise TilingError(f"tiled execution needs NCHW inputs, got shape {graph.tensors[graph.input].shape}")


def plan_fixed(graph: Graph, num_tiles: tuple[int, int], *, input_requires_grad: bool = False) -> TilingPlan:
    """Every maximal tileable run with a convolution or pooling tiled `num_tiles` ways."""
    _check_chain(graph)
    if min(num_tiles) < 1:
        raise TilingError(f"num_tiles must be >= 1, got {num_tiles}")
    model = PeakModel(graph, input_requires_grad=input_requires_grad)
    segments = [tile_segment(graph, s, num_tiles) for s in maximal_segments(graph)]
    return TilingPlan(graph=graph, segments=segments, prediction=model.predict([s.layout for s in segments]),
                      plain_peak_bytes=model.predict([]).peak_bytes, budget_bytes=None, threshold_bytes=None,
                      classes=classify(graph, 0))


def _segment_peak(model: PeakModel, layouts: list[SegmentLayout], k: int) -> int:
    """The peak of segment k's phases (its forward and its backward)."""
    pred = model.predict(layouts)
    label = model.segment_label(layouts[k])
    return max(p for name, p in pred.phases if name in (f"forward {label}", f"backward {label}"))


def _choose_tiles(graph: Graph, model: PeakModel, plans: list[SegmentPlan], k: int, budget: int) -> SegmentPlan:
    seg = plans[k].segment
    out_shape = graph.tensors[seg.output].shape
    n_max = min(MAX_TILES, max(out_shape[d] for d in seg.tile_dims)) if seg.tile_dims else 1

    def attempt(n: int) -> tuple[SegmentPlan, bool]:
        sp = tile_segment(graph, seg, (n, n))
        layouts = [p.layout for p in plans]
        layouts[k] = sp.layout
        return sp, _segment_peak(model, layouts, k) <= budget

    lo, hi = 0, 1  # lo: largest count known not to fit; hi: count being tried
    found = None
    while hi <= n_max:
        sp, ok = attempt(hi)
        if ok:
            found = hi
            break
        lo, hi = hi, hi * 2
    if found is None:
        return attempt(n_max)[0]  # the finest tiling: the caller reports the verdict
    while found - lo > 1:
        mid = (lo + found) // 2
        if attempt(mid)[1]:
            found = mid
        else:
            lo = mid
    best = attempt(found)[0]
    for n in range(found + 1, min(n_max, found + LEAST_OVERHEAD_WINDOW) + 1):
        sp, ok = attempt(n)
        if ok and sp.halo_overhead < best.halo_overhead:
            best = sp
    return best


def step_cost(graph: Graph, segments: list[SegmentPlan]) -> float:
    """Relative cost of a training step: plain operators 3 units of their work (forward,
    and a backward of about twice the forward), segment operators 4 (forward, recompute,
    backward) times their halo overhead. Plans are compared by it."""
    inside = {i: sp for sp in segments for i in sp.segment.positions}
    cost = 0.0
    for i in range(len(graph.nodes)):
        w = op_work(graph, i)
        cost += 3 * w if i not in inside else 4 * w * (1 + inside[i].halo_overhead)
    return cost


def _candidates(graph: Graph, budget_bytes: int) -> list[tuple[int, list[Segment]]]:
    """(threshold, segments) to try: for each checkpoint threshold (the budget, then every
    smaller tensor size), the grown segments alone, and with the remaining may-tile runs
    made segments too (checkpointed, tiled if they must)."""
    sizes = sorted({t.nbytes for name, t in graph.tensors.items() if name != graph.input and t.nbytes < budget_bytes},
                   reverse=True)
    out: list[tuple[int, list[Segment]]] = []
    seen: set[tuple] = set()
    for threshold in [budget_bytes] + sizes:
        grown = grow_segments(graph, threshold)
        with_runs = sorted(grown + may_tile_runs(graph, grown), key=lambda s: s.positions[0])
        for segs in (grown, with_runs):
            key = tuple(s.positions for s in segs)
            if segs and key not in seen:
                seen.add(key)
                out.append((threshold, segs))
    return out


def search(graph: Graph, budget_bytes: int, *, input_requires_grad: bool = False) -> TilingPlan | OutOfMemory:
    """The plan for `budget_bytes` (see the module docstring), or the verdict.
    `input_requires_grad`: whether the network input needs a gradient (it costs memory)."""
    _check_chain(graph)
    model = PeakModel(graph, input_requires_grad=input_requires_grad)
    plain = model.predict([])
    if plain.peak_bytes <= budget_bytes:
        return TilingPlan(graph=graph, segments=[], prediction=plain, plain_peak_bytes=plain.peak_bytes,
                          budget_bytes=budget_bytes, threshold_bytes=None, classes=classify(graph, budget_bytes))
    best_fit: tuple[float, TilingPlan] | None = None
    closest: TilingPlan | None = None
    untileable = ""
    for threshold, segments in _candidates(graph, budget_bytes):
        usable = [s for s in segments if s.tile_dims]
        if len(usable) < len(segments):
            bad = next(s for s in segments if not s.tile_dims)
            untileable = (f"segment {graph.nodes[bad.positions[0]].name}..{graph.nodes[bad.positions[-1]].name} "
                          "keeps no spatial dimension")
        plans = [tile_segment(graph, s, (1, 1)) for s in usable]
        for k in range(len(plans)):
            plans[k] = _choose_tiles(graph, model, plans, k, budget_bytes)
        pred = model.predict([p.layout for p in plans])
        plan = TilingPlan(graph=graph, segments=plans, prediction=pred, plain_peak_bytes=plain.peak_bytes,
                          budget_bytes=budget_bytes, threshold_bytes=threshold, classes=classify(graph, threshold))
        if plan.fits:
            cost = step_cost(graph, plans)
            if best_fit is None or cost < best_fit[0]:
                best_fit = (cost, plan)
        elif closest is None or pred.peak_bytes < closest.prediction.peak_bytes:
            closest = plan
    if best_fit is not None:
        return best_fit[1]
    if closest is None:
        return OutOfMemory(budget_bytes=budget_bytes, plain_peak_bytes=plain.peak_bytes,
                           best_peak_bytes=plain.peak_bytes, best_phase=plain.peak_phase,
                           reason=untileable or "no operator can be tiled")
    cannot = [n.name for n in graph.nodes if not n.spec.tileable]
    reason = untileable or (f"{closest.prediction.peak_phase} does not shrink below the budget with any tile count"
                            + (f" (untiled: {', '.join(cannot)})" if cannot else ""))
    return OutOfMemory(budget_bytes=budget_bytes, plain_peak_bytes=plain.peak_bytes,
                       best_peak_bytes=closest.prediction.peak_bytes, best_phase=closest.prediction.peak_phase,
                       reason=reason)


def plan_for_budget(graph: Graph, budget_bytes: int, *, input_requires_grad: bool = False) -> TilingPlan:
    """`search`, raising `TilingError` with the verdict's numbers when nothing fits."""
    result = search(graph, budget_bytes, input_requires_grad=input_requires_grad)
    if isinstance(result, OutOfMemory):
        raise TilingError(result.message())
    return result


@dataclass(frozen=True, kw_only=True)
class DagSegmentPlan:
    """A segment of a DAG, its tile count and the estimated bytes of one tile's training."""

    segment: Segment
    num_tiles: int
    """Tiles per tiled spatial dimension."""
    sizes: TileSizes
    estimate_bytes: int


@dataclass(frozen=True, kw_only=True)
class DagPlan:
    """Segmentation of a DAG against a budget (planned, not executed)."""

    graph: Graph = field(repr=False)
    segments: list[DagSegmentPlan]
    classes: dict[str, NodeClass]
    budget_bytes: int


def _dag_estimate(graph: Graph, segment: Segment, sizes: TileSizes) -> int:
    """Boundary tensors (input, output and their gradients) plus every tile tensor of the
    segment and its gradient, as the backward of one tile holds them (bytes)."""
    total = 2 * graph.tensors[segment.input].nbytes + 2 * graph.tensors[segment.output].nbytes
    for name, tile in sizes.tensors.items():
        if name == segment.input:
            continue
        info = graph.tensors[name]
        n = info.dtype.itemsize
        for d, s in enumerate(info.shape):
            n *= tile.get(d, s)
        total += 2 * n
    return total


def plan_dag(graph: Graph, budget_bytes: int) -> DagPlan | OutOfMemory:
    """Segments of a DAG (e.g. from `from_fx`) for `budget_bytes` at SFT's threshold (the
    budget), with the smallest tile count whose estimate fits; or the verdict, naming the
    must-tile operator that cannot be tiled or the operator that drops a dimension."""
    classes = classify(graph, budget_bytes)
    segments = grow_segments(graph, budget_bytes)
    covered = {graph.nodes[i].name for s in segments for i in s.positions}
    for n in graph.nodes:
        if graph.tensors[n.output].nbytes > budget_bytes and n.name not in covered:
            why = n.spec.reason or "it shares a region between cuts with an operator that cannot tile"
            return OutOfMemory(budget_bytes=budget_bytes, plain_peak_bytes=0,
                               best_peak_bytes=graph.tensors[n.output].nbytes, best_phase=n.name,
                               reason=f"{n.name} must tile (output {fmt_bytes(graph.tensors[n.output].nbytes)}) "
                                      f"but cannot: {why}")
    plans = []
    for seg in segments:
        losses: list[tuple[str, tuple[int, ...]]] = []
        dims = surviving_dims(graph, seg.positions, losses)
        tile_dims = tuple(d for d in (2, 3) if d in dims)
        label = f"segment {graph.nodes[seg.positions[0]].name}..{graph.nodes[seg.positions[-1]].name}"
        if not tile_dims:
            where = ", ".join(f"{name} drops {'/'.join('HW'[d - 2] for d in lost)}" for name, lost in losses)
            return OutOfMemory(budget_bytes=budget_bytes, plain_peak_bytes=0,
                               best_peak_bytes=graph.tensors[seg.output].nbytes, best_phase=label,
                               reason=f"{label} keeps no spatial dimension ({where})")
        out_shape = graph.tensors[seg.output].shape
        best = None
        for n in range(1, min(MAX_TILES, max(out_shape[d] for d in tile_dims)) + 1):
            tile = {d: -(-out_shape[d] // n) if d in tile_dims else out_shape[d] for d in (2, 3)}
            sizes = propagate(graph, list(seg.positions), (2, 3), tile)
            est = _dag_estimate(graph, seg, sizes)
            best = DagSegmentPlan(segment=seg, num_tiles=n, sizes=sizes, estimate_bytes=est)
            if est <= budget_bytes:
                break
        if best is None or best.estimate_bytes > budget_bytes:
            return OutOfMemory(budget_bytes=budget_bytes, plain_peak_bytes=0,
                               best_peak_bytes=best.estimate_bytes if best else 0, best_phase=label,
                               reason=f"{label} needs {fmt_bytes(best.estimate_bytes if best else 0)} even with "
                                      f"{best.num_tiles if best else 0} tiles per dimension")
        plans.append(best)
    return DagPlan(graph=graph, segments=plans, classes=classes, budget_bytes=budget_bytes)
