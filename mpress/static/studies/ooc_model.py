"""The out-of-core model's inputs: one model on ONE device, its profile, and that device.

What a single-device out-of-core question is made of:

- a model, profiled for one microbatch (`OocModel`): a reference conv net of
  `mpress.tiling.networks` (VGG-16, VGG-19, DarkNet-19 on square images, profiled on fake
  tensors, one layer per conv/ReLU/pool module and one for the head), a GPT/BERT preset
  (the analytic profiler), or a user's `package.module:factory` (fake tensors; its
  microbatch is its example input's);
- a batch of B samples, run as `B / microbatch_size` microbatches on one stage: all
  forwards, then all backwards (GPipe's order on one rank), so every microbatch's
  activations are alive at the backward's start, as in one big batch. The microbatch is
  the swap unit: the program's memory actions stand between compute actions, so a
  swapped-out tensor is given back at the next microbatch's forward (its release point)
  and a batch run as ONE microbatch can swap nothing during its forward (see
  `ooc_setup`);
- the device (`single_device`): a hardware preset cut to one device, its capacity the
  preset's usable memory (memory less its reserve) or `capacity_bytes`; and its host link
  (`with_host_link`), the PCIe figure the emulator's copy channels use.

Units: bytes, seconds, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mpress.config import limits
from mpress.config.model_config import ModelConfig, load_model_config, model_presets
from mpress.config.vocabulary import ScheduleName
from mpress.errors import UserError
from mpress.hardware.server import Hardware, load_hardware
from mpress.static.plan.evaluate import PipelineSetup, setup_pipeline
from mpress.static.profile.profile import ModelIdentity, Profile
from mpress.static.studies.ooc_defaults import DEFAULT_IMAGE_SIZE
from mpress.tiling.networks import NETWORKS

CONV_LAYERS = ("features.*", "head")
"""A conv net's layers: each conv, activation and pool module, and the classifier head."""
DEFAULT_NUM_CLASSES = 1000


@dataclass(frozen=True, kw_only=True)
class OocModel:
    """A model profiled for one microbatch, ready to be laid out on one device."""

    name: str
    """What the tables call it (`vgg16@224px`, `gpt-5.3b`, `pkg.mod:factory`)."""
    kind: str
    """`conv`, `preset` or `module`: how it was profiled."""
    model: ModelConfig | ModelIdentity
    profile: Profile
    """One microbatch's per-layer costs."""

    @property
    def microbatch_size(self) -> int:
        return self.profile.microbatch_size


def single_device(hardware: Hardware, capacity_bytes: int | None = None) -> Hardware:
    """`hardware` cut to its first device, alone on its host link (no NVLink peers, no
    shared PCIe switch); `capacity_bytes`: what a plan may fill on it (the preset's
    reserve is kept on top), None = the preset's usable memory."""
    hw = replace(hardware, num_devices=1, pcie_switches=[],
                 nvlink_links=None if not hardware.nvswitch else hardware.nvlink_links)
    if capacity_bytes is not None:
        if capacity_bytes <= 0:
            raise UserError(f"--capacity must be > 0 bytes, got {capacity_bytes}")
        hw = replace(hw, device=replace(hw.device, memory_bytes=capacity_bytes + hw.device.reserve_bytes))
    return hw


def load_single_device(name_or_path: str, capacity_bytes: int | None = None) -> Hardware:
    """A hardware preset or YAML, cut to one device (`single_device`)."""
    return single_device(load_hardware(name_or_path), capacity_bytes)


def with_host_link(hardware: Hardware, gbps: float) -> Hardware:
    """`hardware` whose host link moves `gbps` GB/s in each direction (effective: the
    preset's PCIe efficiency is not applied on top)."""
    if not gbps > 0:
        raise UserError(f"host-link bandwidth must be > 0 GB/s, got {gbps}")
    return replace(hardware, pcie_h2d_gbps=gbps, pcie_d2h_gbps=gbps, pcie_efficiency=1.0)


def host_link_gbps(hardware: Hardware) -> float:
    """The effective host-link bandwidth of `hardware`, GB/s (the slower direction)."""
    return min(hardware.pcie_gbps("h2d"), hardware.pcie_gbps("d2h"))


def conv_model(network: str, hardware: Hardware, microbatch_size: int, *, image_size: int = DEFAULT_IMAGE_SIZE,
               width_div: int = 1, num_classes: int = DEFAULT_NUM_CLASSES) -> OocModel:
    """A reference conv net (`mpress.tiling.networks`) on `image_size`-pixel square RGB
    images, profiled on fake tensors (nothing allocated; times from `hardware`)."""
    from mpress.static.profile.fake_profile import fake_profile

    if network not in NETWORKS:
        raise UserError(f"unknown conv net {network!r} (known: {', '.join(sorted(NETWORKS))})")
    if microbatch_size < 1 or image_size < 32 or width_div < 1:
        raise UserError(f"{network}: microbatch size >= 1, image size >= 32 pixels (five 2x2 pools) and "
                        f"width_div >= 1 needed, got {microbatch_size}, {image_size}, {width_div}")
    build = NETWORKS[network]
    name = f"{network}@{image_size}px" + (f"/{width_div}" if width_div > 1 else "")

    def factory() -> tuple[torch.nn.Module, torch.Tensor]:
        return (build(width_div=width_div, num_classes=num_classes),
                torch.empty(microbatch_size, 3, image_size, image_size))  # (B, C, H, W)

    profile = fake_profile(factory, model_name=name, hardware=hardware, layers=CONV_LAYERS)
    return OocModel(name=name, kind="conv", model=profile.model_identity(), profile=profile)


