"""What the launcher decides before training: the plan (from a file, or made on rank 0
for `plan: auto`), the hardware it is for, and the device each rank trains on.

Planning at start-up is the launcher's only use of the static half. Rank 0 says each
phase of it as it starts (`say`: `mpress.ui.phase_line`): a plan file is read and checked
(no planning), `plan: auto` profiles the model and plans it (news of the planner's
rounds at most every `PLAN_NEWS_EVERY_S`), `plan: none` profiles it for the split only.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mpress.hardware.cluster import NodeReplicas, replica_devices
from mpress.d2d.static.topology import compare_topology, detect_local_hardware
from mpress.errors import PlanError, TopologyError, UserError
from mpress.hardware.server import Hardware, load_hardware
from mpress.launcher.devices import cuda_bus_ids, cuda_index_of
from mpress.config.model_config import ModelConfig
from mpress.models.user import UserModel
from mpress.contract.plan import Plan
from mpress.contract.plan_check import PINNED, Shape, check_plan, refusal
from mpress.runtime.layer_data.host_layers import refuse_unrun
from mpress.runtime.train_config import HARDWARE_DETECT, TrainConfig
from mpress.static.profile.analytic import analytic_profile
from mpress.static.memory.data_parallel import DataParallel, replicas_of
from mpress.static.plan.evaluate import PipelineSetup, evaluate, setup_pipeline
from mpress.static.profile.fake_profile import fake_profile
from mpress.static.plan.plan_eval import check_plan_for_setup, complete_plan
from mpress.static.profile.profile import Profile
from mpress.static.plan.balance_choice import check_fits_at_all
from mpress.static.plan.planner import PlannerOptions, plan_strategy
from mpress.static.plan.planner_layer_data import plan_host_bytes
from mpress.config.units import fmt_bytes
from mpress.config.vocabulary import Technique


PLAN_NEWS_EVERY_S = 10.0
"""Least time between two lines of the planner's news while rank 0 plans (`plan: auto`)."""

Say = Callable[[str], None]
"""Where rank 0's start-up lines go (`mpress.ui.phase_line`)."""


def _quiet(_line: str) -> None:
    pass


@dataclass(frozen=True)
class StartPlan:
    """What rank 0 decides before training and broadcasts."""

    plan: Plan | None
    """None for `plan: none`."""
    ranges: list[tuple[int, int]]
    """Layer range [start, end) of each stage."""
    predicted_peak_bytes: list[int]
    """Per rank: the emulator's peak of its device in one iteration of the same program
    (plain pipelining for `plan: none`), for the predicted-vs-measured report."""
    device_bus_ids: list[str] | None = None
    """The PCI bus id of each of the plan's devices: the CUDA devices rank 0 saw, in CUDA
    order (the plan's device d is its cuda:d); None on CPU runs."""
    replica_devices: tuple[tuple[int, ...], ...] | None = None
    """With several replicas per node: per replica slot on a node, the node's device
    (rank 0's CUDA index) of each of the plan's devices (`replica_devices_for`); None on
    CPU runs and with one replica per node."""
    model_flops_per_microbatch: float | None = None
    """The profile's matrix-product FLOPs of one microbatch's forward and backward through
    every layer (no recompute): the numerator of the model FLOP utilisation."""
    peak_flops_per_device: float | None = None
    """The hardware preset's nominal peak FLOP/s of one device for the model's dtype
    (None: the preset names none for it)."""


def plan_for(cfg: TrainConfig, model: ModelConfig | UserModel, num_stages: int, world: int, *,
             say: Say = _quiet) -> StartPlan:
    """The plan, the stage layer ranges and the predicted peaks; rank 0 only. A plan file
    without a program gets the one its rules make (the rewriter's, as the planner would),
    and its pinned pools the size that program needs where the file gives none. `say`
    gets a line as each phase starts."""
    cuda = dist.is_initialized() and dist.get_backend() == "nccl"
    bus_ids = cuda_bus_ids() if cuda else None
    start, setup = _plan_of(cfg, model, num_stages, world, cuda, say)
    maps = replica_devices_for(start.plan, world, replicas_per_node(world), setup=setup) if cuda else None
    return dataclasses.replace(start, device_bus_ids=bus_ids, replica_devices=maps, **model_flops(setup))


