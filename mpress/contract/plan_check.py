"""The one check of a plan against what it is used with, for both halves.

Each caller passes what it knows and gets a one-line `PlanError` when the plan does not
belong to it. The line names the plan file, the plan's key (`stages[2].rules[5].tensor`,
`stage_to_device[3]`, `num_ranks`, ...) and what is allowed:

- `mpress emulate PLAN` and the planner (`mpress.static.plan.plan_eval.check_plan_for_setup`):
  the model, the hardware, the pipeline's shape and layer ranges, and the profile's layer
  names and saved-tensor ids per stage;
- training start-up, on rank 0 before any rank builds a stage
  (`mpress.launcher.startup.plan_for`): the job (model, schedule, stages, ranks,
  microbatches, the model's layer count), then all the above;
- the runtime (`wrap_stage`, `PipelineJob`): the model's fingerprint, the job's shape
  and world size, the layers of the stages it builds, and `runtime=True`, which also
  refuses what torch's pipelining cannot execute.

What a plan keeps in host memory is one sum (`host_bytes`), which the planner reads too
(`planner_layer_data.host_why` calls a plan unfit by it), so the two never disagree about
a plan; the launcher's check of several replicas on one node (`HostBytes.times`) and the
out-of-core study's host figure read it through `planner_layer_data.plan_host_bytes`. A plan takes host memory in four parts:

- **pools**: each stage's pinned host pool (`StagePlan.pinned_host_bytes`), which the
  stage's host swaps use;
- **slabs**: the pinned staging slabs of the stages whose optimizer steps on the host
  (gradients in, parameters out; the static side's `rewriter.host_step_pinned_bytes`);
- **drive staging**: the pinned staging buffers of each stage with `nvme` rules: the
  runtime's drive store (`mpress/runtime/swap/nvme.py`) moves every byte between the
  device and the file through one buffer per direction of `NVME_STAGING_BYTES`, pinned
  apart from the pool (`drive_staging_bytes`: what both the plan and the store read);
- **pageable**: the host-step stages' fp32 copies and Adam states (not pinned).

The first three must fit what the server lets plans pin (`Hardware.pinnable_bytes`), all
four its host memory. Units: bytes.

Rules are read by the identity module's `StageRules`, the resolver both halves use: a
rule must name something of its stage (a saved tensor of one of its layers, or, for
`optim:`/`stash:` rules, one of its layers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mpress.contract.actions import Kind
from mpress.errors import PlanError
from mpress.hardware.server import Hardware
from mpress.contract.stage_rules import MODEL_DATA_KINDS, StageRules
from mpress.config.model_config import ModelConfig
from mpress.contract.plan import LAYER_DATA_PREFIXES, Plan, StagePlan, hardware_fingerprint
from mpress.config.units import fmt_bytes
from mpress.config.vocabulary import OptimizerStep, ScheduleName, Technique

RUNS_AS = {ScheduleName.PIPEDREAM: ScheduleName.ONE_F_ONE_B}
"""Planned schedules torch's pipelining runs as another: PipeDream's asynchronous 1F1B
runs as synchronous 1F1B (same order, no weight stashing)."""

_LISTED = 8
"""Names a message lists before it says how many more there are."""


@dataclass(frozen=True)
class Shape:
    """A pipeline's shape: what a plan's microbatch selectors and action lists refer to."""

    schedule: ScheduleName
    num_stages: int
    num_microbatches: int
    microbatch_size: int


def refusal(source: str, key: str, problem: str) -> PlanError:
    """The one-line error for a plan: `SOURCE: KEY: PROBLEM` (as `ConfigError` reads)."""
    return PlanError(f"{source}: {key}: {problem}")


# ---- what a plan keeps in host memory ----------------------------------------------

NVME_STAGING_BYTES = 8 << 20
"""Pinned staging buffer of a drive store, per direction (device -> file, file -> device):
large enough for sequential drive I/O, small beside the pools a large model's plan pins.
A power of two, so every drive's logical block size (a power of two, at most this)
divides it: the store pins exactly twice this, no more."""

PINNED, MEMORY = "pinned", "memory"
"""What `HostBytes.exceeds` names: the server's pinnable memory, or its host memory."""


