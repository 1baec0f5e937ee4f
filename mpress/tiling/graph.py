"""The dimension-connection graph of a network: operators with their `OpSpec`, tensors with
their shapes, for one input shape.

Built from an `nn.Sequential` (nested Sequentials are flattened into their leaves, named
by their path, e.g. `features.3`) or from a module traced with `torch.fx` (a simple DAG:
branches, residual adds, concatenation). Shapes come from running a copy of the network
on the meta device, so building the graph of a 20k x 20k image costs no memory.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch
import torch.fx
from torch import nn

from mpress.errors import UserError
from mpress.tiling.ops import OpSpec, characterise_function, characterise_module


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """One tensor of the graph (an activation, not a parameter)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass(kw_only=True)
class OpNode:
    """One operator: its characterisation, the tensors it reads and the one it writes."""

    name: str
    spec: OpSpec
    inputs: tuple[str, ...]
    output: str
    module: nn.Module | None = None
    """The real leaf module (None for fx functions)."""
    meta_module: nn.Module | None = field(default=None, repr=False)
    """A copy of `module` on the meta device (for probing what autograd saves)."""

    @property
    def windowed(self) -> bool:
        """Whether the operator slides a window (convolution, pooling): the ones halos come from."""
        return bool(self.spec.windows)


@dataclass(kw_only=True)
class Graph:
    """Operators in a topological order and the tensors between them."""

    nodes: list[OpNode]
    tensors: dict[str, TensorInfo]
    input: str
    output: str

    def consumers(self, tensor: str) -> list[tuple[int, int]]:
        """(node position, input index) of every operator reading `tensor`."""
        return [(i, k) for i, n in enumerate(self.nodes) for k, t in enumerate(n.inputs) if t == tensor]

    def producer(self, tensor: str) -> int | None:
        """Position of the operator writing `tensor` (None for the graph input)."""
        for i, n in enumerate(self.nodes):
            if n.output == tensor:
                return i
        return None

    def is_chain(self) -> bool:
        """Whether every operator reads exactly the previous operator's output."""
        prev = self.input
        for n in self.nodes:
            if n.inputs != (prev,):
                return False
            prev = n.output
        return prev == self.output

    def param_bytes(self, positions: range | list[int] | None = None) -> int:
        """Bytes of the trainable parameters of the operators at `positions` (all by default)."""
        seen: dict[int, int] = {}
        for i in (positions if positions is not None else range(len(self.nodes))):
            m = self.nodes[i].module
            if m is None:
                continue
            for p in m.parameters():
                if p.requires_grad:
                    seen[id(p)] = p.numel() * p.element_size()
        return sum(seen.values())


def _drop_broadcast_links(spec: OpSpec, in_shapes: list[tuple[int, ...]], out_shape: tuple[int, ...]) -> OpSpec:
    """An input dimension of size 1 broadcast (no window) over a larger output dimension is
    read whole by every tile (it carries no position), so it does not connect to it."""
    maps = []
    for shape, imap in zip(in_shapes, spec.input_maps):
        fixed = []
        for d, it in enumerate(imap):
            if it is not None and it in spec.output_map and it not in spec.windows and shape[d] == 1:
                od = spec.output_map.index(it)
                fixed.append(None if out_shape[od] != 1 else it)
            else:
                fixed.append(it)
        maps.append(tuple(fixed))
    return replace(spec, input_maps=tuple(maps))