def replicas_per_node(pp_world: int) -> int:
    """How many replicas of a `pp_world`-rank pipeline this node runs: its ranks
    (LOCAL_WORLD_SIZE, as torchrun and `mpress train` set it; one replica without it) over
    the pipeline's (`mpress train` checks before launching that they divide)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or pp_world) // pp_world)


def replica_devices_for(plan: Plan | None, pp_world: int, per_node: int, *, setup: PipelineSetup | None = None,
                        nvml: object = None) -> tuple[tuple[int, ...], ...] | None:
    """Where each of `per_node` replicas on a GPU node trains (`StartPlan.replica_devices`):
    the node's GPUs as this process's CUDA sees them (linked as NVML reports), split by
    `mpress.hardware.cluster.replica_devices` -- replica 0 on the plan's devices, every
    other replica on GPUs of its own linked alike. None for one replica per node. A
    one-line `UserError` when the node cannot hold them, when the replicas together keep
    more on the host than `setup` (the pipeline the plan was checked against: its
    hardware and profile costs) allows -- each pins what the plan pins (its pools, its
    host optimizer steps' slabs, its drive's staging buffers: `plan_host_bytes`, the sum
    the plan check and the planner read) and keeps its host steps' pageable copies.
    Every one of the plan's devices is placed, those no stage runs on too, so a D2D
    plan's replicas each lend and borrow on GPUs of their own (the runtime maps the plan's
    peer numbers through the slot, `mpress.d2d.runtime.peer_store.peer_device`): where
    the node cannot hold that many, it is refused, never shared. The placement `setup`'s
    replicas were costed on (`_setup`, over the same devices) where it has one, else read
    here. Rank 0 only; `nvml` replaces the pynvml module (tests)."""
    if per_node == 1:
        return None
    if plan is not None and setup is not None:
        _check_replicas_host(plan, setup, per_node)
    local = setup.data_parallel.local if setup is not None and setup.data_parallel is not None else None
    if local is not None and local.per_node == per_node:  # the costing's answer: NVML is read once
        return local.devices
    return node_replicas_for(plan.num_devices if plan is not None else pp_world, per_node, nvml=nvml).devices


LINK_FIGURES = ("nvlink_gbps_per_link", "nvlink_efficiency", "nvlink_latency_s", "pcie_h2d_gbps", "pcie_d2h_gbps",
                "pcie_efficiency", "pcie_latency_s")
"""What `node_replicas_for` takes from the plan's hardware rather than from NVML."""


def node_replicas_for(plan_devices: int, per_node: int, *, hardware: Hardware | None = None,
                      nvml: object = None) -> NodeReplicas:
    """The `per_node` replicas of a plan over `plan_devices` GPUs on this node: the node's
    GPUs as this process's CUDA sees them, linked as NVML reports (with `hardware`, the
    plan's, its name -- whose network preset joins such nodes -- and its links' figures,
    `LINK_FIGURES`), and each replica's GPUs on it
    (`mpress.hardware.cluster.replica_devices`). What the ranks bind
    (`replica_devices_for`) and what the replicas' reduction is costed over
    (`data_parallel_for`) read this one answer. A one-line error when the node's GPUs
    cannot be read or cannot hold the replicas. `nvml` replaces the pynvml module (tests)."""
    topology, why = detect_local_hardware(nvml=nvml, visible_bus_ids=cuda_bus_ids())
    if topology is None:
        raise TopologyError(f"dp: cannot place {per_node} replicas on this node's GPUs: {why}")
    node = topology.hardware
    if hardware is not None:
        node = dataclasses.replace(node, name=hardware.name, **{key: getattr(hardware, key) for key in LINK_FIGURES})
    return NodeReplicas(node, replica_devices(node, plan_devices, per_node))


