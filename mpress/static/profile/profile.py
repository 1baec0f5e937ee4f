"""The `Profile` type: what one microbatch costs, layer by layer.

Three sources fill it: the analytic profiler (`analytic.py`, closed forms for the GPT/BERT
presets), the measured profiler (`measured.py`, a real module on the local device, times
as medians of timed steps) and the fake-tensor profiler (`fake_profile.py`, any module
built on meta and run on fake tensors: exact saved tensors and FLOPs at any size, times
from the hardware model). All produce the same type; the partitioner groups layers into
stages.

A profile identifies its model by a fingerprint of the model's structure (a preset's
`ModelConfig.fingerprint()`, or `module_fingerprint` of a user module), so a plan can be
made from a profile alone (`ModelIdentity`, `model_for_profile`).

Identity of a saved tensor: `f"{module}#{index}"`, where `module` is the path of the
innermost module running when autograd saved it (as in `named_modules()` of the whole
model) and `index` the order in which that module's forward saved tensors.
Units: bytes, seconds, FLOPs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from mpress.config.loader import from_dict, load_yaml, to_dict, write_text_atomic
from mpress.errors import ProfileError, UserError
from mpress.config.model_config import ModelConfig, load_model_config, model_presets

PROFILE_VERSION = 3
"""3: layers offer the attention-core recompute choice (`RecomputeOption.attention_core`)."""


@dataclass(kw_only=True, frozen=True)
class SavedTensor:
    """One tensor autograd saves in forward for backward (parameters excluded)."""

    module: str
    """Path of the innermost module that saved it (`named_modules()` of the whole model)."""
    index: int = field(metadata={"min": 0})
    """Order in which that module's forward saved tensors (0, 1, ...)."""
    bytes: int = field(metadata={"min": 0})
    """Storage bytes for one microbatch."""
    shape: list[int] = field(default_factory=list)
    """Shape for one microbatch."""
    dtype: str = "float32"
    """torch dtype name without the `torch.` prefix."""
    what: str = ""
    """Human description, e.g. "fc1 input", "dropout mask", "attention probabilities"."""
    input: bool = False
    """Its storage is the layer's input (the previous layer's output, or, for a stage's
    first layer, the stage's received activation, which swapping it does not free)."""
    held: bool = False
    """Its storage existed before the step and something else holds it throughout (the
    loss's targets, a module buffer): swapping it frees nothing."""
    op: str = ""
    """The operator that produced its storage in the layer's forward (e.g.
    "aten.native_layer_norm.default"); "" when none did (the layer's input, a buffer,
    a tensor the loss saves outside the layer): it cannot be recomputed on its own."""
    op_index: int = field(default=-1, metadata={"min": -1})
    """That operator's ordinal in the layer's forward (`mpress.contract.selective`), -1 for none."""
    op_flops: float = field(default=0.0, metadata={"min": 0})
    """Matrix-product FLOPs of that operator (what re-producing it computes)."""
    op_bytes: int = field(default=0, metadata={"min": 0})
    """Bytes that operator reads and writes (what re-producing it moves)."""
    weight_grad: bool = False
    """A weight gradient reads it (a linear's input): a split backward keeps it from the
    input-gradient half (I) until the weight-gradient half (W)."""

    @property
    def id(self) -> str:
        return f"{self.module}#{self.index}"


@dataclass(kw_only=True, frozen=True)
class LayerMemory:
    """What one layer's forward and backward of one microbatch hold on the device, counted
    as `mpress.contract.live_bytes.LiveBytes` counts (`memory_probe.py` measures it)."""

    kept_bytes: int = field(default=0, metadata={"min": 0})
    """Live after the forward minus before: what it keeps for its backward, and its output."""
    forward_peak_bytes: int = field(default=0, metadata={"min": 0})
    """Highest live bytes above the start during the forward."""
    saves_input: bool = False
    """Autograd (or the checkpoint) keeps the layer's input storage until its backward."""
    saves_output: bool = False
    """Autograd keeps the layer's own output storage until its backward."""
    backward_peak_bytes: int = field(default=0, metadata={"min": 0})
    """Highest live bytes above the start of the backward (what the forward kept and the
    incoming gradient are part of the start)."""
    input_grad_bytes: int = field(default=0, metadata={"min": 0})
    """The gradient of its input the backward hands on."""
    output_bytes: int = field(default=0, metadata={"min": 0})
    """The module's output (for the last layer with a loss: the output before the loss)."""
    loss_bytes: int = field(default=0, metadata={"min": 0})
    """The last layer of a model: its loss (part of `kept_bytes`); the loss's seed gradient
    is as large. 0 for every other layer."""
    split_held_bytes: int = field(default=-1, metadata={"min": -1})
    """A split backward (torch's `stage_backward_input`, then `stage_backward_weight`):
    what its input-gradient half I leaves live until its weight-gradient half W beyond
    what the whole backward leaves (torch's I retains the graph and its saves, and holds
    the output gradients of the operators with weights, which W starts from). -1: not
    measured (a layer whose input takes no gradient, an op-level choice)."""
    input_peak_bytes: int = field(default=-1, metadata={"min": -1})
    """Highest live bytes above the start of that I (as `backward_peak_bytes` is counted:
    I frees nothing as it goes, the graph stays for W). -1: not measured."""
    input_end_bytes: int = field(default=-1, metadata={"min": -1})
    """Live bytes above the start of that I when it has made the layer's input gradient,
    before torch's I detaches the outputs (the graph and every save stay to then: a
    stage's I gives back what its forward kept only when the whole stage's I ends). -1:
    not measured."""
    output_grad_freed_bytes: int = field(default=0, metadata={"min": 0})
    """Bytes of the incoming gradient (of the layer's output) that I gives back once it
    has used it: 0 where I keeps it for W, or the layer ends the model (its seed)."""
    weight_peak_bytes: int = field(default=-1, metadata={"min": -1})
    """Highest live bytes above the start of that W (a fresh layer's: its parameters'
    gradients are part of it). -1: not measured."""
    weight_replays: int = field(default=-1, metadata={"min": -1})
    """How many times that W runs the layer's forward again: 0 for a layer that keeps
    what it saves; for a recomputed one, torch's W runs one gradient pass per group of
    parameters (`stage_backward_weight`) and the non-reentrant checkpoint replays the
    layer in each pass that unpacks its saves (its I replays it once more, as a whole
    backward does). -1: not measured."""


