"""The memory model: from profile + partition + schedule + hardware to bytes per device.

(`lowering.py` turns the action lists into the emulator's costed tasks with it.)

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

from dataclasses import dataclass

from mpress.actions import Schedule
from mpress.errors import ScheduleError, UserError
from mpress.hardware import Hardware
from mpress.static.profile import LayerProfile, Profile, SavedTensor
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