def _check_replicas_host(plan: Plan, setup: PipelineSetup, per_node: int) -> None:
    """Refuse (one line) `per_node` replicas of `plan` whose host memory together exceeds
    what `setup.hardware` may pin, or its host memory."""
    one = plan_host_bytes(plan, setup.costs)
    need, host = one.times(per_node), setup.hardware
    exceeds = need.exceeds(host)
    if exceeds is None:
        return
    parts = ", ".join(f"{what} {fmt_bytes(nbytes)}" for what, nbytes in
                      [("pools", one.pools), ("host optimizer steps' staging slabs", one.slabs),
                       ("drive staging buffers", one.drive)] if nbytes or what == "pools")
    if exceeds == PINNED:
        held = (f"pin {fmt_bytes(need.pinned)} of host memory ({per_node} x the plan's {fmt_bytes(one.pinned)}: "
                f"{parts}); {host.name} can pin {fmt_bytes(host.pinnable_bytes)}")
    else:
        held = (f"keep {fmt_bytes(need.total)} in host memory ({per_node} x the plan's {fmt_bytes(one.total)}: "
                f"{parts} pinned, {fmt_bytes(one.pageable)} of the host steps' fp32 copies and Adam states); "
                f"{host.name} has {fmt_bytes(host.host_memory_bytes)}")
    raise UserError(f"dp: {per_node} replicas per node {held}: run fewer replicas per node or plan for a share "
                    "of the host")


def model_flops(setup: PipelineSetup) -> dict[str, float | None]:
    """`StartPlan`'s FLOP figures from the pipeline's profile and hardware: the forward +
    backward FLOPs of one microbatch through every layer, and one device's peak FLOP/s for
    the model's precision (None where the preset has no figure for that dtype, e.g. a
    mixed-dtype module)."""
    flops = sum(layer.forward_flops + layer.backward_flops for layer in setup.profile.layers)
    try:
        peak: float | None = setup.hardware.peak_flops(setup.model.precision)
    except (UserError, KeyError):
        peak = None
    return {"model_flops_per_microbatch": float(flops) or None, "peak_flops_per_device": peak}


def _plan_of(cfg: TrainConfig, model: ModelConfig | UserModel, num_stages: int, world: int,
             cuda: bool, say: Say = _quiet) -> tuple[StartPlan, PipelineSetup]:
    if cfg.plan not in ("auto", "none"):
        say(f"plan {cfg.plan}: checking it against the job and emulating its program (no planning)")
        plan, setup = load_checked_plan(cfg, model, num_stages, world, cuda=cuda)
        try:
            plan, ev = complete_plan(setup, plan)  # written by hand: the program and pools its rules make
        except PlanError as exc:
            raise PlanError(f"{cfg.plan}: {exc}") from None
        return StartPlan(plan, [(sp.first_layer, sp.end_layer) for sp in plan.stages],
                         _rank_peaks(ev.result.peak_bytes, plan.stage_to_device, world)), setup
    hardware = hardware_for(cfg, world, cuda)
    how = "on fake tensors" if isinstance(model, UserModel) else "analytic"
    say(f"profiling {model.name} ({how}) for " + ("the stages' split (plan: none)" if cfg.plan == "none" else
                                                 f"planning on {hardware.name}"))
    setup = _setup(cfg, model, hardware, num_stages, world, profile=profile_for(cfg, model, hardware), cuda=cuda)
    if cfg.plan == "none":
        return StartPlan(None, setup.ranges,
                         _rank_peaks(evaluate(setup).result.peak_bytes, setup.stage_to_device, world)), setup
    check_fits_at_all(setup, cfg.strategy)
    say(f"planning {cfg.strategy} for {num_stages} stages on {hardware.name} (plan: auto)")
    result = plan_strategy(setup, cfg.strategy, PlannerOptions(), progress=_every(PLAN_NEWS_EVERY_S, say))
    if not result.fits:
        raise UserError(f"plan: auto: {model.name} does not fit {hardware.name}: {result.reason}")
    plan = result.plan
    source = f"plan: auto ({cfg.strategy})"
    _check_job(plan, cfg, model, num_stages, world, source=source)
    check_plan_for_setup(plan, setup, source=source)
    peaks = [0] * hardware.num_devices
    for sp in plan.stages:
        peaks[sp.device] = sp.predicted_peak_bytes  # the device's peak, as emulated when planning
    return StartPlan(plan, setup.ranges, _rank_peaks(peaks, plan.stage_to_device, world)), setup


