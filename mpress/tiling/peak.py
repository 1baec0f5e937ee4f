"""Predicted peak memory of one training step of a chain under a tiling.

The step is what `TiledSequential` runs for `F.mse_loss(model(x), target).backward()`
(SFT's loss) with every parameter's `.grad` unset beforehand; the prediction is the high-water mark of live
tensor bytes created during the step (memory.LiveBytes measures the same quantity: the
input batch and the parameters are not counted, parameter gradients are). The model
replays the executor's schedule on byte counts: every tensor has holders (the running
value, the operators that saved it, a segment's checkpoint, autograd's gradient
buffers) and is freed with its last holder; each operator contributes its probed
footprint (footprint.py): output, saved tensors, transient bytes, gradients.

A segment costs, on top of what is live around it: in forward its output buffer, the
staging buffer and the largest tile's no-grad working set; in backward the gradient of
its input (if needed), the staging buffer, and the largest tile's recompute-plus-backward
working set, beside the parameter gradients the first tile left in `.grad`. Tile working sets are computed per
distinct tile geometry (border, interior and short last tiles differ) and cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpress.tiling.footprint import FootprintCache
from mpress.tiling.graph import Graph
from mpress.tiling.tiles import DimTiling, Span


@dataclass(frozen=True, kw_only=True)
class SegmentLayout:
    """Where a segment sits and how it is tiled (per spatial dimension 2 and 3)."""

    positions: tuple[int, ...]
    tilings: dict[int, DimTiling]


@dataclass(frozen=True, kw_only=True)
class PeakPrediction:
    """Predicted high-water mark of one training step, and where it happens."""

    peak_bytes: int
    phases: list[tuple[str, int]] = field(default_factory=list)
    """(phase, peak bytes during it) in execution order: forward of each step, backward of each step."""
    kept_bytes: int = 0
    """Bytes held at the end of the forward pass (checkpoints and saved activations)."""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: p[1])[0] if self.phases else ""


class _Memory:
    """Byte counts with holders: a tensor is freed when its last holder lets go."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._tensors: dict[str, list] = {}

    def new(self, name: str, nbytes: int, holder: str) -> None:
        self._tensors[name] = [nbytes, {holder}]
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def hold(self, name: str, holder: str) -> None:
        if name in self._tensors:
            self._tensors[name][1].add(holder)

    def drop(self, name: str, holder: str) -> None:
        entry = self._tensors.get(name)
        if entry is None:
            return
        entry[1].discard(holder)
        if not entry[1]:
            self.live -= entry[0]
            del self._tensors[name]

    def spike(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.live + nbytes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class PeakModel:
    """Predicts `PeakPrediction`s for one graph (a chain) under different segmentations."""

    def __init__(self, graph: Graph, *, input_requires_grad: bool = False,
                 footprints: FootprintCache | None = None) -> None:
        self.graph = graph
        self.fp = footprints or FootprintCache(graph)
        self.itemsize = graph.tensors[graph.input].dtype.itemsize
        # requires_grad of each operator's input
        self.req_in: list[bool] = []
        req = input_requires_grad
        for n in graph.nodes:
            self.req_in.append(req)
            req = req or any(p.requires_grad for p in (n.module.parameters() if n.module is not None else []))
        self._tile_cache: dict[tuple, tuple[int, int]] = {}

    # --- one tile ------------------------------------------------------------------------
    def _tile(self, positions: tuple[int, ...], hs: tuple[Span, ...], ws: tuple[Span, ...],
              first: bool) -> tuple[int, int]:
        """(no-grad forward peak, recompute+backward peak) of one tile, relative to the bytes
        live before it (staging buffer excluded). The first tile's weight gradients stay
        (they become the parameters' .grad); later tiles' are added and freed."""
        key = (positions, first, tuple((s.in_extent, s.out_extent, s.pad_lo + s.pad_hi) for s in hs),
               tuple((s.in_extent, s.out_extent, s.pad_lo + s.pad_hi) for s in ws))
        if key in self._tile_cache:
            return self._tile_cache[key]
        g = self.graph
        n0 = g.tensors[g.input].shape[0]

        def nbytes(position: int, k: int, which: str, padded: bool) -> int:
            node = g.nodes[position]
            t = node.output if which == "out" else node.inputs[0]
            c = g.tensors[t].shape[1]
            if which == "out":
                return n0 * c * hs[k].out_extent * ws[k].out_extent * self.itemsize
            if padded:
                return n0 * c * hs[k].in_extent * ws[k].in_extent * self.itemsize
            return n0 * c * (hs[k].in_hi - hs[k].in_lo) * (ws[k].in_hi - ws[k].in_lo) * self.itemsize

        # forward without autograd: one operator's input and output at a time
        fwd = 0
        cur = 0  # the staging view costs nothing of its own
        for k, i in enumerate(positions):
            fp = self.fp.node(i, tiled=True, input_grad=self.req_in[i])
            area = hs[k].out_extent * ws[k].out_extent
            padded = k > 0 and (hs[k].pad_lo + hs[k].pad_hi + ws[k].pad_lo + ws[k].pad_hi) > 0
            if padded:
                pad = nbytes(i, k, "in", True)
                fwd = max(fwd, cur + pad)
                cur = pad
            out = 0 if fp.output_aliases_input else nbytes(i, k, "out", False)
            fwd = max(fwd, cur + out + fp.forward_extra.at(area) + fp.saved_other.at(area))
            cur = out
        # recompute with autograd, then autograd.backward over the tile
        mem = _Memory()
        mem.new("x", 0, "cur")
        prev = "x"
        saved: list[list[str]] = []
        pads: list[bool] = []
        for k, i in enumerate(positions):
            fp = self.fp.node(i, tiled=True, input_grad=self.req_in[i])
            area = hs[k].out_extent * ws[k].out_extent
            padded = k > 0 and (hs[k].pad_lo + hs[k].pad_hi + ws[k].pad_lo + ws[k].pad_hi) > 0
            pads.append(padded)
            if padded:
                mem.new(f"p{k}", nbytes(i, k, "in", True), "cur")
                mem.drop(prev, "cur")
                prev = f"p{k}"
            out = f"o{k}"
            mem.new(out, 0 if fp.output_aliases_input else nbytes(i, k, "out", False), "cur")
            mem.spike(fp.forward_extra.at(area))
            holds = []
            if fp.saves_input:
                mem.hold(prev, f"s{k}")
                holds.append(prev)
            if fp.saves_output:
                mem.hold(out, f"s{k}")
                holds.append(out)
            mem.new(f"other{k}", fp.saved_other.at(area), f"s{k}")
            holds.append(f"other{k}")
            saved.append(holds)
            mem.drop(prev, "cur")
            prev = out
        # the tile output (the last o{k}) stays referenced by the executor until backward returns
        grad = "gy"
        mem.new(grad, 0, "engine")  # a view of the segment's output gradient
        for k in reversed(range(len(positions))):
            i = positions[k]
            req = self.req_in[i]
            fp = self.fp.node(i, tiled=True, input_grad=req)
            area = hs[k].out_extent * ws[k].out_extent
            gin = nbytes(i, k, "in", True) if req else 0
            mem.new(f"g{k}", gin, "engine")
            mem.new(f"gp{k}", fp.grad_param_bytes, "param" if first else "tmp")
            mem.spike(fp.backward_extra.at(area))
            mem.drop(f"gp{k}", "tmp")  # added into .grad
            for name in saved[k]:
                mem.drop(name, f"s{k}")
            mem.drop(grad, "engine")
            grad = f"g{k}"
            if pads[k] and req:
                mem.new(f"gu{k}", nbytes(i, k, "in", False), "engine")  # gradient of the unpadded tile
                mem.drop(grad, "engine")
                grad = f"gu{k}"
        result = (fwd, mem.peak)
        self._tile_cache[key] = result
        return result

    # --- the whole step ------------------------------------------------------------------
    def predict(self, segments: list[SegmentLayout]) -> PeakPrediction:
        """The peak of one training step with `segments` tiled and every other operator
        run as usual (an empty list: plain training)."""
        g = self.graph
        starts = {s.positions[0]: s for s in segments}
        steps: list[tuple[str, object]] = []
        i = 0
        while i < len(g.nodes):
            if i in starts:
                steps.append(("segment", starts[i]))
                i = starts[i].positions[-1] + 1
            else:
                steps.append(("module", i))
                i += 1
        mem = _Memory()
        phases: list[tuple[str, int]] = []
        cur = g.input
        mem.new(cur, 0, "cur")  # the batch exists before the step

        def phase(label: str) -> None:
            phases.append((label, mem.peak))
            mem.peak = mem.live

        for kind, step in steps:
            if kind == "module":
                i = step  # type: ignore[assignment]
                node = g.nodes[i]
                fp = self.fp.node(i, tiled=False, input_grad=self.req_in[i])
                out_shape = g.tensors[node.output].shape
                area = out_shape[2] * out_shape[3] if len(out_shape) == 4 else 1
                nb = 0 if fp.output_aliases_input else _numel(out_shape) * self.itemsize
                mem.new(node.output, nb, "cur")
                if fp.output_aliases_input:
                    mem.hold(cur, f"view{i}")  # the view keeps its base alive
                mem.spike(fp.forward_extra.at(area))
                mem.new(f"other{i}", fp.saved_other.at(area), f"s{i}")
                if fp.saves_input:
                    mem.hold(cur, f"s{i}")
                if fp.saves_output:
                    mem.hold(node.output, f"s{i}")
                mem.drop(cur, "cur")
                cur = node.output
                phase(f"forward {node.name}")
            else:
                seg: SegmentLayout = step  # type: ignore[assignment]
                out = g.nodes[seg.positions[-1]].output
                mem.new(out, _numel(g.tensors[out].shape) * self.itemsize, "cur")
                stage = self._stage_bytes(seg)
                fwd_peak = max(self._tile(seg.positions, hs, ws, False)[0] for hs, ws, _ in self._geometries(seg))
                mem.spike(stage + fwd_peak)
                mem.hold(cur, f"seg{seg.positions[0]}")
                mem.drop(cur, "cur")
                cur = out
                phase(f"forward {self.segment_label(seg)}")
        kept = mem.live
        # mse_loss saves the output until its backward, which allocates the output's gradient;
        # its 0-dim result keeps the unreduced buffer (output-sized) as storage all along
        out_bytes = _numel(g.tensors[cur].shape) * self.itemsize
        mem.new("loss", out_bytes, "caller")
        mem.hold(cur, "loss")
        mem.drop(cur, "cur")
        phase("loss")
        grad = f"grad:{cur}"
        mem.new(grad, out_bytes, "engine")
        mem.drop(cur, "loss")
        for kind, step in reversed(steps):
            if kind == "module":
                i = step  # type: ignore[assignment]
                node = g.nodes[i]
                fp = self.fp.node(i, tiled=False, input_grad=self.req_in[i])
                if not (self.req_in[i] or fp.grad_param_bytes):
                    mem.drop(grad, "engine")
                    break  # nothing before this operator needs a gradient
                out_shape = g.tensors[node.output].shape
                area = out_shape[2] * out_shape[3] if len(out_shape) == 4 else 1
                if fp.output_aliases_input:
                    # a view's backward is a view of the incoming gradient: nothing new
                    mem.drop(node.inputs[0], f"view{i}")
                    phase(f"backward {node.name}")
                    continue
                gin = _numel(g.tensors[node.inputs[0]].shape) * self.itemsize if self.req_in[i] else 0
                mem.new(f"grad:{node.inputs[0]}", gin, "engine")
                mem.new(f"param-grad{i}", fp.grad_param_bytes, "param")
                mem.spike(fp.backward_extra.at(area))
                mem.drop(f"other{i}", f"s{i}")
                mem.drop(node.inputs[0], f"s{i}")
                mem.drop(node.output, f"s{i}")
                mem.drop(grad, "engine")
                grad = f"grad:{node.inputs[0]}"
                phase(f"backward {node.name}")
            else:
                seg = step  # type: ignore[assignment]
                first = seg.positions[0]
                src = g.nodes[first].inputs[0]
                need_input = self.req_in[first]
                gin = _numel(g.tensors[src].shape) * self.itemsize if need_input else 0
                mem.new(f"grad:{src}", gin, "engine")
                stage = self._stage_bytes(seg)
                mem.new("stage", stage, "runner")
                acc = g.param_bytes(list(seg.positions))
                geoms = self._geometries(seg)
                mem.spike(self._tile(seg.positions, geoms[0][0], geoms[0][1], True)[1])
                # every later tile runs beside the gradients the first one left in .grad
                later = [(hs, ws) for j, (hs, ws, count) in enumerate(geoms) if j > 0 or count > 1]
                if later:
                    mem.spike(acc + max(self._tile(seg.positions, hs, ws, False)[1] for hs, ws in later))
                mem.drop("stage", "runner")
                mem.new(f"param-grad-seg{first}", acc, "param")
                mem.drop(src, f"seg{first}")
                mem.drop(grad, "engine")
                grad = f"grad:{src}"
                phase(f"backward {self.segment_label(seg)}")
        return PeakPrediction(peak_bytes=max(p for _, p in phases) if phases else 0, phases=phases, kept_bytes=kept)

    def _geometries(self, seg: SegmentLayout) -> list[tuple[tuple[Span, ...], tuple[Span, ...], int]]:
        """Distinct tile geometries with how many tiles have each, the first tile's first."""
        per_dim = []
        for d in (2, 3):
            seen: dict[tuple, list] = {}
            for spans in seg.tilings[d].spans:
                key = tuple((s.in_extent, s.out_extent, s.pad_lo + s.pad_hi) for s in spans)
                seen.setdefault(key, [tuple(spans), 0])[1] += 1
            per_dim.append(list(seen.values()))
        return [(hs, ws, ch * cw) for hs, ch in per_dim[0] for ws, cw in per_dim[1]]

    def _stage_bytes(self, seg: SegmentLayout) -> int:
        src = self.graph.tensors[self.graph.nodes[seg.positions[0]].inputs[0]].shape
        h, w = seg.tilings[2], seg.tilings[3]
        return (src[0] * src[1] * max(s[0].in_extent for s in h.spans) * max(s[0].in_extent for s in w.spans)
                * self.itemsize)

    def segment_label(self, seg: SegmentLayout) -> str:
        """How phases name a segment: `segment FIRST..LAST` (layer names)."""
        g = self.graph
        return f"segment {g.nodes[seg.positions[0]].name}..{g.nodes[seg.positions[-1]].name}"
