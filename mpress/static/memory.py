"""The memory model: from profile + partition + schedule + hardware to bytes per device,
and the lowering of (rewritten) action lists into an emulator `Program`.

What a pipeline stage holds on its device (all per stage, summed over its layers):

- model states: parameters and gradients in the training dtype, Adam's two fp32 states,
  fp32 master weights under mixed precision;
- stashed weights (PipeDream asynchronous 1F1B): one extra parameter version per
  microbatch in flight beyond the first, as PipeDream keeps the weights each in-flight
  microbatch's forward used until its backward;
- communication buffers: the received input and the outgoing activation, and the same
  for gradients on the way back (one of each: sends complete before the next action);
- activations: the tensors autograd saves, per microbatch, for every microbatch whose
  forward has run and whose backward has not (`max_in_flight` of the schedule);
- workspace: the largest transient a layer needs while it runs (measured profiles only).

Units: bytes, seconds, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpress.actions import Action, Kind, Schedule
from mpress.errors import ScheduleError, UserError
from mpress.hardware import Hardware
from mpress.static.profile import LayerProfile, Profile, SavedTensor
from mpress.static.program import Channel, Program, Task, Technique, Transfer
from mpress.static.schedules import max_in_flight

ADAM_FLOPS_PER_PARAM = 16.0
"""Rough FLOPs of one fused Adam update per parameter (moments, bias correction, sqrt,
division, weight update); the step is memory-bound, so this only sizes its small share."""


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """One pipeline stage's share of a profile, for one microbatch."""

    stage: int
    first_layer: int
    end_layer: int
    """Layer range [first_layer, end_layer) of the profile."""
    layers: tuple[LayerProfile, ...]
    forward_s: float
    backward_s: float
    forward_flops: float
    backward_flops: float
    saved_bytes: int
    """Activation bytes saved for backward per microbatch."""
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    master_bytes: int
    input_bytes: int
    """Bytes received from the previous stage per microbatch (0 for stage 0)."""
    output_bytes: int
    """Bytes sent to the next stage per microbatch (0 for the last stage)."""
    workspace_bytes: int

    @property
    def saved(self) -> list[SavedTensor]:
        return [t for layer in self.layers for t in layer.saved]


def stage_costs(profile: Profile, ranges: list[tuple[int, int]]) -> list[StageCosts]:
    """Group a profile's layers into stages by `ranges` ([start, end) per stage)."""
    if not ranges:
        raise ScheduleError("a pipeline needs at least one stage")
    expected = 0
    for start, end in ranges:
        if start != expected or end <= start:
            raise ScheduleError(f"stage layer ranges must be contiguous and non-empty, got {ranges}")
        expected = end
    if expected != profile.num_layers:
        raise ScheduleError(f"stage layer ranges cover {expected} layers, profile has {profile.num_layers}")
    out = []
    last = len(ranges) - 1
    for s, (start, end) in enumerate(ranges):
        layers = tuple(profile.layers[start:end])
        out.append(StageCosts(
            stage=s, first_layer=start, end_layer=end, layers=layers,
            forward_s=sum(x.forward_time_s for x in layers),
            backward_s=sum(x.backward_time_s for x in layers),
            forward_flops=sum(x.forward_flops for x in layers),
            backward_flops=sum(x.backward_flops for x in layers),
            saved_bytes=sum(x.saved_bytes for x in layers),
            param_bytes=sum(x.param_bytes for x in layers),
            grad_bytes=sum(x.grad_bytes for x in layers),
            optim_bytes=sum(x.optim_bytes for x in layers),
            master_bytes=sum(x.master_bytes for x in layers),
            input_bytes=0 if s == 0 else profile.layers[start - 1].output_bytes,
            output_bytes=0 if s == last else layers[-1].output_bytes,
            workspace_bytes=max((x.workspace_bytes for x in layers), default=0),
        ))
    return out


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Bytes one stage needs on its device at its peak, by category."""

    stage: int
    device: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    master_bytes: int
    stash_bytes: int
    """Extra weight versions kept by PipeDream's weight stashing."""
    comm_bytes: int
    activation_bytes_per_microbatch: int
    max_in_flight: int
    """Microbatches whose activations are held at once."""
    workspace_bytes: int
    capacity_bytes: int

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes + self.master_bytes

    @property
    def static_bytes(self) -> int:
        """Held for the whole iteration: model states, stashed weights, comm buffers."""
        return self.model_state_bytes + self.stash_bytes + self.comm_bytes

    @property
    def activation_bytes(self) -> int:
        return self.activation_bytes_per_microbatch * self.max_in_flight

    @property
    def total_bytes(self) -> int:
        """Peak need without any memory compaction."""
        return self.static_bytes + self.activation_bytes + self.workspace_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes


