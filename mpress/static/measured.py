"""Measured profiler: run a real module (training mode) and record what one microbatch costs.

Per layer it records forward/backward times, matrix-product FLOPs (from
`torch.utils.flop_counter.FlopCounterMode`), every tensor autograd saves for backward,
model-state bytes and the bytes handed to the next layer; on CUDA also the peak
allocated memory of one step.

Layers and saved-tensor names are those of `mpress.identity` (`layer_paths`,
`SavedTensorNamer`), the same the runtime uses. Bytes are storage bytes; a tensor whose
storage an earlier saved tensor of the same layer already holds is recorded with 0 bytes,
so sums count memory once. Sharing across layers is counted in each layer: at a stage
boundary the next stage holds a copy of its own. Tensors saved by the loss (outside every
module) belong to the last layer, under its path.

Timing: layer boundaries are marked in forward by the layers' pre-hooks (and the end of
the loss), in backward by gradient hooks on each layer's output (the gradient of layer
i's output is ready when layer i's backward starts). Layer i's forward time is the span
from its mark to the next; the loss forward and backward count toward the last layer.
A layer whose output needs no gradient gets no backward mark, and its backward time goes
to the layer after it. CPU: `time.perf_counter`; CUDA: CUDA events on the current stream.
Times are means over `iters` steps after `warmup` untimed steps.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mpress.errors import UserError
from mpress.identity import SavedTensorNamer, layer_paths, storage_key
from mpress.live_bytes import LiveBytes
from mpress.model_config import ModelConfig
from mpress.models.transformer import (
    build_model,
    example_batch,
    lm_loss,
    num_parameters,
)
from mpress.static.memory_probe import probe_layers
from mpress.static.profile import LayerProfile, Profile, SavedTensor

LossFn = Callable[[Any], torch.Tensor]

PRECISION_OF_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(kw_only=True)
class UserModule:
    """What a user factory returns: a module, its example input and an optional loss."""

    module: nn.Module
    example_input: Any
    """A tensor or a tuple of tensors passed positionally to `module`."""
    loss_fn: LossFn | None = None
    """output -> scalar tensor; None: the sum of the floating outputs."""


@dataclass(kw_only=True)
class _LayerRecord:
    """What one instrumented pass learned about one layer."""

    saved: list[SavedTensor] = field(default_factory=list)
    output_bytes: int = 0


def _as_args(example_input: Any) -> tuple[Any, ...]:
    return tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a (nested) tuple/list/dict output."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def default_loss(output: Any) -> torch.Tensor:
    """Sum of every floating tensor in `output` (in fp32): a stand-in loss so backward runs."""
    parts = [t.float().sum() for t in _tensors(output) if t.is_floating_point()]
    if not parts:
        raise UserError("module output has no floating-point tensor to back-propagate from")
    return torch.stack(parts).sum()


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return t.numel() * t.element_size()


def module_fingerprint(module: nn.Module) -> str:
    """Stable short hash of a module's structure: class names and parameter/buffer shapes."""
    parts = [f"{name}:{type(m).__name__}" for name, m in module.named_modules()]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in module.named_parameters()]
    parts += [f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in module.named_buffers()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


class _Marks:
    """Layer-boundary marks of one step: times (perf_counter or CUDA events) and FLOPs."""

    def __init__(self, cuda: bool, flop_counter: FlopCounterMode | None) -> None:
        self.cuda = cuda
        self.flop_counter = flop_counter
        self.forward: dict[int, Any] = {}
        self.backward: dict[int, Any] = {}
        self.points: dict[str, Any] = {}

    def now(self) -> Any:
        flops = self.flop_counter.get_total_flops() if self.flop_counter is not None else 0
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event, flops
        return time.perf_counter(), flops

    def spans(self, num_layers: int) -> list[tuple[float, float, float, float]]:
        """Per layer (forward_s, backward_s, forward_flops, backward_flops)."""
        if self.cuda:
            torch.cuda.synchronize()

        def seconds(a: Any, b: Any) -> float:
            if self.cuda:
                return a[0].elapsed_time(b[0]) / 1e3
            return b[0] - a[0]

        fwd = [self.forward[i] for i in range(num_layers)] + [self.points["forward_end"]]
        # Backward boundaries in time order: start, grad ready for layer n-2 .. 0, end.
        bwd = [self.points["backward_start"]]
        for i in range(num_layers - 2, -1, -1):
            bwd.append(self.backward.get(i))
        bwd.append(self.points["backward_end"])
        for k in range(len(bwd) - 2, 0, -1):  # a missing mark takes the next one's value
            if bwd[k] is None:
                bwd[k] = bwd[k + 1]
        out = []
        for i in range(num_layers):
            j = num_layers - 1 - i  # layer i's backward span is bwd[j] .. bwd[j + 1]
            out.append((seconds(fwd[i], fwd[i + 1]), seconds(bwd[j], bwd[j + 1]),
                        float(fwd[i + 1][1] - fwd[i][1]), float(bwd[j + 1][1] - bwd[j][1])))
        return out


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    return next((t for t in _tensors(value) if t.requires_grad), None)


def _step(module: nn.Module, args: tuple[Any, ...], loss_fn: LossFn,
          layers: list[nn.Module], marks: _Marks | None) -> None:
    """One forward + loss + backward; with `marks`, marks every layer boundary."""
    handles = []
    if marks is not None:
        def pre_hook(i: int) -> Callable[..., None]:
            def hook(_m: nn.Module, _a: Any) -> None:
                marks.forward[i] = marks.now()
            return hook

        def post_hook(i: int) -> Callable[..., None]:
            def hook(_m: nn.Module, _a: Any, out: Any) -> None:
                t = _first_grad_tensor(out)
                if t is not None and i < len(layers) - 1:
                    t.register_hook(lambda _g: marks.backward.__setitem__(i, marks.now()))
            return hook

        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(pre_hook(i)))
            handles.append(layer.register_forward_hook(post_hook(i)))
    try:
        loss = loss_fn(module(*args))
        if marks is not None:
            marks.points["forward_end"] = marks.points["backward_start"] = marks.now()
        loss.backward()
        if marks is not None:
            marks.points["backward_end"] = marks.now()
    finally:
        for h in handles:
            h.remove()
    module.zero_grad(set_to_none=True)


