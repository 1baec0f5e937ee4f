"""The baselines users reach for instead of mpress: DeepSpeed's ZeRO-Offload (Ren et al.,
ATC'21) and ZeRO-Infinity (Rajbhandari et al., SC'21), planned for the model, microbatch
and server of a pipeline setup, so `mpress plan` can set them beside the pipelines.

What is modelled, and why this shape:

- **Data parallelism over every GPU of the server.** DeepSpeed runs ZeRO-2/3 as data
  parallelism (its pipeline engine takes ZeRO-1 at most), so a user with the same 8 GPUs
  and the same global batch (microbatch size x microbatches per iteration) runs each GPU
  over its share of the batch: ceil(microbatches / GPUs) micro-steps of the microbatch
  size with gradient accumulation. The microbatch is the pipeline's, so the profile (the
  per-layer times and bytes) is the very one the mpress plans are made from.
- **DeepSpeed activation checkpointing of whole layers**, as both papers train: each
  block between the first layer (embedding) and the last (head) keeps only its input,
  and is recomputed in its backward; the first and last layers keep their saved tensors.
  Without it neither baseline holds the activations of a billion-scale model at all.
- **zero-offload** (ZeRO-2 + `offload_optimizer: cpu`): fp16 parameters replicated on
  every GPU; in each micro-step's backward each layer's gradients are reduce-scattered
  over NVLink and the GPU's 1/N partition goes to the host (from the second micro-step
  on DeepSpeed brings the partition accumulated so far back to add to it on the GPU,
  `async_accumulate_grad_in_cpu_via_gpu`); after the last micro-step CPU Adam steps each
  rank's 1/N of the parameters on the host (fp32 master, moments, fp32 gradients there:
  the last micro-step sends its partition as fp32); then the updated partition is cast
  to fp16, copied to its GPU and all-gathered over NVLink (`stage_1_and_2.py`'s step:
  cpu_adam's overlapped `dev_params` copy is disabled there). Device: fp16 parameters,
  DeepSpeed's two gradient buckets (`overlap_comm`) and accumulation staging buffer, one
  micro-step's checkpoints and the largest layer's working set.
- **zero-infinity** (ZeRO-3, `offload_param` and `offload_optimizer` to the host,
  `cpu_checkpointing`): before each layer's forward and again before its backward each
  GPU copies its 1/N of the layer's fp16 parameters from the host and they are
  all-gathered over NVLink, the next layer's fetch overlapping this layer's compute;
  after each layer's backward its gradients are reduce-scattered and each partition goes
  to the host (accumulated there in fp32 by the CPU); checkpoints go to the host after
  each forward and come back before the backward; CPU Adam on the host. Device: the
  layer running and the one prefetched, a gradient bucket, the first/last layers'
  activations and the largest working set.
- **zero-infinity-nvme** (where the server states drives, `Hardware.has_nvme`): the same
  with fp16 parameters, the optimizer states (fp32 master, moments) and the fp32
  gradients on the drives: each parameter fetch reads the drives, the last micro-step's
  backward writes the fp32 gradient partitions there, and the step reads states and
  gradients and writes the states back one sub-group after another, the drives and the
  CPU taking turns (DeepSpeed's default, unpipelined swapper); the gradient partitions in
  the model's dtype and the checkpoints stay on the host.

Host bytes are bounded by `Hardware.pinnable_bytes` (DeepSpeed pins its offload buffers
with `pin_memory: true`, the papers' setting), drive bytes by `Hardware.nvme_bytes`. Besides
the step's fp32 states, DeepSpeed pins 2 B/param more: zero-offload an fp16 copy of each
partition the step casts into (`param_buffer_of_bit16_for_cpu_offload_groups`), ZeRO-3 the
gradient partitions in the model's dtype (`grad_partitions_flat_buffer`).
Not modelled: DeepSpeed's staging buffers for drive I/O, the CPU's own arithmetic (the
step is DRAM-bound, `host_adam`), per-copy latencies, loss scaling's overflow checks.
Times follow `zero_time`'s channel model.

Units: bytes, seconds, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpress.errors import UserError
from mpress.hardware.server import Hardware
from mpress.static.emulate.dp_reduction import ring_wire_bytes
from mpress.static.emulate.host_adam import host_adam_step_s
from mpress.static.profile.profile import LayerMemory, LayerProfile
from mpress.static.baselines.zero_time import LayerStep, Load, Rates, load_s, pipelined_s, server_rates, with_host_copies

if TYPE_CHECKING:  # a pipeline setup (its analytic profile) loads torch; the variants' names do not
    from mpress.static.plan.evaluate import PipelineSetup

ZERO_OFFLOAD = "zero-offload"
ZERO_INFINITY = "zero-infinity"
ZERO_INFINITY_NVME = "zero-infinity-nvme"
ZERO_VARIANTS = (ZERO_OFFLOAD, ZERO_INFINITY, ZERO_INFINITY_NVME)

REDUCE_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's `reduce_bucket_size` default (elements): gradients are reduced in buckets
of this many elements, each a device buffer of the gradients' dtype allocated at its full
size (`torch.empty(reduce_bucket_size)` in stage_1_and_2.py and stage3.py), even for a
model with fewer parameters."""
FP32_BYTES = 4
CPU_ACCUMULATE_BYTES = 2 + 4 + 4
"""Host DRAM bytes per parameter to add a micro-step's fp16 gradient into the fp32
partition (read fp16 and fp32, write fp32); the first micro-step writes (2 + 4)."""