def on_drive(sp: StagePlan) -> bool:
    """Whether stage `sp` keeps optimizer states on the local drive (it has `nvme` rules;
    a stage stepping on the host has none, `StagePlan` refuses them)."""
    return sp.optimizer_step is not OptimizerStep.HOST and any(r.technique is Technique.NVME for r in sp.rules)


def drive_staging_bytes(sp: StagePlan) -> int:
    """Pinned bytes of stage `sp`'s drive staging buffers: both directions' (0 without a drive)."""
    return 2 * NVME_STAGING_BYTES if on_drive(sp) else 0


@dataclass(frozen=True)
class HostBytes:
    """A plan's host memory in its parts (see the module docstring)."""

    pools: int
    slabs: int
    drive: int
    pageable: int

    @property
    def pinned(self) -> int:
        """What is page-locked: pools, host steps' slabs and drive staging."""
        return self.pools + self.slabs + self.drive

    @property
    def total(self) -> int:
        return self.pinned + self.pageable

    def times(self, n: int) -> HostBytes:
        """What `n` copies of the plan take (replicas of its pipeline on one server)."""
        return HostBytes(pools=n * self.pools, slabs=n * self.slabs, drive=n * self.drive, pageable=n * self.pageable)

    def exceeds(self, hardware: Hardware) -> str | None:
        """`PINNED` when the pinned parts exceed what `hardware` lets plans pin, else
        `MEMORY` when all parts exceed its host memory, else None (it holds them)."""
        if self.pinned > hardware.pinnable_bytes:
            return PINNED
        if self.total > hardware.host_memory_bytes:
            return MEMORY
        return None


def host_bytes(plan: Plan, host_step_bytes: Mapping[int, tuple[int, int]]) -> HostBytes:
    """The host memory of `plan`, given per stage stepping its optimizer on the host the
    (pinned, pageable) bytes of that step (the static side's figures from the profile)."""
    return HostBytes(pools=sum(sp.pinned_host_bytes for sp in plan.stages),
                     slabs=sum(p for p, _h in host_step_bytes.values()),
                     drive=sum(drive_staging_bytes(sp) for sp in plan.stages),
                     pageable=sum(h for _p, h in host_step_bytes.values()))


# ---- the check ---------------------------------------------------------------------

