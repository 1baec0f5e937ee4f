"""The plan: the one contract between the static half and the runtime.

A plan says, for one model, hardware, schedule and stage count, which memory technique
each saved tensor (per microbatch) and each piece of model data gets, where D2D stripes
go, when swap-ins are issued, and how much pinned host memory and peer pool each device
must reserve. The static half writes it (`mpress plan`), the runtime reads it and
refuses one that does not match the model, stage or hardware it is given.

Tensor patterns (`TensorRule.tensor`):

- saved activations by identity `module#index` (`layers.3.mlp.fc1#0`), shell globs
  (`layers.*.attn.*#*`), or `PREFIX.**` for every tensor saved inside module PREFIX
  (`layers.3.**` = all of block 3; PREFIX may be a glob: `layers.*.mlp.**`);
- model data: `optim:LAYER` (Adam states and fp32 master weights of that layer's
  parameters) and `stash:LAYER` (PipeDream's stashed weight versions), with globs
  (`optim:*`). Only such patterns name model data: `*` is every saved activation.

Microbatch selectors (`TensorRule.microbatches`): `all`, a list `0,2,5`, a range `0-3`,
or a mix `0-3,7`. The first rule that matches a tensor and microbatch decides; a tensor
no rule matches is kept.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from mpress import __version__
from mpress.config import from_dict, load_yaml, to_dict, write_text_atomic
from mpress.errors import ConfigError, PlanError
from mpress.hardware import Hardware
from mpress.model_config import ModelConfig

PLAN_VERSION = 1

Technique = Literal["keep", "recompute", "host", "d2d"]
TECHNIQUES: tuple[str, ...] = ("keep", "recompute", "host", "d2d")


def parse_microbatches(selector: str, num_microbatches: int | None = None) -> frozenset[int] | None:
    """`"all"` -> None (every microbatch); `"0-3,7"` -> {0, 1, 2, 3, 7}.

    Raises `PlanError` on malformed selectors or indices >= num_microbatches.
    """
    text = selector.strip()
    if text == "all":
        return None
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise PlanError(f"microbatches: cannot read {selector!r} (use all, 0,2,5, 0-3)") from None
        if first < 0 or last < first:
            raise PlanError(f"microbatches: bad range {part!r} in {selector!r}")
        if num_microbatches is not None and last >= num_microbatches:
            raise PlanError(f"microbatches: {last} is out of range (the plan has {num_microbatches} microbatches)")
        out.update(range(first, last + 1))
    return frozenset(out)


def format_microbatches(mbs: list[int] | frozenset[int] | None) -> str:
    """Inverse of `parse_microbatches`: runs of consecutive indices become ranges."""
    if mbs is None:
        return "all"
    items = sorted(mbs)
    parts: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(parts)


def pattern_matches(pattern: str, tensor: str) -> bool:
    """Whether tensor identity `tensor` (`module#index`, `optim:LAYER`, `stash:LAYER`)
    matches `pattern` (see the module docstring)."""
    kind, is_model_data, _ = tensor.partition(":")
    if is_model_data and not pattern.startswith(kind + ":"):
        return False  # `*` and other activation globs would otherwise catch optimizer states too
    if pattern.endswith(".**"):
        prefix = pattern[:-3]
        module = tensor.split("#", 1)[0]
        return not is_model_data and (fnmatch.fnmatchcase(module, prefix)
                                       or fnmatch.fnmatchcase(module, prefix + ".*"))
    return fnmatch.fnmatchcase(tensor, pattern)


@dataclass(kw_only=True, frozen=True)
class Stripe:
    """One stripe of a D2D-swapped tensor."""

    device: int = field(metadata={"min": 0})
    """Peer device that holds the stripe (it must have NVLink to the exporter)."""
    fraction: float = field(metadata={"gt": 0, "max": 1})
    """Share of the tensor's bytes (stripes of a rule sum to 1)."""


@dataclass(kw_only=True, frozen=True)
class PeerQuota:
    """How much of one peer device's pool an exporter stage may fill at once."""

    device: int = field(metadata={"min": 0})
    """The importer device (it reserves the pool)."""
    quota_bytes: int = field(metadata={"gt": 0})
    """Bytes of that pool set aside for this stage's stripes."""


