"""A GPU's reserve: what a training process takes on the device besides the plan's tensors.

A plan fills `memory_bytes - reserve_bytes` of each device (`Hardware.usable_memory_bytes`).
The reserve is the sum of five causes (`mpress.hardware.server.ReserveSpec`); `gpu_reserve`
derives them for a GPU from the figures below, and every GPU preset states the same
figures with their sources (tests/hardware/test_hardware.py checks they agree). What can be
measured on one GPU (the context, cuBLAS) is measured by `mpress.hardware.probe`, and
tests/hardware/test_gpu_reserve.py checks the reserve covers it there.

- unreported: nominal memory (`memory_bytes`, the datasheet's GiB) less what CUDA
  reports as the device's total (cudaMemGetInfo / totalGlobalMem), which ECC, the
  driver and firmware keep. Per model (presets); a detected GPU's total already is
  what NVML reports, and NVML's total is itself above CUDA's (see `gpu_reserve`).
- context: `CONTEXT_BYTES`.
- cuBLAS: `CUBLAS_HANDLES` workspaces of torch's default size, each in a segment of the
  caching allocator (`allocator_segment_bytes`), plus `CUBLAS_KERNELS_BYTES`.
- NCCL: `NCCL_CONNECTIONS` x `NCCL_CHANNELS` x `NCCL_CHANNEL_BUFFERS_BYTES`, plus NVLink
  SHARP buffers on Hopper behind NVSwitch (`NCCL_NVLS_BYTES_PER_GPU` per GPU).
- fragmentation: `FRAGMENTATION_FRACTION` of CUDA's total.

The derived figures are rounded up to whole MiB. Units: bytes.
"""

from __future__ import annotations

import math

from mpress.hardware.server import MiB, ReserveSpec, load_hardware
from mpress.config.presets import hardware_presets

CONTEXT_BYTES = 768 * MiB
"""The CUDA context of a torch process. Measured at creation with lazy module loading
(torch's default since 1.13): 287,047,680 B after one small tensor (pytorch/pytorch#86509,
CUDA 11.7), "around 400MB" (pytorch/pytorch#109888), 426 MiB with torch 2.10 and CUDA 13
on an RTX 6000 Ada (unslothai/unsloth-zoo#1053). Kernels (torch's, NCCL's, cuBLAS's)
load into it as they are first used during training, so the budget is about 1.8x the
largest creation figure: an assumption, not a measurement."""

CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
"""torch's default cuBLAS workspace per (handle, stream) on pre-Hopper GPUs: 8 MiB +
128 KiB (`CUBLAS_WORKSPACE_CONFIG` default, aten/src/ATen/cuda/CublasHandlePool.cpp);
cuBLASLt shares it (`TORCH_CUBLASLT_UNIFIED_WORKSPACE`, the default)."""
CUBLAS_WORKSPACE_BYTES_HOPPER = 4096 * 8 * 1024
"""The same on compute capability 9.0 (H100/H200): 32 MiB."""
CUBLAS_HANDLES = 2
"""cuBLAS handles are per thread (CublasHandlePool.cpp): the training thread's forward
and autograd's device thread's backward each have one, both on the compute stream."""
CUBLAS_KERNELS_BYTES = 64 * MiB
"""The handles' own memory and cuBLAS kernels loaded lazily: an assumption, measured by
`mpress.hardware.probe` (its `cublas_bytes` include it)."""

NCCL_CHANNEL_BUFFERS_BYTES = 10 * MiB
"""One connection's buffers on one channel: LL 8 x 512 x 8 x 16 = 524,288 B, LL128
120 x 640 x 8 x 8 = 4,915,200 B and Simple 4 MiB (NCCL src/init.cc DEFAULT_LL_BUFFSIZE,
DEFAULT_LL128_BUFFSIZE, DEFAULT_BUFFSIZE; src/include/device.h), 9,633,792 B mapped in
2 MiB granules: the 10,485,760-B buffers NVIDIA/nccl#1685 shows on 8xH100."""
NCCL_CHANNELS = 32
"""Channels per connection: 32 per GPU pair on 8xH100 (NVIDIA/nccl#1685); NCCL uses
fewer where links are slower, so this bounds V100 and A100 servers too."""
NCCL_CONNECTIONS = 4
"""Peers a pipeline rank connects to: the previous and next stage (torch's NCCL process
group makes a two-rank communicator per send/recv pair) and its two ring neighbours in
the job's collective group (losses, barriers)."""
NCCL_NVLS_BYTES_PER_GPU = 16 * 2 * 8 * (128 << 10)
"""NVLink SHARP on Hopper behind NVSwitch, per GPU of the node: 16 channels
(NVLS_NCHANNELS_SM90) x 2 x 128 KiB chunks (NCCL_NVLS_CHUNKSIZE) x 8 steps
(NCCL src/transport/nvls.cc, ncclNvlsBufferSetup: nvlsPerRankSize x nHeads)."""

