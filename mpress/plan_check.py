"""The one check of a plan against what it is used with, for both halves.

Each caller passes what it knows and gets a one-line `PlanError` when the plan does not
belong to it:

- `mpress emulate PLAN` and the planner: the model, the hardware, the pipeline's shape and
  layer ranges, and the profile's layer names and saved-tensor ids per stage;
- the runtime (`wrap_stage`, `PipelineJob`): the model's fingerprint, the job's shape
  and world size, the layers of the stages it builds, and `runtime=True`, which also
  refuses what torch's pipelining cannot execute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mpress.errors import PlanError
from mpress.hardware import Hardware
from mpress.model_config import ModelConfig
from mpress.plan import Plan, hardware_fingerprint, pattern_matches
from mpress.vocabulary import ScheduleName

RUNS_AS = {ScheduleName.PIPEDREAM: ScheduleName.ONE_F_ONE_B}
"""Planned schedules torch's pipelining runs as another: PipeDream's asynchronous 1F1B
runs as synchronous 1F1B (same order, no weight stashing)."""


@dataclass(frozen=True)
class Shape:
    """A pipeline's shape: what a plan's microbatch selectors and action lists refer to."""

    schedule: ScheduleName
    num_stages: int
    num_microbatches: int
    microbatch_size: int


def check_plan(plan: Plan, *, source: str = "plan", model: ModelConfig | None = None,
               model_fingerprint: str | None = None, hardware: Hardware | None = None,
               shape: Shape | None = None, ranges: Sequence[tuple[int, int]] | None = None,
               world_size: int | None = None, stage_layers: Mapping[int, Sequence[str]] | None = None,
               stage_tensors: Mapping[int, Sequence[str]] | None = None, runtime: bool = False) -> None:
    """Refuse a plan that does not belong to what it is used with (one-line `PlanError`).

    model / model_fingerprint: the plan must have been made for this model.
    hardware: same device count and topology; stripes only to NVLink neighbours; pinned
        pools within host memory, peer pools within device memory.
    shape: the pipeline's schedule, stage count, microbatch count and size (at run time
        a PipeDream plan runs as 1F1B). ranges: each stage's layer range [start, end).
    world_size: the ranks of the job.
    stage_layers / stage_tensors: per stage (of those the caller has), its layer names and
        saved-tensor ids; every rule must name something the stage has, and a stage must
        hold as many layers as the plan gives it.
    runtime: the plan is about to run on torch's pipelining: rules that need weight
        stashing (`stash:`) are refused, as its schedules are synchronous.
    """
    if model is not None:
        model_fingerprint = model.fingerprint()
    if model_fingerprint is not None and plan.model_fingerprint != model_fingerprint:
        name = f"{model.name!r}" if model is not None else f"this one (fingerprint {model_fingerprint})"
        raise PlanError(f"{source}: made for model {plan.model!r}, not {name} (fingerprints differ)")
    if hardware is not None:
        if plan.hardware_fingerprint != hardware_fingerprint(hardware):
            raise PlanError(f"{source}: made for hardware {plan.hardware!r}, not {hardware.name!r} "
                            "(device count, memory or topology differ)")
        _check_devices(plan, source, hardware)
    if shape is not None:
        _check_shape(plan, source, shape, runtime)
    if world_size is not None and plan.num_ranks != world_size:
        raise PlanError(f"{source}: made for {plan.num_ranks} ranks, this job has {world_size}")
    if ranges is not None:
        for sp, (start, end) in zip(plan.stages, ranges):
            if (sp.first_layer, sp.end_layer) != (start, end):
                raise PlanError(f"{source}: stage {sp.stage} holds layers {sp.first_layer}..{sp.end_layer - 1} in "
                                f"the plan but {start}..{end - 1} in this partition")
    if stage_layers is not None or stage_tensors is not None:
        _check_names(plan, source, stage_tensors or {}, stage_layers or {})
    if runtime:
        _check_executable(plan, source)


def _check_shape(plan: Plan, source: str, shape: Shape, runtime: bool) -> None:
    schedule = RUNS_AS.get(plan.schedule, plan.schedule) if runtime else plan.schedule
    planned = (schedule, plan.num_stages, plan.num_microbatches, plan.microbatch_size)
    if planned != (shape.schedule, shape.num_stages, shape.num_microbatches, shape.microbatch_size):
        raise PlanError(f"{source}: made for {plan.schedule}, {plan.num_stages} stages, {plan.num_microbatches} x "
                        f"{plan.microbatch_size} microbatches; this pipeline is {shape.schedule}, {shape.num_stages} "
                        f"stages, {shape.num_microbatches} x {shape.microbatch_size}")


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


def _check_names(plan: Plan, source: str, stage_tensors: Mapping[int, Sequence[str]],
                 stage_layers: Mapping[int, Sequence[str]]) -> None:
    for sp in plan.stages:
        tensors = stage_tensors.get(sp.stage)
        layers = stage_layers.get(sp.stage)
        if layers is not None and len(layers) != sp.end_layer - sp.first_layer:
            raise PlanError(f"{source}: stage {sp.stage} holds layers {sp.first_layer}..{sp.end_layer - 1} in the "
                            f"plan, the stage module holds {len(layers)} layers ({', '.join(layers) or 'none'})")
        for r, rule in enumerate(sp.rules):
            kind, _, rest = rule.tensor.partition(":")
            if rest and kind in ("optim", "stash"):
                names = None if layers is None else [f"{kind}:{x}" for x in layers]
            else:
                names = tensors
            if names is not None and not any(pattern_matches(rule.tensor, t) for t in names):
                raise PlanError(f"{source}: stage {sp.stage} rule {r} names {rule.tensor!r}, "
                                "which the profile does not have in that stage")


def _check_executable(plan: Plan, source: str) -> None:
    for sp in plan.stages:
        for r, rule in enumerate(sp.rules):
            if rule.tensor.startswith("stash:"):
                raise PlanError(f"{source}: stage {sp.stage} rule {r} ({rule.tensor}) moves stashed weight versions, "
                                "which only PipeDream's asynchronous schedule keeps; torch's pipelining runs "
                                "synchronously, so this rule cannot run (plan for 1f1b instead)")