def check_plan(plan: Plan, *, source: str = "plan", model: ModelConfig | None = None,
               model_fingerprint: str | None = None, hardware: Hardware | None = None,
               shape: Shape | None = None, ranges: Sequence[tuple[int, int]] | None = None,
               world_size: int | None = None, num_layers: int | None = None,
               stage_layers: Mapping[int, Sequence[str]] | None = None,
               stage_tensors: Mapping[int, Sequence[str]] | None = None, runtime: bool = False,
               host_step_bytes: Mapping[int, tuple[int, int]] | None = None) -> None:
    """Refuse a plan that does not belong to what it is used with (one-line `PlanError`
    naming `source`, the plan's key and what is allowed).

    model / model_fingerprint: the plan must have been made for this model.
    hardware: same device count and topology; every device a stage, a stripe or a peer
        quota names exists, stripes and quotas only to NVLink neighbours of the stage's
        device; the pinned pools, with the drive's staging buffers, fit what the host
        can pin, each device's peer pools (and the quotas exporters hold in it) its
        usable memory.
    host_step_bytes: with `hardware`, per stage whose optimizer steps on the host, the
        (pinned, pageable) host bytes its step keeps (staging buffers apart from the
        pool; fp32 copies and Adam states): with the pools and the drive's staging, the
        pinned ones must fit what the hardware can pin, and all of them its host memory
        (`host_bytes`, the sum the planner uses too).
    shape: the pipeline's schedule, stage count, microbatch count and size (at run time
        a PipeDream plan runs as 1F1B). ranges: each stage's layer range [start, end).
    world_size: the ranks of the job; each rank's stages on one device of its own.
    num_layers: the model's layer count (the last stage must end there).
    stage_layers / stage_tensors: per stage (of those the caller has), its layer names and
        saved-tensor ids; every rule must name something the stage has (model-data rules
        are checked where layer names are given, others where tensor ids are), and a
        stage must hold as many layers as the plan gives it.
    runtime: the plan is about to run on torch's pipelining: rules that need weight
        stashing (`stash:`) are refused, as its schedules are synchronous, and so are
        `param:`/`grad:` host rules under a schedule that stashes weights or splits the
        backward (`mpress/static/plan/layer_data.py`).
    """
    if model is not None:
        model_fingerprint = model.fingerprint()
        # the same model in another precision (its fingerprint differs too): say which
        precision = getattr(model, "precision", None)  # a preset's, a module's parameters' ("bf16+fp32": mixed)
        if (plan.dtype is not None and plan.model == model.name and precision in ("fp32", "bf16", "fp16")
                and precision != plan.dtype):
            raise refusal(source, "dtype", f"made for {plan.model!r} in {plan.dtype}, but this model trains in "
                                           f"{precision}; train it in {plan.dtype} (an HF model: dtype: "
                                           f"{plan.dtype}) or plan again in {precision}")
    if model_fingerprint is not None and plan.model_fingerprint != model_fingerprint:
        name = f"{model.name!r}" if model is not None else "this one"
        raise refusal(source, "model_fingerprint", f"made for model {plan.model!r}, not {name} (fingerprints differ: "
                                                   f"the plan's {plan.model_fingerprint}, this model's "
                                                   f"{model_fingerprint}); plan again for this model")
    if isinstance(model, ModelConfig) and plan.model != model.name:  # a preset or model YAML: it names itself
        raise refusal(source, "model", f"made for {plan.model!r}, but this model is {model.name!r} (a fingerprint "
                                       f"leaves out the name: the plan's {plan.model_fingerprint} is that of "
                                       f"{model.name!r}); plan again for {model.name!r}")
    if shape is not None:
        _check_shape(plan, source, shape, runtime)
    if world_size is not None:
        _check_ranks(plan, source, world_size)
    if num_layers is not None and plan.stages[-1].end_layer != num_layers:
        last = plan.num_stages - 1
        raise refusal(source, f"stages[{last}].end_layer", f"must be {num_layers}: the last stage ends at the "
                                                           f"model's last layer (the model has {num_layers} layers)")
    if hardware is not None:
        if plan.hardware_fingerprint != hardware_fingerprint(hardware):
            raise refusal(source, "hardware_fingerprint",
                          f"made for hardware {plan.hardware!r} ({plan.num_devices} devices of "
                          f"{fmt_bytes(plan.device_memory_bytes)}), not this {hardware.name!r} ({hardware.num_devices} "
                          f"devices of {fmt_bytes(hardware.device.memory_bytes)}; device count, memory or topology "
                          "differ): plan again for this hardware")
        if plan.hardware != hardware.name:
            raise refusal(source, "hardware", f"made for {plan.hardware!r}, not {hardware.name!r} (whose fingerprint "
                                              f"the plan carries); plan again for {hardware.name!r}")
        _check_devices(plan, source, hardware)
        _check_pools(plan, source, hardware)
        _check_host(plan, source, hardware, host_step_bytes or {})
    if ranges is not None:
        for sp, (start, end) in zip(plan.stages, ranges):
            if (sp.first_layer, sp.end_layer) != (start, end):
                raise refusal(source, f"stages[{sp.stage}].{'first_layer' if sp.first_layer != start else 'end_layer'}",
                              f"stage {sp.stage} holds layers {sp.first_layer}..{sp.end_layer - 1} in the plan but "
                              f"{start}..{end - 1} in this partition")
    if stage_layers is not None or stage_tensors is not None:
        _check_names(plan, source, stage_tensors or {}, stage_layers or {})
    if runtime:
        _check_executable(plan, source)