def _every(seconds: float, say: Say) -> Say:
    """`say`, passing on a line only when `seconds` have gone by since the last one."""
    last = [time.monotonic()]

    def news(line: str) -> None:
        if time.monotonic() - last[0] >= seconds:
            last[0] = time.monotonic()
            say(f"planning: {line}")

    return news


def load_checked_plan(cfg: TrainConfig, model: ModelConfig | UserModel, num_stages: int, world: int, *,
                      cuda: bool = False) -> tuple[Plan, PipelineSetup]:
    """The plan file `cfg.plan`, checked before any rank trains under it, and the pipeline
    it lays out (its layer ranges on the hardware it names). Rank 0 only.

    Raises a one-line `UserError` (a `PlanError` naming the file and the plan's key where
    the plan is at fault) when it does not belong to the job -- another model, schedule,
    stage, rank or microbatch count, a rank's stages on two devices -- or to the model,
    the hardware or the profile: every device named must exist, every rule must name a
    layer or saved tensor of its stage, pools must fit the host and the devices
    (`mpress.contract.plan_check.check_plan`, the check `mpress emulate` makes too).
    """
    source = cfg.plan
    plan = Plan.load(source)
    _check_job(plan, cfg, model, num_stages, world, source=source)
    hardware = job_hardware(cfg, plan)
    check_plan(plan, source=source, hardware=hardware)  # the job's hardware, before anything is laid out on it
    if cuda:
        check_topology(hardware)
    profile = profile_for(cfg, model, hardware)
    check_plan(plan, source=source, num_layers=profile.num_layers)
    setup = _setup(cfg, model, hardware, num_stages, world, profile=profile,
                   ranges=[(sp.first_layer, sp.end_layer) for sp in plan.stages], cuda=cuda)
    check_plan_for_setup(plan, setup, source=source)
    return plan, setup


def job_hardware(cfg: TrainConfig, plan: Plan) -> Hardware:
    """The hardware a job under the plan file `plan` runs on, as the plan must describe
    it: the config's `hardware` (the CPU ranks' stand-in, or the GPUs' preset) with the
    plan's device count and memory; with `hardware: detect`, the plan's own (the GPUs'
    topology is checked against it, `check_topology`). The plan check compares the rest
    (`hardware_fingerprint`).

    The config's `device_memory` (on CPU, each rank's capacity) may exceed the plan's (a
    plan that fits less memory fits more: room for what the memory model leaves out),
    never fall short of it. A one-line `PlanError` naming the plan's key otherwise, or
    when the config's hardware cannot take the plan's device count."""
    if cfg.device_memory_bytes is not None and cfg.device_memory_bytes < plan.device_memory_bytes:
        raise refusal(cfg.plan, "device_memory_bytes",
                      f"made for {fmt_bytes(plan.device_memory_bytes)} per device; this job's devices have "
                      f"{fmt_bytes(cfg.device_memory_bytes)} (the config's device_memory): give at least the plan's, "
                      "or plan again for them")
    name = plan.hardware if cfg.hardware == HARDWARE_DETECT else cfg.hardware
    try:
        return load_hardware(name, num_devices=plan.num_devices, memory_bytes=plan.device_memory_bytes)
    except UserError as exc:
        raise refusal(cfg.plan, "hardware", f"made for {plan.hardware!r} ({plan.num_devices} devices); this job's "
                                            f"hardware is {cfg.hardware!r} (the config's hardware): {exc}") from None


def profile_for(cfg: TrainConfig, model: ModelConfig | UserModel, hardware: Hardware) -> Profile:
    """What the job's model costs per microbatch on `hardware`: a preset's analytic profile,
    or a user module's or HF model's profile on fake tensors (exact saved tensors and
    FLOPs, times from the hardware model; deterministic, so `plan: none` splits the layers
    as a plan made from `mpress profile --module/--hf-config ... --fake` does)."""
    if isinstance(model, UserModel):
        return fake_profile(model.factory(), model_name=model.spec, hardware=hardware, layers=model.layers,
                            fingerprint=model.fingerprint())
    return analytic_profile(model, hardware, cfg.microbatch_size)


