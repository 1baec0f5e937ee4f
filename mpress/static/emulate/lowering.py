"""Lowering: (rewritten) per-rank action lists -> the emulator's `Program` of costed tasks.

The forward and backward of a microbatch become one task per layer of the stage (the
memory of each from `stage_memory.py`; its time from the profile). The memory actions the
list puts right after F(s, m) (SO, DO, DR) run inside it, each after its own layer's
task; the recomputes after B(s, m) (RC) run inside it, each before its layer's backward.
Copy-outs give their bytes back at the next release point (the first task of the next
compute action, which waits for them); copy-ins take theirs when issued; a layer's
backward consumes the copy-ins of its own saved tensors. A split backward's I(s, m)
costs each layer's input-gradient time and its W(s, m) the weight-gradient time
(`LayerProfile.input_grad_time_s`, `weight_grad_time_s`); their memory is
`stage_memory.split_backward_steps`'s (what W reads stays from I until W; a unit
swapped back for the backward is back before I, so before W too). A layer the I
recomputes (its RC) is replayed by W too, before its weight gradient, as often as its
probe counted (`stage_memory.weight_replay_time_s`; the replays' bytes are in the
layer's measured W peak). The optimizer step of a stage
(OPT), or of one layer's chunk of it (`OPT:{s}:optim:LAYER`), gives back the gradients it
used, holding the optimizer's temporaries while it runs. The step of a layer of a stage
that steps on the host (`TensorInfo.host_step`) runs on its rank's thread as the runtime
runs it (`runtime/master_weights.py`), on one copy stream, in order: the layer's
gradients go device -> host (pinned staging in their dtype; a `{s}:grads:LAYER` copy-out
that the step waits for), the CPU steps Adam (`compute_s`; nothing of it on the device),
the layer's gradients are given back, and its updated parameters go host -> device in
place (a `{s}:params:LAYER` copy-in, which the next layer's gradients queue behind: a
zero-time task of the next step waits for it). A stage output that torch's
schedule keeps referenced past its backward (`schedules.held_outputs`: a send's work
holds it), and the gradient of a stage's input (`schedules.held_input_grads`), go at the
end of the backward in which the schedule lets their send go (`late_frees`).

Units: bytes, seconds, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mpress.contract.actions import Action, Kind, Schedule, UnitId, UnitKind, moves_layer_data
from mpress.errors import ScheduleError, UserError
from mpress.hardware.server import Hardware
from mpress.static.emulate.channels import (build_channels, drive_transfers, host_transfers, nvlink_transfers,
                                            peer_transfers)
from mpress.static.emulate.dp_reduction import add_reduction
from mpress.static.memory.data_parallel import DataParallel, reduction_buffer_bytes
from mpress.static.memory.model import buffer_bytes, default_stage_to_device, optimizer_step_s
from mpress.static.memory.stage_costs import StageCosts, stage_costs
from mpress.static.profile.profile import LayerProfile, Profile
from mpress.static.emulate.program import Cost, Program, Task, Transfer
from mpress.static.schedules import held_input_grads, held_outputs
from mpress.static.memory.stage_memory import (
    WHOLE, Choice, StepMemory, backward_steps, forward_steps, recompute_time_s, split_backward_steps,
    weight_replay_time_s,
)

__all__ = ["LateFrees", "TensorInfo", "build_program", "late_frees", "lower_rank", "lower_rank_traced",
           "optimizer_transient_bytes"]


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """What the lowering needs to cost a memory action on a tensor (or tensor group).

    bytes: device bytes the action gives back (a copy-out, at its release point) or takes
        (a copy-in, when issued).
    compute_s: compute time of the action that restores it (RC) or updates it (OPT of
        one chunk of model data).
    stripes: D2D only: (peer device, fraction of the bytes) per stripe; fractions sum to 1.
    pool_bytes: what its blocks take in a pinned or peer pool while it is away (each of its
        tensors rounded up to the pools' alignment); 0 for what never leaves the device.
    largest_block_bytes: its largest single block in such a pool.
    """

    bytes: int
    compute_s: float = 0.0
    pool_bytes: int = 0
    largest_block_bytes: int = 0
    stripes: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    recompute: Choice = None
    """A dropped unit: its layer's recompute choice (`stage_memory.Choice`; None: the
    whole layer), which sets its memory and its recompute's time."""
    drive: bool = False
    """Optimizer data the plan keeps on the local drive (`nvme` rules): its OO and OI
    cross the drive's channels besides the host's (`channels.drive_transfers`)."""
    host_step: bool = False
    """The OPT of one layer of a stage that steps on the host (`optimizer_step: host`):
    `bytes` are its gradients, `compute_s` its CPU Adam step (see the module docstring)."""
    host_copy: bool = False
    """A layer's working parameters that a `param:` host rule keeps on the host for good:
    their eviction (SO) copies nothing and gives the bytes back at once. On a host step's
    OPT: the step writes the layer's parameters there, nothing comes back."""