def leaf_modules(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The leaves of nested `nn.Sequential`s in execution order, with their dotted paths."""
    if not isinstance(model, nn.Sequential):
        return [(prefix or type(model).__name__, model)]
    out = []
    for name, child in model.named_children():
        out += leaf_modules(child, f"{prefix}.{name}" if prefix else name)
    return out


def meta_clone(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose parameters and buffers live on the meta device; no
    parameter data is copied (a memo maps each one to an empty meta tensor)."""
    memo: dict[int, object] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        clone = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(clone, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else clone
    return copy.deepcopy(module, memo)


def from_sequential(model: nn.Sequential, input_shape: tuple[int, ...],
                    dtype: torch.dtype = torch.float32) -> Graph:
    """The graph of `model` applied to an input of `input_shape` (e.g. (1, 3, H, W)).

    Raises `UserError` when a layer rejects the shape (the message names the layer).
    """
    x = torch.empty(input_shape, dtype=dtype, device="meta")
    tensors = {"input": TensorInfo(name="input", shape=tuple(input_shape), dtype=dtype)}
    nodes = []
    prev = "input"
    for name, module in leaf_modules(model):
        meta = meta_clone(module)
        try:
            y = meta(x)
        except Exception as exc:  # a layer that cannot take this shape: a user mistake
            raise UserError(f"layer {name} ({type(module).__name__}) rejects input {tuple(x.shape)}: {exc}") from exc
        if not isinstance(y, torch.Tensor):
            raise UserError(f"layer {name} ({type(module).__name__}) returns {type(y).__name__}, not a tensor")
        spec = _drop_broadcast_links(characterise_module(module, (x.dim(),)), [tuple(x.shape)], tuple(y.shape))
        tensors[name] = TensorInfo(name=name, shape=tuple(y.shape), dtype=y.dtype)
        nodes.append(OpNode(name=name, spec=spec, inputs=(prev,), output=name, module=module,
                            meta_module=meta))
        prev, x = name, y
    return Graph(nodes=nodes, tensors=tensors, input="input", output=prev)


class _ShapeRecorder(torch.fx.Interpreter):
    """Runs a traced graph on meta tensors and keeps every node's output."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, object] = {}

    def run_node(self, n: torch.fx.Node) -> object:
        value = super().run_node(n)
        self.values[n.name] = value
        return value


def _tensor_args(args: object) -> list[torch.fx.Node]:
    return [a for a in _flatten(args) if isinstance(a, torch.fx.Node)]


def _flatten(args: object) -> list[object]:
    if isinstance(args, (list, tuple)):
        return [x for a in args for x in _flatten(a)]
    if isinstance(args, dict):
        return [x for a in args.values() for x in _flatten(a)]
    return [args]


def from_fx(module: nn.Module, input_shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Graph:
    """The graph of `module` traced by `torch.fx.symbolic_trace`, for one input of
    `input_shape`. Parameters read with `get_attr` are not graph tensors."""
    gm = torch.fx.symbolic_trace(module)
    meta_gm = meta_clone(gm)
    recorder = _ShapeRecorder(meta_gm)
    recorder.run(torch.empty(input_shape, dtype=dtype, device="meta"))
    modules = dict(gm.named_modules())
    meta_modules = dict(meta_gm.named_modules())
    tensors: dict[str, TensorInfo] = {}
    nodes: list[OpNode] = []
    graph_input = graph_output = ""
    for n in gm.graph.nodes:
        value = recorder.values.get(n.name)
        if n.op == "placeholder":
            if graph_input:
                raise UserError("fx graphs with more than one input are not supported for tiling")
            graph_input = n.name
            tensors[n.name] = TensorInfo(name=n.name, shape=tuple(value.shape), dtype=value.dtype)
            continue
        if n.op == "output":
            outs = _tensor_args(n.args)
            if len(outs) != 1:
                raise UserError("fx graphs with more than one output are not supported for tiling")
            graph_output = outs[0].name
            continue
        if n.op == "get_attr" or not isinstance(value, torch.Tensor):
            continue  # parameters, constants and non-tensor values are not activations
        ins = [a for a in _tensor_args((n.args, n.kwargs)) if a.name in tensors]
        in_shapes = [tensors[a.name].shape for a in ins]
        ranks = tuple(len(s) for s in in_shapes)
        if n.op == "call_module":
            spec = characterise_module(modules[n.target], ranks)
            mod, meta = modules[n.target], meta_modules[n.target]
        else:
            spec = characterise_function(n.target, n.args, dict(n.kwargs), ranks, value.dim())
            mod, meta = None, None
        spec = _drop_broadcast_links(spec, in_shapes, tuple(value.shape))
        tensors[n.name] = TensorInfo(name=n.name, shape=tuple(value.shape), dtype=value.dtype)
        nodes.append(OpNode(name=str(n.target) if n.op == "call_module" else n.name, spec=spec,
                            inputs=tuple(a.name for a in ins), output=n.name, module=mod, meta_module=meta))
    return Graph(nodes=nodes, tensors=tensors, input=graph_input, output=graph_output)