def _check_job(plan: Plan, cfg: TrainConfig, model: ModelConfig | UserModel, num_stages: int, world: int, *,
               source: str) -> None:
    """The plan check with what the job knows: its model, schedule, stages, microbatches
    and ranks (the rest with the pipeline, `check_plan_for_setup`)."""
    check_plan(plan, source=source, model=model, world_size=world, runtime=True,
               shape=Shape(cfg.schedule, num_stages, cfg.num_microbatches, cfg.microbatch_size))
    refuse_unrun(plan, clipping=cfg.optimizer.clips, replicas=cfg.dp > 1, tied=False, source=source)
    for sp in plan.stages if cfg.nvme_dir is None else ():
        for i, rule in enumerate(sp.rules):
            if rule.technique is Technique.NVME:
                raise PlanError(f"{source}: stages[{sp.stage}].rules[{i}]: {rule.tensor} goes to nvme: set nvme_dir in "
                                "the training config (a directory on a local drive)")


def _setup(cfg: TrainConfig, model: ModelConfig | UserModel, hardware: Hardware, num_stages: int, world: int,
           ranges: list[tuple[int, int]] | None = None, profile: Profile | None = None, *,
           cuda: bool = False) -> PipelineSetup:
    """One replica's pipeline (`world`: its ranks), with the replicas' DDP reduction and
    buckets counted when the config has several (`data_parallel_for`; on CUDA, those
    sharing this node on its GPUs as `node_replicas_for` places them)."""
    per_node = replicas_per_node(world) if cuda and cfg.dp > 1 else 1
    local = node_replicas_for(hardware.num_devices, per_node, hardware=hardware) if per_node > 1 else None
    return setup_pipeline(model, hardware, schedule=cfg.schedule, num_stages=num_stages,  # type: ignore[arg-type]
                          num_ranks=world, profile=profile,
                          microbatch_size=cfg.microbatch_size, num_microbatches=cfg.num_microbatches, ranges=ranges,
                          data_parallel=data_parallel_for(cfg, hardware, local))