@dataclass(kw_only=True, frozen=True)
class TensorRule:
    """The technique for the tensors matching `tensor` in the selected microbatches."""

    tensor: str
    """Tensor pattern (see the module docstring)."""
    microbatches: str = "all"
    """Microbatch selector: all, 0,2,5, 0-3."""
    technique: Technique
    """keep, recompute, host (swap to pinned host memory), d2d (stripe over NVLink peers)."""
    stripes: list[Stripe] = field(default_factory=list)
    """d2d only: where the stripes go."""
    prefetch_lead: int = field(default=1, metadata={"min": 1})
    """Swap-in is issued before the compute action this many compute actions ahead of the
    backward that needs the tensor (1 = overlap with the one compute action just before)."""

    def __post_init__(self) -> None:
        try:
            parse_microbatches(self.microbatches)
        except PlanError as exc:  # a ConfigError, so loading names the file and key
            raise ConfigError("", "microbatches", str(exc).removeprefix("microbatches: ")) from None
        if self.technique == "d2d":
            if not self.stripes:
                raise ConfigError("", "stripes", f"d2d rule for {self.tensor!r} needs at least one stripe")
            total = sum(s.fraction for s in self.stripes)
            if abs(total - 1.0) > 1e-6:
                raise ConfigError("", "stripes", f"fractions of {self.tensor!r} sum to {total:.6f}, not 1")
            devices = [s.device for s in self.stripes]
            if len(set(devices)) != len(devices):
                raise ConfigError("", "stripes", f"{self.tensor!r} has two stripes on one device")
        elif self.stripes:
            raise ConfigError("", "stripes", f"only d2d rules take stripes ({self.tensor!r} is {self.technique})")
        if self.technique == "recompute" and self.tensor.startswith(("optim:", "stash:")):
            raise ConfigError("", "technique", f"{self.tensor!r} is model data and cannot be recomputed")

    def matches(self, tensor: str, microbatch: int | None) -> bool:
        if not pattern_matches(self.tensor, tensor):
            return False
        selected = parse_microbatches(self.microbatches)
        return selected is None or microbatch is None or microbatch in selected


@dataclass(kw_only=True, frozen=True)
class StagePlan:
    """What one pipeline stage does with its memory."""

    stage: int = field(metadata={"min": 0})
    device: int = field(metadata={"min": 0})
    """Device the stage runs on."""
    first_layer: int = field(metadata={"min": 0})
    end_layer: int = field(metadata={"min": 1})
    """Layer range [first_layer, end_layer) of the profile's layer list."""
    rules: list[TensorRule] = field(default_factory=list)
    """First match wins; unmatched tensors are kept."""
    pinned_host_bytes: int = field(default=0, metadata={"min": 0})
    """Pinned host pool this stage's process allocates at start-up."""
    peer_pool_bytes: int = field(default=0, metadata={"min": 0})
    """Bytes this stage's device reserves and exports for its D2D exporters."""
    peer_quotas: list[PeerQuota] = field(default_factory=list)
    """Exporter side: this stage's share of each peer pool it stripes to. A peer without
    an entry gets an equal share of what its pool has left."""
    need_bytes: int = field(default=0, metadata={"min": 0})
    """Peak need without compaction (memory model)."""
    predicted_peak_bytes: int = field(default=0, metadata={"min": 0})
    """Emulated peak with this plan, peer pool included."""
    optimizer_step: Literal["device", "host"] = "device"
    """Where the stage's optimizer step runs. `device`: Adam states and fp32 master
    weights live on the stage's device, or, for layers an `optim:` host rule names, in the
    pinned pool between steps (back on the device for the step). `host`: they live in host
    memory for good; each step copies the gradients to the host, runs Adam on the CPU and
    copies the updated parameters back. A host step subsumes `optim:` rules: `keep` and
    `host` rules of such a stage change nothing, `d2d` ones are refused."""

    def __post_init__(self) -> None:
        if self.optimizer_step != "host":
            return
        for rule in self.rules:
            if rule.technique == "d2d" and rule.tensor.startswith("optim:"):
                raise ConfigError("", "optimizer_step",
                                  f"stage {self.stage} steps on the host, so its optimizer states cannot go to "
                                  f"peers ({rule.tensor!r} is d2d); drop the rule or use optimizer_step: device")

    def technique(self, tensor: str, microbatch: int | None) -> TensorRule | None:
        """The rule deciding `tensor` in `microbatch`, or None (keep)."""
        for rule in self.rules:
            if rule.matches(tensor, microbatch):
                return rule
        return None


