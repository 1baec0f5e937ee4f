"""Lowering: (rewritten) per-rank action lists -> the emulator's `Program` of costed tasks.

Each action gets its compute time, its copies on the server's channels (PCIe up/down per
switch group, NVLink per directed pair or NVSwitch egress per GPU) and the device memory
it takes and gives back, from the stage costs and memory model (`memory.py`).
Units: bytes, seconds, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpress.actions import Action, Kind, Schedule
from mpress.errors import ScheduleError, UserError
from mpress.hardware import Hardware
from mpress.static.memory import StageCosts, default_stage_to_device, memory_model, optimizer_step_s, stage_costs
from mpress.static.profile import Profile
from mpress.static.program import Channel, Cost, Program, Task, Transfer
from mpress.vocabulary import SwapInPolicy


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


_COST: dict[Kind, Cost] = {
    Kind.SO: Cost.HOST, Kind.SI: Cost.HOST, Kind.DO: Cost.D2D, Kind.DI: Cost.D2D,
    Kind.DR: Cost.DROP, Kind.RC: Cost.RECOMPUTE, Kind.OO: Cost.OPTIMIZER_OFFLOAD, Kind.OI: Cost.OPTIMIZER_OFFLOAD,
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
    cost = _COST.get(kind, Cost.COMPUTE)
    to_peers = kind in (Kind.DO, Kind.DI) or (kind in (Kind.OO, Kind.OI) and bool(info.stripes))
    if kind in (Kind.SO, Kind.OO) and not to_peers:
        return Task(action, transfers=(Transfer(pcie_up(hardware, device), info.bytes),),
                    free_bytes=info.bytes, cost=cost)
    if kind in (Kind.SI, Kind.OI) and not to_peers:
        return Task(action, transfers=(Transfer(pcie_down(hardware, device), info.bytes),),
                    alloc_bytes=info.bytes, cost=cost)
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
            return Task(action, transfers=tuple(transfers), free_bytes=info.bytes, cost=cost)
        return Task(action, transfers=tuple(transfers), alloc_bytes=info.bytes, cost=cost)
    if kind is Kind.DR:
        return Task(action, cost=cost)  # never taken: see `dropped_bytes`
    if kind is Kind.RC:
        return Task(action, compute_s=info.compute_s, cost=cost)  # bytes: B's transient
    if kind is Kind.OPT:
        return Task(action, compute_s=info.compute_s)
    raise ScheduleError(f"cannot lower action {action}")  # unreachable: every Kind is handled


def build_program(profile: Profile, ranges: list[tuple[int, int]], schedule: Schedule, hardware: Hardware, *,
                  microbatch_size: int, stage_to_device: list[int] | None = None,
                  tensors: dict[str, TensorInfo] | None = None,
                  offloaded_bytes: list[int] | None = None,
                  pool_bytes: list[int] | None = None,
                  swap_in_policy: SwapInPolicy = SwapInPolicy.CAPACITY) -> Program:
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
