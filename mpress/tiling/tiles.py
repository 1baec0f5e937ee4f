"""Tile sizes and tile regions of a segment.

Two views of the same arithmetic:

- `propagate` (any DAG segment): extents only. From the segment output tile, walk the
  operators backwards; a tensor's tile is the max over what its consumers need, an
  operator's iteration tile is its output tensor's tile, and an input tile is
  `scale * tile + delta` of the connection (ops.Link). The backward operators are walked
  too: the weight gradient of an operator iterates over its forward iteration tile and
  reads its forward input tile (no extra halo); its input gradient produces the gradient
  over the forward input tile and reads the output gradient over `input_grad_extent` of
  it, wider than the forward's iteration tile by `backward_halo`. In the executor's
  decomposition (each tile back-propagates the gradient of its own, non-overlapping
  output region through its recomputed forward) the output gradient in that halo is
  exactly zero: the tile's share of the loss does not depend on positions outside its
  forward region. The transposed window supplies those zeros as padding, so the backward
  halo costs neither data nor memory; what the backward needs beyond the forward is only
  the gradient of the recomputed input region (the halo of the input gradient), which
  the executor accumulates into the segment's input gradient.
- `chain_spans` (chains, what the executor runs): exact ranges per tile. Output positions
  [lo, hi) of an operator need input positions `[lo*stride - pad, (hi-1)*stride - pad +
  span)`, clipped to the tensor, with the clipped part replaced by padding; border tiles
  see real padding, interior tiles real neighbour data, uneven last tiles their own size.
  Tiles are separable: tile (i, j) covers the i-th row range times the j-th column range,
  so sums over tiles factor per dimension (`halo_overhead`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpress.errors import UserError
from mpress.tiling.graph import Graph


def split(length: int, num_tiles: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of `num_tiles` near-equal tiles of `length` (the first `length %
    num_tiles` tiles one longer); `num_tiles` is capped at `length`."""
    n = max(1, min(num_tiles, length))
    base, extra = divmod(length, n)
    out, lo = [], 0
    for i in range(n):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


@dataclass(frozen=True, kw_only=True)
class Span:
    """One operator's ranges along one dimension for one tile (positions)."""

    out_lo: int
    out_hi: int
    in_lo: int
    """Input slice [in_lo, in_hi), clipped to the input tensor."""
    in_hi: int
    pad_lo: int
    """Padding added before the slice (only at the true image border)."""
    pad_hi: int

    @property
    def out_extent(self) -> int:
        return self.out_hi - self.out_lo

    @property
    def in_extent(self) -> int:
        """Extent of the padded input slice the operator reads."""
        return self.in_hi - self.in_lo + self.pad_lo + self.pad_hi


def chain_spans(graph: Graph, positions: list[int], dim: int, out_lo: int, out_hi: int) -> list[Span]:
    """Exact ranges along `dim` of every operator of a chain segment (forward order) for
    segment-output positions [out_lo, out_hi)."""
    spans: list[Span] = []
    lo, hi = out_lo, out_hi
    for i in reversed(positions):
        node = graph.nodes[i]
        link = node.spec.link_for(0, dim)
        if link is None or link.in_dim != dim:
            raise UserError(f"layer {node.name} ({node.spec.kind}) does not connect dimension {dim} "
                            "of its input to its output; it cannot sit inside a segment tiled along it")
        length = graph.tensors[node.inputs[0]].shape[dim]
        if link.window is None:
            spans.append(Span(out_lo=lo, out_hi=hi, in_lo=lo, in_hi=hi, pad_lo=0, pad_hi=0))
        else:
            in_lo, in_hi, p_lo, p_hi = link.window.input_range(lo, hi, length)
            spans.append(Span(out_lo=lo, out_hi=hi, in_lo=in_lo, in_hi=in_hi, pad_lo=p_lo, pad_hi=p_hi))
            lo, hi = in_lo, in_hi
    return spans[::-1]


@dataclass(frozen=True, kw_only=True)
class DimTiling:
    """The tiles of a chain segment along one dimension: `spans[t][k]` for tile t, operator k."""

    dim: int
    ranges: list[tuple[int, int]]
    spans: list[list[Span]]

    @property
    def num_tiles(self) -> int:
        return len(self.ranges)


def tile_dim(graph: Graph, positions: list[int], dim: int, num_tiles: int) -> DimTiling:
    """Split the segment output along `dim` into `num_tiles` tiles and derive every span."""
    length = graph.tensors[graph.nodes[positions[-1]].output].shape[dim]
    ranges = split(length, num_tiles)
    return DimTiling(dim=dim, ranges=ranges, spans=[chain_spans(graph, positions, dim, lo, hi) for lo, hi in ranges])