@dataclass(kw_only=True, frozen=True)
class Plan:
    """A memory plan for one model on one server with one pipeline shape."""

    version: int = PLAN_VERSION
    mpress_version: str = __version__
    strategy: str
    """Planner strategy that made it: none, recompute, host-swap, d2d, mpress."""
    model: str
    model_fingerprint: str
    profile_fingerprint: str
    """Hash of the profile the plan was made from (its layers and costs)."""
    hardware: str
    """Hardware preset name (or the `name` inside a hardware YAML)."""
    hardware_fingerprint: str
    num_devices: int = field(metadata={"min": 1})
    """Devices of the hardware the plan was made for (cpu-local varies it)."""
    device_memory_bytes: int = field(metadata={"gt": 0})
    """Memory per device of that hardware (cpu-local varies it)."""
    schedule: Literal["gpipe", "1f1b", "pipedream", "interleaved"]
    num_stages: int = field(metadata={"min": 1})
    num_ranks: int = field(metadata={"min": 1})
    num_microbatches: int = field(metadata={"min": 1})
    microbatch_size: int = field(metadata={"min": 1})
    swap_in_policy: Literal["capacity", "layer-ahead"] = "capacity"
    stage_to_device: list[int]
    stages: list[StagePlan]
    fits: bool
    """Every device within its memory in emulation."""
    predicted_iteration_s: float = field(default=0.0, metadata={"min": 0})

    def __post_init__(self) -> None:
        if self.version != PLAN_VERSION:
            raise ConfigError("", "version", f"plan version {self.version} is not supported (expected {PLAN_VERSION})")
        if len(self.stages) != self.num_stages or len(self.stage_to_device) != self.num_stages:
            raise ConfigError("", "stages", f"need one entry per stage ({self.num_stages})")
        for i, sp in enumerate(self.stages):
            if sp.stage != i:
                raise ConfigError("", f"stages[{i}].stage", f"must be {i} (stages are listed in order)")
            if sp.device != self.stage_to_device[i]:
                raise ConfigError("", f"stages[{i}].device", "differs from stage_to_device")
            if sp.end_layer <= sp.first_layer:
                raise ConfigError("", f"stages[{i}].end_layer",
                                  f"must be > first_layer ({sp.first_layer}): a stage holds at least one layer")
        if self.stages and self.stages[0].first_layer != 0:
            raise ConfigError("", "stages[0].first_layer", "must be 0 (the first stage starts at the first layer)")
        for i, sp in enumerate(self.stages[1:], start=1):
            if sp.first_layer != self.stages[i - 1].end_layer:
                raise ConfigError("", f"stages[{i}].first_layer", "stage layer ranges must be contiguous")
        for sp in self.stages:
            for r, rule in enumerate(sp.rules):
                try:
                    parse_microbatches(rule.microbatches, self.num_microbatches)
                except PlanError as exc:
                    raise ConfigError("", f"stages[{sp.stage}].rules[{r}].microbatches",
                                      str(exc).removeprefix("microbatches: ")) from None
                for stripe in rule.stripes:
                    if stripe.device == sp.device:
                        raise ConfigError("", f"stages[{sp.stage}].rules[{r}].stripes",
                                          "a stripe cannot go to the exporter's own device")
            quota_devices = [q.device for q in sp.peer_quotas]
            if len(set(quota_devices)) != len(quota_devices) or sp.device in quota_devices:
                raise ConfigError("", f"stages[{sp.stage}].peer_quotas",
                                  "one entry per peer device, never the stage's own device")

    # -- queries -----------------------------------------------------------------------
    def stage(self, stage: int) -> StagePlan:
        if not 0 <= stage < self.num_stages:
            raise PlanError(f"plan has stages 0..{self.num_stages - 1}, not {stage}")
        return self.stages[stage]

    def technique(self, stage: int, tensor: str, microbatch: int | None) -> Technique:
        rule = self.stage(stage).technique(tensor, microbatch)
        return rule.technique if rule else "keep"

    def rank_of_stage(self, stage: int) -> int:
        """The rank that runs `stage`: stage s on rank s % ranks (one stage per rank, or
        several under interleaved schedules)."""
        return stage % self.num_ranks

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stages `rank` runs, in order."""
        return list(range(rank, self.num_stages, self.num_ranks))

    def peer_pool_bytes_by_device(self) -> dict[int, int]:
        """Peer pool each device reserves for its D2D exporters (the sum over the stages
        it runs); devices without one are left out."""
        out: dict[int, int] = {}
        for sp in self.stages:
            if sp.peer_pool_bytes:
                out[sp.device] = out.get(sp.device, 0) + sp.peer_pool_bytes
        return out

    @property
    def uses_peer_pools(self) -> bool:
        """Whether the plan reserves a peer pool or D2D-swaps anything (then every rank
        of the job takes part in setting the pools up)."""
        return any(sp.peer_pool_bytes or any(r.technique == "d2d" for r in sp.rules) for sp in self.stages)

    # -- storage -----------------------------------------------------------------------
    def to_yaml(self) -> str:
        return yaml.safe_dump(to_dict(self), sort_keys=False, width=120)

    def save(self, path: str | Path) -> None:
        """Write the plan as YAML (JSON if the path ends in .json), atomically."""
        p = Path(path)
        write_text_atomic(p, json.dumps(to_dict(self), indent=1) if p.suffix == ".json" else self.to_yaml())

    @staticmethod
    def load(path: str | Path) -> "Plan":
        """Read a plan; unknown keys, wrong types and inconsistent stages are `ConfigError`s."""
        return from_dict(Plan, load_yaml(path), str(path))


def fingerprint(data: object) -> str:
    """Short stable hash of plain data (dicts, lists, numbers, strings)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def hardware_fingerprint(hardware: Hardware) -> str:
    """Hash of everything in a hardware description."""
    return fingerprint(to_dict(hardware))