@dataclass(kw_only=True, frozen=True)
class RecomputeOption:
    """Recomputing some of a layer's saved tensors and keeping the rest (`mpress.contract.selective`:
    the layer is checkpointed and the operators producing what it keeps are cached)."""

    tensors: list[int] = field(default_factory=list)
    """Positions (in the layer's `saved` list) of the tensors recomputed."""
    flops: float = field(default=0.0, metadata={"min": 0})
    """Matrix-product FLOPs the backward's replay repeats."""
    bytes_moved: int = field(default=0, metadata={"min": 0})
    """Bytes the replay's operators read and write."""
    time_s: float = field(default=0.0, metadata={"min": 0})
    """The replay's time on the profile's device (`recompute_options.replay_time_s`)."""
    memory: LayerMemory = field(default_factory=lambda: LayerMemory())
    """What the layer holds with this choice (the memory probe, run as the runtime runs it)."""
    attention_core: bool = False
    """It recomputes the layer's attention core as Megatron-LM's selective recompute does
    (`mpress.contract.selective.attention_core_set`)."""


@dataclass(kw_only=True, frozen=True)
class LayerProfile:
    """One layer (embedding, a transformer block, the head) for one microbatch."""

    name: str
    """Module path of the layer in the whole model, e.g. "embed", "layers.3", "head"."""
    forward_flops: float = field(metadata={"min": 0})
    backward_flops: float = field(metadata={"min": 0})
    forward_time_s: float = field(metadata={"min": 0})
    """Measured: the median over the timed steps; otherwise FLOPs over the hardware's rate."""
    backward_time_s: float = field(metadata={"min": 0})
    weight_grad_flops: float = field(default=-1.0, metadata={"min": -1})
    """FLOPs of the weight-gradient half of the backward (what a split backward's W
    runs; the input-gradient half I runs the rest); -1: not recorded, taken as half
    (a linear's backward is two matrix products of equal size, one per half)."""
    forward_time_iqr_s: float = field(default=0.0, metadata={"min": 0})
    """Spread of the measured forward times (interquartile range); 0 when not measured."""
    backward_time_iqr_s: float = field(default=0.0, metadata={"min": 0})
    saved: list[SavedTensor] = field(default_factory=list)
    """Tensors saved for backward, in saving order."""
    param_bytes: int = field(default=0, metadata={"min": 0})
    """Parameters in the training dtype."""
    grad_bytes: int = field(default=0, metadata={"min": 0})
    """Gradients (same dtype as parameters)."""
    optim_bytes: int = field(default=0, metadata={"min": 0})
    """Optimizer states (Adam: exp_avg and exp_avg_sq in fp32)."""
    master_bytes: int = field(default=0, metadata={"min": 0})
    """fp32 master weights under mixed precision, else 0."""
    param_tensors: int = field(default=0, metadata={"min": 0})
    """How many parameter tensors it has (each moves as its own block when offloaded)."""
    largest_param_bytes: int = field(default=0, metadata={"min": 0})
    """The largest parameter tensor's bytes as the optimizer steps it (fp32): one-tensor
    optimizer steps hold temporaries of this size."""
    output_bytes: int = field(default=0, metadata={"min": 0})
    """Activation bytes this layer hands to the next one (what a stage boundary sends)."""
    memory: LayerMemory = field(default_factory=lambda: LayerMemory())
    """What its forward and backward hold on the device (the memory probe)."""
    recompute_memory: LayerMemory = field(default_factory=lambda: LayerMemory())
    """The same when the layer is checkpointed (recomputed in its backward)."""
    recompute_options: list[RecomputeOption] = field(default_factory=list)
    """Recomputing part of its saved tensors (op-level recompute), cheapest per freed
    byte first; none when it saves nothing an operator of its own produced."""

    @property
    def saved_bytes(self) -> int:
        return sum(t.bytes for t in self.saved)

    @property
    def weight_grad_time_s(self) -> float:
        """Time of the weight-gradient half of the backward: `backward_time_s` split by
        FLOPs (`weight_grad_flops`)."""
        if self.weight_grad_flops < 0:
            return 0.5 * self.backward_time_s
        if self.backward_flops <= 0:
            return 0.0
        return self.backward_time_s * min(1.0, self.weight_grad_flops / self.backward_flops)

    @property
    def input_grad_time_s(self) -> float:
        """Time of the input-gradient half: the backward less its weight-gradient half."""
        return self.backward_time_s - self.weight_grad_time_s

    @property
    def optimizer_data_bytes(self) -> int:
        """Optimizer states + fp32 master weights: what an `optim:` rule moves."""
        return self.optim_bytes + self.master_bytes

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer states + master weights."""
        return self.param_bytes + self.grad_bytes + self.optimizer_data_bytes


@dataclass(kw_only=True, frozen=True)
class Profile:
    """Per-layer costs of one microbatch of a model on a device."""

    version: int = PROFILE_VERSION
    model: str
    """Model preset name (or `package.module:factory` for user modules)."""
    model_fingerprint: str
    """`ModelConfig.fingerprint()`, or a hash of the module structure for user modules."""
    source: Literal["analytic", "measured", "fake"]
    """analytic: closed forms; measured: a real run; fake: a run on fake tensors."""
    device: str
    """Where times come from: a hardware preset name (analytic, fake) or the measured device."""
    dtype: str
    """Activation precision: fp32, fp16 or bf16."""
    microbatch_size: int = field(metadata={"min": 1})
    layers: list[LayerProfile]
    input_bytes: int = field(default=0, metadata={"min": 0})
    """One microbatch of the model's input (the first stage holds the iteration's batch)."""
    target_bytes: int = field(default=0, metadata={"min": 0})
    """One microbatch of the loss's targets (the last stage holds the iteration's)."""
    time_samples: int = field(default=0, metadata={"min": 0})
    """Timed steps the measured times are the medians of (after untimed warm-up steps);
    0: times come from the hardware model."""

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ProfileError(f"profile version {self.version} is not supported (expected {PROFILE_VERSION})")
        if not self.layers:
            raise ProfileError("a profile needs at least one layer")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def model_identity(self) -> "ModelIdentity":
        """The model this profile was made for, as planning needs it (name, fingerprint)."""
        return ModelIdentity(name=self.model, structure=self.model_fingerprint)

    def check_model(self, model: "ModelConfig | ModelIdentity", path: str = "profile") -> None:
        """Raise `ProfileError` unless this profile was made for `model`."""
        if self.model_fingerprint != model.fingerprint():
            raise ProfileError(
                f"{path}: profile was made for model {self.model!r} (fingerprint {self.model_fingerprint}), "
                f"not {model.name!r} (fingerprint {model.fingerprint()})"
            )

    def save(self, path: str | Path) -> None:
        """Write as YAML, or JSON when the path ends in .json."""
        data = to_dict(self)
        p = Path(path)
        text = json.dumps(data, indent=1) if p.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        write_text_atomic(p, text)

    @staticmethod
    def load(path: str | Path) -> "Profile":
        """Read a profile written by `save` (YAML or JSON)."""
        return from_dict(Profile, load_yaml(path), str(path))


@dataclass(kw_only=True, frozen=True)
class ModelIdentity:
    """A model known only by its profile (a user module): what the planner and a plan need
    of a model, `name` and `fingerprint()`, as `ModelConfig` has them."""

    name: str
    """`package.module:factory` for user modules, or a preset's name."""
    structure: str
    """The profile's `model_fingerprint`."""

    def fingerprint(self) -> str:
        return self.structure


def model_for_profile(name: str | None, profile: Profile | None, default: str,
                      path: str = "profile") -> "ModelConfig | ModelIdentity":
    """The model a command plans for: the profile's own when `--model` is not given (or
    names the profile's model), else the preset or YAML `name` (default `default`), which
    `Profile.check_model` then holds the profile to. A profile that names a model preset
    must be that preset's (its fingerprint), or it is refused naming `path`."""
    if profile is not None and name in (None, profile.model):
        if profile.model in model_presets():
            preset = load_model_config(profile.model)
            profile.check_model(preset, path)
            return preset
        return profile.model_identity()
    if name is not None and ":" in name and not Path(name).exists():
        raise UserError(f"--model {name!r} names a user factory: give it as --module {name}, "
                        "or plan from its profile (--profile FILE from mpress profile --module)")
    return load_model_config(name or default)
