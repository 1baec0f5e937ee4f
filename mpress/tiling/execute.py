"""`TiledSequential`: train an `nn.Sequential` with fused-tiled segments.

    model = TiledSequential(vgg16(), budget_bytes=parse_bytes("2GiB"))
    loss = F.mse_loss(model(x), target); loss.backward(); optimizer.step()

Parameters, `state_dict` keys (under `model.`), `.train()`/`.eval()` are the wrapped
model's. A plan (mpress.tiling.planner) is made per input shape, dtype and module mode
and cached. Operators outside segments run as usual; each segment runs as one
`torch.autograd.Function`:

- forward (no autograd): tile by tile, the input slice with its halo is copied into a
  staging buffer allocated once per pass (padded with the first operator's padding
  value where the tile touches the image border), every operator runs on the tile with
  padding 0 (intermediate tiles that touch the border are padded the same way), and the
  tile's output is written into the preallocated segment output. Only the segment input
  is saved.
- backward: per tile, the forward is recomputed from the saved input with autograd on
  and `torch.autograd.backward` back-propagates the gradient of the tile's own output
  region only, accumulating weight gradients straight into the parameters' `.grad` (as
  reentrant checkpointing does; gradient hooks on those parameters fire once per tile).
  Output regions do not overlap, so the summed weight gradients count every output
  position, and through it every halo position, exactly once; the input gradients of
  the tiles (over their haloed input regions) are added into the segment's input
  gradient.

Gradients equal untiled training's (up to float rounding). Limits: segments of a chain
only (fx DAGs are planned, not executed); BatchNorm must be frozen inside segments
(training-mode BatchNorm and Dropout end a segment and run untiled).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _disable_current_modes

from mpress.errors import TilingError
from mpress.tiling.graph import Graph, OpNode, from_sequential
from mpress.tiling.planner import TilingPlan, plan_fixed, plan_for_budget
from mpress.tiling.tiles import DimTiling, Span


class SegmentRunner:
    """Runs one chain segment tile by tile (forward) and recomputes it tile by tile (backward)."""

    def __init__(self, graph: Graph, positions: tuple[int, ...], tilings: dict[int, DimTiling]) -> None:
        self.nodes: list[OpNode] = [graph.nodes[i] for i in positions]
        self.tilings = [tilings[d] for d in (2, 3)]
        self.in_shape = graph.tensors[self.nodes[0].inputs[0]].shape
        self.out_shape = graph.tensors[self.nodes[-1].output].shape
        params: dict[int, nn.Parameter] = {}
        for n in self.nodes:
            for p in (n.module.parameters() if n.module is not None else []):
                params.setdefault(id(p), p)
        self.params = list(params.values())
        h, w = self.tilings
        self.stage_numel = self.in_shape[0] * self.in_shape[1] * max(s[0].in_extent for s in h.spans) * max(
            s[0].in_extent for s in w.spans)

    def tiles(self) -> list[tuple[tuple[Span, ...], tuple[Span, ...]]]:
        """Every tile in row-major order: (H spans per operator, W spans per operator)."""
        h, w = self.tilings
        return [(tuple(hs), tuple(ws)) for hs in h.spans for ws in w.spans]

    def _stage(self, x: torch.Tensor, stage: torch.Tensor, hs: tuple[Span, ...], ws: tuple[Span, ...]) -> torch.Tensor:
        """The first operator's padded input tile, in the staging buffer."""
        h0, w0 = hs[0], ws[0]
        shape = (x.shape[0], x.shape[1], h0.in_extent, w0.in_extent)
        xs = stage[: shape[0] * shape[1] * shape[2] * shape[3]].view(shape)
        if h0.pad_lo or h0.pad_hi or w0.pad_lo or w0.pad_hi:
            xs.fill_(self.nodes[0].spec.fill)
        xs[:, :, h0.pad_lo:h0.pad_lo + h0.in_hi - h0.in_lo, w0.pad_lo:w0.pad_lo + w0.in_hi - w0.in_lo].copy_(
            x[:, :, h0.in_lo:h0.in_hi, w0.in_lo:w0.in_hi])
        return xs

    def _run(self, xs: torch.Tensor, hs: tuple[Span, ...], ws: tuple[Span, ...]) -> torch.Tensor:
        """The segment on one staged tile: operator k reads its padded input tile."""
        h = xs
        for k, node in enumerate(self.nodes):
            if k:
                pads = (ws[k].pad_lo, ws[k].pad_hi, hs[k].pad_lo, hs[k].pad_hi)
                if any(pads):
                    h = F.pad(h, pads, value=node.spec.fill)
            h = node.spec.kernel(h)  # (N, C_k, hs[k].out_extent, ws[k].out_extent)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The segment output, computed tile by tile without autograd."""
        out: torch.Tensor | None = None
        stage = x.new_empty(self.stage_numel)
        for hs, ws in self.tiles():
            with torch.profiler.record_function("mpress.tile.forward"):
                y = self._run(self._stage(x, stage, hs, ws), hs, ws)
                if out is None:  # the first tile tells the dtype (autocast may change it)
                    out = y.new_empty(self.out_shape)
                out[:, :, hs[-1].out_lo:hs[-1].out_hi, ws[-1].out_lo:ws[-1].out_hi].copy_(y)
            del y
        return out

    def backward(self, x: torch.Tensor, grad_out: torch.Tensor, need_input: bool, params: list[torch.Tensor]
                 ) -> torch.Tensor | None:
        """Accumulate the gradients of `params` into their `.grad` by recomputing every tile;
        return the gradient of the segment input (None unless `need_input`)."""
        grad_in = torch.zeros_like(x) if need_input else None
        if not need_input and not params:
            return None
        stage = x.new_empty(self.stage_numel)
        for hs, ws in self.tiles():
            with torch.profiler.record_function("mpress.tile.backward"), torch.enable_grad():
                xs = self._stage(x, stage, hs, ws).detach()
                if need_input:
                    xs.requires_grad_(True)
                y = self._run(xs, hs, ws)
                if not y.requires_grad:
                    continue
                g = grad_out[:, :, hs[-1].out_lo:hs[-1].out_hi, ws[-1].out_lo:ws[-1].out_hi]
                # into .grad directly: each operator's weight gradient is added as soon as it
                # exists, so only one operator's gradient is ever held beside the sums
                torch.autograd.backward(y, g, inputs=([xs] if need_input else []) + params)
                del y, g
            if need_input:
                h0, w0 = hs[0], ws[0]
                grad_in[:, :, h0.in_lo:h0.in_hi, w0.in_lo:w0.in_hi].add_(
                    xs.grad[:, :, h0.pad_lo:h0.pad_lo + h0.in_hi - h0.in_lo,
                            w0.pad_lo:w0.pad_lo + w0.in_hi - w0.in_lo])
            del xs
        return grad_in