def _record_saved(module: nn.Module, args: tuple[Any, ...], loss_fn: LossFn,
                  paths: list[str]) -> list[_LayerRecord]:
    """One step with saved-tensor hooks: per layer, saved tensors and output bytes."""
    records = [_LayerRecord() for _ in paths]
    layer_of = {module.get_submodule(p): i for i, p in enumerate(paths)}
    device = next((t.device for t in (*module.parameters(), *_tensors(args))), torch.device("cpu"))
    namer = SavedTensorNamer(module, paths)
    layer_inputs: dict[int, set[tuple[str, int]]] = {}  # layer -> storages of its input

    def enter(m: nn.Module, args_in: Any) -> None:
        if namer.active and m in layer_of:
            layer_inputs[layer_of[m]] = {storage_key(t) for t in _tensors(args_in)}
    seen: dict[tuple[int, str, int], str] = {}  # (layer, device, data_ptr) -> first id

    def output(m: nn.Module, _a: Any, out: Any) -> None:
        if namer.active and m in layer_of:
            records[layer_of[m]].output_bytes = sum(t.numel() * t.element_size() for t in _tensors(out))

    def pack(t: torch.Tensor) -> torch.Tensor:
        name = namer.name(t)
        if name is None:
            return t
        if t.grad_fn is not None:
            what = f"output of {t.grad_fn.name().removesuffix('Backward0')}"
        else:
            what = "no autograd history (input, mask, index or statistic)"
        nbytes = _storage_bytes(t)
        if t.device != device:  # a CPU scalar a user's forward made: not the device's memory,
            what, nbytes = f"{what} (on {t.device}: not device memory)", 0  # and the router keeps it
        layer_key = (name.layer, *storage_key(t))
        if layer_key in seen and t.numel() > 0:
            what, nbytes = f"{what} (same storage as {seen[layer_key]})", 0
        else:
            seen[layer_key] = name.id
        is_input = storage_key(t) in layer_inputs.get(name.layer, ())
        records[name.layer].saved.append(SavedTensor(
            module=name.module, index=name.index, bytes=nbytes, shape=list(t.shape),
            dtype=str(t.dtype).removeprefix("torch."), what=what, input=is_input,
            # made before the step and not the layer's input: the targets, a buffer
            held=not is_input and not made.counts(t)))
        return t

    handles = [layer.register_forward_hook(output) for layer in layer_of]
    handles += [layer.register_forward_pre_hook(enter) for layer in layer_of]
    made = LiveBytes(rank=0)  # the storages the step makes
    try:
        with made.watch(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            namer.begin()
            output_value = module(*args)
            loss = loss_fn(output_value)  # outside every module: the last layer's
        records[-1].output_bytes = loss.numel() * loss.element_size()
        namer.end()
        loss.backward()
    finally:
        namer.end()
        namer.close()
        for h in handles:
            h.remove()
    module.zero_grad(set_to_none=True)
    return records


def _precision(module: nn.Module) -> str:
    for p in module.parameters():
        if p.is_floating_point():
            return PRECISION_OF_DTYPE.get(p.dtype, "fp32")
    return "fp32"


def _model_state(layer: nn.Module) -> dict[str, int]:
    params = list(layer.parameters())
    numel = sum(p.numel() for p in params)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    half = any(p.dtype in (torch.float16, torch.bfloat16) for p in params)
    return {"param_bytes": nbytes, "grad_bytes": nbytes, "optim_bytes": 8 * numel,
            "master_bytes": 4 * numel if half else 0,
            "largest_param_bytes": 4 * max((p.numel() for p in params), default=0), "param_tensors": len(params)}


def measure_profile(module: nn.Module, example_input: Any, *, model_name: str, fingerprint: str,
                    microbatch_size: int, loss_fn: LossFn | None = None, warmup: int = 2,
                    iters: int = 3, device: str | torch.device = "cpu", target_bytes: int = 0) -> Profile:
    """Run `module` in training mode on `device` and return its measured `Profile`.

    `example_input` is one microbatch (a tensor or a tuple of positional tensors);
    `loss_fn(output) -> scalar` defaults to `default_loss`; `target_bytes`: one
    microbatch of what the loss compares with (the pipeline's last stage holds them).
    The module is moved to `device` and left in training mode with no gradients.
    """
    if warmup < 0 or iters < 1:
        raise UserError(f"need warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda requested but CUDA is not available here (use --device cpu)")
    module = module.to(dev).train()
    args = _as_args(_to_device(example_input, dev))
    loss = loss_fn or default_loss
    paths = layer_paths(module, args)
    layers = [module.get_submodule(p) for p in paths]
    cuda = dev.type == "cuda"

    for _ in range(warmup):
        _step(module, args, loss, layers, None)
    records = _record_saved(module, args, loss, paths)
    with FlopCounterMode(display=False) as counter:
        flop_marks = _Marks(cuda, counter)
        _step(module, args, loss, layers, flop_marks)
    flops = flop_marks.spans(len(paths))
    totals = [[0.0, 0.0] for _ in paths]
    for _ in range(iters):
        marks = _Marks(cuda, None)
        _step(module, args, loss, layers, marks)
        for i, (fs, bs, _ff, _bf) in enumerate(marks.spans(len(paths))):
            totals[i][0] += fs
            totals[i][1] += bs
    memory = probe_layers(module, args, paths, loss_fn=loss)
    profiles = []
    for i, path in enumerate(paths):
        profiles.append(LayerProfile(
            name=path,
            forward_flops=flops[i][2],
            backward_flops=flops[i][3],
            forward_time_s=max(totals[i][0] / iters, 0.0),
            backward_time_s=max(totals[i][1] / iters, 0.0),
            saved=records[i].saved,
            output_bytes=records[i].output_bytes,
            memory=memory[i][0],
            recompute_memory=memory[i][1],
            **_model_state(layers[i]),
        ))
    device_name = torch.cuda.get_device_name(dev) if cuda else dev.type
    return Profile(model=model_name, model_fingerprint=fingerprint, source="measured", device=device_name,
                   dtype=_precision(module), microbatch_size=microbatch_size, layers=profiles,
                   input_bytes=sum(t.numel() * t.element_size() for t in _tensors(args)), target_bytes=target_bytes)


def _available_bytes(dev: torch.device) -> int:
    """Memory free for a new model on `dev` (CUDA: free device memory; CPU: MemAvailable)."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _check_fits(cfg: ModelConfig, microbatch_size: int, dev: torch.device) -> None:
    """Refuse (UserError) a model whose parameters, gradients and saved activations
    (the analytic estimate) exceed the memory free on the device."""
    from mpress.static.analytic import layer_saved_tensors

    saved = sum(t.bytes for i in range(cfg.num_layers + 2) for t in layer_saved_tensors(cfg, i, microbatch_size))
    need = 2 * num_parameters(cfg) * cfg.dtype_bytes + saved
    have = _available_bytes(dev)
    if need > have:
        raise UserError(f"model {cfg.name}: parameters, gradients and activations need about {need / 1e9:.1f} GB "
                        f"but {dev.type} has {have / 1e9:.1f} GB free; use --analytic --hardware PRESET")


def measure_model_profile(cfg: ModelConfig, microbatch_size: int, device: str | torch.device = "cpu", *,
                          warmup: int = 2, iters: int = 3, seed: int = 0) -> Profile:
    """Measured profile of the whole reference model for `cfg` (cross-entropy loss)."""
    if microbatch_size < 1:
        raise UserError(f"microbatch size must be >= 1, got {microbatch_size}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda requested but CUDA is not available here (use --device cpu)")
    _check_fits(cfg, microbatch_size, dev)
    model = build_model(cfg, seed=seed, device=dev)
    ids, targets = example_batch(cfg, microbatch_size, seed=seed, device=dev)
    return measure_profile(model, ids, model_name=cfg.name, fingerprint=cfg.fingerprint(),
                           microbatch_size=microbatch_size, loss_fn=lambda out: lm_loss(out, targets),
                           warmup=warmup, iters=iters, device=dev, target_bytes=targets.numel() * targets.element_size())


def load_user_factory(spec: str) -> UserModule:
    """Import `package.module:factory` and call it.

    The factory takes no arguments and returns `(module, example_input)` or
    `(module, example_input, loss_fn)`. Any problem is a one-line `UserError`.
    """
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise UserError(f"--module {spec!r}: expected 'package.module:factory'")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as exc:  # any import-time failure is the user's module's problem
        raise UserError(f"--module {spec!r}: cannot import {mod_name}: {type(exc).__name__}: {exc}") from None
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise UserError(f"--module {spec!r}: {mod_name} has no callable {attr!r}")
    try:
        result = factory()
    except Exception as exc:  # report the user's factory failing in one line
        raise UserError(f"--module {spec!r}: factory raised {type(exc).__name__}: {exc}") from None
    if not isinstance(result, tuple) or len(result) not in (2, 3) or not isinstance(result[0], nn.Module):
        raise UserError(f"--module {spec!r}: factory must return (nn.Module, example_input[, loss_fn])")
    loss_fn = result[2] if len(result) == 3 else None
    if loss_fn is not None and not callable(loss_fn):
        raise UserError(f"--module {spec!r}: the third returned item (loss_fn) is not callable")
    if not any(isinstance(t, torch.Tensor) for t in _as_args(result[1])):
        raise UserError(f"--module {spec!r}: example_input must be a tensor or a tuple of tensors")
    return UserModule(module=result[0], example_input=result[1], loss_fn=loss_fn)