FRAGMENTATION_FRACTION = 0.05
"""The caching allocator's fragmentation, as a fraction of CUDA's total: an assumption
(blocks are rounded up to 512 B, 2 MiB and 20 MiB segments are split; the swap and
optimizer streams' frees wait for their events), not measured here."""

LARGE_ALLOC_BYTES = 10 * MiB
LARGE_SEGMENT_BYTES = 20 * MiB
ROUND_LARGE_BYTES = 2 * MiB
SMALL_SIZE_BYTES = 1 * MiB
SMALL_SEGMENT_BYTES = 2 * MiB


def allocator_segment_bytes(nbytes: int) -> int:
    """The segment torch's caching allocator maps for one request of `nbytes` when none
    is free: 2 MiB up to 1 MiB, 20 MiB below 10 MiB, else rounded up to 2 MiB
    (c10/cuda/CUDACachingAllocator.cpp, get_allocation_size)."""
    if nbytes <= SMALL_SIZE_BYTES:
        return SMALL_SEGMENT_BYTES
    if nbytes < LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-nbytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


def _mib_up(nbytes: float) -> int:
    return math.ceil(nbytes / MiB) * MiB


def gpu_reserve(*, memory_bytes: int, cuda_total_bytes: int, hopper: bool, nvswitch_gpus: int = 0) -> ReserveSpec:
    """The reserve of one GPU (see the module docstring).

    memory_bytes: the device's memory as the hardware model states it (a preset's
    nominal figure, or NVML's total for a detected GPU). cuda_total_bytes: what CUDA
    reports as its total (cudaMemGetInfo; at most `memory_bytes`). hopper: compute
    capability 9.x (larger cuBLAS workspace, NVLink SHARP). nvswitch_gpus: GPUs sharing
    the NVSwitch fabric (0: none).
    """
    if not 0 < cuda_total_bytes <= memory_bytes:
        raise ValueError(f"CUDA's total ({cuda_total_bytes}) must be in (0, memory_bytes={memory_bytes}]")
    workspace = CUBLAS_WORKSPACE_BYTES_HOPPER if hopper else CUBLAS_WORKSPACE_BYTES
    nvls = NCCL_NVLS_BYTES_PER_GPU * nvswitch_gpus if hopper and nvswitch_gpus > 1 else 0
    return ReserveSpec(
        unreported_bytes=memory_bytes - cuda_total_bytes,
        context_bytes=CONTEXT_BYTES,
        cublas_bytes=_mib_up(CUBLAS_HANDLES * allocator_segment_bytes(workspace) + CUBLAS_KERNELS_BYTES),
        nccl_bytes=_mib_up(NCCL_CONNECTIONS * NCCL_CHANNELS * NCCL_CHANNEL_BUFFERS_BYTES + nvls),
        fragmentation_bytes=_mib_up(FRAGMENTATION_FRACTION * cuda_total_bytes),
    )


def reserve_for(name: str, *, cuda_total_bytes: int, hopper: bool) -> tuple[ReserveSpec, str]:
    """The reserve mpress plans with on a GPU named `name` (as CUDA and NVML name it):
    the preset's whose device has that name, else `gpu_reserve` for that GPU on its own
    (no NVSwitch known, its memory as CUDA reports it); and where it came from
    ("preset <name>" or "derived")."""
    for preset in hardware_presets():
        device = load_hardware(preset).device
        if device.name == name and device.reserve is not None:
            return device.reserve, f"preset {preset}"
    return gpu_reserve(memory_bytes=cuda_total_bytes, cuda_total_bytes=cuda_total_bytes, hopper=hopper), "derived"
