"""Operator characterisation for fused-tiled execution: which dimensions of an operator
can be tiled, with which (scale, delta), and how to run the operator on one tile.

The IR follows SFT (PAPERS.md section 2). Every operator has an iteration space; each
input dimension maps to one iteration index (or to none), each output dimension to one
iteration index. An input dimension and an output dimension are *connected* when they
map to the same index; a connection is FT-compatible when an output slice of extent T
needs only an input slice of extent `scale*T + delta`. Sliding windows (convolution,
pooling) connect through a `Window`: output index o reads the input positions
`[o*stride - pad_lo, o*stride - pad_lo + span)`, with `span = dilation*(kernel-1) + 1`.

Per connection three (scale, delta) pairs matter (`scale_delta`):
- forward: output tile T needs input tile `stride*T + (span - stride)`;
- input gradient (a transposed window): a gradient tile T of the input needs the
  output gradient over at most `T/stride + (span + stride - 2)/stride` positions;
- weight gradient: iterates over output positions, so it needs the output gradient
  over T (scale 1, delta 0) and the input as the forward does.

Tiles run without the operator's own padding: the executor slices the input with its
halo and pads only at true image borders with `OpSpec.fill` (zero for convolution and
average pooling, -inf for max pooling), then calls `OpSpec.kernel`, which applies the
operator with padding 0. Not tileable (documented choices): BatchNorm in training
mode (batch statistics span the image; freeze it with `.eval()` or `FrozenBatchNorm2d`),
Dropout in training mode (masks would differ between tiles and their recompute),
non-zero padding modes, average pooling with `ceil_mode` or `count_include_pad=False`
(the divisor depends on the position), pooling that returns indices, and every
operator not listed here (Linear, adaptive/global pooling, flatten, softmax over space
are characterised as such; anything unknown is refused rather than guessed).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from mpress.tiling.networks import FrozenBatchNorm2d

Direction = Literal["forward", "input_grad", "weight_grad"]
Kernel = Callable[..., torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Window:
    """A sliding window along one dimension: output o reads input [o*stride - pad_lo, ... + span)."""

    span: int
    """dilation * (kernel - 1) + 1: input positions one output position reads."""
    stride: int
    pad_lo: int
    """Implicit padding before position 0 (the operator's own padding, low side)."""

    def input_range(self, lo: int, hi: int, length: int) -> tuple[int, int, int, int]:
        """Output positions [lo, hi) -> (in_lo, in_hi, pad_lo, pad_hi): the input slice
        [in_lo, in_hi) clipped to [0, length) and the padding to add on each side so
        that a padding-0 window over the padded slice yields exactly outputs [lo, hi)."""
        start = lo * self.stride - self.pad_lo
        end = (hi - 1) * self.stride - self.pad_lo + self.span
        in_lo, in_hi = max(start, 0), min(end, length)
        return in_lo, in_hi, in_lo - start, end - in_hi

    def forward_extent(self, tile: int) -> int:
        """Input extent an output tile of `tile` positions needs (before clipping)."""
        return (tile - 1) * self.stride + self.span

    def input_grad_extent(self, tile: int) -> int:
        """Most output-gradient positions an input-gradient tile of `tile` positions reads."""
        return (tile + self.span - 2) // self.stride + 1


@dataclass(frozen=True, kw_only=True)
class Link:
    """One FT-compatible connection: input dimension -> output dimension of an operator."""

    input_index: int
    in_dim: int
    out_dim: int
    window: Window | None
    """None: position i of the output needs position i of the input (scale 1, delta 0)."""

    def scale_delta(self, direction: Direction) -> tuple[Fraction, Fraction]:
        """(scale, delta) of this connection; see the module docstring."""
        w = self.window
        if w is None:
            return Fraction(1), Fraction(0)
        if direction == "forward":
            return Fraction(w.stride), Fraction(w.span - w.stride)
        if direction == "input_grad":
            return Fraction(1, w.stride), Fraction(w.span + w.stride - 2, w.stride)
        return Fraction(1), Fraction(0)  # weight_grad: output gradient over the iteration tile

    def needed_extent(self, tile: int) -> int:
        """Input extent an output tile of `tile` positions needs along this connection."""
        return tile if self.window is None else self.window.forward_extent(tile)


@dataclass(frozen=True, kw_only=True)
class OpSpec:
    """The characterisation of one operator.

    `iteration` names the iteration-space indices; `input_maps[k][d]` is the iteration
    index input k's dimension d maps to (None: the whole dimension is read by every
    iteration, e.g. a broadcast), `output_map[d]` the index of output dimension d;
    `windows` gives the sliding window of an index. Connections (`links`) are composed
    from these maps, as in SFT's graph IR.
    """

    kind: str
    iteration: tuple[str, ...]
    input_maps: tuple[tuple[int | None, ...], ...]
    output_map: tuple[int, ...]
    windows: dict[int, Window] = field(default_factory=dict)
    reason: str = ""
    """Why spatial tiling is refused ("" when the operator is spatially tileable)."""
    fill: float = 0.0
    """Value the executor pads tile borders with (the operator's own padding value)."""
    kernel: Kernel | None = None
    """`kernel(x1, ..., xk) -> y`: the operator on pre-padded tiles, padding 0. None when
    the operator cannot run on tiles."""
    macs_per_output: int = 1
    """Multiply-accumulates (or comparisons) per output element: weights halo overhead."""

    def links(self) -> list[Link]:
        """Every connection input dim -> output dim through a shared iteration index."""
        out = []
        for k, imap in enumerate(self.input_maps):
            for d, it in enumerate(imap):
                if it is None or it not in self.output_map:
                    continue
                out.append(Link(input_index=k, in_dim=d, out_dim=self.output_map.index(it),
                                window=self.windows.get(it)))
        return out

    def link_for(self, input_index: int, out_dim: int) -> Link | None:
        """The connection from input `input_index` to output dimension `out_dim`, if any."""
        for link in self.links():
            if link.input_index == input_index and link.out_dim == out_dim:
                return link
        return None

    @property
    def tileable(self) -> bool:
        """Whether the operator may sit inside an FT segment (it has a tile kernel)."""
        return self.kernel is not None and not self.reason


# --- iteration spaces -----------------------------------------------------------------

def _identity_spec(kind: str, rank: int, kernel: Kernel | None, *, num_inputs: int = 1,
                   reason: str = "", input_ranks: tuple[int, ...] | None = None) -> OpSpec:
    """An element-wise operator: every dimension connects to itself (scale 1, delta 0).
    Inputs of lower rank broadcast from the right; their missing or size-1 dimensions are
    handled by the caller (graph.py drops links of broadcast dimensions)."""
    ranks = input_ranks or (rank,) * num_inputs
    maps = tuple(tuple(range(rank - r, rank)) for r in ranks)
    return OpSpec(kind=kind, iteration=tuple(f"d{i}" for i in range(rank)), input_maps=maps,
                  output_map=tuple(range(rank)), kernel=kernel, reason=reason)


def _window_spec(kind: str, *, kernel_size: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
                 dilation: tuple[int, int], channels_reduce: bool, kernel: Kernel | None, fill: float,
                 macs: int, reason: str = "") -> OpSpec:
    """Convolution (channels reduce) or pooling (channels map through) on NCHW."""
    windows = {2 + i: Window(span=dilation[i] * (kernel_size[i] - 1) + 1, stride=stride[i], pad_lo=padding[i])
               for i in range(2)}
    if channels_reduce:
        # (n, co, oh, ow, ci, kh, kw): input channels reduce over ci, output channels are co
        iteration = ("n", "co", "oh", "ow", "ci", "kh", "kw")
        in_map: tuple[int | None, ...] = (0, 4, 2, 3)
    else:
        iteration = ("n", "c", "oh", "ow", "kh", "kw")
        in_map = (0, 1, 2, 3)
    return OpSpec(kind=kind, iteration=iteration, input_maps=(in_map,), output_map=(0, 1, 2, 3),
                  windows=windows, kernel=kernel, fill=fill, macs_per_output=macs, reason=reason)


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _conv2d(m: nn.Conv2d) -> OpSpec:
    k, s, d = _pair(m.kernel_size), _pair(m.stride), _pair(m.dilation)
    if isinstance(m.padding, str):
        # 'valid' is 0; 'same' (stride 1 only) pads d*(k-1) in total, the extra one at the end
        p = (0, 0) if m.padding == "valid" else tuple(d[i] * (k[i] - 1) // 2 for i in range(2))
    else:
        p = _pair(m.padding)
    reason = "" if m.padding_mode == "zeros" else f"padding_mode={m.padding_mode!r} reads across the image"

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, m.weight, m.bias, m.stride, 0, m.dilation, m.groups)

    return _window_spec("conv2d", kernel_size=k, stride=s, padding=p, dilation=d, channels_reduce=True,
                        kernel=kernel, fill=0.0, macs=(m.in_channels // m.groups) * k[0] * k[1], reason=reason)


def _max_pool2d(m: nn.MaxPool2d) -> OpSpec:
    k = _pair(m.kernel_size)
    s = _pair(m.stride if m.stride is not None else m.kernel_size)
    p, d = _pair(m.padding), _pair(m.dilation)
    reason = "returns indices" if m.return_indices else ""

    def kernel(x: torch.Tensor) -> torch.Tensor:
        # ceil_mode windows that run past the end read -inf padding: max ignores it
        return F.max_pool2d(x, k, s, 0, d, ceil_mode=False)

    return _window_spec("max_pool2d", kernel_size=k, stride=s, padding=p, dilation=d, channels_reduce=False,
                        kernel=kernel, fill=-math.inf, macs=k[0] * k[1], reason=reason)


def _avg_pool2d(m: nn.AvgPool2d) -> OpSpec:
    k = _pair(m.kernel_size)
    s = _pair(m.stride if m.stride is not None else m.kernel_size)
    p = _pair(m.padding)
    reason = ""
    if m.ceil_mode:
        reason = "ceil_mode: the last window's divisor depends on the image border"
    elif not m.count_include_pad and any(p):
        reason = "count_include_pad=False: the divisor depends on the position"

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(x, k, s, 0, divisor_override=m.divisor_override)

    return _window_spec("avg_pool2d", kernel_size=k, stride=s, padding=p, dilation=(1, 1), channels_reduce=False,
                        kernel=kernel, fill=0.0, macs=k[0] * k[1], reason=reason)


def _batch_norm(m: nn.BatchNorm2d, rank: int) -> OpSpec:
    if m.training or not m.track_running_stats:
        # batch statistics reduce over N, H, W: only channels stay independent
        return OpSpec(kind="batch_norm_train", iteration=("n", "c", "h", "w"), input_maps=((None, 1, None, None),),
                      output_map=(0, 1, 2, 3), reason="BatchNorm in training mode uses batch statistics over the "
                      "whole image; freeze it (.eval() or FrozenBatchNorm2d)")

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, m.eps)

    return _identity_spec("batch_norm_eval", rank, kernel)


_ELEMENTWISE: dict[type, Callable[[nn.Module], Kernel]] = {
    nn.ReLU: lambda m: F.relu,
    nn.ReLU6: lambda m: F.relu6,
    nn.LeakyReLU: lambda m: (lambda x: F.leaky_relu(x, m.negative_slope)),
    nn.GELU: lambda m: (lambda x: F.gelu(x, approximate=m.approximate)),
    nn.SiLU: lambda m: F.silu,
    nn.Sigmoid: lambda m: torch.sigmoid,
    nn.Tanh: lambda m: torch.tanh,
    nn.ELU: lambda m: (lambda x: F.elu(x, m.alpha)),
    nn.Hardswish: lambda m: F.hardswish,
    nn.Identity: lambda m: (lambda x: x),
    FrozenBatchNorm2d: lambda m: m.forward,
}
"""Element-wise modules and the out-of-place function a tile runs (in-place flags are
ignored inside segments: a tile's input may be the staging buffer autograd must keep)."""


def characterise_module(module: nn.Module, input_ranks: tuple[int, ...]) -> OpSpec:
    """The `OpSpec` of a leaf module applied to inputs of the given ranks.

    Conv2d, MaxPool2d, AvgPool2d, BatchNorm2d (eval), Dropout (eval) and the element-wise
    activations are characterised with a tile kernel; Linear, Flatten, adaptive pooling,
    Softmax and training-mode BatchNorm/Dropout are characterised but not tileable on H/W;
    any other module gets an empty map and a reason.
    """
    rank = input_ranks[0]
    t = type(module)
    if isinstance(module, nn.Conv2d) and rank == 4:
        return _conv2d(module)
    if isinstance(module, nn.MaxPool2d) and rank == 4:
        return _max_pool2d(module)
    if isinstance(module, nn.AvgPool2d) and rank == 4:
        return _avg_pool2d(module)
    if isinstance(module, nn.BatchNorm2d) and rank == 4:
        return _batch_norm(module, rank)
    if isinstance(module, (nn.Dropout, nn.Dropout2d)):
        if module.training and module.p > 0:
            return OpSpec(kind="dropout_train", iteration=tuple(f"d{i}" for i in range(rank)), input_maps=((),),
                          output_map=tuple(range(rank)), reason="Dropout in training mode draws a new mask per "
                          "tile and per recompute")
        return _identity_spec("identity", rank, lambda x: x)
    if t in _ELEMENTWISE:
        return _identity_spec(t.__name__.lower(), rank, _ELEMENTWISE[t](module))
    if isinstance(module, nn.Linear):
        # (..., in) -> (..., out): leading dimensions map through, the last one reduces
        lead = tuple(range(rank - 1))
        return OpSpec(kind="linear", iteration=tuple(f"d{i}" for i in range(rank + 1)),
                      input_maps=(lead + (rank,),), output_map=lead + (rank - 1,),
                      reason="Linear reduces over its input features")
    if isinstance(module, nn.Flatten):
        return _flatten_spec(rank, module.start_dim, module.end_dim)
    if isinstance(module, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)) and rank == 4:
        return OpSpec(kind="adaptive_pool2d", iteration=("n", "c", "oh", "ow", "ih", "iw"),
                      input_maps=((0, 1, 4, 5),), output_map=(0, 1, 2, 3),
                      reason="adaptive pooling: each output reads a fraction of the whole image")
    if isinstance(module, (nn.Softmax, nn.LogSoftmax)):
        dim = module.dim if module.dim is not None else 1
        return _reduce_dims_spec("softmax", rank, {dim % rank}, keep_reduced=True, kernel=module)
    return OpSpec(kind=f"unknown:{t.__name__}", iteration=(), input_maps=tuple(() for _ in input_ranks),
                  output_map=(), reason=f"{t.__name__} is not characterised for tiling")


def _flatten_spec(rank: int, start_dim: int, end_dim: int) -> OpSpec:
    start, end = start_dim % rank, end_dim % rank
    # the iteration space is the input's; dimensions outside [start, end] map through, the
    # merged block needs all of its inputs (its output index -1 is one no input maps to)
    in_map = tuple(None if start <= i <= end else i for i in range(rank))
    out_rank = rank - (end - start)
    out_map = tuple(j if j < start else (-1 if j == start else j + end - start) for j in range(out_rank))
    return OpSpec(kind="flatten", iteration=tuple(f"d{i}" for i in range(rank)), input_maps=(in_map,),
                  output_map=out_map, reason="flatten merges the spatial dimensions")


def _reduce_dims_spec(kind: str, rank: int, dims: set[int], *, keep_reduced: bool,
                      kernel: Kernel | None = None) -> OpSpec:
    """Softmax/mean over `dims`: those dimensions need their whole extent. Tileable (with
    `kernel`) only when no spatial dimension of an NCHW tensor is reduced."""
    in_map = tuple(None if d in dims else d for d in range(rank))
    out_dims = [d for d in range(rank) if keep_reduced or d not in dims]
    out_map = tuple(-1 if d in dims else d for d in out_dims)
    spatial = (rank != 4) or bool({2, 3} & dims)
    reason = f"{kind} reduces over dimension(s) {sorted(dims)}" if spatial else ""
    if not reason and kernel is None:
        reason = f"{kind} has no tile kernel"
    return OpSpec(kind=kind, iteration=tuple(f"d{i}" for i in range(rank)), input_maps=(in_map,),
                  output_map=out_map, reason=reason, kernel=None if reason else kernel)


def characterise_function(target: object, args: tuple, kwargs: dict, input_ranks: tuple[int, ...],
                          out_rank: int) -> OpSpec:
    """The `OpSpec` of a `torch.fx` call_function/call_method target (`args`, `kwargs`: the
    node's arguments, read for `dim`-like parameters) on tensor inputs of the given ranks.
    Element-wise arithmetic and activations, `torch.cat` over channels, flatten and
    reductions (mean, sum, amax, softmax) are characterised; anything else is not tileable."""
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    elementwise = {"add", "sub", "mul", "truediv", "div", "relu", "sigmoid", "tanh", "gelu", "silu", "iadd",
                   "add_", "mul_"}
    if name in elementwise:
        fn = {"add": operator.add, "iadd": operator.add, "add_": operator.add, "sub": operator.sub,
              "mul": operator.mul, "mul_": operator.mul, "truediv": operator.truediv, "div": operator.truediv,
              "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "gelu": F.gelu, "silu": F.silu}[name]
        return _identity_spec(name, out_rank, fn, num_inputs=len(input_ranks), input_ranks=input_ranks)
    if name == "cat":
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0) % out_rank
        maps = tuple(tuple(None if d == dim else d for d in range(out_rank)) for _ in input_ranks)
        reason = "" if dim == 1 else f"cat along dimension {dim}"
        return OpSpec(kind="cat", iteration=tuple(f"d{i}" for i in range(out_rank)), input_maps=maps,
                      output_map=tuple(range(out_rank)), kernel=(lambda *xs: torch.cat(xs, dim)) if not reason
                      else None, reason=reason)
    if name == "flatten":
        start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
        end = kwargs.get("end_dim", args[2] if len(args) > 2 else -1)
        return _flatten_spec(input_ranks[0], start, end)
    if name in ("mean", "sum", "amax", "softmax", "log_softmax"):
        raw = kwargs.get("dim", args[1] if len(args) > 1 else None)
        rank = input_ranks[0]
        dims = set(range(rank)) if raw is None else {d % rank for d in ((raw,) if isinstance(raw, int) else raw)}
        keep = name in ("softmax", "log_softmax") or bool(kwargs.get("keepdim", False))
        return _reduce_dims_spec(name, rank, dims, keep_reduced=keep)
    return OpSpec(kind=f"unknown:{name}", iteration=(), input_maps=tuple(() for _ in input_ranks),
                  output_map=(), reason=f"{name} is not characterised for tiling")


def scale_delta_table(spec: OpSpec) -> list[tuple[int, int, Direction, Fraction, Fraction]]:
    """(in_dim, out_dim, direction, scale, delta) for every connection of input 0 and every
    direction: the characterisation as the CLI and the tests read it."""
    rows = []
    for link in spec.links():
        if link.input_index != 0:
            continue
        for direction in ("forward", "input_grad", "weight_grad"):
            scale, delta = link.scale_delta(direction)  # type: ignore[arg-type]
            rows.append((link.in_dim, link.out_dim, direction, scale, delta))
    return rows
