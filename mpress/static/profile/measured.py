"""Measured profiler: run a module (training mode) and record what one microbatch costs.

Per layer it records forward/backward times, matrix-product FLOPs (from
`torch.utils.flop_counter.FlopCounterMode`), every tensor autograd saves for backward,
model-state bytes and the bytes handed to the next layer, and what each layer holds
(`memory_probe.py`). `instrument` is the part that needs no clock: the fake-tensor
profiler (`fake_profile.py`) runs exactly it on fake tensors, so both agree byte for byte.

Layers and saved-tensor names are those of `mpress.contract.identity` (`layer_paths`,
`SavedTensorNamer`), the same the runtime uses, or the layers a user names
(`mpress.models.user_module.select_layers`). Bytes are storage bytes; a tensor whose
storage an earlier saved tensor of the same layer already holds is recorded with 0 bytes,
so sums count memory once. Storages are told apart by their storage object (`_cdata`),
never by `data_ptr()`, which is 0 for every fake or meta tensor. Sharing across layers is
counted in each layer: at a stage boundary the next stage holds a copy of its own.
Tensors saved by the loss (outside every module) belong to the last layer, under its path.

Timing: layer boundaries are marked in forward by the layers' pre-hooks (and the end of
the loss), in backward by gradient hooks on each layer's output (the gradient of layer
i's output is ready when layer i's backward starts). Layer i's forward time is the span
from its mark to the next; the loss forward and backward count toward the last layer.
A layer whose output needs no gradient gets no backward mark, and its backward time goes
to the layer after it. CPU: `time.perf_counter`; CUDA: CUDA events on the current stream.
After `warmup` untimed steps, `iters` steps are timed; a layer's time is the median of its
spans and its spread their interquartile range (`torch.utils.benchmark.Measurement`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mpress.errors import UserError
from mpress.contract.identity import SavedTensorNamer, layer_paths
from mpress.contract.live_bytes import LiveBytes
from mpress.contract.selective import storage_id
from mpress.config.model_config import ModelConfig
from mpress.models.transformer import (
    build_model,
    example_batch,
    lm_loss,
    num_parameters,
)
from mpress.hardware.server import Hardware, load_hardware
from mpress.contract.flop_formulas import EXTRA_FLOP_FORMULAS
from mpress.static.profile.memory_probe import Probed, probe_layers
from mpress.static.profile.recompute_options import recompute_options, replay_time_s, with_producers
from mpress.static.profile.profile import LayerProfile, Profile, SavedTensor
from mpress.models.user_module import as_args, default_loss, select_layers, tensors

LossFn = Callable[[Any], torch.Tensor]

PRECISION_OF_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(kw_only=True)
class _LayerRecord:
    """What one instrumented pass learned about one layer."""

    saved: list[SavedTensor] = field(default_factory=list)
    output_bytes: int = 0


@dataclass(kw_only=True)
class Instrumented:
    """What `instrument` learned, per layer: saved tensors and output bytes, FLOPs of
    forward and backward, and the memory probe's findings (plain, recomputed, op-level choices)."""

    paths: list[str]
    records: list[_LayerRecord]
    flops: list[tuple[float, float]]
    memory: list[Probed]


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return t.numel() * t.element_size()


class _Namer(SavedTensorNamer):
    """`SavedTensorNamer` that tells parameters by storage object, not by address."""

    _NOT_A_PARAMETER = (torch.device("meta"), -1)

    def __init__(self, module: nn.Module, layers: Sequence[str]) -> None:
        super().__init__(module, layers)
        self._param_storages = {storage_id(p) for p in module.parameters()}

    def is_parameter(self, t: torch.Tensor) -> bool:
        return storage_id(t) in self._param_storages

    def name(self, t: torch.Tensor, storage: Any = None):  # type: ignore[override]
        if self.is_parameter(t):
            return None
        return super().name(t, storage=self._NOT_A_PARAMETER)


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
    return next((t for t in tensors(value) if t.requires_grad), None)


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
    """One step with saved-tensor hooks: per layer, saved tensors and output bytes.
    Raises `UserError` when a layer does not run, or the layers run in another order."""
    records = [_LayerRecord() for _ in paths]
    layer_of = {module.get_submodule(p): i for i, p in enumerate(paths)}
    device = next((t.device for t in (*module.parameters(), *tensors(args))), torch.device("cpu"))
    namer = _Namer(module, paths)
    order: list[int] = []  # layers in the order their forwards start
    layer_inputs: dict[int, set[int]] = {}  # layer -> storages of its input
    alive: list[torch.UntypedStorage] = []  # what the storage ids above name, kept for the step

    def enter(m: nn.Module, args_in: Any) -> None:
        if namer.active and m in layer_of:
            order.append(layer_of[m])
            inputs = [t.untyped_storage() for t in tensors(args_in)]
            alive.extend(inputs)
            layer_inputs[layer_of[m]] = {s._cdata for s in inputs}
    seen: dict[tuple[int, int], str] = {}  # (layer, storage) -> first id

    def output(m: nn.Module, _a: Any, out: Any) -> None:
        if namer.active and m in layer_of:
            records[layer_of[m]].output_bytes = sum(t.numel() * t.element_size() for t in tensors(out))

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
        storage = storage_id(t)
        layer_key = (name.layer, storage)
        if layer_key in seen and t.numel() > 0:
            what, nbytes = f"{what} (same storage as {seen[layer_key]})", 0
        else:
            seen[layer_key] = name.id
        is_input = storage in layer_inputs.get(name.layer, ())
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
    _check_order(paths, order)
    return records