@dataclass(frozen=True, kw_only=True)
class ZeroDeviceMemory:
    """What one GPU holds at its peak, by category; bytes."""

    param_bytes: int
    """fp16 parameters: the whole model (zero-offload), or the layer running and the one
    prefetched (zero-infinity)."""
    grad_bytes: int
    """Gradient buckets; zero-offload also its staging buffer for the host accumulation
    (the largest parameter's, in the model's dtype), zero-infinity the running layer's gradients."""
    activation_bytes: int
    """One micro-step's kept activations: checkpoints (zero-offload) and the first and
    last layers' saved tensors, the micro-step's input batch and targets."""
    working_bytes: int
    """The largest transient of a layer's forward or backward (with its recompute), and,
    zero-infinity, the checkpoint it has brought back."""

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.activation_bytes + self.working_bytes


@dataclass(frozen=True, kw_only=True)
class ZeroTimes:
    """One iteration's time by phase (they run one after another); seconds."""

    compute_s: float
    """Pure GPU compute of the iteration on one GPU (forward, recompute, backward), for
    reference: the phases below include it."""
    forward_s: float
    """All micro-steps' forward passes, with the copies that did not hide."""
    backward_s: float
    """All micro-steps' backward passes (recompute included), likewise."""
    optimizer_s: float
    """The CPU Adam step and the cast of its fp32 parameters to fp16 (and, NVMe variant,
    the drives' reads and writes it takes turns with)."""
    param_update_s: float
    """After the step: zero-offload's copy of each updated fp16 partition to its GPU and
    their all-gather."""


@dataclass(frozen=True, kw_only=True)
class BaselineResult:
    """A ZeRO baseline planned for a pipeline setup's model, batch and server."""

    strategy: str
    """One of `ZERO_VARIANTS`."""
    fits: bool
    reason: str
    """Why it does not fit ("" when it does)."""
    iteration_s: float
    """One iteration (the global batch); nan when it cannot be timed."""
    samples_per_s: float
    model_tflops: float
    """Model FLOPs (without recompute) per second, in 1e12, the whole server (as the
    emulator's `EmulatorResult.model_tflops`)."""
    peak_bytes: int
    """Per GPU (every GPU the same)."""
    host_bytes: int
    """Host memory the offload holds (all ranks together)."""
    nvme_bytes: int
    """Bytes on the local drives (zero-infinity-nvme), else 0."""
    host_checkpoint_bytes: int
    """Of `host_bytes`: activation checkpoints offloaded (zero-infinity)."""
    memory: ZeroDeviceMemory
    times: ZeroTimes
    micro_steps: int
    """Micro-steps each GPU runs per iteration (gradient accumulation)."""


def zero_variants(hardware: Hardware) -> tuple[str, ...]:
    """The baselines a server supports: the NVMe variant only where it states drives."""
    return ZERO_VARIANTS if hardware.has_nvme else (ZERO_OFFLOAD, ZERO_INFINITY)


@dataclass(frozen=True)
class _Layer:
    """One layer as the baselines run it (one microbatch)."""

    profile: LayerProfile
    checkpointed: bool
    checkpoint_bytes: int
    """Its input, kept (or offloaded) for the recompute; 0 when not checkpointed."""

    @property
    def num_params(self) -> int:
        return self.profile.optim_bytes // 8 or self.profile.param_bytes // FP32_BYTES

    @property
    def memory(self) -> LayerMemory:
        return self.profile.recompute_memory if self.checkpointed else self.profile.memory

    @property
    def forward_s(self) -> float:
        return self.profile.forward_time_s

    @property
    def backward_s(self) -> float:
        """Its backward, with the forward replayed first when checkpointed."""
        return self.profile.backward_time_s + (self.profile.forward_time_s if self.checkpointed else 0.0)

    @property
    def transient_bytes(self) -> int:
        m = self.memory
        return max(m.forward_peak_bytes - m.kept_bytes, m.backward_peak_bytes)