def check_plan(plan: Plan, *, source: str = "plan", model: ModelConfig | None = None,
               hardware: Hardware | None = None, stage_tensors: list[list[str]] | None = None,
               stage_layers: list[list[str]] | None = None) -> None:
    """Refuse a plan that does not belong to what it is used with (one-line `PlanError`).

    model: the plan must have been made for this model (fingerprint).
    hardware: same device count and topology; stripes only to NVLink neighbours; pinned
        pools within host memory, peer pools within device memory.
    stage_tensors / stage_layers: per stage, the saved-tensor ids and layer names of the
        profile; every rule must name something the stage has.
    """
    if model is not None and plan.model_fingerprint != model.fingerprint():
        raise PlanError(f"{source}: made for model {plan.model!r}, not {model.name!r} (fingerprints differ)")
    if hardware is not None:
        if plan.hardware_fingerprint != hardware_fingerprint(hardware):
            raise PlanError(f"{source}: made for hardware {plan.hardware!r}, not {hardware.name!r} "
                            "(device count, memory or topology differ)")
        _check_devices(plan, source, hardware)
    if stage_tensors is not None or stage_layers is not None:
        _check_names(plan, source, stage_tensors, stage_layers)


def _check_devices(plan: Plan, source: str, hardware: Hardware) -> None:
    n = hardware.num_devices
    for s, d in enumerate(plan.stage_to_device):
        if not 0 <= d < n:
            raise PlanError(f"{source}: stage {s} is mapped to device {d}; {hardware.name} has devices 0..{n - 1}")
    for sp in plan.stages:
        for r, rule in enumerate(sp.rules):
            for stripe in rule.stripes:
                if not 0 <= stripe.device < n or hardware.links(sp.device, stripe.device) == 0:
                    raise PlanError(
                        f"{source}: stage {sp.stage} rule {r} ({rule.tensor}) stripes to device {stripe.device}, "
                        f"which is not an NVLink neighbour of device {sp.device}")
    host = sum(sp.pinned_host_bytes for sp in plan.stages)
    if host > hardware.host_memory_bytes:
        raise PlanError(f"{source}: pinned host pools need {host / 1e9:.1f} GB, "
                        f"{hardware.name} has {hardware.host_memory_bytes / 1e9:.1f} GB of host memory")
    for d, b in plan.peer_pool_bytes_by_device().items():
        if b > hardware.device.memory_bytes:
            raise PlanError(f"{source}: device {d} peer pool of {b / 1e9:.1f} GB exceeds its "
                            f"{hardware.device.memory_bytes / 1e9:.1f} GB")


def _check_names(plan: Plan, source: str, stage_tensors: list[list[str]] | None,
                 stage_layers: list[list[str]] | None) -> None:
    for sp in plan.stages:
        tensors = stage_tensors[sp.stage] if stage_tensors is not None else None
        layers = stage_layers[sp.stage] if stage_layers is not None else None
        for r, rule in enumerate(sp.rules):
            kind, _, rest = rule.tensor.partition(":")
            if rest and kind in ("optim", "stash"):
                names = None if layers is None else [f"{kind}:{x}" for x in layers]
            else:
                names = tensors
            if names is not None and not any(pattern_matches(rule.tensor, t) for t in names):
                raise PlanError(f"{source}: stage {sp.stage} rule {r} names {rule.tensor!r}, "
                                "which the profile does not have in that stage")