def _check_order(paths: list[str], order: list[int]) -> None:
    """Layers are pipeline stages' units: each runs, once, in the listed order."""
    first = list(dict.fromkeys(order))
    missing = [paths[i] for i in range(len(paths)) if i not in first]
    if missing:
        raise UserError(f"layer {missing[0]!r} does not run in the module's forward; name layers it calls")
    if first != sorted(first) or len(order) != len(first):
        ran = ", ".join(paths[i] for i in order)
        raise UserError(f"layers must run once each in the order they are defined; the forward runs {ran}")


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


def layer_list(module: nn.Module, args: tuple[Any, ...], layers: Sequence[str] | None) -> list[str]:
    """The layers to profile: those `layers` names (patterns), else `layer_paths`."""
    return select_layers(module, layers) if layers else layer_paths(module, args)


def instrument(module: nn.Module, args: tuple[Any, ...], loss_fn: LossFn | None,
               layers: Sequence[str] | None = None) -> Instrumented:
    """Everything of a profile but times: saved tensors, FLOPs and memory per layer, from
    steps of `module` (training mode) on `args`; real, meta or fake tensors alike."""
    loss = loss_fn or default_loss
    paths = layer_list(module, args, layers)
    records = _record_saved(module, args, loss, paths)
    mods = [module.get_submodule(p) for p in paths]
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:  # CPU SDPA too
        flop_marks = _Marks(False, counter)
        _step(module, args, loss, mods, flop_marks)
    flops = [(f, b) for _fs, _bs, f, b in flop_marks.spans(len(paths))]
    memory = probe_layers(module, args, paths, loss_fn=loss)
    return Instrumented(paths=paths, records=records, flops=flops, memory=memory)


def layer_profiles(module: nn.Module, found: Instrumented, times: Sequence[tuple[float, float, float, float]],
                   hardware: Hardware, *, measured: bool) -> list[LayerProfile]:
    """`LayerProfile`s from `instrument`'s findings and per layer (forward_s, backward_s,
    forward_iqr_s, backward_iqr_s). Op-level recompute choices are priced on `hardware`;
    for `measured` times, as that share of the layer's measured forward."""
    out = []
    for i, path in enumerate(found.paths):
        fs, bs, fiqr, biqr = times[i]
        probed = found.memory[i]
        saved = found.records[i].saved
        options = recompute_options(saved, probed, hardware, _precision(module))
        if measured:
            whole = replay_time_s(probed.ops, frozenset(), hardware, _precision(module))
            options = [replace(o, time_s=fs * o.time_s / whole if whole else 0.0) for o in options]
        out.append(LayerProfile(
            name=path, forward_flops=found.flops[i][0], backward_flops=found.flops[i][1],
            forward_time_s=fs, backward_time_s=bs, forward_time_iqr_s=fiqr, backward_time_iqr_s=biqr,
            saved=with_producers(saved, probed.ops), output_bytes=found.records[i].output_bytes,
            memory=probed.plain, recompute_memory=probed.recomputed, recompute_options=options,
            **_model_state(module.get_submodule(path)),
        ))
    return out


def _median_iqr(samples: list[float], what: str) -> tuple[float, float]:
    # imported here: torch.utils.benchmark loads torch.utils.cpp_extension, which warns on
    # stderr under a CUDA build of torch without a CUDA runtime (every mpress command's output)
    from torch.utils.benchmark import Measurement
    from torch.utils.benchmark.utils.common import TaskSpec

    m = Measurement(number_per_run=1, raw_times=[max(x, 0.0) for x in samples],
                    task_spec=TaskSpec(stmt=what, setup=""))
    return m.median, m.iqr


