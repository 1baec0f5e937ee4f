"""One call from a model, hardware and pipeline shape to an emulated iteration.

`setup_pipeline` does the pure steps every static tool needs (profile, partition,
schedule, per-stage costs and memory); `evaluate` adds lowering and emulation.
Used by `mpress emulate`, the benchmarks and the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mpress.contract.actions import Schedule
from mpress.contract.plan import fingerprint
from mpress.errors import ProfileError, UserError
from mpress.hardware.server import Hardware
from mpress.config.model_config import ModelConfig
from mpress.static.profile.analytic import analytic_profile
from mpress.static.memory.data_parallel import DataParallel, shard_profile
from mpress.static.emulate.emulator import EmulatorResult, emulate
from mpress.static.emulate.lowering import TensorInfo, build_program
from mpress.static.memory.model import StageMemory, default_stage_to_device, memory_model
from mpress.static.memory.stage_costs import StageCosts, stage_costs
from mpress.static.plan.partition import partition_profile
from mpress.static.profile.profile import Profile
from mpress.static.emulate.program import Program
from mpress.static.schedules import build_schedule
from mpress.config.vocabulary import ScheduleName



@dataclass(frozen=True, kw_only=True)
class PipelineSetup:
    """A model laid out on a pipeline: everything before any memory decision."""

    model: ModelConfig
    hardware: Hardware
    profile: Profile
    microbatch_size: int
    ranges: list[tuple[int, int]]
    """Layer range [start, end) of each stage."""
    schedule: Schedule
    stage_to_device: list[int]
    costs: list[StageCosts]
    memory: list[StageMemory]
    data_parallel: DataParallel | None = None
    """Replicas of this pipeline on other nodes (None: one server); `profile`, `costs`
    and `memory` are then one device's, sharded states included."""


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """A pipeline setup with its emulated iteration."""

    setup: PipelineSetup
    schedule: Schedule
    """The action lists emulated (with a plan: its program, `Plan.actions`)."""
    program: Program
    result: EmulatorResult
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    """What the memory actions of `schedule` move (the rewriter's)."""
    peer_quotas: list[dict[int, int]] = field(default_factory=list)
    """Per stage, per peer device: the quota its D2D data needs under `schedule`
    (`mpress.d2d.static.pool_slots.quota_need`, what the runtime's quotas allocate by)."""


def setup_pipeline(model: ModelConfig, hardware: Hardware, *, schedule: ScheduleName, num_stages: int,
                   microbatch_size: int, num_microbatches: int, num_ranks: int | None = None,
                   profile: Profile | None = None, balance: Literal["compute", "memory"] = "compute",
                   stage_to_device: list[int] | None = None,
                   ranges: list[tuple[int, int]] | None = None, profile_path: str = "profile",
                   data_parallel: DataParallel | None = None) -> PipelineSetup:
    """Profile (analytic unless given), partition (unless `ranges` gives each stage's layer
    range, e.g. a plan's), schedule and size a pipeline. `profile_path`: where a given
    profile came from, named when it does not fit the model or the microbatch size.
    data_parallel: the pipeline is replicated across nodes; stages are partitioned on
    the whole profile, then sized on one device's (`data_parallel.shard_profile`)."""
    if microbatch_size < 1:
        raise UserError(f"--microbatch-size must be >= 1, got {microbatch_size}")
    if profile is None:
        profile = analytic_profile(model, hardware, microbatch_size)
    else:
        profile.check_model(model, profile_path)
        if profile.microbatch_size != microbatch_size:
            raise ProfileError(f"{profile_path}: profile was measured with microbatch size {profile.microbatch_size}, "
                               f"not {microbatch_size}")
    sched = build_schedule(schedule, num_stages, num_microbatches, num_ranks=num_ranks)
    if sched.num_ranks > hardware.num_devices:
        raise UserError(
            f"{sched.num_ranks} pipeline ranks need {sched.num_ranks} devices, "
            f"but hardware {hardware.name} has {hardware.num_devices}")
    if ranges is None:
        ranges = partition_profile(profile, num_stages, balance)
    elif len(ranges) != num_stages:
        raise UserError(f"{len(ranges)} layer ranges for {num_stages} stages")
    devices = stage_to_device or default_stage_to_device(sched, hardware)
    if data_parallel is not None:
        profile = shard_profile(profile, data_parallel)
    costs = stage_costs(profile, ranges)
    return PipelineSetup(
        model=model, hardware=hardware, profile=profile, microbatch_size=microbatch_size, ranges=ranges,
        schedule=sched, stage_to_device=devices, costs=costs,
        memory=memory_model(costs, sched, hardware, devices, data_parallel), data_parallel=data_parallel,
    )


def evaluate(setup: PipelineSetup, schedule: Schedule | None = None, *,
             tensors: dict[str, TensorInfo] | None = None) -> Evaluation:
    """Emulate one iteration of `schedule` (default: the setup's, without memory actions)."""
    program = build_program(
        setup.profile, setup.ranges, schedule or setup.schedule, setup.hardware,
        microbatch_size=setup.microbatch_size, stage_to_device=setup.stage_to_device,
        tensors=tensors, data_parallel=setup.data_parallel,
    )
    return Evaluation(setup=setup, schedule=schedule or setup.schedule, program=program, result=emulate(program))


def profile_fingerprint(setup: PipelineSetup) -> str:
    """Hash of the profile's layers and costs (what a plan was computed from)."""
    p = setup.profile
    return fingerprint([p.model_fingerprint, p.source, p.microbatch_size,
                        [(x.name, x.forward_time_s, x.backward_time_s, x.saved_bytes, x.param_bytes) for x in p.layers]])