def _layers(setup: PipelineSetup) -> list[_Layer]:
    """The profile's layers, the blocks between the first and the last checkpointed."""
    layers = setup.profile.layers
    out = []
    for i, x in enumerate(layers):
        ckpt = 0 < i < len(layers) - 1
        out.append(_Layer(x, ckpt, layers[i - 1].output_bytes if ckpt else 0))
    return out


def plan_zero(setup: PipelineSetup, variant: str) -> BaselineResult:
    """Plan `variant` (one of `ZERO_VARIANTS`) for the model, global batch and server of
    `setup` (module docstring). Raises UserError for an unknown variant, the NVMe variant
    on a server without drives, or a setup replicated over nodes."""
    if variant not in ZERO_VARIANTS:
        raise UserError(f"unknown ZeRO baseline {variant!r} (allowed: {', '.join(ZERO_VARIANTS)})")
    hw = setup.hardware
    if variant == ZERO_INFINITY_NVME and not hw.has_nvme:
        raise UserError(f"{variant}: hardware {hw.name} states no local drives (nvme_bytes, nvme_read_gbps)")
    if setup.data_parallel is not None and setup.data_parallel.degree > 1:
        raise UserError("the ZeRO baselines are planned for one server, not for replicas on several nodes")
    layers = _layers(setup)
    n = hw.num_devices
    steps = math.ceil(setup.schedule.num_microbatches / n)
    num_params = sum(x.num_params for x in layers)
    param_bytes = sum(x.profile.param_bytes for x in layers)
    memory = _device_memory(setup, layers, variant, num_params)
    checkpoints = n * sum(x.checkpoint_bytes for x in layers) if variant != ZERO_OFFLOAD else 0
    host, nvme = _host_and_nvme_bytes(setup, variant, num_params, param_bytes, steps, checkpoints)
    times = _times(setup, layers, variant, num_params, steps)
    iteration = (math.nan if times is None else
                 times.forward_s + times.backward_s + times.optimizer_s + times.param_update_s)
    reason = _why_not(hw, memory, param_bytes, host, nvme, variant, timed=times is not None)
    samples = setup.schedule.num_microbatches * setup.microbatch_size
    flops = setup.schedule.num_microbatches * sum(x.forward_flops + x.backward_flops for x in setup.profile.layers)
    return BaselineResult(
        strategy=variant, fits=not reason, reason=reason, iteration_s=iteration,
        samples_per_s=samples / iteration if times is not None else math.nan,
        model_tflops=flops / iteration / 1e12 if times is not None else math.nan,
        peak_bytes=memory.total_bytes, host_bytes=host, nvme_bytes=nvme, host_checkpoint_bytes=checkpoints,
        memory=memory, times=times or ZeroTimes(compute_s=math.nan, forward_s=math.nan, backward_s=math.nan,
                                                optimizer_s=math.nan, param_update_s=math.nan),
        micro_steps=steps)