def _check_shape(plan: Plan, source: str, shape: Shape, runtime: bool) -> None:
    schedule = RUNS_AS.get(plan.schedule, plan.schedule) if runtime else plan.schedule
    fields = {"schedule": (schedule, shape.schedule), "num_stages": (plan.num_stages, shape.num_stages),
              "num_microbatches": (plan.num_microbatches, shape.num_microbatches),
              "microbatch_size": (plan.microbatch_size, shape.microbatch_size)}
    for key, (planned, given) in fields.items():
        if planned != given:
            raise refusal(source, key, f"made for {plan.schedule}, {plan.num_stages} stages, {plan.num_microbatches} "
                                       f"x {plan.microbatch_size} microbatches; this pipeline is {shape.schedule}, "
                                       f"{shape.num_stages} stages, {shape.num_microbatches} x {shape.microbatch_size}")


def _check_ranks(plan: Plan, source: str, world_size: int) -> None:
    """The job's ranks: as many as the plan's, each rank's stages on one device, no
    device shared by two ranks (a rank trains on one device, and no two on one GPU)."""
    if plan.num_ranks != world_size:
        raise refusal(source, "num_ranks", f"made for {plan.num_ranks} ranks, this job has {world_size}")
    owner: dict[int, int] = {}
    for s, device in enumerate(plan.stage_to_device):
        rank = plan.rank_of_stage(s)
        first = plan.stage_to_device[rank]
        if device != first:
            raise refusal(source, f"stage_to_device[{s}]", f"must be {first}: stage {s} runs on rank {rank}, whose "
                                                           f"stage {rank} is on device {first} (a rank has one device)")
        if owner.setdefault(device, rank) != rank:
            raise refusal(source, f"stage_to_device[{s}]", f"device {device} is rank {owner[device]}'s already "
                                                           f"(stage {s} runs on rank {rank}); one rank per device")


def _listing(names: Sequence[object]) -> str:
    shown = ", ".join(str(n) for n in names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "") if names else "none"


def _neighbours(hardware: Hardware, device: int) -> str:
    return _listing([e for e in range(hardware.num_devices) if e != device and hardware.links(device, e)])


def _check_devices(plan: Plan, source: str, hardware: Hardware) -> None:
    """Every device the plan names exists; stripes and quotas go to NVLink neighbours."""
    n = hardware.num_devices
    for s, d in enumerate(plan.stage_to_device):
        if not 0 <= d < n:
            raise refusal(source, f"stage_to_device[{s}]", f"stage {s} is mapped to device {d}; {hardware.name} has "
                                                           f"devices 0..{n - 1}")
    for sp in plan.stages:
        for r, rule in enumerate(sp.rules):
            for k, stripe in enumerate(rule.stripes):
                _require_neighbour(source, f"stages[{sp.stage}].rules[{r}].stripes[{k}].device", hardware, sp.device,
                                   stripe.device, f"stage {sp.stage} rule {r} ({rule.tensor}) stripes to")
        for k, quota in enumerate(sp.peer_quotas):
            _require_neighbour(source, f"stages[{sp.stage}].peer_quotas[{k}].device", hardware, sp.device,
                               quota.device, f"stage {sp.stage} holds a quota on")


def _require_neighbour(source: str, key: str, hardware: Hardware, device: int, peer: int, what: str) -> None:
    """Refuse (naming `key`) a peer device that does not exist or has no NVLink to `device`."""
    if not 0 <= peer < hardware.num_devices or hardware.links(device, peer) == 0:
        raise refusal(source, key, f"{what} device {peer}, which is not an NVLink neighbour of device {device} "
                                   f"(its neighbours on {hardware.name}: {_neighbours(hardware, device)})")