def _time_layers(module: nn.Module, args: tuple[Any, ...], loss: LossFn, paths: list[str], cuda: bool, *,
                 warmup: int, iters: int) -> list[tuple[float, float, float, float]]:
    """Per layer (median forward s, median backward s, their IQRs) over `iters` timed steps."""
    layers = [module.get_submodule(p) for p in paths]
    for _ in range(warmup):
        _step(module, args, loss, layers, None)
    samples: list[tuple[list[float], list[float]]] = [([], []) for _ in paths]
    for _ in range(iters):
        marks = _Marks(cuda, None)
        _step(module, args, loss, layers, marks)
        for i, (fs, bs, _ff, _bf) in enumerate(marks.spans(len(paths))):
            samples[i][0].append(fs)
            samples[i][1].append(bs)
    out = []
    for path, (fwd, bwd) in zip(paths, samples):
        (f, fiqr), (b, biqr) = _median_iqr(fwd, f"{path} forward"), _median_iqr(bwd, f"{path} backward")
        out.append((f, b, fiqr, biqr))
    return out


def measure_profile(module: nn.Module, example_input: Any, *, model_name: str, fingerprint: str,
                    microbatch_size: int, loss_fn: LossFn | None = None, warmup: int = 2,
                    iters: int = 10, device: str | torch.device = "cpu", target_bytes: int = 0,
                    layers: Sequence[str] | None = None, hardware: Hardware | None = None) -> Profile:
    """Run `module` in training mode on `device` and return its measured `Profile`.

    `example_input` is one microbatch (a tensor or a tuple of positional tensors);
    `loss_fn(output) -> scalar` defaults to `default_loss`; `target_bytes`: one
    microbatch of what the loss compares with (the pipeline's last stage holds them);
    `layers`: module names or patterns of the split points (default `layer_paths`).
    `hardware`: the machine model that prices op-level recompute choices as a share of
    a layer's measured forward (default the cpu-local preset).
    The module is moved to `device` and left in training mode with no gradients.
    """
    if warmup < 0 or iters < 1:
        raise UserError(f"need warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda requested but CUDA is not available here (use --device cpu)")
    module = module.to(dev).train()
    args = as_args(_to_device(example_input, dev))
    loss = loss_fn or default_loss
    cuda = dev.type == "cuda"
    for _ in range(warmup):  # before the instrumented steps too: lazy init, caches
        _step(module, args, loss, [], None)
    found = instrument(module, args, loss, layers)
    times = _time_layers(module, args, loss, found.paths, cuda, warmup=0, iters=iters)
    device_name = torch.cuda.get_device_name(dev) if cuda else dev.type
    return Profile(model=model_name, model_fingerprint=fingerprint, source="measured", device=device_name,
                   dtype=_precision(module), microbatch_size=microbatch_size,
                   layers=layer_profiles(module, found, times, hardware or load_hardware("cpu-local"), measured=True),
                   time_samples=iters,
                   input_bytes=sum(t.numel() * t.element_size() for t in tensors(args)), target_bytes=target_bytes)


def available_bytes(dev: torch.device) -> int:
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


def model_need_bytes(cfg: ModelConfig, microbatch_size: int) -> int:
    """What measuring the reference model holds: parameters, gradients and the saved
    activations of one microbatch (the analytic estimate)."""
    from mpress.static.profile.analytic import layer_saved_tensors

    saved = sum(t.bytes for i in range(cfg.num_layers + 2) for t in layer_saved_tensors(cfg, i, microbatch_size))
    return 2 * num_parameters(cfg) * cfg.dtype_bytes + saved


def measure_model_profile(cfg: ModelConfig, microbatch_size: int, device: str | torch.device = "cpu", *,
                          warmup: int = 2, iters: int = 10, seed: int = 0) -> Profile:
    """Measured profile of the whole reference model for `cfg` (cross-entropy loss);
    a model that does not fit the device is refused (`UserError`)."""
    if microbatch_size < 1:
        raise UserError(f"microbatch size must be >= 1, got {microbatch_size}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda requested but CUDA is not available here (use --device cpu)")
    need, have = model_need_bytes(cfg, microbatch_size), available_bytes(dev)
    if need > have:
        raise UserError(f"model {cfg.name}: parameters, gradients and activations need about {need / 1e9:.1f} GB "
                        f"but {dev.type} has {have / 1e9:.1f} GB free; profile it with --fake")
    model = build_model(cfg, seed=seed, device=dev)
    ids, targets = example_batch(cfg, microbatch_size, seed=seed, device=dev)
    return measure_profile(model, ids, model_name=cfg.name, fingerprint=cfg.fingerprint(),
                           microbatch_size=microbatch_size, loss_fn=lambda out: lm_loss(out, targets),
                           warmup=warmup, iters=iters, device=dev, target_bytes=targets.numel() * targets.element_size())