def default_stage_to_device(schedule: Schedule, hardware: Hardware) -> list[int]:
    """Rank r runs on device r; a stage runs on its rank's device."""
    if schedule.num_ranks > hardware.num_devices:
        raise UserError(
            f"{schedule.num_ranks} pipeline ranks need {schedule.num_ranks} devices; "
            f"hardware {hardware.name} has {hardware.num_devices}"
        )
    return [schedule.stage_to_rank[s] for s in range(schedule.num_stages)]


def memory_model(costs: list[StageCosts], schedule: Schedule, hardware: Hardware,
                 stage_to_device: list[int] | None = None) -> list[StageMemory]:
    """Peak bytes per stage, by category, with no memory compaction."""
    devices = stage_to_device or default_stage_to_device(schedule, hardware)
    out = []
    for c in costs:
        in_flight = max_in_flight(schedule, c.stage)
        stash = (in_flight - 1) * c.param_bytes if schedule.weight_stashing else 0
        comm = 2 * (c.input_bytes + c.output_bytes)  # activation + gradient, each direction
        out.append(StageMemory(
            stage=c.stage, device=devices[c.stage],
            param_bytes=c.param_bytes, grad_bytes=c.grad_bytes, optim_bytes=c.optim_bytes,
            master_bytes=c.master_bytes, stash_bytes=stash, comm_bytes=comm,
            activation_bytes_per_microbatch=c.saved_bytes, max_in_flight=in_flight,
            workspace_bytes=c.workspace_bytes, capacity_bytes=hardware.device.memory_bytes,
        ))
    return out


def optimizer_step_s(num_params: int, hardware: Hardware) -> float:
    """Time of one Adam step over `num_params` parameters on one device."""
    return num_params * ADAM_FLOPS_PER_PARAM / (hardware.peak_flops("fp32") * hardware.compute_efficiency)


# -- channels ----------------------------------------------------------------------------

def pcie_up(hardware: Hardware, device: int) -> str:
    """Channel id of the device->host direction of `device`'s PCIe uplink."""
    return f"pcie-up:{hardware.pcie_group(device)}"


def pcie_down(hardware: Hardware, device: int) -> str:
    """Channel id of the host->device direction of `device`'s PCIe uplink."""
    return f"pcie-down:{hardware.pcie_group(device)}"


def nvlink(hardware: Hardware, src: int, dst: int) -> str:
    """Channel id of the NVLink path src->dst (an NVSwitch GPU's egress is one channel)."""
    return f"nvswitch-out:{src}" if hardware.nvswitch else f"nvlink:{src}->{dst}"


def build_channels(hardware: Hardware) -> dict[str, Channel]:
    """Every copy channel of the server with its effective bandwidth."""
    n = hardware.num_devices
    channels: dict[str, Channel] = {}
    for d in range(n):
        up, down = pcie_up(hardware, d), pcie_down(hardware, d)
        channels[up] = Channel(up, hardware.pcie_gbps("d2h"), hardware.pcie_latency_s)
        channels[down] = Channel(down, hardware.pcie_gbps("h2d"), hardware.pcie_latency_s)
        for p in range(n):
            if p != d and hardware.links(d, p) > 0:
                cid = nvlink(hardware, d, p)
                channels[cid] = Channel(cid, hardware.nvlink_gbps(d, p), hardware.nvlink_latency_s)
    return channels


def peer_transfers(hardware: Hardware, src: int, dst: int, num_bytes: int) -> tuple[Transfer, ...]:
    """Transfers that move `num_bytes` from device src to dst: NVLink when linked, else
    through host over both PCIe uplinks (cut-through: the slower one bounds the time)."""
    if src == dst or num_bytes == 0:
        return ()
    if hardware.links(src, dst) > 0:
        return (Transfer(nvlink(hardware, src, dst), num_bytes),)
    return (Transfer(pcie_up(hardware, src), num_bytes), Transfer(pcie_down(hardware, dst), num_bytes))