def preset_model(name: str, hardware: Hardware, microbatch_size: int) -> OocModel:
    """A GPT/BERT preset (or model YAML), profiled analytically for `hardware`."""
    from mpress.static.profile.analytic import analytic_profile

    cfg = load_model_config(name)
    return OocModel(name=cfg.name, kind="preset", model=cfg, profile=analytic_profile(cfg, hardware, microbatch_size))


def module_model(spec: str, hardware: Hardware, layers: Sequence[str] | None = None) -> OocModel:
    """A user's `package.module:factory`, profiled on fake tensors; its microbatch is its
    example input's."""
    from mpress.static.profile.fake_profile import profile_user_module

    profile = profile_user_module(spec, hardware=hardware, fake=True, layers=layers)
    return OocModel(name=spec, kind="module", model=profile.model_identity(), profile=profile)


def load_ooc_model(*, model: str | None, module: str | None, hardware: Hardware, microbatch_size: int | None,
                   image_size: int = DEFAULT_IMAGE_SIZE, width_div: int = 1,
                   layers: Sequence[str] | None = None) -> OocModel:
    """The model the arguments name (exactly one of `model`, `module`); `microbatch_size`
    None: 32 images for a conv net, 1 sequence for a preset; a module's is its own."""
    if (model is None) == (module is None):
        raise UserError("give one model: --model NAME (a conv net or a GPT/BERT preset) or --module PKG.MOD:FACTORY")
    if module is not None:
        found = module_model(module, hardware, layers)
        if microbatch_size is not None and microbatch_size != found.microbatch_size:
            raise UserError(f"--microbatch-size {microbatch_size} does not match the example input of {module} "
                            f"(first dimension {found.microbatch_size}); leave it out for --module")
        return found
    if layers is not None:
        raise UserError("--layers names split points of a --module (conv nets and presets have theirs)")
    assert model is not None  # exactly one of model and module, checked above
    if model not in NETWORKS and model not in model_presets() and not Path(model).exists():
        raise UserError(f"unknown model {model!r} (conv nets: {', '.join(sorted(NETWORKS))}; GPT/BERT presets: "
                        f"{', '.join(model_presets())}; or a model YAML path)")
    if model in NETWORKS:
        return conv_model(model, hardware, microbatch_size or 32, image_size=image_size, width_div=width_div)
    return preset_model(model, hardware, microbatch_size or 1)


def num_microbatches_for(model: OocModel, batch_size: int) -> int:
    """Microbatches of a batch: `batch_size / microbatch_size`, which must be whole."""
    b = model.microbatch_size
    if batch_size < b or batch_size % b:
        raise UserError(f"batch size {batch_size} is not a multiple of {model.name}'s microbatch size {b} "
                        f"(the swap unit; allowed: {b}, {2 * b}, {3 * b}, ...)")
    if batch_size // b > limits.MAX_MICROBATCHES:
        raise UserError(f"batch size {batch_size} is {batch_size // b} microbatches of {b}; at most "
                        f"{limits.MAX_MICROBATCHES} are emulated (raise --microbatch-size)")
    return batch_size // b


def ooc_setup(model: OocModel, hardware: Hardware, batch_size: int) -> PipelineSetup:
    """`model` on one device (a one-stage GPipe pipeline on `hardware`, which must have
    one device) with a batch of `batch_size` samples as `batch_size / microbatch_size`
    microbatches. Why microbatches: the planner and the emulator place memory actions
    between compute actions (a swap-out frees its bytes at the rank's next compute action,
    a swap-in waits before one), and on one stage the compute actions are the
    microbatches' forwards and backwards, so the microbatch is the finest unit a swap can
    free memory by (vDNN swaps per layer inside one forward; here it is per microbatch)."""
    if hardware.num_devices != 1:
        raise UserError(f"the out-of-core model runs on one device; {hardware.name} has {hardware.num_devices} "
                        "(use single_device)")
    return setup_pipeline(model.model, hardware, schedule=ScheduleName.GPIPE, num_stages=1,  # type: ignore[arg-type]
                          microbatch_size=model.microbatch_size,
                          num_microbatches=num_microbatches_for(model, batch_size), profile=model.profile,
                          profile_path=model.name)