def _op_weight(graph: Graph, i: int) -> int:
    """Work per output position of operator i (all channels and the batch): MACs x C x N."""
    node = graph.nodes[i]
    shape = graph.tensors[node.output].shape
    per_pos = node.spec.macs_per_output
    for d, s in enumerate(shape):
        if d not in (2, 3):
            per_pos *= s
    return per_pos


def op_work(graph: Graph, i: int) -> int:
    """Untiled work of operator i: output positions x channels x batch x MACs per output."""
    shape = graph.tensors[graph.nodes[i].output].shape
    area = shape[2] * shape[3] if len(shape) == 4 else 1
    return _op_weight(graph, i) * area


def halo_overhead(graph: Graph, positions: list[int], tilings: list[DimTiling]) -> float:
    """Extra work of tiled execution over untiled, as a fraction (0.0 = none): the work of
    every operator over every tile's output range, summed, over the untiled work, minus 1.
    Work per operator = output positions x channels x batch x MACs per output."""
    tiled = untiled = 0
    for k, i in enumerate(positions):
        w = _op_weight(graph, i)
        shape = graph.tensors[graph.nodes[i].output].shape
        t_area = u_area = 1
        for tl in tilings:
            t_area *= sum(spans[k].out_extent for spans in tl.spans)
            u_area *= shape[tl.dim]
        for d in (2, 3):
            if d < len(shape) and d not in [tl.dim for tl in tilings]:
                t_area *= shape[d]
                u_area *= shape[d]
        tiled += w * t_area
        untiled += w * u_area
    return tiled / untiled - 1.0 if untiled else 0.0


@dataclass(frozen=True, kw_only=True)
class OpTile:
    """Tile sizes of one operator (per tiled dimension, in positions)."""

    name: str
    iteration: dict[int, int]
    """Forward iteration tile = the operator's output tile."""
    inputs: list[dict[int, int]]
    """Per tensor input: the padded input tile the forward (and the weight gradient) reads."""
    grad_output: dict[int, int]
    """Output-gradient extent the input-gradient operator reads to produce the gradient
    of the forward input tile (its transposed window)."""
    backward_halo: dict[int, int]
    """grad_output minus iteration: the backward's halo beyond the forward's (zeros in
    the executor's decomposition, see the module docstring)."""


@dataclass(frozen=True, kw_only=True)
class TileSizes:
    """The result of `propagate`: per tensor its tile, per operator its `OpTile`."""

    tensors: dict[str, dict[int, int]]
    ops: list[OpTile]


def propagate(graph: Graph, positions: list[int], dims: tuple[int, ...], out_tile: dict[int, int]) -> TileSizes:
    """Tile sizes of a segment (operators at `positions`, topological order; any DAG) for a
    segment-output tile `out_tile` ({dim: extent}); see the module docstring."""
    inside = {graph.nodes[i].output for i in positions}
    inside.add(graph.nodes[positions[0]].inputs[0])
    for i in positions:
        inside.update(t for t in graph.nodes[i].inputs if graph.producer(t) is None or t in inside)
    out_name = graph.nodes[positions[-1]].output
    tiles: dict[str, dict[int, int]] = {out_name: dict(out_tile)}
    ops: list[OpTile] = []
    for i in reversed(positions):
        node = graph.nodes[i]
        it = tiles.get(node.output)
        if it is None:  # an output no operator of the segment reads (dead end): nothing to compute
            continue
        in_tiles: list[dict[int, int]] = []
        grad_out: dict[int, int] = {}
        for k, t in enumerate(node.inputs):
            need: dict[int, int] = {}
            for d in dims:
                link = node.spec.link_for(k, d)
                if link is None:
                    need[d] = graph.tensors[t].shape[d]  # read whole (a broadcast input)
                    continue
                need[link.in_dim] = link.needed_extent(it[d])
                if link.window is not None and k == 0:
                    grad_out[d] = link.window.input_grad_extent(need[link.in_dim])
            in_tiles.append(need)
            if t in inside:
                cur = tiles.setdefault(t, {})
                for d, e in need.items():
                    cur[d] = min(max(cur.get(d, 0), e), graph.tensors[t].shape[d])
        for d in dims:
            grad_out.setdefault(d, it[d])
        ops.append(OpTile(name=node.name, iteration=dict(it), inputs=in_tiles, grad_output=grad_out,
                          backward_halo={d: grad_out[d] - it[d] for d in dims}))
    return TileSizes(tensors=tiles, ops=ops[::-1])