def _check_pools(plan: Plan, source: str, hardware: Hardware) -> None:
    """Pinned pools within the host memory; per device, its peer pools and, apart, the
    quotas exporters hold in it (an idle device's pool is their sum) within its usable
    memory."""
    host = sum(sp.pinned_host_bytes for sp in plan.stages)
    if host > hardware.pinnable_bytes:
        big = max(plan.stages, key=lambda sp: sp.pinned_host_bytes)
        raise refusal(source, f"stages[{big.stage}].pinned_host_bytes",
                      f"pinned host pools need {fmt_bytes(host)} ({fmt_bytes(big.pinned_host_bytes)} for stage "
                      f"{big.stage}); {hardware.name} can pin {fmt_bytes(hardware.pinnable_bytes)} of its "
                      f"{fmt_bytes(hardware.host_memory_bytes)} of host memory")
    usable = hardware.usable_memory_bytes
    allowed = (f"a {hardware.name} device has {fmt_bytes(usable)} usable "
               f"({fmt_bytes(hardware.device.memory_bytes)} less its reserve)")
    for d, nbytes in plan.peer_pool_bytes_by_device().items():
        if nbytes > usable:
            big = max((sp for sp in plan.stages if sp.device == d), key=lambda sp: sp.peer_pool_bytes)
            raise refusal(source, f"stages[{big.stage}].peer_pool_bytes",
                          f"device {d} peer pool of {fmt_bytes(nbytes)} exceeds its memory: {allowed}")
    quotas: dict[int, list[tuple[int, int, int]]] = {}
    for sp in plan.stages:
        for k, quota in enumerate(sp.peer_quotas):
            quotas.setdefault(quota.device, []).append((quota.quota_bytes, sp.stage, k))
    for d, held in quotas.items():
        total = sum(b for b, _s, _k in held)
        if total > usable:
            _b, s, k = max(held)
            raise refusal(source, f"stages[{s}].peer_quotas[{k}].quota_bytes",
                          f"quotas on device {d}'s peer pool total {fmt_bytes(total)}, more than its memory: {allowed}")


def _check_host(plan: Plan, source: str, hardware: Hardware,
                host_step_bytes: Mapping[int, tuple[int, int]]) -> None:
    """What is pinned apart from the pools (the host optimizer steps' slabs, the drive's
    staging buffers) and the host steps' pageable copies, with the pools, within the host
    (`host_bytes`; the pools alone are `_check_pools`')."""
    need = host_bytes(plan, host_step_bytes)
    exceeds = need.exceeds(hardware)
    if exceeds is None or not (need.slabs or need.drive or need.pageable):
        return
    if host_step_bytes:
        big = max(host_step_bytes, key=lambda s: sum(host_step_bytes[s]))
        key = f"stages[{big}].optimizer_step"
    else:  # the drive's staging buffers: the first nvme rule of the first stage with one
        sp = next(sp for sp in plan.stages if on_drive(sp))
        key = f"stages[{sp.stage}].rules[{next(r for r, x in enumerate(sp.rules) if x.technique is Technique.NVME)}]"
    if exceeds == PINNED:
        parts = [("the host optimizer steps' pinned staging buffers", need.slabs),
                 ("the drive's pinned staging buffers", need.drive), ("the pinned pools", need.pools)]
        listed = [f"{what} ({fmt_bytes(nbytes)})" for what, nbytes in parts if nbytes or what == "the pinned pools"]
        raise refusal(source, key, f"{', '.join(listed[:-1])} and {listed[-1]} need {fmt_bytes(need.pinned)}; "
                                   f"{hardware.name} can pin {fmt_bytes(hardware.pinnable_bytes)}")
    raise refusal(source, key, f"the host optimizer steps keep {fmt_bytes(need.pageable)} of fp32 copies and Adam "
                               f"states and {fmt_bytes(need.slabs + need.drive)} of pinned staging, the pools pin "
                               f"{fmt_bytes(need.pools)}: {fmt_bytes(need.total)} of "
                               f"{hardware.name}'s {fmt_bytes(hardware.host_memory_bytes)} of host memory")