class _SegmentFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: SegmentRunner, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.runner = runner
        ctx.save_for_backward(x)
        # the recompute in backward must see the autocast state the forward saw
        device = x.device.type
        ctx.autocast = ((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                        if torch.amp.is_autocast_available(device) else None)  # the meta device has none
        return runner.forward(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        runner: SegmentRunner = ctx.runner
        params = [p for p, need in zip(runner.params, ctx.needs_input_grad[2:]) if need]
        if ctx.autocast is None:
            grad_in = runner.backward(x, grad_out, ctx.needs_input_grad[1], params)
        else:
            device, enabled, dtype = ctx.autocast
            with torch.autocast(device, dtype=dtype, enabled=enabled):
                grad_in = runner.backward(x, grad_out, ctx.needs_input_grad[1], params)
        # parameter gradients went into .grad tile by tile, as reentrant checkpointing does
        return (None, grad_in, *([None] * len(runner.params)))


class TiledSequential(nn.Module):
    """An `nn.Sequential` whose giant activations are computed tile by tile.

    Give `budget_bytes` (plan segments and tile counts to fit it: `TilingError` with the
    numbers when nothing fits) or `num_tiles` (tiles per spatial dimension for every
    maximal tileable run; an int or (H, W)). Plans are made on first use of a shape and
    cached; `plan(shape)` returns one without running anything.
    """

    def __init__(self, model: nn.Sequential, *, budget_bytes: int | None = None,
                 num_tiles: int | tuple[int, int] | None = None) -> None:
        super().__init__()
        if (budget_bytes is None) == (num_tiles is None):
            raise TilingError("TiledSequential: give exactly one of budget_bytes and num_tiles")
        if budget_bytes is not None and budget_bytes <= 0:
            raise TilingError(f"TiledSequential: budget_bytes must be > 0, got {budget_bytes}")
        self.model = model
        self.budget_bytes = budget_bytes
        self.num_tiles = (num_tiles, num_tiles) if isinstance(num_tiles, int) else num_tiles
        self._plans: dict[tuple, tuple[TilingPlan, list[tuple[str, object]]]] = {}

    def plan(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
             input_requires_grad: bool = False) -> TilingPlan:
        """The plan for inputs of `shape` and `dtype` (made once, then cached)."""
        return self._steps(tuple(shape), dtype, input_requires_grad)[0]

    def _steps(self, shape: tuple[int, ...], dtype: torch.dtype,
               input_requires_grad: bool) -> tuple[TilingPlan, list[tuple[str, object]]]:
        # the mode of every module is part of the key: it decides what can be tiled (BatchNorm)
        key = (shape, dtype, input_requires_grad, tuple(m.training for m in self.model.modules()),
               tuple(p.requires_grad for p in self.model.parameters()))
        if key not in self._plans:
            # planning runs the network on the meta device; no dispatch mode the caller has
            # active (a memory tracker, say) should see that as part of the step
            with _disable_current_modes():
                self._plans[key] = self._make_plan(shape, dtype, input_requires_grad)
        return self._plans[key]

    def _make_plan(self, shape: tuple[int, ...], dtype: torch.dtype,
               input_requires_grad: bool) -> tuple[TilingPlan, list[tuple[str, object]]]:
        graph = from_sequential(self.model, shape, dtype)
        if self.num_tiles is not None:
            plan = plan_fixed(graph, self.num_tiles, input_requires_grad=input_requires_grad)
        else:
            plan = plan_for_budget(graph, self.budget_bytes, input_requires_grad=input_requires_grad)
        steps: list[tuple[str, object]] = []
        by_start = {sp.segment.positions[0]: sp for sp in plan.segments}
        i = 0
        while i < len(graph.nodes):
            sp = by_start.get(i)
            if sp is None:
                steps.append(("module", graph.nodes[i].module))
                i += 1
            else:
                steps.append(("segment", SegmentRunner(graph, sp.segment.positions, sp.tilings)))
                i = sp.segment.positions[-1] + 1
        return plan, steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, steps = self._steps(tuple(x.shape), x.dtype, x.requires_grad and torch.is_grad_enabled())
        h = x
        for kind, step in steps:
            if kind == "module":
                h = step(h)
            else:
                h = _SegmentFunction.apply(step, h, *step.params)
        return h