# -- lowering ----------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """What the lowering needs to cost a memory action on a tensor (or tensor group).

    bytes: bytes moved, dropped or restored.
    compute_s: compute time of the action that restores it (RC) or updates it (OPT of
        one chunk of model data).
    stripes: D2D only: (peer device, fraction of the bytes) per stripe; fractions sum to 1.
    """

    bytes: int
    compute_s: float = 0.0
    stripes: tuple[tuple[int, float], ...] = field(default_factory=tuple)


_TECHNIQUE: dict[Kind, Technique] = {
    Kind.SO: "host-swap", Kind.SI: "host-swap", Kind.DO: "d2d", Kind.DI: "d2d",
    Kind.DR: "drop", Kind.RC: "recompute", Kind.OO: "optimizer-offload", Kind.OI: "optimizer-offload",
}


def tensor_info(action: Action, tensors: dict[str, TensorInfo]) -> TensorInfo:
    """What `tensors` says about the tensor `action` names; a `UserError` if nothing."""
    info = tensors.get(action.tensor or "")
    if info is None:
        raise UserError(f"action {action} names tensor {action.tensor!r}, which the plan does not describe")
    return info


def lower_action(action: Action, *, costs: StageCosts, device: int, hardware: Hardware,
                 tensors: dict[str, TensorInfo], weight_stashing: bool = False, dropped_bytes: int = 0,
                 recomputed_peak_bytes: int = 0) -> Task:
    """Cost one action of stage `costs.stage` running on `device`.

    With weight stashing, F(s, m) creates microbatch m's weight version and B(s, m)
    releases it (see `build_program` for the matching static bytes).
    Recompute: `dropped_bytes` of F(s, m)'s saved tensors are recomputed. A checkpointed
    forward never holds them (F does not take them, DR frees nothing), and the backward
    recomputes one checkpointed layer at a time, right before that layer's backward: B
    holds `recomputed_peak_bytes` (the largest layer's) only while it runs. RC is the
    recompute's compute time, placed before B.
    """
    kind = action.kind
    per_microbatch = costs.saved_bytes + (costs.param_bytes if weight_stashing else 0) - dropped_bytes
    if kind is Kind.F:
        return Task(action, compute_s=costs.forward_s, alloc_bytes=per_microbatch,
                    transient_bytes=costs.workspace_bytes)
    if kind is Kind.B:
        return Task(action, compute_s=costs.backward_s, free_bytes=per_microbatch,
                    transient_bytes=costs.workspace_bytes + recomputed_peak_bytes)
    if kind is Kind.OPT and action.tensor is None:
        num_params = (costs.optim_bytes // 8) if costs.optim_bytes else costs.param_bytes // 4
        return Task(action, compute_s=optimizer_step_s(num_params, hardware))
    info = tensor_info(action, tensors)
    technique = _TECHNIQUE.get(kind, "compute")
    to_peers = kind in (Kind.DO, Kind.DI) or (kind in (Kind.OO, Kind.OI) and bool(info.stripes))
    if kind in (Kind.SO, Kind.OO) and not to_peers:
        return Task(action, transfers=(Transfer(pcie_up(hardware, device), info.bytes),),
                    free_bytes=info.bytes, technique=technique)
    if kind in (Kind.SI, Kind.OI) and not to_peers:
        return Task(action, transfers=(Transfer(pcie_down(hardware, device), info.bytes),),
                    alloc_bytes=info.bytes, technique=technique)
    if to_peers:  # D2D, or optimizer states the plan stripes over peers
        out = kind in (Kind.DO, Kind.OO)
        if not info.stripes:
            raise UserError(f"action {action}: D2D tensor {action.tensor!r} has no stripes")
        transfers = []
        for peer, fraction in info.stripes:
            if hardware.links(device, peer) == 0:
                raise UserError(f"action {action}: stripe peer {peer} has no NVLink to device {device}")
            src, dst = (device, peer) if out else (peer, device)
            transfers.append(Transfer(nvlink(hardware, src, dst), round(info.bytes * fraction)))
        if out:
            return Task(action, transfers=tuple(transfers), free_bytes=info.bytes, technique=technique)
        return Task(action, transfers=tuple(transfers), alloc_bytes=info.bytes, technique=technique)
    if kind is Kind.DR:
        return Task(action, technique=technique)  # never taken: see `dropped_bytes`
    if kind is Kind.RC:
        return Task(action, compute_s=info.compute_s, technique=technique)  # bytes: B's transient
    if kind is Kind.OPT:
        return Task(action, compute_s=info.compute_s)
    raise ScheduleError(f"cannot lower action {action}")  # unreachable: every Kind is handled


def build_program(profile: Profile, ranges: list[tuple[int, int]], schedule: Schedule, hardware: Hardware, *,
                  microbatch_size: int, stage_to_device: list[int] | None = None,
                  tensors: dict[str, TensorInfo] | None = None,
                  offloaded_bytes: list[int] | None = None,
                  pool_bytes: list[int] | None = None,
                  swap_in_policy: str = "capacity") -> Program:
    """Lower `schedule` (with or without memory actions) into an emulator `Program`.

    tensors: describes every tensor a memory action names (see `TensorInfo`).
    offloaded_bytes: per stage, model-data bytes that start the iteration off the device
        (optimizer states the plan offloads; OI brings them in, OO takes them out).
    pool_bytes: per device, peer-pool bytes it reserves for D2D exporters.
    Weight stashing is accounted per microbatch: F(s, m) allocates a weight version and
    B(s, m) frees it, and the static bytes hold one version fewer (the live weights are
    the newest version), so the peak equals `StageMemory.total_bytes`.
    Raises `UserError` when the stage count, device count or tensor names do not match.
    """
    if len(ranges) != schedule.num_stages:
        raise UserError(f"partition has {len(ranges)} stages, schedule {schedule.num_stages}")
    costs = stage_costs(profile, ranges)
    devices = stage_to_device or default_stage_to_device(schedule, hardware)
    mem = memory_model(costs, schedule, hardware, devices)
    table = tensors or {}
    stash = schedule.weight_stashing
    dropped: dict[tuple[int, int | None], int] = {}
    largest: dict[tuple[int, int | None], int] = {}
    for actions in schedule.ranks:
        for a in actions:
            if a.kind is Kind.DR:
                info = tensor_info(a, table)
                key = (a.stage, a.microbatch)
                dropped[key] = dropped.get(key, 0) + info.bytes
                largest[key] = max(largest.get(key, 0), info.bytes)
    ranks = []
    for r, actions in enumerate(schedule.ranks):
        ranks.append(tuple(
            lower_action(a, costs=costs[a.stage], device=devices[a.stage], hardware=hardware, tensors=table,
                         weight_stashing=stash,
                         dropped_bytes=dropped.get((a.stage, a.microbatch), 0) if a.kind in (Kind.F, Kind.B) else 0,
                         recomputed_peak_bytes=largest.get((a.stage, a.microbatch), 0) if a.kind is Kind.B else 0)
            for a in actions
        ))
    offloaded = offloaded_bytes or [0] * schedule.num_stages
    pools = pool_bytes or [0] * hardware.num_devices
    rank_device = []
    static = []
    for r in range(schedule.num_ranks):
        stages = schedule.stages_of_rank(r)
        if not stages:
            raise ScheduleError(f"rank {r} runs no stage")
        device = devices[stages[0]]
        pool = 0 if device in rank_device else pools[device]  # a device's pool counts once
        rank_device.append(device)
        static.append(pool + sum(
            mem[s].static_bytes - offloaded[s] - (mem[s].stash_bytes + mem[s].param_bytes if stash else 0)
            for s in stages))
    sends: dict[tuple[int, int], tuple[Transfer, ...]] = {}
    grad_sends: dict[tuple[int, int], tuple[Transfer, ...]] = {}
    for s in range(schedule.num_stages - 1):
        a, b = devices[s], devices[s + 1]
        sends[(s, s + 1)] = peer_transfers(hardware, a, b, costs[s].output_bytes)
        grad_sends[(s + 1, s)] = peer_transfers(hardware, b, a, costs[s].output_bytes)
    flops = sum(c.forward_flops + c.backward_flops for c in costs) * schedule.num_microbatches
    return Program(
        ranks=tuple(ranks), rank_device=tuple(rank_device),
        device_capacity_bytes=tuple([hardware.device.memory_bytes] * hardware.num_devices),
        static_bytes=tuple(static), channels=build_channels(hardware), sends=sends, grad_sends=grad_sends,
        samples_per_iteration=microbatch_size * schedule.num_microbatches,
        model_flops_per_iteration=flops, swap_in_policy=swap_in_policy,  # type: ignore[arg-type]
    )
