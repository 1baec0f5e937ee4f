"""What the launcher decides before training: the plan (from a file, or made on rank 0
for `plan: auto`), the hardware it is for, and the device each rank trains on.

Planning at start-up is the launcher's only use of the static half.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from mpress.d2d.static.topology import compare_topology, detect_local_hardware
from mpress.errors import PlanError, TopologyError, UserError
from mpress.hardware import Hardware, load_hardware
from mpress.model_config import ModelConfig
from mpress.plan import Plan
from mpress.runtime.train_config import HARDWARE_DETECT, TrainConfig
from mpress.static.evaluate import setup_pipeline
from mpress.static.planner import PlannerOptions, check_fits_at_all, plan_strategy
from mpress.vocabulary import ScheduleName


def plan_for(cfg: TrainConfig, model: ModelConfig, num_stages: int,
             world: int) -> tuple[Plan | None, list[tuple[int, int]]]:
    """The plan (None for `plan: none`) and the stage layer ranges; rank 0 only."""
    cuda = dist.is_initialized() and dist.get_backend() == "nccl"
    if cfg.plan not in ("auto", "none"):
        plan = Plan.load(cfg.plan)
        if cuda:
            check_topology(load_hardware(plan.hardware, num_devices=plan.num_devices,
                                         memory_bytes=plan.device_memory_bytes))
        return plan, [(sp.first_layer, sp.end_layer) for sp in plan.stages]
    hardware = hardware_for(cfg, world, cuda)
    setup = setup_pipeline(model, hardware, schedule=cfg.schedule, num_stages=num_stages,  # type: ignore[arg-type]
                           num_ranks=world if cfg.schedule is ScheduleName.INTERLEAVED else None,
                           microbatch_size=cfg.microbatch_size, num_microbatches=cfg.num_microbatches)
    if cfg.plan == "none":
        return None, setup.ranges
    check_fits_at_all(setup)
    result = plan_strategy(setup, cfg.strategy, PlannerOptions())
    if not result.fits:
        raise UserError(f"plan: auto: {model.name} does not fit {hardware.name}: {result.reason}")
    return result.plan, setup.ranges


def hardware_for(cfg: TrainConfig, world: int, cuda: bool) -> Hardware:
    """What `plan: auto` plans for: the config's preset (its device count and memory as
    the run has them), checked against this machine's GPUs on CUDA; or, with `hardware:
    detect`, the GPUs pynvml finds."""
    if cfg.hardware == HARDWARE_DETECT:
        topology, why = detect_local_hardware()
        if topology is None:
            raise TopologyError(f"hardware: detect: {why}")
        hardware = topology.hardware
        if cfg.device_memory_bytes is not None:
            hardware = dataclasses.replace(hardware, device=dataclasses.replace(
                hardware.device, memory_bytes=cfg.device_memory_bytes))
        return hardware
    hardware = load_hardware(cfg.hardware, num_devices=world, memory_bytes=cfg.device_memory_bytes)
    if cuda:
        check_topology(hardware)
    return hardware


def check_topology(expected: Hardware, *, nvml: object = None) -> None:
    """Refuse to train when this machine's GPUs are not linked as `expected` says (a plan
    for another topology would stripe over links that do not exist). A subset of the
    machine's GPUs may be used: a larger machine is not a mismatch. `nvml` replaces the
    pynvml module (tests)."""
    topology, why = detect_local_hardware(nvml=nvml)
    if topology is None:
        raise TopologyError(f"cannot check the topology of {expected.name} against this machine: {why}")
    problems = [p for p in compare_topology(expected, topology.hardware)
                if not (p.startswith("device count") and expected.num_devices < topology.hardware.num_devices)]
    if problems:
        raise TopologyError(f"the plan's hardware {expected.name} does not match this machine: {'; '.join(problems)}")


def rank_device(plan: Plan | None, rank: int, world: int, cuda: bool) -> torch.device:
    """The device this rank trains on: on CUDA the plan's stage-to-device map decides
    (without a plan: LOCAL_RANK); gloo ranks all use the CPU."""
    if not cuda:
        return torch.device("cpu")
    if plan is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    devices = {plan.stage_to_device[s] for s in range(rank, plan.num_stages, world)}
    if len(devices) != 1:
        raise PlanError(f"plan puts the stages of rank {rank} on devices {sorted(devices)}; a rank has one device")
    index = devices.pop()
    if index >= torch.cuda.device_count():
        raise PlanError(f"plan maps rank {rank} to GPU {index}, this process sees {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def pool_override(variable: str) -> int | None:
    """$MPRESS_HOST_POOL_BYTES (pinned pool per stage) or $MPRESS_PEER_POOL_BYTES (peer
    pool per importer device) instead of the plan's, for sizing experiments and fault
    tests; unset = the plan's."""
    value = os.environ.get(variable)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{variable}: expected a whole number of bytes, got {value!r}") from None
