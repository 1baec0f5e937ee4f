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
  parameters), `stash:LAYER` (PipeDream's stashed weight versions), `param:LAYER` (the
  layer's working parameters) and `grad:LAYER` (their gradients), with globs (`optim:*`).
  Only such patterns name model data: `*` is every saved activation. `param:` and `grad:`
  take `keep` or `host` only, in every microbatch, and `host` needs the stage's
  `optimizer_step: host`: the parameters live in pinned host memory, come to the device
  one layer ahead of the layer's forward and backward of each microbatch and go after
  them; the gradients go to the host after each backward of the layer and are summed
  there, where the host step reads them (and writes the parameters).

Microbatch selectors (`TensorRule.microbatches`): `all`, a list `0,2,5`, a range `0-3`,
or a mix `0-3,7`. The first rule that matches a tensor and microbatch decides; a tensor
no rule matches is kept.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from mpress import __version__
from mpress.config.loader import from_dict, load_yaml, to_dict, write_text_atomic
from mpress.contract.actions import Action, parse_actions, stage_to_rank
from mpress.errors import ConfigError, PlanError, ScheduleError
from mpress.hardware.server import Hardware
from mpress.config.limits import MAX_DEVICES, MAX_MICROBATCH_SIZE, MAX_MICROBATCHES, MAX_STAGES
from mpress.config.units import MAX_BYTES
from mpress.config.vocabulary import V_SCHEDULES, OptimizerStep, ScheduleName, SwapInPolicy, Technique, as_word

PLAN_VERSION = 1

MAX_PREFETCH_LEAD = 2 * MAX_MICROBATCHES * MAX_STAGES
"""Most compute actions a swap-in may lead its backward by: a rank's whole action list at
the largest pipeline (a forward and a backward per microbatch and stage)."""
LAYER_DATA_PREFIXES = ("param:", "grad:")
"""Rule prefixes naming a layer's working parameters and their gradients."""
MODEL_DATA_PREFIXES = ("optim:", "stash:") + LAYER_DATA_PREFIXES
"""Rule prefixes naming model data (everything else names saved activations)."""
MAX_LAYER_INDEX = 1 << 20
"""Bound on a stage's layer indices (the profile's layer count decides the real end)."""


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
    """Whether tensor identity `tensor` (`module#index`, `optim:LAYER`, `stash:LAYER`,
    `param:LAYER`, `grad:LAYER`) matches `pattern` (see the module docstring)."""
    kind, is_model_data, _ = tensor.partition(":")
    if is_model_data and not pattern.startswith(kind + ":"):
        return False  # `*` and other activation globs would otherwise catch optimizer states too
    if pattern.endswith(".**"):
        prefix = pattern[:-3]
        module = tensor.split("#", 1)[0]
        if is_model_data:
            return False
        if plain_module_prefix(pattern) is not None:  # a plain module path (the planner's): no fnmatch
            return module == prefix or module.startswith(prefix + ".")
        return fnmatch.fnmatchcase(module, prefix) or fnmatch.fnmatchcase(module, prefix + ".*")
    if is_exact_pattern(pattern):
        return tensor == pattern
    return fnmatch.fnmatchcase(tensor, pattern)


def is_exact_pattern(pattern: str) -> bool:
    """Whether `pattern` names one tensor identity only (itself): no glob characters and
    not `X.**`."""
    return not pattern.endswith(".**") and not _GLOB_CHARS.intersection(pattern)


def plain_module_prefix(pattern: str) -> str | None:
    """The module path X of a pattern `X.**` without glob characters (it names the
    activations saved in X and the modules under it), else None."""
    if pattern.endswith(".**") and not _GLOB_CHARS.intersection(pattern[:-3]):
        return pattern[:-3]
    return None


_GLOB_CHARS = frozenset("*?[")
"""What makes a pattern a glob for `fnmatch` (anything else matches only itself)."""


@dataclass(kw_only=True, frozen=True)
class Stripe:
    """One stripe of a D2D-swapped tensor."""

    device: int = field(metadata={"min": 0, "max": MAX_DEVICES - 1})
    """Peer device that holds the stripe (it must have NVLink to the exporter)."""
    fraction: float = field(metadata={"gt": 0, "max": 1})
    """Share of the tensor's bytes (stripes of a rule sum to 1)."""


@dataclass(kw_only=True, frozen=True)
class PeerQuota:
    """How much of one peer device's pool an exporter stage may fill at once."""

    device: int = field(metadata={"min": 0, "max": MAX_DEVICES - 1})
    """The importer device (it reserves the pool)."""
    quota_bytes: int = field(metadata={"gt": 0, "max": MAX_BYTES})
    """Bytes of that pool set aside for this stage's stripes."""


@dataclass(kw_only=True, frozen=True)
class TensorRule:
    """The technique for the tensors matching `tensor` in the selected microbatches."""

    tensor: str
    """Tensor pattern (see the module docstring)."""
    microbatches: str = "all"
    """Microbatch selector: all, 0,2,5, 0-3."""
    technique: Technique
    """keep, recompute, host (swap to pinned host memory), d2d (stripe over NVLink peers),
    nvme (`optim:` only: files on a local drive, the train config's `nvme_dir`)."""
    # (a rule decides; the identity module's `StageRules` reads rules for both halves)
    stripes: list[Stripe] = field(default_factory=list)
    """d2d only: where the stripes go."""
    prefetch_lead: int = field(default=1, metadata={"min": 1, "max": MAX_PREFETCH_LEAD})
    """Swap-in is issued before the compute action this many compute actions ahead of the
    backward that needs the tensor (1 = overlap with the one compute action just before)."""

    def __post_init__(self) -> None:
        as_word(self, "technique", Technique)
        try:
            parse_microbatches(self.microbatches)
        except PlanError as exc:  # a ConfigError, so loading names the file and key
            raise ConfigError("", "microbatches", str(exc).removeprefix("microbatches: ")) from None
        if self.technique is Technique.D2D:
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
        if self.technique is Technique.RECOMPUTE and self.tensor.startswith(MODEL_DATA_PREFIXES):
            raise ConfigError("", "technique", f"{self.tensor!r} is model data and cannot be recomputed")
        if self.tensor.startswith(LAYER_DATA_PREFIXES):
            if self.technique not in (Technique.KEEP, Technique.HOST):
                raise ConfigError("", "technique", f"{self.tensor!r} takes keep or host (pinned host memory), "
                                                   f"not {self.technique}")
            if self.microbatches.strip() != "all":
                raise ConfigError("", "microbatches", f"{self.tensor!r} is one copy for every microbatch: "
                                                      "use all")
        if self.technique is Technique.NVME and not self.tensor.startswith("optim:"):
            raise ConfigError("", "technique", f"nvme holds optimizer states only (optim:LAYER), not {self.tensor!r}")

    @functools.cached_property
    def selected(self) -> frozenset[int] | None:
        """The microbatches the rule selects (None: all), parsed once."""
        return parse_microbatches(self.microbatches)

    def selects(self, microbatch: int | None) -> bool:
        """Whether the rule applies in `microbatch` (None: model data, any microbatch)."""
        return self.selected is None or microbatch is None or microbatch in self.selected

    def matches(self, tensor: str, microbatch: int | None) -> bool:
        """Whether the rule names `tensor` and applies in `microbatch`."""
        return pattern_matches(self.tensor, tensor) and self.selects(microbatch)


@dataclass(kw_only=True, frozen=True)
class StagePlan:
    """What one pipeline stage does with its memory."""

    stage: int = field(metadata={"min": 0, "max": MAX_STAGES - 1})
    device: int = field(metadata={"min": 0, "max": MAX_DEVICES - 1})
    """Device the stage runs on."""
    first_layer: int = field(metadata={"min": 0, "max": MAX_LAYER_INDEX})
    end_layer: int = field(metadata={"min": 1, "max": MAX_LAYER_INDEX})
    """Layer range [first_layer, end_layer) of the profile's layer list."""
    rules: list[TensorRule] = field(default_factory=list)
    """First match wins; unmatched tensors are kept."""
    pinned_host_bytes: int = field(default=0, metadata={"min": 0, "max": MAX_BYTES})
    """Pinned host pool this stage's process allocates at start-up."""
    peer_pool_bytes: int = field(default=0, metadata={"min": 0, "max": MAX_BYTES})
    """Bytes this stage's device reserves and exports for its D2D exporters."""
    peer_quotas: list[PeerQuota] = field(default_factory=list)
    """Exporter side: this stage's share of each peer pool it stripes to. A peer without
    an entry gets an equal share of what its pool has left."""
    need_bytes: int = field(default=0, metadata={"min": 0, "max": MAX_BYTES})
    """Peak need without compaction (memory model)."""
    predicted_peak_bytes: int = field(default=0, metadata={"min": 0, "max": MAX_BYTES})
    """Emulated peak with this plan, peer pool included."""
    optimizer_step: OptimizerStep = OptimizerStep.DEVICE
    """Where the stage's optimizer step runs. `device`: Adam states and fp32 master
    weights live on the stage's device, or, for layers an `optim:` host rule names, in the
    pinned pool between steps (back on the device for the step). `host`: they live in host
    memory for good; each step copies the gradients to the host, runs Adam on the CPU and
    copies the updated parameters back. A host step subsumes `optim:` rules: `keep` and
    `host` rules of such a stage change nothing, `d2d` and `nvme` ones are refused."""

    def __post_init__(self) -> None:
        as_word(self, "optimizer_step", OptimizerStep)
        if self.optimizer_step is not OptimizerStep.HOST:
            for rule in self.rules:
                if rule.technique is Technique.HOST and rule.tensor.startswith(LAYER_DATA_PREFIXES):
                    raise ConfigError("", "optimizer_step",
                                      f"stage {self.stage} keeps {rule.tensor!r} on the host, where the optimizer "
                                      f"step must read the gradients and write the parameters: use optimizer_step: "
                                      f"host")
            return
        for rule in self.rules:
            if rule.technique in (Technique.D2D, Technique.NVME) and rule.tensor.startswith("optim:"):
                raise ConfigError("", "optimizer_step",
                                  f"stage {self.stage} steps on the host, so its optimizer states stay in host "
                                  f"memory ({rule.tensor!r} is {rule.technique}); drop the rule or use "
                                  "optimizer_step: device")


@dataclass(kw_only=True, frozen=True)
class Plan:
    """A memory plan for one model on one server with one pipeline shape."""

    version: int = PLAN_VERSION
    mpress_version: str = __version__
    strategy: str
    """Planner strategy that made it: none, recompute, host-swap, d2d, mpress."""
    model: str
    model_fingerprint: str
    dtype: Literal["fp32", "bf16", "fp16"] | None = None
    """The model's precision the plan was made for (its profile's): a job training the
    model in another precision is refused (`check_plan`), as its activations differ.
    None: a plan written before plans recorded it (the model fingerprint, which holds the
    parameters' dtype, still tells another precision apart)."""
    profile_fingerprint: str
    """Hash of the profile the plan was made from (its layers and costs)."""
    hardware: str
    """Hardware preset name (or the `name` inside a hardware YAML)."""
    hardware_fingerprint: str
    num_devices: int = field(metadata={"min": 1, "max": MAX_DEVICES})
    """Devices of the hardware the plan was made for (cpu-local varies it)."""
    device_memory_bytes: int = field(metadata={"gt": 0, "max": MAX_BYTES})
    """Memory per device of that hardware (cpu-local varies it)."""
    schedule: ScheduleName
    num_stages: int = field(metadata={"min": 1, "max": MAX_STAGES})
    num_ranks: int = field(metadata={"min": 1, "max": MAX_STAGES})
    """Pipeline ranks: num_stages, or for interleaved a divisor of it (stage s runs on rank
    s % num_ranks)."""
    num_microbatches: int = field(metadata={"min": 1, "max": MAX_MICROBATCHES})
    microbatch_size: int = field(metadata={"min": 1, "max": MAX_MICROBATCH_SIZE})
    swap_in_policy: SwapInPolicy = SwapInPolicy.CAPACITY
    stage_to_device: list[int] = field(metadata={"min": 0, "max": MAX_DEVICES - 1})
    stages: list[StagePlan]
    fits: bool
    """Every device within its memory in emulation."""
    predicted_iteration_s: float = field(default=0.0, metadata={"min": 0})
    """Emulated iteration time when planned, seconds (finite: the loader refuses inf and nan)."""
    actions: list[str] = field(default_factory=list)
    """The program: per rank, its action list (`mpress/contract/actions.py` string form) as the
    rewriter made it from the rules and the emulator simulated it. The runtime executes
    it: compute in this order, memory actions where they stand. Empty: no program (a plan
    made by hand; the runtime then refuses it)."""

    def __post_init__(self) -> None:
        as_word(self, "schedule", ScheduleName)
        as_word(self, "swap_in_policy", SwapInPolicy)
        if self.version != PLAN_VERSION:
            raise ConfigError("", "version", f"plan version {self.version} is not supported (expected {PLAN_VERSION})")
        if len(self.stages) != self.num_stages or len(self.stage_to_device) != self.num_stages:
            raise ConfigError("", "stages", f"need one entry per stage ({self.num_stages})")
        looped = (ScheduleName.INTERLEAVED, ScheduleName.INTERLEAVED_ZB, ScheduleName.LOOPED_BFS)
        if self.schedule in looped and self.num_stages % self.num_ranks:
            raise ConfigError("", "num_ranks", f"{self.schedule} runs num_stages / num_ranks stages per rank: must "
                                               f"divide num_stages ({self.num_stages}), got {self.num_ranks}")
        if self.schedule in V_SCHEDULES and self.num_ranks * 2 != self.num_stages:
            raise ConfigError("", "num_ranks", f"{self.schedule} runs two stages per rank: must be num_stages / 2 "
                                               f"({self.num_stages} / 2), got {self.num_ranks}")
        if self.schedule not in looped + V_SCHEDULES and self.num_ranks != self.num_stages:
            raise ConfigError("", "num_ranks", f"{self.schedule} runs one stage per rank: must equal num_stages "
                                               f"({self.num_stages}), got {self.num_ranks}")
        for i, sp in enumerate(self.stages):
            if sp.stage != i:
                raise ConfigError("", f"stages[{i}].stage", f"must be {i} (stages are listed in order)")
            if sp.device != self.stage_to_device[i]:
                raise ConfigError("", f"stages[{i}].device", "differs from stage_to_device")
            if sp.end_layer <= sp.first_layer:
                raise ConfigError("", f"stages[{i}].end_layer",
                                  f"must be > first_layer ({sp.first_layer}): a stage holds at least one layer")
        if self.actions and len(self.actions) != self.num_ranks:
            raise ConfigError("", "actions", f"need one action list per rank ({self.num_ranks}), got {len(self.actions)}")
        for r, text in enumerate(self.actions):
            problem = _action_list_problem(text)
            if problem is not None:
                raise ConfigError("", f"actions[{r}]", problem)
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

    def program(self, rank: int) -> list[Action]:
        """Rank `rank`'s action list (the program it executes)."""
        if not self.actions:
            raise PlanError("the plan carries no program (no action lists): make it with mpress plan")
        if not 0 <= rank < self.num_ranks:
            raise PlanError(f"plan has ranks 0..{self.num_ranks - 1}, not {rank}")
        return parse_actions(self.actions[rank])

    def rank_of_stage(self, stage: int) -> int:
        """The rank that runs `stage` (`mpress.contract.actions.stage_to_rank`)."""
        return stage_to_rank(self.schedule, self.num_stages, self.num_ranks)[stage]

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stages `rank` runs, in order."""
        ranks = stage_to_rank(self.schedule, self.num_stages, self.num_ranks)
        return [s for s, r in enumerate(ranks) if r == rank]

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
        return any(sp.peer_pool_bytes or any(r.technique is Technique.D2D for r in sp.rules) for sp in self.stages)

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


@functools.lru_cache(maxsize=64)
def _action_list_problem(text: str) -> str | None:
    """Why a rank's action list does not parse, None when it does; remembered, as planning
    copies a plan with the same program many times (`dataclasses.replace` checks again)."""
    try:
        parse_actions(text)
    except ScheduleError as exc:
        return str(exc)
    return None


def fingerprint(data: object) -> str:
    """Short stable hash of plain data (dicts, lists, numbers, strings)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def hardware_fingerprint(hardware: Hardware) -> str:
    """Hash of everything in a hardware description."""
    return fingerprint(to_dict(hardware))