_COST: dict[Kind, Cost] = {
    Kind.SO: Cost.HOST, Kind.SI: Cost.HOST, Kind.DO: Cost.D2D, Kind.DI: Cost.D2D,
    Kind.DR: Cost.DROP, Kind.RC: Cost.RECOMPUTE, Kind.OO: Cost.OPTIMIZER_OFFLOAD, Kind.OI: Cost.OPTIMIZER_OFFLOAD,
}
_OUT = (Kind.SO, Kind.DO, Kind.OO)
_IN = (Kind.SI, Kind.DI, Kind.OI)
_INSIDE_F = (Kind.SO, Kind.DO, Kind.DR)


def tensor_info(action: Action, tensors: dict[str, TensorInfo]) -> TensorInfo:
    """What `tensors` says about the tensor `action` names; a `UserError` if nothing."""
    info = tensors.get(action.tensor or "")
    if info is None:
        raise UserError(f"action {action} names tensor {action.tensor!r}, which the plan does not describe")
    return info


def optimizer_transient_bytes(layer: LayerProfile, hardware: Hardware) -> int:
    """Temporaries of one layer's optimizer step: the fp32 gradients of its masters under
    mixed precision, and Adam's: its whole group at once when the hardware's optimizer
    runs fused multi-tensor calls; else, one tensor at a time, the square root and the
    denominator of a tensor while the previous tensor's denominator is still referenced
    (torch's `_single_tensor_adam` loop), at most three times its largest tensor."""
    numel = layer.optim_bytes // 8
    adam = 2 * 4 * numel if hardware.optimizer_foreach else 3 * layer.largest_param_bytes
    return (4 * numel if layer.master_bytes else 0) + adam


def _copy(action: Action, info: TensorInfo, device: int, hardware: Hardware) -> Task:
    out = action.kind in _OUT
    kind = action.kind
    to_peers = kind in (Kind.DO, Kind.DI) or (kind in (Kind.OO, Kind.OI) and bool(info.stripes))
    if info.drive:
        if not hardware.has_nvme:
            raise UserError(f"action {action}: the plan keeps {action.tensor!r} on nvme, but hardware {hardware.name} "
                            "states no local drive (nvme_bytes, nvme_read_gbps)")
        transfers: tuple[Transfer, ...] = drive_transfers(hardware, device, "d2h" if out else "h2d", info.bytes)
    elif not to_peers:
        transfers = host_transfers(hardware, device, "d2h" if out else "h2d", info.bytes)
    else:
        if not info.stripes:
            raise UserError(f"action {action}: D2D tensor {action.tensor!r} has no stripes")
        parts: list[Transfer] = []
        for peer, fraction in info.stripes:
            if hardware.links(device, peer) == 0:
                raise UserError(f"action {action}: stripe peer {peer} has no NVLink to device {device}")
            src, dst = (device, peer) if out else (peer, device)
            parts.extend(nvlink_transfers(hardware, src, dst, round(info.bytes * fraction)))
        transfers = tuple(parts)
    return Task(action, transfers=transfers, alloc_bytes=0 if out else info.bytes, cost=_COST[kind])


def _unit_layer(action: Action, costs: StageCosts) -> int | None:
    """The index (within the stage) of the layer an activation unit belongs to."""
    unit = UnitId.parse(action.tensor or "")
    if unit.layer is None:
        return None
    for j, layer in enumerate(costs.layers):
        if layer.name == unit.layer:
            return j
    raise ScheduleError(f"action {action} names layer {unit.layer!r}, which stage {action.stage} does not hold")