def data_parallel_for(cfg: TrainConfig, hardware: Hardware, local: NodeReplicas | None = None) -> DataParallel | None:
    """What the runtime replicates (`mpress.runtime.data_parallel`): `dp` replicas of the
    pipeline on `hardware`, `local.per_node` of them sharing each node (`local`; None: one
    per node), gradients reduced by DDP, over the node's links first
    (`mpress.static.emulate.dp_reduction`); the dp / per_node nodes joined by the network
    preset of the node's hardware (configs/clusters/). None for one replica. A
    `UserError` when the replicas span nodes whose hardware has no network preset."""
    if cfg.dp == 1:
        return None
    per_node = local.per_node if local is not None else 1
    if cfg.dp % per_node:
        raise UserError(f"dp: {cfg.dp} replicas cannot run {per_node} on each node (this node's ranks over the "
                        f"pipeline's): make dp a multiple of {per_node}, or run another number of ranks per node")
    try:
        return replicas_of(hardware, cfg.dp // per_node, local)
    except UserError as exc:
        raise UserError(f"dp: {exc}") from None


def _rank_peaks(device_peaks: list[int], stage_to_device: list[int], world: int) -> list[int]:
    """Per rank, the predicted peak of its device (stage r runs on rank r; interleaved:
    its first stage, and the rank's other stages share the device)."""
    return [device_peaks[stage_to_device[r]] for r in range(world)]


def hardware_for(cfg: TrainConfig, world: int, cuda: bool, *, nvml: object = None) -> Hardware:
    """What `plan: auto` plans for: the config's preset (its device count and memory as
    the run has them), checked against the GPUs this process sees on CUDA; or, with
    `hardware: detect`, the GPUs this process sees (its CUDA devices, in CUDA order, linked
    as pynvml reports them; every GPU NVML lists where CUDA sees none), never GPUs that
    CUDA_VISIBLE_DEVICES leaves to other jobs. With several replicas per node
    (`replicas_per_node`), replica 0's share of them: the first 1/replicas in CUDA order
    (the others' GPUs are placed alike by `replica_devices_for`, or refused).
    `nvml` replaces the pynvml module (tests)."""
    if cfg.hardware == HARDWARE_DETECT:
        visible = cuda_bus_ids()
        if visible is not None:
            visible = visible[:max(1, len(visible) // replicas_per_node(world))]
        topology, why = detect_local_hardware(nvml=nvml, visible_bus_ids=visible)
        if topology is None:
            raise TopologyError(f"hardware: detect: {why}")
        hardware = topology.hardware
        if cfg.device_memory_bytes is not None:
            hardware = dataclasses.replace(hardware, device=dataclasses.replace(
                hardware.device, memory_bytes=cfg.device_memory_bytes))
        return hardware
    hardware = load_hardware(cfg.hardware, num_devices=world, memory_bytes=cfg.device_memory_bytes)
    if cuda:
        check_topology(hardware, nvml=nvml)
    return hardware


def check_topology(expected: Hardware, *, nvml: object = None) -> None:
    """Refuse to train when the GPUs this process sees (its CUDA devices, in CUDA order:
    the plan's device d is cuda:d) are not linked as `expected` says (a plan for another
    topology would stripe over links that do not exist). A subset of them may be used: more
    GPUs than the plan's is not a mismatch. `nvml` replaces the pynvml module (tests)."""
    topology, why = detect_local_hardware(nvml=nvml, visible_bus_ids=cuda_bus_ids())
    if topology is None:
        raise TopologyError(f"cannot check the topology of {expected.name} against this machine: {why}")
    problems = [p for p in compare_topology(expected, topology.hardware)
                if not (p.startswith("device count") and expected.num_devices < topology.hardware.num_devices)]
    if problems:
        raise TopologyError(f"the plan's hardware {expected.name} does not match this machine: {'; '.join(problems)}")


def rank_device(plan: Plan | None, rank: int, world: int, cuda: bool, *,
                plan_bus_ids: list[str] | None = None,
                node_devices: tuple[int, ...] | None = None) -> torch.device:
    """The device this rank trains on: on CUDA the plan's stage-to-device map decides
    (without a plan: LOCAL_RANK); gloo ranks all use the CPU.

    node_devices (a slot of `StartPlan.replica_devices`): the node device of each of the
    plan's devices for this rank's replica (without a plan: of each rank); None: the
    plan's own.

    plan_bus_ids (`StartPlan.device_bus_ids`): the PCI bus id of each of the plan's
    devices. The rank takes the CUDA device with its device's bus id, whatever this
    process's CUDA numbers it; without them, the plan's number is taken as this process's
    CUDA index. A D2D plan addresses peer GPUs by CUDA index (the plan's numbers, through
    `node_devices` in a replica's slot), so there every rank must number them as rank 0 did.
    """
    if not cuda:
        return torch.device("cpu")
    if plan is None:
        return torch.device("cuda", node_devices[rank] if node_devices else int(os.environ.get("LOCAL_RANK", "0")))
    devices = {plan.stage_to_device[s] for s in range(rank, plan.num_stages, world)}
    if len(devices) != 1:
        raise PlanError(f"plan puts the stages of rank {rank} on devices {sorted(devices)}; a rank has one device")
    index = devices.pop()
    if node_devices is not None:
        index = node_devices[index]  # this replica's GPU for the plan's device
    if plan_bus_ids is None:
        if index >= torch.cuda.device_count():
            raise PlanError(f"plan maps rank {rank} to GPU {index}, this process sees {torch.cuda.device_count()} GPUs")
        return torch.device("cuda", index)
    if index >= len(plan_bus_ids):
        raise PlanError(f"plan maps rank {rank} to GPU {index}, rank 0 saw {len(plan_bus_ids)} GPUs when it planned")
    bus_id = plan_bus_ids[index]
    local = cuda_index_of(bus_id, cuda_bus_ids(), rank=rank, plan_device=index)
    if local != index and plan.uses_peer_pools:
        raise PlanError(f"rank {rank}: the plan's GPU {index} (PCI {bus_id}) is cuda:{local} here, and D2D swaps "
                        "address peer GPUs by rank 0's CUDA numbers: give every rank the same CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", local)
