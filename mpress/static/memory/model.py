"""The memory model: from profile + partition + schedule + hardware to bytes per device.

(`stage_memory.py` gives the layer-by-layer walk of one microbatch, and `lowering.py`
turns the action lists into the emulator's costed tasks with both.)

What a pipeline stage holds on its device (all per stage, summed over its layers):

- model states: parameters in the training dtype, Adam's two fp32 states, fp32 master
  weights under mixed precision, for the whole iteration (a stage whose optimizer steps
  on the host, `optimizer_step: host`, keeps states and masters in host memory: none on
  its device); gradients (in the parameters' dtype) from the step's first backward of the
  stage to its optimizer step;
- stashed weights (PipeDream asynchronous 1F1B): one extra parameter version per
  microbatch in flight beyond the first, as PipeDream keeps the weights each in-flight
  microbatch's forward used until its backward;
- torch's pipeline buffers: a receive buffer per microbatch for the input activation
  (every stage but the first) and one for the output's gradient (every stage but the
  last), made once and kept; the input batch of the iteration on the first stage, the
  targets on the last;
- activations: what each layer's forward keeps for its backward (saved tensors, the
  output; the loss's on the last stage), per microbatch in flight (`max_in_flight`);
- transients: what a layer's forward or backward holds only while it runs.

Units: bytes, seconds, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from mpress.contract.actions import Schedule
from mpress.errors import UserError
from mpress.hardware.server import Hardware
from mpress.static.memory.data_parallel import DataParallel, reduction_buffer_bytes
from mpress.static.memory.stage_costs import StageCosts
from mpress.static.schedules import max_in_flight
from mpress.static.memory.stage_memory import forward_steps

ADAM_FLOPS_PER_PARAM = 16.0
"""Rough FLOPs of one fused Adam update per parameter (moments, bias correction, sqrt,
division, weight update); the step is memory-bound, so this only sizes its small share."""


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Bytes one stage needs on its device, by category, without memory compaction. An
    estimate before emulation (the emulated walk of the stage's layers is exact)."""

    stage: int
    device: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    master_bytes: int
    stash_bytes: int
    """Extra weight versions kept by PipeDream's weight stashing."""
    buffer_bytes: int
    """torch's receive buffers (input activation and output gradient per microbatch) and
    the iteration's input batch or targets."""
    activation_bytes_per_microbatch: int
    """What the stage's forward of one microbatch keeps until its backward."""
    max_in_flight: int
    """Microbatches whose activations are held at once."""
    transient_bytes: int
    """The largest transient of a layer's forward or backward."""
    capacity_bytes: int
    """The device's usable memory."""

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes + self.master_bytes

    @property
    def static_bytes(self) -> int:
        """Held for the whole iteration (gradients from the first backward on)."""
        return self.model_state_bytes + self.stash_bytes + self.buffer_bytes

    @property
    def activation_bytes(self) -> int:
        return self.activation_bytes_per_microbatch * self.max_in_flight

    @property
    def total_bytes(self) -> int:
        """Peak need without any memory compaction (estimate)."""
        return self.static_bytes + self.activation_bytes + self.transient_bytes

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
                 stage_to_device: list[int] | None = None,
                 data_parallel: DataParallel | None = None, *,
                 host_step_stages: Collection[int] = ()) -> list[StageMemory]:
    """Bytes per stage, by category, with no memory compaction. data_parallel: its
    reduction's buffers count as buffers (`data_parallel.reduction_buffer_bytes`; the
    sharded states are in `costs`, from the sharded profile). host_step_stages: stages
    whose optimizer steps on the host (`optimizer_step: host`): no optimizer states or
    master weights on their devices."""
    devices = stage_to_device or default_stage_to_device(schedule, hardware)
    m = schedule.num_microbatches
    out = []
    for c in costs:
        in_flight = max_in_flight(schedule, c.stage)
        stash = (in_flight - 1) * c.param_bytes if schedule.weight_stashing else 0
        kept = sum(step.alloc_bytes - step.free_bytes for step in forward_steps(c.layers, [None] * len(c.layers)))
        # a forward's peak includes what the layer keeps (counted in `kept`): only the rest is transient
        transient = max((max(x.memory.forward_peak_bytes - x.memory.kept_bytes, x.memory.backward_peak_bytes)
                         for x in c.layers), default=0)
        on_host = c.stage in host_step_stages
        out.append(StageMemory(
            stage=c.stage, device=devices[c.stage],
            param_bytes=c.param_bytes, grad_bytes=c.grad_bytes, optim_bytes=0 if on_host else c.optim_bytes,
            master_bytes=0 if on_host else c.master_bytes, stash_bytes=stash,
            buffer_bytes=buffer_bytes(c, m) + reduction_buffer_bytes(c, data_parallel),
            activation_bytes_per_microbatch=kept, max_in_flight=in_flight,
            transient_bytes=transient, capacity_bytes=hardware.usable_memory_bytes,
        ))
    return out


def buffer_bytes(costs: StageCosts, num_microbatches: int) -> int:
    """torch's receive buffers of a stage (one per microbatch for the input activation and
    for the output's gradient, made once and kept) and the iteration's batch on it."""
    return num_microbatches * (costs.input_bytes + costs.output_bytes + costs.batch_bytes)


def optimizer_step_s(num_params: int, hardware: Hardware) -> float:
    """Time of one Adam step over `num_params` parameters on one device."""
    return num_params * ADAM_FLOPS_PER_PARAM / (hardware.peak_flops("fp32") * hardware.compute_efficiency)
