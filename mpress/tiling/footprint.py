"""What one operator costs in memory during training, probed on the meta device.

Which tensors autograd saves for an operator's backward (its input, its output, index or
mask tensors of its own) and what its backward allocates are properties of PyTorch's
derivative formulas, not of mpress; rather than restate them per operator (and drift
from the installed torch), `probe` runs the operator once forward and once backward on
meta tensors (no data, no compute) under `LiveBytes` with saved-tensor hooks and
records what it sees. The memory model (peak.py) composes these footprints along the
executor's schedule.

A footprint is affine in the operator's output area (H x W positions) at fixed batch and
channels: `probe` measures it at two small tile sizes and `Footprint.at` evaluates it at
any tile or whole-image size. Tensors that existed before the call (parameters, buffers,
the input) are never counted as the operator's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from mpress.tiling.graph import Graph, OpNode
from mpress.contract.live_bytes import LiveBytes
from mpress.tiling.ops import characterise_module


@dataclass(frozen=True, kw_only=True)
class Bytes:
    """A byte count affine in the output area: `base + per_position * H_out * W_out`."""

    base: float
    per_position: float

    def at(self, area: int) -> int:
        return max(0, round(self.base + self.per_position * area))


@dataclass(frozen=True, kw_only=True)
class Footprint:
    """Memory behaviour of one operator in training (bytes, see `Bytes`)."""

    output_aliases_input: bool
    """The output is a view of the input (Flatten, Identity): it allocates nothing."""
    saves_input: bool
    saves_output: bool
    saved_other: Bytes
    """Tensors the operator creates and saves for backward (max-pool indices, masks)."""
    forward_extra: Bytes
    """Transient bytes of the forward above its output and saved tensors (temporaries)."""
    grad_param_bytes: int
    """Gradients of its trainable parameters."""
    backward_extra: Bytes
    """Transient bytes of the backward above the gradients it returns."""


def _area(shape: tuple[int, ...]) -> int:
    return shape[2] * shape[3] if len(shape) == 4 else 1


def _probe_once(call: Callable[[torch.Tensor], torch.Tensor], params: list[torch.Tensor],
                in_shape: tuple[int, ...], dtype: torch.dtype, input_grad: bool) -> dict[str, float]:
    x = torch.empty(in_shape, dtype=dtype, device="meta", requires_grad=input_grad)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with LiveBytes() as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = call(x)
    created = fwd.storage_bytes()
    xk, yk = x.untyped_storage()._cdata, y.untyped_storage()._cdata
    keys = {t.untyped_storage()._cdata for t in saved}
    other = sum(created[k] for k in keys if k not in (xk, yk) and k in created)
    out_bytes = created.get(yk, 0)
    result = {"alias": float(yk == xk), "saves_input": float(xk in keys), "saves_output": float(yk in keys and yk != xk),
              "other": float(other), "fwd_extra": float(max(0, fwd.peak_bytes - out_bytes - other)),
              "grad_params": 0.0, "bwd_extra": 0.0, "area": float(_area(tuple(y.shape)))}
    wanted = ([x] if input_grad else []) + [p for p in params if p.requires_grad]
    if y.requires_grad and wanted:
        g = torch.empty_like(y)
        with LiveBytes() as bwd:
            grads = torch.autograd.grad(y, wanted, g, allow_unused=True)
        kept = bwd.live_bytes
        grad_in = grads[0].untyped_storage().nbytes() if input_grad and grads[0] is not None else 0
        result["grad_params"] = float(kept - grad_in)
        result["bwd_extra"] = float(max(0, bwd.peak_bytes - kept))
        del grads
    return result


def _fit(a: dict[str, float], b: dict[str, float], key: str) -> Bytes:
    if b["area"] == a["area"]:
        return Bytes(base=a[key], per_position=0.0)
    slope = (b[key] - a[key]) / (b["area"] - a["area"])
    return Bytes(base=a[key] - slope * a["area"], per_position=slope)


def probe(call: Callable[[torch.Tensor], torch.Tensor], params: list[torch.Tensor],
          in_shapes: tuple[tuple[int, ...], tuple[int, ...]], dtype: torch.dtype, input_grad: bool) -> Footprint:
    """The footprint of `call` (on meta tensors; `params` are its meta parameters) from runs
    at two input shapes with the same batch and channels and different areas."""
    a = _probe_once(call, params, in_shapes[0], dtype, input_grad)
    b = a if in_shapes[1] == in_shapes[0] else _probe_once(call, params, in_shapes[1], dtype, input_grad)
    return Footprint(output_aliases_input=bool(a["alias"]), saves_input=bool(a["saves_input"]),
                     saves_output=bool(a["saves_output"]), saved_other=_fit(a, b, "other"),
                     forward_extra=_fit(a, b, "fwd_extra"), grad_param_bytes=int(a["grad_params"]),
                     backward_extra=_fit(a, b, "bwd_extra"))


class FootprintCache:
    """Footprints of a graph's operators, probed once per (operator, mode, input grad)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._cache: dict[tuple, Footprint] = {}

    def _probe_shapes(self, node: OpNode, tiled: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape = self.graph.tensors[node.inputs[0]].shape
        if len(shape) != 4:
            return shape, shape
        if not tiled:
            return shape, shape  # evaluated only at the whole tensor: one probe is exact
        ext = []
        for t in (2, 4):
            dims = []
            for d in (2, 3):
                link = node.spec.link_for(0, d)
                dims.append(link.needed_extent(t) if link is not None else shape[d])
            ext.append(shape[:2] + tuple(dims))
        return ext[0], ext[1]

    def node(self, position: int, *, tiled: bool, input_grad: bool) -> Footprint:
        """Footprint of the operator at `position`: as a tile kernel on padded tiles
        (`tiled`) or as the module on whole tensors."""
        key = (position, tiled, input_grad)
        if key not in self._cache:
            node = self.graph.nodes[position]
            meta = node.meta_module
            if meta is None:
                raise ValueError(f"{node.name}: no meta module to probe (fx function nodes are planned, not executed)")
            call = characterise_module(meta, (len(self.graph.tensors[node.inputs[0]].shape),)).kernel if tiled else meta
            self._cache[key] = probe(call, list(meta.parameters()), self._probe_shapes(node, tiled),
                                     self.graph.tensors[node.inputs[0]].dtype, input_grad)
        return self._cache[key]

    def pad(self, channels_shape: tuple[int, int], dtype: torch.dtype, input_grad: bool) -> Footprint:
        """Footprint of the executor's border padding (`F.pad`) of an (N, C, h, w) tile."""
        key = ("pad", channels_shape, dtype, input_grad)
        if key not in self._cache:
            n, c = channels_shape
            self._cache[key] = probe(lambda x: F.pad(x, (1, 1, 1, 1)), [], ((n, c, 2, 2), (n, c, 4, 4)),
                                     dtype, input_grad)
        return self._cache[key]