def _device_memory(setup: PipelineSetup, layers: list[_Layer], variant: str, num_params: int) -> ZeroDeviceMemory:
    grad_elem = max(x.profile.grad_bytes // max(x.num_params, 1) for x in layers)
    bucket = REDUCE_BUCKET_ELEMENTS * grad_elem  # allocated whole, however small the model
    batch = setup.profile.input_bytes + setup.profile.target_bytes
    transient = max(x.transient_bytes for x in layers)
    if variant == ZERO_OFFLOAD:
        # DeepSpeed's temp_grad_buffer_for_gpu_offload: the largest parameter's numel in the model's dtype
        # (stage_1_and_2.py, dtype=self.dtype); the profile states the largest parameter in fp32 bytes
        staging = max(x.profile.largest_param_bytes for x in layers) // FP32_BYTES * grad_elem
        return ZeroDeviceMemory(
            param_bytes=sum(x.profile.param_bytes for x in layers),
            grad_bytes=2 * bucket + staging,  # overlap_comm: one bucket reduces while the next fills
            activation_bytes=batch + sum(x.memory.kept_bytes for x in layers),
            working_bytes=transient)
    # zero-infinity: checkpoints live on the host; only the first and last layers' activations stay
    kept = sum(x.memory.kept_bytes for x in layers if not x.checkpointed)
    return ZeroDeviceMemory(
        param_bytes=2 * max(x.profile.param_bytes for x in layers),
        grad_bytes=bucket + max(x.profile.grad_bytes for x in layers),
        activation_bytes=batch + kept,
        working_bytes=transient + max(x.checkpoint_bytes for x in layers))


def _host_and_nvme_bytes(setup: PipelineSetup, variant: str, num_params: int, param_bytes: int,
                         steps: int, checkpoints: int) -> tuple[int, int]:
    """Host and drive bytes of the whole server: ZeRO's partitions of all ranks together."""
    optim = sum(x.optim_bytes for x in setup.profile.layers)
    master = FP32_BYTES * num_params  # fp32 parameters (master weights) of the CPU step
    grads32 = FP32_BYTES * num_params  # fp32 gradient partitions the step reads
    if variant == ZERO_OFFLOAD:
        accumulate = param_bytes if steps > 1 else 0  # fp16 partitions accumulated between micro-steps
        # stage_1_and_2.py pins an fp16 copy of each partition that the step casts into and copies to the GPU
        # (param_buffer_of_bit16_for_cpu_offload_groups)
        cast16 = param_bytes
        return master + optim + grads32 + accumulate + cast16, 0
    # stage3.py keeps the gradient partitions in the model's dtype on the host, pinned
    # (grad_partitions_flat_buffer; grad_accum_dtype defaults to the model's)
    grads16 = param_bytes
    if variant == ZERO_INFINITY:
        return param_bytes + master + optim + grads32 + grads16 + checkpoints, 0
    # NVMe: the optimizer swapper also keeps the fp32 gradients on the drives (swap_out_gradients)
    return grads16 + checkpoints, param_bytes + master + optim + grads32


def _why_not(hw: Hardware, memory: ZeroDeviceMemory, param_bytes: int, host: int, nvme: int, variant: str,
             *, timed: bool) -> str:
    usable = hw.usable_memory_bytes
    gib = 1 << 30
    if variant == ZERO_OFFLOAD and param_bytes > usable:
        return (f"fp16 parameters alone ({param_bytes / gib:.1f} GiB) exceed each GPU's usable "
                f"{usable / gib:.1f} GiB")
    if memory.total_bytes > usable:
        return f"each GPU needs {memory.total_bytes / gib:.1f} GiB, usable {usable / gib:.1f} GiB"
    if host > hw.pinnable_bytes:
        return f"host needs {host / gib:.0f} GiB, pinnable {hw.pinnable_bytes / gib:.0f} GiB (pinnable_host_bytes)"
    if hw.nvme_bytes is not None and nvme > hw.nvme_bytes:
        return f"drives need {nvme / 1e12:.2f} TB, the server has {hw.nvme_bytes / 1e12:.2f} TB (nvme_bytes)"
    if not timed:
        return f"hardware {hw.name} states no host_memory_gbps: the CPU optimizer step cannot be timed"
    return ""


def _times(setup: PipelineSetup, layers: list[_Layer], variant: str, num_params: int,
           steps: int) -> ZeroTimes | None:
    hw = setup.hardware
    if hw.host_memory_gbps is None:
        return None
    rates = server_rates(hw)
    n = hw.num_devices
    compute = steps * sum(x.forward_s + x.backward_s for x in layers)
    forward = backward = 0.0
    for k in range(steps):
        if variant == ZERO_OFFLOAD:
            fwd = [LayerStep(compute_s=x.forward_s) for x in layers]
            bwd = [LayerStep(compute_s=x.backward_s, drain=_offload_grad_drain(x, n, k, last=k == steps - 1))
                   for x in reversed(layers)]
        else:
            nvme = variant == ZERO_INFINITY_NVME
            fwd = [LayerStep(compute_s=x.forward_s, fetch=_param_fetch(x, n, nvme),
                             drain=with_host_copies(Load(d2h=x.checkpoint_bytes), n)) for x in layers]
            bwd = [LayerStep(compute_s=x.backward_s,
                             fetch=_param_fetch(x, n, nvme) + with_host_copies(Load(h2d=x.checkpoint_bytes), n),
                             drain=_infinity_grad_drain(x, n, k, to_drives=nvme and k == steps - 1))
                   for x in reversed(layers)]
        forward += pipelined_s(fwd, rates)
        backward += pipelined_s(bwd, rates)
    optimizer, update = _step_s(setup, variant, num_params, rates)
    return ZeroTimes(compute_s=compute, forward_s=forward, backward_s=backward, optimizer_s=optimizer,
                     param_update_s=update)


def _per_rank(nbytes: int, n: int) -> float:
    return nbytes / n


def _offload_grad_drain(x: _Layer, n: int, micro_step: int, *, last: bool) -> Load:
    """zero-offload, after a layer's backward: reduce-scatter its gradients and, after the
    first micro-step, bring the partition accumulated on the host back to add to; then
    send the partition to the host, in fp32 into the step's gradients on the last
    micro-step (DeepSpeed's `async_inplace_copy_grad_to_fp32_buffer_from_gpu` casts it on
    the GPU first), in its own dtype into the accumulation buffer before."""
    part = _per_rank(x.profile.grad_bytes, n)
    out = _per_rank(FP32_BYTES * x.num_params, n) if last else part
    load = Load(ring=ring_wire_bytes(x.profile.grad_bytes, n, all_reduce=False), d2h=out,
                h2d=part if micro_step else 0.0)
    return with_host_copies(load, n)


def _param_fetch(x: _Layer, n: int, nvme: bool) -> Load:
    """zero-infinity, before a layer runs: each rank's 1/N of its fp16 parameters from the
    host (read from the drives first, NVMe variant) and their all-gather."""
    load = with_host_copies(Load(h2d=_per_rank(x.profile.param_bytes, n),
                                 ring=ring_wire_bytes(x.profile.param_bytes, n, all_reduce=False)), n)
    if nvme:  # the drives' DMA writes the host buffers the copies read
        load += Load(nvme_read=x.profile.param_bytes, host=x.profile.param_bytes)
    return load


def _infinity_grad_drain(x: _Layer, n: int, micro_step: int, *, to_drives: bool) -> Load:
    """zero-infinity, after a layer's backward: reduce-scatter, partition to the host, where
    the CPU adds it into the fp32 partition. `to_drives` (NVMe variant, last micro-step):
    the fp32 partitions are then written to the drives (stage3.py's
    `_swap_out_offload_fp32_gradients` at the accumulation boundary; the drives' DMA reads
    the host buffers)."""
    load = with_host_copies(Load(ring=ring_wire_bytes(x.profile.grad_bytes, n, all_reduce=False),
                                 d2h=_per_rank(x.profile.grad_bytes, n)), n)
    cpu = x.num_params * (CPU_ACCUMULATE_BYTES if micro_step else CPU_ACCUMULATE_BYTES - FP32_BYTES)
    load += Load(host=cpu)
    if to_drives:
        grads32 = FP32_BYTES * x.num_params
        load += Load(nvme_write=grads32, host=grads32)
    return load


def _step_s(setup: PipelineSetup, variant: str, num_params: int, rates: Rates) -> tuple[float, float]:
    """The optimizer step after the last micro-step, and what follows it: (step, update)."""
    hw = setup.hardware
    n = hw.num_devices
    adam = host_adam_step_s(math.ceil(num_params / n), hw, sharers=n)
    param_bytes = sum(x.param_bytes for x in setup.profile.layers)
    # after the step DeepSpeed casts the fp32 partition into the fp16 one (`copy_`; the
    # cast reads the fp32 parameters again; `host_adam` counts the fp16 write)
    cast = Load(host=FP32_BYTES * num_params)
    if variant == ZERO_OFFLOAD:
        # stage 2 copies the cast partition to its GPU (torch casts on the CPU first), then
        # all-gathers it; nothing overlaps either
        copy = with_host_copies(Load(h2d=_per_rank(param_bytes, n)), n) + cast
        gather = load_s(Load(ring=ring_wire_bytes(param_bytes, n, all_reduce=False)), rates)
        return adam, load_s(copy, rates) + gather
    if variant == ZERO_INFINITY:
        return adam + load_s(cast, rates), 0.0  # the host's fp16 partition is the parameters' home
    # NVMe: DeepSpeed's default optimizer swapper (PartitionedOptimizerSwapper; offload_optimizer's
    # pipeline_read/pipeline_write default False) reads each sub-group's states (fp32 master,
    # moments) and fp32 gradients from the drives, waits, steps it, writes the states back and
    # waits, then the next sub-group: drives and CPU take turns. The new fp16 parameters are
    # written to the drives too.
    states = sum(x.optim_bytes for x in setup.profile.layers) + FP32_BYTES * num_params
    io = Load(nvme_read=states + FP32_BYTES * num_params, nvme_write=states + param_bytes)
    dram = adam + load_s(cast + Load(host=io.nvme_read + io.nvme_write), rates)
    drives = io.nvme_read / rates.nvme_read_gbps / 1e9 + io.nvme_write / rates.nvme_write_gbps / 1e9  # type: ignore[operator]
    return dram + drives, 0.0