def _check_names(plan: Plan, source: str, stage_tensors: Mapping[int, Sequence[str]],
                 stage_layers: Mapping[int, Sequence[str]]) -> None:
    """Every rule of a stage the caller knows names something there, as `StageRules`
    reads rules: a saved tensor (activation rules, where tensor ids are given) or a layer's
    model data (`optim:`/`stash:` rules, where layer names are given)."""
    for sp in plan.stages:
        tensors = stage_tensors.get(sp.stage)
        layers = stage_layers.get(sp.stage)
        if layers is not None and len(layers) != sp.end_layer - sp.first_layer:
            raise refusal(source, f"stages[{sp.stage}].end_layer",
                          f"stage {sp.stage} holds layers {sp.first_layer}..{sp.end_layer - 1} in the plan, the stage "
                          f"module holds {len(layers)} layers ({_listing(layers)})")
        rules = StageRules(sp, [])
        named: set[int] = set()
        for t in tensors or ():
            named.update(rules.candidates(t))
        for layer in layers or ():
            for kind in MODEL_DATA_KINDS:
                named.update(rules.candidates(f"{kind}:{layer}"))
        for r, rule in enumerate(sp.rules):
            if r in named:
                continue
            model_data = rule.tensor.partition(":")[0] in MODEL_DATA_KINDS
            if model_data and layers is not None:
                raise refusal(source, f"stages[{sp.stage}].rules[{r}].tensor",
                              f"stage {sp.stage} rule {r} names {rule.tensor!r}, which the profile does not have in "
                              f"that stage: it matches none of its layers {_listing(layers)} (optim:LAYER, "
                              "stash:LAYER, param:LAYER, grad:LAYER, or a glob such as optim:*)")
            if not model_data and tensors is not None:
                where = f"layers {_listing(layers)}" if layers is not None else \
                    f"modules {_listing(sorted({t.split('#', 1)[0] for t in tensors}))}"
                example = f", e.g. {tensors[0]} or {(layers or [tensors[0].split('#', 1)[0]])[0]}.**" if tensors else ""
                raise refusal(source, f"stages[{sp.stage}].rules[{r}].tensor",
                              f"stage {sp.stage} rule {r} names {rule.tensor!r}, which the profile does not have in "
                              f"that stage: it matches no tensor saved in its {where} (MODULE#INDEX or "
                              f"LAYER.**{example})")


def _check_executable(plan: Plan, source: str) -> None:
    for sp in plan.stages:
        for r, rule in enumerate(sp.rules):
            if rule.tensor.startswith(LAYER_DATA_PREFIXES) and rule.technique is Technique.HOST:
                # the runtime carries the scheme out (`mpress/runtime/layer_data`) where the
                # static half lists it: not with weight stashing or a split backward
                split = next((a for rank in range(plan.num_ranks) for a in plan.program(rank) if a.kind is Kind.W),
                             None)
                if plan.schedule is ScheduleName.PIPEDREAM or split is not None:
                    why = "keeps parameter versions on the device" if split is None else \
                        f"splits the backward ({split}), which would fetch and drain them twice"
                    raise refusal(source, f"stages[{sp.stage}].rules[{r}].tensor",
                                  f"stage {sp.stage} rule {r} ({rule.tensor}) keeps a layer's working parameters or "
                                  f"gradients on the host, which the runtime does not run under {plan.schedule}, "
                                  f"whose schedule {why} (use 1f1b or gpipe)")
            if rule.tensor.startswith("stash:"):
                raise refusal(source, f"stages[{sp.stage}].rules[{r}].tensor",
                              f"stage {sp.stage} rule {r} ({rule.tensor}) moves stashed weight versions, which only "
                              "PipeDream's asynchronous schedule keeps; torch's pipelining runs synchronously, so "
                              "this rule cannot run (plan for 1f1b instead)")
