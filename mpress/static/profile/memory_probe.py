"""The memory probe: what one layer's forward and backward of one microbatch hold on the
device, counted by `LiveBytes` (every storage an operator creates), the way the runtime
counts a CPU stand-in's device.

A layer runs alone on an input made before (so the input is not counted), then its
backward from a gradient made before. The probe runs on any device: the real one for the
measured profiler, the meta device for the analytic one (operators create storages of
the right sizes there without computing, so a 20B-parameter model's layers are probed in
milliseconds). It records (`mpress.static.profile.profile.LayerMemory`):

- kept_bytes: live after the forward minus before: what the layer keeps for its backward
  and its output (the caller holds the output; for the last layer with a loss, the
  module's output too, which the pipeline keeps until the microbatch's backward);
- forward_peak_bytes: the highest live bytes above the start during the forward;
- saves_input / saves_output: whether autograd saved the layer's input (resp. output)
  storage, which then lives until this layer's backward;
- backward_peak_bytes: the highest live bytes above the start of the backward (the
  start includes what the forward kept and the incoming gradient);
- input_grad_bytes: the gradient of the input the backward hands to the layer before;
- loss_bytes: with a loss, the loss's bytes (its seed gradient is as large);
- split_held_bytes / input_peak_bytes / input_end_bytes / output_grad_freed_bytes /
  weight_peak_bytes / weight_replays: the same forward, then its backward split as torch's
  zero-bubble schedules split it (`split_backward`);
- and, beside it, the parameters' gradients the first backward of a step creates.

`mpress/static/memory/stage_memory.py` composes these into a stage's memory curve. Units: bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from mpress.contract.identity import side_effect_free
from mpress.contract.live_bytes import LiveBytes, tensors_in
from mpress.contract.selective import (LayerOps, cached_ops, recompute_menu, run_recomputed, storage_id,
                                      trace_layer_ops)
from mpress.static.profile.cuda_kernels import in_recompute
from mpress.static.profile.profile import LayerMemory

LossFn = Callable[[Any], torch.Tensor]


def _nbytes(values: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors_in(values):
        seen[storage_id(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def probe_layer(layer: nn.Module, args: tuple[Any, ...], *, loss_fn: LossFn | None = None,
                split: bool = True) -> tuple[LayerMemory, int]:
    """Probe `layer` on `args` (one microbatch, on the layer's device; floating inputs that
    should carry gradients must require them). With `loss_fn(output) -> scalar`, the loss
    is part of the layer (the last layer of a model). The layer's parameters must not have
    gradients; none are left behind. Random streams and buffers are left as they were.
    Returns the layer's memory and the bytes of the parameter gradients its backward made.
    split: measure a split backward too (`split_backward`)."""
    tracker = _tracker(layer, args)
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(storage_id(t))
        return t

    inputs = {storage_id(t) for t in tensors_in(args)}
    devices = sorted({p.device.index for p in layer.parameters() if p.device.type == "cuda"})
    buffers = [(b, b.detach().clone()) for b in layer.buffers()]
    with torch.random.fork_rng(devices=devices), tracker.watch():
        start = tracker.live_bytes
        tracker.reset_peak()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = layer(*args)
            root = loss_fn(output) if loss_fn is not None else output
        kept = tracker.live_bytes - start
        forward_peak = tracker.peak_bytes - start
        outputs = {storage_id(t) for t in tensors_in(output)}
        output_bytes = _nbytes(output)
        loss_bytes = _nbytes(root) if loss_fn is not None else 0
        roots = [t for t in tensors_in(root) if t.requires_grad]
        # the incoming gradient is a receive buffer made before the backward; a loss's
        # seed is made by the backward itself, as at run time
        grads = [torch.ones_like(t) for t in roots] if loss_fn is None else None
        backward_start = tracker.live_bytes
        tracker.reset_peak()
        if roots:
            torch.autograd.backward(roots, grads)
        del output, root, roots, grads
        backward_peak = tracker.peak_bytes - backward_start
        input_grads = sum(t.grad.untyped_storage().nbytes() for t in tensors_in(args)
                          if isinstance(t, torch.Tensor) and t.grad is not None)
        param_grads = sum(p.grad.untyped_storage().nbytes() for p in layer.parameters() if p.grad is not None)
    _restore(layer, args, buffers)
    split_found = split_backward(layer, args, loss_fn=loss_fn) if split else SplitMemory()
    return LayerMemory(kept_bytes=kept, forward_peak_bytes=forward_peak, saves_input=bool(saved & inputs),
                       saves_output=bool(saved & outputs), backward_peak_bytes=backward_peak,
                       input_grad_bytes=input_grads, output_bytes=output_bytes, loss_bytes=loss_bytes,
                       split_held_bytes=split_found.held, input_peak_bytes=split_found.input_peak,
                       input_end_bytes=split_found.input_end, output_grad_freed_bytes=split_found.output_grad_freed,
                       weight_peak_bytes=split_found.weight_peak, weight_replays=split_found.replays), param_grads


@dataclass(frozen=True)
class SplitMemory:
    """What `split_backward` measured (the `LayerMemory` fields of the same names; -1:
    not measured)."""

    held: int = -1
    input_peak: int = -1
    input_end: int = -1
    output_grad_freed: int = 0
    weight_peak: int = -1
    replays: int = -1


def split_backward(layer: nn.Module, args: tuple[Any, ...], *, loss_fn: LossFn | None = None) -> SplitMemory:
    """The split backward's memory of `layer` on `args` (see `LayerMemory`): its forward,
    then torch's own halves of the backward, I (`stage_backward_input`) and W
    (`stage_backward_weight`), as the zero-bubble schedules run them (a checkpointed
    layer counts the runs of its forward during W). I's end is when the engine hands
    over the input's gradient (a hook on the input; the last one, with several), before
    torch detaches the outputs. Not measured when no input takes a gradient (torch then
    runs the whole backward in W) or an output is a view (alone, the layer's output
    would be the stage's). Leaves the layer as `probe_layer` does."""
    inputs = [t for t in tensors_in(args) if t.requires_grad]
    if not inputs:
        return SplitMemory()
    tracker = _tracker(layer, args)
    devices = sorted({p.device.index for p in layer.parameters() if p.device.type == "cuda"})
    buffers = [(b, b.detach().clone()) for b in layer.buffers()]
    found = SplitMemory()
    with torch.random.fork_rng(devices=devices), tracker.watch():
        output = layer(*args)
        root = loss_fn(output) if loss_fn is not None else output
        roots = [t for t in tensors_in(root) if t.requires_grad]
        if not any(t._is_view() for t in roots):  # torch's I detaches them in place, which a view refuses
            grads = [torch.ones_like(t) for t in roots] if loss_fn is None else None
            start = tracker.live_bytes
            tracker.reset_peak()
            ends: list[int] = []
            hooks = [t.register_hook(lambda _g: ends.append(tracker.live_bytes - start)) for t in inputs]
            try:
                _dinputs, groups = stage_backward_input(roots, grads, inputs, layer.parameters())
            finally:
                for h in hooks:
                    h.remove()
            input_peak = tracker.peak_bytes - start
            kept_grads = {storage_id(g) for group in groups for g in tensors_in(group.get("grads", []))}
            freed = sum(g.untyped_storage().nbytes() for g in grads or [] if storage_id(g) not in kept_grads)
            del output, root, roots, grads, _dinputs
            after_input = tracker.live_bytes
            tracker.reset_peak()
            runs = layer.runs if isinstance(layer, _Checkpointed) else 0
            stage_backward_weight(layer.parameters(), groups)
            replays = (layer.runs if isinstance(layer, _Checkpointed) else 0) - runs
            del groups
            weight_peak = tracker.peak_bytes - after_input
            param_grads = sum(p.grad.untyped_storage().nbytes() for p in layer.parameters() if p.grad is not None)
            found = SplitMemory(held=max(after_input - (tracker.live_bytes - param_grads), 0), input_peak=input_peak,
                                input_end=ends[-1] if ends else input_peak, output_grad_freed=freed,
                                weight_peak=weight_peak, replays=replays)
    _restore(layer, args, buffers)
    return found


class _Checkpointed(nn.Module):
    """A layer run as the runtime runs a recomputed one (`mpress.contract.selective.run_recomputed`:
    non-reentrant checkpoint, random state preserved, the operators `cached` cached).
    `runs`: how many times the layer's forward ran, the checkpoint's replays included."""

    def __init__(self, layer: nn.Module, ops: LayerOps | None = None, cached: frozenset[int] | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.ops = ops
        self.cached = cached
        self.runs = 0

    def forward(self, *args: Any) -> Any:
        layer = self.layer

        def run(*inputs: Any) -> Any:  # the recompute runs a GPU's kernels too (`cuda_kernels.in_recompute`)
            self.runs += 1
            with in_recompute():
                return layer(*inputs)

        return run_recomputed(run, self.ops, self.cached, *args)


@dataclass(frozen=True)
class Probed:
    """What `probe` found for one layer."""

    plain: LayerMemory
    """It keeps what it saves."""
    recomputed: LayerMemory
    """The whole layer is recomputed (its checkpoint keeps its input)."""
    param_grad_bytes: int
    """Its parameters' gradients."""
    ops: LayerOps
    """Its forward's operators and the producers of what it saves (`mpress.contract.selective`)."""
    options: list[tuple[frozenset[int], LayerMemory]]
    """Op-level recompute choices (`selective.recompute_menu`) and the memory of each,
    those that keep less than the plain layer."""


def probe(layer: nn.Module, args: tuple[Any, ...], *, loss_fn: LossFn | None = None) -> Probed:
    """The layer's memory when it keeps what it saves, when it is recomputed and under
    each op-level recompute choice, and the bytes of its parameters' gradients (see
    `probe_layer`). A recomputed layer keeps its input (the checkpoint holds it)."""
    plain, grads = probe_layer(layer, args, loss_fn=loss_fn)
    recomputed, _ = probe_layer(_Checkpointed(layer), args, loss_fn=loss_fn)
    with side_effect_free(layer):
        ops = trace_layer_ops(layer, args, loss_fn=loss_fn)
    layer.zero_grad(set_to_none=True)
    options = []
    for tensors in recompute_menu(ops):
        cached = cached_ops(ops, tensors)
        # (a split backward replays a layer twice, which a selective checkpoint refuses)
        memory, _ = probe_layer(_Checkpointed(layer, ops, cached), args, loss_fn=loss_fn, split=False)
        if memory.kept_bytes < plain.kept_bytes:  # else what it caches outweighs what it frees
            # the checkpoint keeps its input; a cached output lives until the backward
            options.append((tensors, replace(memory, saves_input=True,
                                             saves_output=memory.saves_output or ops.output_op in cached)))
    return Probed(plain=plain, recomputed=replace(recomputed, saves_input=True), param_grad_bytes=grads,
                  ops=ops, options=options)


def probe_layers(module: nn.Module, args: tuple[Any, ...], paths: list[str], *,
                 loss_fn: LossFn | None = None) -> list[Probed]:
    """`probe` of each layer of `module` (paths as `mpress.contract.identity.layer_paths` gives them)
    on the input it gets in a forward of `args`; the loss goes with the last layer. Each
    layer runs alone, so what the module computes between its layers is not counted.
    Layers of one `layer_signature` (a model's repeated blocks) are probed once and share
    what it found: a 64-block model's fake profile probes 3 layers, not 65."""
    if paths == [""]:
        return [probe(module, args, loss_fn=loss_fn)]
    inputs: dict[int, tuple[Any, ...]] = {}
    handles = [module.get_submodule(p).register_forward_pre_hook(
        lambda _m, a, i=i: inputs.setdefault(i, tuple(_detached(x) for x in a))) for i, p in enumerate(paths)]
    try:
        with torch.no_grad(), torch.random.fork_rng(
                devices=sorted({p.device.index for p in module.parameters() if p.device.type == "cuda"})):
            module(*args)
    finally:
        for h in handles:
            h.remove()
    out = []
    found: dict[tuple, Probed] = {}
    for i, p in enumerate(paths):
        layer = module.get_submodule(p)
        layer_args = tuple(_with_grad(x, i > 0 or _needs_grad(args)) for x in inputs[i])
        last = i == len(paths) - 1
        key = None if last else layer_signature(layer, layer_args)
        probed = found.get(key) if key is not None else None
        if probed is None:
            probed = probe(layer, layer_args, loss_fn=loss_fn if last else None)
            if key is not None:
                found[key] = probed
        out.append(probed)
    return out


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)

INDEX_ATTRS = frozenset({"layer_idx"})
"""Attributes left out of a signature: transformers' index of a block in its model, which
its forward reads only to address a KV cache (mpress runs blocks with none) or to scale a
scalar; what a block derives from it when built (a sliding window, an attention kind, a
scaling) is an attribute of its own and counted. Kept in, every HF block would be a kind
of its own and a 32-block model probed 32 times."""


def _value_key(value: Any) -> tuple | None:
    """An attribute's or argument's part of a signature; None where it cannot say."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype,
                value.device.type, value.requires_grad)
    if isinstance(value, _PLAIN):
        return ("plain", type(value).__name__, value)
    if isinstance(value, tuple | list):
        parts = [_value_key(v) for v in value]
        return None if any(k is None for k in parts) else (type(value).__name__, tuple(parts))
    return None


def _storage_pattern(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """Per tensor, the position of the first one sharing its storage (tied weights,
    inputs that are views of one another)."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(storage_id(t), i) for i, t in enumerate(tensors))


def layer_signature(layer: nn.Module, args: tuple[Any, ...]) -> tuple | None:
    """What `probe` of `layer` on `args` depends on, so that two layers of one signature
    probe alike: per submodule its path, class, training flag and every public attribute
    but `INDEX_ATTRS`
    (a plain value, or the identity of any other object: layers that share a config object
    match, layers holding objects of their own do not), its parameters' and buffers' paths,
    shapes, strides, dtypes and gradient flags and which share storage, forward hooks, and
    the arguments' shapes, strides, dtypes, gradient flags and aliasing. None (probe it)
    where an argument is neither a tensor nor a plain value."""
    arg_keys = [_value_key(a) for a in args]
    if any(k is None for k in arg_keys):
        return None
    parts: list[Any] = [tuple(arg_keys), _storage_pattern([a for a in args if isinstance(a, torch.Tensor)])]
    for name, m in layer.named_modules():
        attrs = tuple(sorted((k, _value_key(v) or ("object", id(v))) for k, v in vars(m).items()
                             if not k.startswith("_") and k not in INDEX_ATTRS))
        hooks = tuple(id(h) for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks) for h in d.values())
        parts.append((name, type(m), m.training, attrs, hooks))
    tensors = list(layer.named_parameters(remove_duplicate=False)) + list(layer.named_buffers(remove_duplicate=False))
    parts.append(tuple((n, _value_key(t)) for n, t in tensors))
    parts.append(_storage_pattern([t for _n, t in tensors]))
    return tuple(parts)


def _detached(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _needs_grad(args: tuple[Any, ...]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in args)


def _with_grad(value: Any, grad: bool) -> Any:
    """A layer's input as the pipeline hands it: floating tensors carry gradients."""
    if isinstance(value, torch.Tensor) and grad and value.is_floating_point():
        return value.requires_grad_(True)
    return value


def _tracker(layer: nn.Module, args: tuple) -> LiveBytes:
    """A byte counter that already holds the layer's inputs, parameters and buffers."""
    tracker = LiveBytes(rank=0)
    for t in tensors_in(args):
        tracker.adopt(t, "input")
    for p in layer.parameters():
        tracker.adopt(p, "parameter")
    for b in layer.buffers():
        tracker.adopt(b, "buffer")
    return tracker


def _restore(layer: nn.Module, args: tuple, buffers: list) -> None:
    """Leaves the layer and its inputs as a probe found them: no gradients, buffers reset."""
    for t in tensors_in(args):
        t.grad = None
    layer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for b, value in buffers:
            b.copy_(value)