@dataclass(frozen=True)
class LateFrees:
    """What torch's schedule holds past a microbatch's backward (its send works): the
    stage outputs not given back at their own backward, and per backward (stage,
    microbatch) the bytes given back at its end (held outputs and input gradients)."""

    outputs: frozenset[tuple[int, int]] = frozenset()
    frees: dict[tuple[int, int], int] = field(default_factory=dict)


def late_frees(schedule: Schedule, costs: list[StageCosts]) -> LateFrees:
    """`LateFrees` of `schedule` (`schedules.held_outputs`, `schedules.held_input_grads`)."""
    frees: dict[tuple[int, int], int] = {}
    outputs = {k: v for k, v in held_outputs(schedule).items() if k != v}
    for (stage, _m), holder in outputs.items():
        frees[holder] = frees.get(holder, 0) + costs[stage].layers[-1].memory.output_bytes
    for (stage, _m), holder in held_input_grads(schedule).items():
        frees[holder] = frees.get(holder, 0) + costs[stage].layers[0].memory.input_grad_bytes
    return LateFrees(frozenset(outputs), frees)


def lower_rank(actions: Sequence[Action], *, costs: list[StageCosts], devices: list[int], hardware: Hardware,
               tensors: dict[str, TensorInfo], weight_stashing: bool = False,
               late: LateFrees | None = None) -> tuple[Task, ...]:
    """The tasks of one rank's action list (see the module docstring)."""
    return lower_rank_traced(actions, costs=costs, devices=devices, hardware=hardware, tensors=tensors,
                             weight_stashing=weight_stashing, late=late)[0]


