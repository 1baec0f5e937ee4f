"""Fake-tensor profiler: profile a module of any size without its memory.

The factory is called under the meta device (`torch.device("meta")`: parameters get
shapes and dtypes, no storage, no init work), then every tensor it made becomes a fake
tensor (`torch._subclasses.fake_tensor.FakeTensorMode`) on the fake device (the CPU),
and the measured profiler's instrumentation (`measured.instrument`: saved-tensor hooks,
`FlopCounterMode`, the memory probe) runs on them: saved tensors, their storage bytes,
FLOPs and what each layer holds come out exactly as a real run on the CPU gives them,
while nothing is computed or allocated. A 10-billion-parameter model takes seconds. For
a GPU target (a hardware preset whose device is no CPU stand-in) the run saves what the
GPU's kernels save instead: its dropout masks, LayerNorm statistics and fused attention
kernel (`cuda_kernels.py`).

Why meta first, then fake: parameters made inside `FakeTensorMode` cannot be cast or
moved (`module.to()` swaps tensors, and fake ones carry weak references that forbid it),
so a factory that calls `.half()` would fail; on meta it does not. Fake tensors wrap the
meta tensors (same storages, so views and tied weights keep sharing), and tensors the
factory made that the module does not hold (targets a loss closes over) are mapped too,
through the fake mode's memo, so the loss sees them fake as well.

Times are not measured: they come from the hardware model the analytic profiler uses
(`analytic.flops_time_s`: FLOPs / (peak FLOP/s x efficiency) of the hardware preset), and
the profile's `source` is "fake", its `device` the preset's name. Storages are told apart
by storage object (`contract.selective.storage_id`); every fake storage's `data_ptr()` is 0.

A module whose forward needs tensor values (`.item()`, boolean masks, `nonzero`) cannot
run on fake tensors: that is one `UserError`, and `profile_user_module` measures such a
module for real when it fits.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode

from mpress.errors import UserError
from mpress.hardware.server import Hardware
from mpress.contract.live_bytes import tensors_in
from mpress.config.model_config import ModelConfig
from mpress.models.transformer import build_model, example_batch, lm_loss
from mpress.static.profile.analytic import flops_time_s
from mpress.static.profile.cuda_kernels import CudaKernels
from mpress.static.profile.sdpa_choice import compute_capability
from mpress.static.profile.measured import (
    _precision,
    available_bytes,
    instrument,
    layer_profiles,
    measure_model_profile,
    measure_profile,
    model_need_bytes,
)
from mpress.static.profile.profile import Profile
from mpress.models.user_module import (
    Factory,
    UserModule,
    call_factory,
    import_factory,
    module_fingerprint,
    tensors,
)

FAKE_DEVICE = torch.device("cpu")
"""The device fake tensors stand on: no torch runs autograd on fake CUDA tensors without a
GPU (`cuda_kernels.py` says why), so a host scalar a forward makes is on the device, and
for a GPU target `cuda_kernels.CudaKernels` makes the CPU's fake kernels save what CUDA's
save (dropout masks, LayerNorm statistics, the fused attention kernel's)."""

FITS_FRACTION = 0.8
"""A real measurement is made only when its estimated need is within this share of the
memory free on the device (the rest: the allocator, the interpreter, other processes)."""

_NEEDS_VALUES = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


class _Made(TorchDispatchMode):
    """Remembers (weakly) every meta tensor the operators it sees return."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.made += [weakref.ref(t) for t in tensors_in(out) if t.device.type == "meta"]
        return out


def _build_on_meta(factory: Factory, spec: str) -> tuple[UserModule, list[torch.Tensor]]:
    """Call `factory` under the meta device; also returns the meta tensors it made that
    are still alive (what its loss may close over)."""
    made = _Made()
    with torch.device("meta"), made:
        user = call_factory(factory, spec)
    return user, [t for ref in made.made if (t := ref()) is not None]


def _fake(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """`t`'s fake twin on `FAKE_DEVICE` (a meta tensor is wrapped, sharing its storage)."""
    if isinstance(t, FakeTensor):
        return t
    if t.device.type == "meta":
        return mode.fake_tensor_converter.from_meta_and_device(mode, t, FAKE_DEVICE)
    return mode.from_tensor(t)


def _fake_module(module: nn.Module, mode: FakeTensorMode) -> None:
    """Replace `module`'s parameters and buffers by fake twins in place (tied ones stay
    tied); `module.to()` is no way to do it (it cannot swap fake tensors)."""
    done: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in done:
                    fake = _fake(t.detach() if isinstance(t, nn.Parameter) else t, mode)
                    done[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
                table[name] = done[id(t)]


def _fake_input(value: Any, mode: FakeTensorMode) -> Any:
    if isinstance(value, torch.Tensor):
        return _fake(value, mode)
    if isinstance(value, (tuple, list)):
        return type(value)(_fake_input(v, mode) for v in value)
    return value


def fake_profile(factory: Factory, *, model_name: str, hardware: Hardware, layers: Sequence[str] | None = None,
                 target_bytes: int = 0, fingerprint: str | Callable[[nn.Module], str] | None = None) -> Profile:
    """The profile of what `factory` (see `mpress.models.user_module`) returns, made on
    fake tensors (see the module docstring); times for `hardware`. `fingerprint` (a
    string, or a function of the module) defaults to `module_fingerprint` of the module."""
    user, made = _build_on_meta(factory, model_name)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # the fake mode's memo maps them when the loss uses them; it holds its values weakly
    twins = [_fake(t, mode) for t in made]
    _fake_module(user.module, mode)
    module = user.module.train()
    args = tuple(_fake_input(a, mode) for a in user.args)
    cc = compute_capability(hardware)  # None: a CPU target, whose kernels these are
    try:
        with mode, CudaKernels(cc) if cc else contextlib.nullcontext(), warnings.catch_warnings():
            # the shared namer's parameter set reads data_ptr (0 here); our namer does not use it
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            found = instrument(module, args, user.loss_fn, layers)
    except _NEEDS_VALUES as exc:
        raise UserError(f"{model_name}: its forward needs tensor values ({type(exc).__name__}: {exc}), "
                        "which fake tensors do not have; measure it for real") from None
    except UserError:
        raise
    except Exception as exc:  # e.g. a device mix only fake tensors see: one line, as any user-module failure
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UserError(f"{model_name}: cannot run on fake tensors ({type(exc).__name__}: {first}); "
                        "measure it for real") from None
    del twins
    _refuse_nothing_saved(module, found, model_name)
    precision = _precision(module)
    times = [(flops_time_s(f, hardware, precision), flops_time_s(b, hardware, precision), 0.0, 0.0)
             for f, b in found.flops]
    name = fingerprint(module) if callable(fingerprint) else fingerprint or module_fingerprint(module)
    return Profile(model=model_name, model_fingerprint=name, source="fake",
                   device=hardware.name, dtype=precision, microbatch_size=user.microbatch_size,
                   layers=layer_profiles(module, found, times, hardware, measured=False), time_samples=0,
                   input_bytes=sum(t.numel() * t.element_size() for t in tensors(args)), target_bytes=target_bytes)


def _refuse_nothing_saved(module: nn.Module, found: Any, model_name: str) -> None:
    """A model with trainable layers saves activations for backward; a profile that found
    none (fake storages told apart by address, all 0, once made every saved tensor one)
    would let the planner say any such model fits. One line, never a fit."""
    trainable = any(p.requires_grad for p in module.parameters())
    if trainable and not any(x.bytes for r in found.records for x in r.saved):
        raise UserError(f"{model_name}: its profile on fake tensors found 0 saved bytes, though it has trainable "
                        "layers; it cannot be planned from this profile (measure it for real)")


def fake_model_profile(cfg: ModelConfig, microbatch_size: int, hardware: Hardware, *, seed: int = 0) -> Profile:
    """The reference model for `cfg` profiled on fake tensors (cross-entropy loss)."""
    if microbatch_size < 1:
        raise UserError(f"microbatch size must be >= 1, got {microbatch_size}")
    ids, targets = example_batch(cfg, microbatch_size, seed=seed)  # (B, T) int64 each: tiny, real

    def factory() -> tuple[nn.Module, torch.Tensor, Callable[[Any], torch.Tensor]]:
        return build_model(cfg, seed=seed, device="meta"), ids, lambda out: lm_loss(out, targets)

    return fake_profile(factory, model_name=cfg.name, hardware=hardware, fingerprint=cfg.fingerprint(),
                        target_bytes=targets.numel() * targets.element_size())


def profile_need_bytes(profile: Profile) -> int:
    """What measuring the profiled model for real holds at least: parameters, gradients,
    every saved activation and the largest layer's passing peak."""
    layers = profile.layers
    return (sum(x.param_bytes + x.grad_bytes + x.saved_bytes for x in layers)
            + max(max(x.memory.forward_peak_bytes, x.memory.backward_peak_bytes) for x in layers))


def fits_device(need_bytes: int, device: str | torch.device) -> bool:
    """Whether a real measurement needing `need_bytes` fits the memory free on `device`."""
    return need_bytes <= FITS_FRACTION * available_bytes(torch.device(device))


def profile_model(cfg: ModelConfig, microbatch_size: int, *, hardware: Hardware, fake: bool | None,
                  device: str = "cpu", warmup: int = 2, iters: int = 10) -> Profile:
    """A preset's profile: on fake tensors when `fake`, or when `fake` is None and the
    model does not fit `device`; measured there otherwise."""
    if fake or (fake is None and not fits_device(model_need_bytes(cfg, microbatch_size), device)):
        return fake_model_profile(cfg, microbatch_size, hardware)
    return measure_model_profile(cfg, microbatch_size, device, warmup=warmup, iters=iters)


def profile_user_module(spec: str, *, hardware: Hardware, fake: bool | None, layers: Sequence[str] | None = None,
                        device: str = "cpu", warmup: int = 2, iters: int = 10, factory: Factory | None = None,
                        fingerprint: Callable[[nn.Module], str] = module_fingerprint) -> Profile:
    """The profile of `package.module:factory`: on fake tensors first (cheap at any size);
    that profile is the answer when `fake`, or when `fake` is None and the model does not
    fit `device`; otherwise the module is built for real and measured there (also when
    its forward needs values and cannot run on fake tensors, if its parameters fit).
    `factory` replaces the one `spec` names (`spec` then only names the model: a Hugging
    Face model's `HFSource.factory`); `fingerprint` names the model by its module."""
    factory = factory or import_factory(spec)
    try:
        fake_prof: Profile | None = fake_profile(factory, model_name=spec, hardware=hardware, layers=layers,
                                                 fingerprint=fingerprint)
    except UserError:
        if fake:
            raise
        meta = _build_on_meta(factory, spec)[0].module
        need = 2 * sum(p.numel() * p.element_size() for p in meta.parameters())
        if not fits_device(need, device):
            raise
        fake_prof = None
    if fake_prof is not None and (fake or (fake is None and not fits_device(profile_need_bytes(fake_prof), device))):
        return fake_prof
    user = call_factory(factory, spec)
    return measure_profile(user.module, user.example_input, model_name=spec,
                           fingerprint=fingerprint(user.module), microbatch_size=user.microbatch_size,
                           loss_fn=user.loss_fn, warmup=warmup, iters=iters, device=device, layers=layers)


def profile_hf_model(name: str, *, microbatch_size: int, hardware: Hardware, fake: bool | None,
                     seq_len: int | None = None, layers: Sequence[str] | None = None, device: str = "cpu",
                     warmup: int = 2, iters: int = 10, dtype: str = "fp32") -> Profile:
    """The profile of the Hugging Face model `name` (`mpress.models.hf_config`: a built-in
    config, a config.json or a local weights directory) for one microbatch of
    `microbatch_size` sequences, its parameters and activations in `dtype` (fp32, bf16,
    fp16; the profile's `dtype`), as `profile_user_module` makes a module's: on fake tensors
    when `fake` or when it does not fit `device`, measured otherwise. The model is named
    `hf:<name>` and fingerprinted by its chain and sequence length (`HFSource.fingerprint`)."""
    from mpress.models.hf_config import resolve_hf

    if microbatch_size < 1:
        raise UserError(f"microbatch size must be >= 1, got {microbatch_size}")
    source = resolve_hf(name, seq_len=seq_len, layers=layers, dtype=dtype)
    return profile_user_module(source.label, hardware=hardware, fake=fake, device=device, warmup=warmup,
                               iters=iters, factory=source.factory(microbatch_size), fingerprint=source.fingerprint)