def lower_rank_traced(actions: Sequence[Action], *, costs: list[StageCosts], devices: list[int], hardware: Hardware,
                      tensors: dict[str, TensorInfo], weight_stashing: bool = False,
                      late: LateFrees | None = None) -> tuple[tuple[Task, ...], list[int]]:
    """`lower_rank`, and for each task the index of the action in `actions` it comes from.
    late: what torch's schedule gives back late (`late_frees`); None: nothing (outputs go
    with their backward, input gradients stay)."""
    late = late or LateFrees()
    held, releases = late.outputs, late.frees
    out: list[Task] = []
    origins: list[int] = []
    pending: list[int] = []            # copy-outs since the last release point (indices in out)
    released: dict[int, int] = {}      # copy-out index -> bytes it gives back
    issued_in: dict[tuple[int, int | None, int | None], list[str]] = {}  # (stage, mb, layer) -> copy-ins
    backward_seen: set[int] = set()   # stages whose parameters' gradients exist (a B or a W ran)
    weight_steps: dict[tuple[int, int | None], list[StepMemory]] = {}  # an I's W half, until its W
    weight_recomputed: dict[tuple[int, int | None], list[Choice]] = {}  # the recompute choices of its I
    grads_out: set[int] = set()
    host_params_in: dict[int, str] = {}  # stage -> its host step's last parameters copy-in
    layer_of: dict[tuple[int, str | None], int | None] = {}  # a unit's layer, parsed once per name
    holders: dict[str, int] = {}  # host parameters on the device -> the passes holding them (`_held_params`)

    def unit_layer(x: Action) -> int | None:
        key = (x.stage, x.tensor)
        if key not in layer_of:
            layer_of[key] = _unit_layer(x, costs[x.stage])
        return layer_of[key]

    def start(task: Task) -> Task:
        nbytes = sum(released.pop(k) for k in pending)
        pending.clear()
        return Task(**{**task.__dict__, "starts_action": True, "release_bytes": nbytes})

    i = start_index = 0
    while i < len(actions):
        a = actions[i]
        c, device = costs[a.stage], devices[a.stage]
        if a.kind is Kind.F:
            inside = []
            while i + 1 < len(actions) and (actions[i + 1].kind in _INSIDE_F or moves_layer_data(actions[i + 1])) \
                    and (actions[i + 1].stage, actions[i + 1].microbatch) == (a.stage, a.microbatch):
                i += 1
                inside.append(actions[i])
            data = [x for x in inside if moves_layer_data(x)]
            inside = [x for x in inside if not moves_layer_data(x)]
            dropped = {unit_layer(x): _choice(x, tensors) for x in inside if x.kind is Kind.DR}
            recomputed = [dropped.get(j) for j in range(len(c.layers))]
            by_layer: dict[int | None, list[Action]] = {}
            for x in inside:
                by_layer.setdefault(unit_layer(x), []).append(x)
            steps = forward_steps(c.layers, recomputed)
            for j, step in enumerate(steps):
                stash = c.param_bytes if weight_stashing and j == 0 else 0
                task = Task(a, layer=j, compute_s=c.layers[j].forward_time_s, alloc_bytes=step.alloc_bytes + stash,
                            transient_bytes=step.transient_bytes, free_bytes=step.free_bytes,
                            consumes=tuple(issued_in.pop((a.stage, a.microbatch, j), ())))
                out.append(start(task) if j == 0 else task)
                for x in by_layer.get(j, []) + (by_layer.get(None, []) if j == len(steps) - 1 else []):
                    out.append(_lower_memory(x, tensors, device, hardware, pending, released, out))
                out.extend(_layer_data_after(data, unit_layer, j, j + 1, tensors, device, hardware, issued_in,
                                             holders))
        elif a.kind in (Kind.B, Kind.I):
            inside = []
            while i + 1 < len(actions) and (actions[i + 1].kind is Kind.RC or moves_layer_data(actions[i + 1])) \
                    and (actions[i + 1].stage, actions[i + 1].microbatch) == (a.stage, a.microbatch):
                i += 1
                inside.append(actions[i])
            data = [x for x in inside if moves_layer_data(x)]
            drained = {unit_layer(x) for x in data if UnitId.parse(x.tensor or "").kind is UnitKind.GRADS}
            rc = {unit_layer(x): x for x in inside if x.kind is Kind.RC}
            recomputed = [_choice(rc[j], tensors) if j in rc else None for j in range(len(c.layers))]
            output_held = (a.stage, a.microbatch) in held
            whole = a.kind is Kind.B or a.stage == 0  # the first stage's I runs its whole backward
            if not whole:  # the parameters' gradients and what W reads wait for the W
                steps, weight_steps[(a.stage, a.microbatch)] = split_backward_steps(
                    c.layers, recomputed, first_weight=False, output_held=output_held)
                weight_recomputed[(a.stage, a.microbatch)] = recomputed
            else:
                if a.kind is Kind.I:
                    weight_steps[(a.stage, a.microbatch)] = []
                first = a.stage not in backward_seen
                steps = backward_steps(c.layers, recomputed, first_backward=first, output_held=output_held)
                backward_seen.add(a.stage)
            group: list[Task] = []
            for k, step in enumerate(steps):
                j = len(steps) - 1 - k
                if j in rc:
                    group.append(Task(rc[j], layer=j, compute_s=recompute_time_s(c.layers[j], recomputed[j]),
                                      cost=Cost.RECOMPUTE))
                stash = c.param_bytes if weight_stashing and j == 0 else 0
                consumes = issued_in.get((a.stage, a.microbatch, j), [])
                if k == 0:  # stashed weights (no layer) come back before the backward
                    consumes = consumes + issued_in.get((a.stage, a.microbatch, None), [])
                time_s = c.layers[j].backward_time_s if whole else c.layers[j].input_grad_time_s
                # gradients drained to the host after every backward are made anew in each, as
                # in the first (the new gradient is theirs: no accumulation holds it beside them)
                remade = c.layers[j].grad_bytes if j in drained and a.kind is Kind.B and not first else 0
                group.append(Task(a, layer=j, compute_s=time_s, alloc_bytes=step.alloc_bytes + remade,
                                  transient_bytes=max(step.transient_bytes - remade, 0),
                                  free_bytes=step.free_bytes + stash,
                                  consumes=tuple(consumes)))
                group.extend(_layer_data_after(data, unit_layer, j, j - 1, tensors, device, hardware, issued_in,
                                               holders))
            let_go = releases.get((a.stage, a.microbatch), 0) if whole else 0  # sends held it till now
            if let_go:  # at the end of the backward's last layer (the copies after it are not the backward)
                end = max(n for n, t in enumerate(group) if t.action is a)
                group[end] = Task(**{**group[end].__dict__, "free_bytes": group[end].free_bytes + let_go})
            out.append(start(group[0]))
            out.extend(group[1:])
        elif a.kind is Kind.W:
            split = weight_steps.pop((a.stage, a.microbatch), None)
            if split is None:
                raise ScheduleError(f"action {a}: no input-gradient half ({a.stage}I{a.microbatch}) before it")
            recomputed = weight_recomputed.pop((a.stage, a.microbatch), [])
            first = a.stage not in backward_seen
            backward_seen.add(a.stage)
            group = []
            for k, step in enumerate(split):
                j = len(split) - 1 - k
                replay_s = weight_replay_time_s(c.layers[j], recomputed[j])
                if replay_s > 0:  # the layer its I recomputed is replayed again by W (its memory: the step's)
                    group.append(Task(a, layer=j, compute_s=replay_s, cost=Cost.RECOMPUTE))
                alloc = c.layers[j].grad_bytes if first else 0  # (`split` was made with first_weight=False)
                group.append(Task(a, layer=j, compute_s=c.layers[j].weight_grad_time_s, alloc_bytes=alloc,
                                  transient_bytes=max(step.alloc_bytes + step.transient_bytes - alloc, 0),
                                  free_bytes=step.free_bytes))
            let_go = releases.get((a.stage, a.microbatch), 0) if group else 0  # (a whole I let it go)
            if not group:  # the first stage's: its I ran the whole backward
                group = [Task(a, compute_s=0.0)]
            if let_go:
                group[-1] = Task(**{**group[-1].__dict__, "free_bytes": group[-1].free_bytes + let_go})
            out.append(start(group[0]))
            out.extend(group[1:])
        elif a.kind is Kind.OPT and a.tensor is not None and tensor_info(a, tensors).host_step:
            j = unit_layer(a)
            grads_out.add((a.stage, j))
            begin, grads, step, params = _host_step(a, c.layers[j], tensor_info(a, tensors), device, hardware,
                                                    after=host_params_in.get(a.stage))
            host_params_in[a.stage] = params.action.tensor  # type: ignore[assignment]
            out.append(start(begin))
            pending.append(len(out))  # the gradients' copy-out: the CPU step waits for it, frees nothing
            released[len(out)] = 0
            out.extend((grads, start(step), params))
        elif a.kind is Kind.OPT:
            if a.tensor is None:
                layers = [j for j in range(len(c.layers)) if (a.stage, j) not in grads_out]
                task = Task(a, compute_s=optimizer_step_s(c.optim_bytes // 8 or c.param_bytes // 4, hardware),
                            free_bytes=sum(c.layers[j].grad_bytes for j in layers),
                            transient_bytes=max((optimizer_transient_bytes(c.layers[j], hardware) for j in layers),
                                                default=0))
            else:
                j = unit_layer(a)
                grads_out.add((a.stage, j))
                info = tensor_info(a, tensors)
                task = Task(a, compute_s=info.compute_s, free_bytes=c.layers[j].grad_bytes,
                            transient_bytes=optimizer_transient_bytes(c.layers[j], hardware),
                            consumes=tuple(issued_in.get((a.stage, None, j), ())))
            out.append(start(task))
        elif a.kind in _OUT or a.kind is Kind.DR:
            out.append(_lower_memory(a, tensors, device, hardware, pending, released, out))
        elif a.kind in _IN:
            info = tensor_info(a, tensors)
            layer = unit_layer(a)
            issued_in.setdefault((a.stage, a.microbatch, layer), []).append(a.tensor)  # type: ignore[arg-type]
            out.append(_held_params(a, info, device, hardware, holders) if moves_layer_data(a)
                       else _copy(a, info, device, hardware))
        else:
            raise ScheduleError(f"action {a} is not inside the F or B it belongs to (the rewriter puts "
                                f"{a.kind.value} actions right after their compute action)")
        origins.extend([start_index] * (len(out) - len(origins)))
        i += 1
        start_index = i
    for k in pending:  # no release point follows: these give their bytes back when they end
        out[k] = Task(**{**out[k].__dict__, "free_bytes": released.pop(k)})
    return tuple(out), origins


def _host_step(action: Action, layer: LayerProfile, info: TensorInfo, device: int, hardware: Hardware, *,
               after: str | None) -> tuple[Task, Task, Task, Task]:
    """The tasks of one layer's step on the host (see the module docstring): a zero-time
    start that waits for the previous layer's parameters copy-in `after` (on the same
    copy stream as this layer's gradients), the gradients' copy-out, the CPU step, the
    parameters' copy-in."""
    unit = UnitId.parse(action.tensor or "")
    grads = Action(action.stage, Kind.OO, None, str(UnitId(action.stage, UnitKind.GRADS, layer=unit.layer)))
    params = Action(action.stage, Kind.OI, None, str(UnitId(action.stage, UnitKind.PARAMS, layer=unit.layer)))
    return (
        Task(action, consumes=(after,) if after else ()),
        Task(grads, transfers=host_transfers(hardware, device, "d2h", info.bytes), cost=Cost.OPTIMIZER_OFFLOAD),
        Task(action, compute_s=info.compute_s, free_bytes=info.bytes),
        Task(params, transfers=host_transfers(hardware, device, "h2d", 0 if info.host_copy else layer.param_bytes),
             cost=Cost.OPTIMIZER_OFFLOAD),
    )


def _layer_data_after(data: list[Action], unit_layer: Callable[[Action], int | None], done: int, ahead: int,
                      tensors: dict[str, TensorInfo], device: int, hardware: Hardware,
                      issued_in: dict[tuple[int, int | None, int | None], list[str]],
                      holders: dict[str, int]) -> list[Task]:
    """The copies of host parameters and gradients (`param:`/`grad:` rules) issued when a
    pass's layer `done` ends: its parameters' eviction and its gradients' drain, which
    give their bytes back when they end (an eviction copies nothing, `_held_params`),
    and the fetch of layer `ahead`'s parameters, the next in the pass."""
    out = []
    for x in data:
        layer, info = unit_layer(x), tensor_info(x, tensors)
        if x.kind is Kind.SO and layer == done:
            if info.host_copy:
                out.append(_held_params(x, info, device, hardware, holders))
            else:
                out.append(Task(x, transfers=host_transfers(hardware, device, "d2h", info.bytes),
                                free_bytes=info.bytes, cost=Cost.HOST))
        elif x.kind is Kind.SI and layer == ahead:
            issued_in.setdefault((x.stage, x.microbatch, layer), []).append(x.tensor)  # type: ignore[arg-type]
            out.append(_held_params(x, info, device, hardware, holders))
    return out


def _held_params(action: Action, info: TensorInfo, device: int, hardware: Hardware,
                 holders: dict[str, int]) -> Task:
    """A pass's fetch (SI) or eviction (SO) of a layer's host parameters: one device copy
    serves every pass holding it (the runtime refills the parameters' own storages)."""
    held = holders.get(action.tensor or "", 0)
    holders[action.tensor or ""] = held + 1 if action.kind is Kind.SI else max(held - 1, 0)
    if action.kind is Kind.SI:  # already held by another pass: nothing copied or allocated
        return _copy(action, info, device, hardware) if held == 0 else Task(action, cost=Cost.HOST)
    return Task(action, free_bytes=info.bytes if held <= 1 else 0, cost=Cost.HOST)  # the last frees it


def _choice(action: Action, tensors: dict[str, TensorInfo]) -> Choice:
    """The recompute choice of a dropped unit (DR, RC): what its `TensorInfo` says, the
    whole layer when it says nothing."""
    info = tensors.get(action.tensor or "")
    return WHOLE if info is None or info.recompute is None else info.recompute


def _lower_memory(action: Action, tensors: dict[str, TensorInfo], device: int, hardware: Hardware,
                  pending: list[int], released: dict[int, int], out: list[Task]) -> Task:
    """A copy-out (its bytes given back at the next release point) or a drop marker."""
    if action.kind is Kind.DR:
        return Task(action, cost=Cost.DROP)
    info = tensor_info(action, tensors)
    pending.append(len(out))
    released[len(out)] = info.bytes
    return _copy(action, info, device, hardware)


def rank_static_bytes(costs: list[StageCosts], schedule: Schedule, hardware: Hardware, devices: list[int], *,
                      offloaded_bytes: list[int] | None = None, pool_bytes: list[int] | None = None,
                      data_parallel: DataParallel | None = None) -> tuple[list[int], list[int]]:
    """(device, static bytes) per rank, as `build_program` gives its `Program`: what its
    stages hold for the whole iteration (parameters, optimizer states and masters not
    offloaded, pipeline and reduction buffers) and its device's peer pool, counted on the
    device's first rank. Arguments as `build_program`'s."""
    stash = schedule.weight_stashing
    offloaded = offloaded_bytes or [0] * schedule.num_stages
    pools = pool_bytes or [0] * hardware.num_devices
    rank_device: list[int] = []
    static: list[int] = []
    for r in range(schedule.num_ranks):
        stages = schedule.stages_of_rank(r)
        if not stages:
            raise ScheduleError(f"rank {r} runs no stage")
        device = devices[stages[0]]
        pool = 0 if device in rank_device else pools[device]  # a device's pool counts once
        rank_device.append(device)
        static.append(pool + sum(
            (0 if stash else costs[s].param_bytes) + costs[s].optimizer_data_bytes - offloaded[s]
            + buffer_bytes(costs[s], schedule.num_microbatches) + reduction_buffer_bytes(costs[s], data_parallel)
            for s in stages))
    return rank_device, static


def build_program(profile: Profile, ranges: list[tuple[int, int]], schedule: Schedule, hardware: Hardware, *,
                  microbatch_size: int, stage_to_device: list[int] | None = None,
                  tensors: dict[str, TensorInfo] | None = None,
                  offloaded_bytes: list[int] | None = None,
                  pool_bytes: list[int] | None = None,
                  data_parallel: DataParallel | None = None) -> Program:
    """Lower `schedule` (with or without memory actions) into an emulator `Program`.

    tensors: describes every tensor a memory action names (see `TensorInfo`).
    offloaded_bytes: per stage, model-data bytes that start the iteration off the device
        (optimizer states the plan offloads; OI brings them in, OO takes them out).
    pool_bytes: per device, peer-pool bytes it reserves for D2D exporters.
    data_parallel: replicas across nodes: adds their gradient reduction and buffers
        (`data_parallel.add_reduction`); `profile` is then the per-device one
        (`data_parallel.shard_profile`).
    Weight stashing is accounted per microbatch: F(s, m) allocates a weight version and
    B(s, m) frees it, and the static bytes hold one version fewer (the live weights are
    the newest version).
    Raises `UserError` when the stage count, device count or tensor names do not match.
    """
    if len(ranges) != schedule.num_stages:
        raise UserError(f"partition has {len(ranges)} stages, schedule {schedule.num_stages}")
    costs = stage_costs(profile, ranges)
    devices = stage_to_device or default_stage_to_device(schedule, hardware)
    table = tensors or {}
    stash = schedule.weight_stashing
    late = late_frees(schedule, costs)
    ranks = tuple(lower_rank(actions, costs=costs, devices=devices, hardware=hardware, tensors=table,
                             weight_stashing=stash, late=late) for actions in schedule.ranks)
    rank_device, static = rank_static_bytes(costs, schedule, hardware, devices, offloaded_bytes=offloaded_bytes,
                                            pool_bytes=pool_bytes, data_parallel=data_parallel)
    sends: dict[tuple[int, int], tuple[Transfer, ...]] = {}
    grad_sends: dict[tuple[int, int], tuple[Transfer, ...]] = {}
    for s in range(schedule.num_stages - 1):
        a, b = devices[s], devices[s + 1]
        sends[(s, s + 1)] = peer_transfers(hardware, a, b, costs[s].output_bytes)
        grad_sends[(s + 1, s)] = peer_transfers(hardware, b, a, costs[s].output_bytes)
    flops = sum(c.forward_flops + c.backward_flops for c in costs) * schedule.num_microbatches
    return add_reduction(Program(
        ranks=ranks, rank_device=tuple(rank_device),
        device_capacity_bytes=tuple([hardware.usable_memory_bytes] * hardware.num_devices),
        static_bytes=tuple(static), channels=build_channels(hardware), sends=sends, grad_sends=grad_sends,
        samples_per_iteration=microbatch_size * schedule.num_microbatches, model_flops_per_iteration=flops,
    ), costs, data_parallel)
