"""The hardware model: devices, host memory, PCIe and NVLink topology.

Loaded from `configs/hardware/<name>.yaml` (a preset name) or any YAML path. Used by the
static half (emulator channels, planner capacities) and by the runtime's topology check,
so it lives outside both.

Units: bytes, seconds, GB/s with GB = 1e9 bytes, FLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from mpress.config.loader import from_dict, load_yaml
from mpress.config.presets import HARDWARE_DIR, resolve_config
from mpress.errors import ConfigError, UserError
from mpress.config.limits import MAX_DEVICES, MAX_LATENCY_S, MAX_NVLINK_LINKS, MIN_BANDWIDTH_GBPS
from mpress.config.units import MAX_BYTES, fmt_bytes

MiB = 1 << 20


@dataclass(kw_only=True, frozen=True)
class ReserveSpec:
    """What `DeviceSpec.reserve_bytes` holds back from plans, by cause; bytes. A preset
    states each figure's source; `gpu_reserve` derives them for any GPU (see its
    constants); `mpress.hardware.probe` measures the context and cuBLAS shares."""

    unreported_bytes: int = field(default=0, metadata={"min": 0, "max": MAX_BYTES})
    """Nominal memory CUDA does not report: `memory_bytes` less cudaMemGetInfo's total
    (ECC, driver and firmware reservations)."""
    context_bytes: int = field(default=0, metadata={"min": 0, "max": MAX_BYTES})
    """The process's CUDA context, with the kernel modules loaded into it as they are
    first used (CUDA's lazy loading)."""
    cublas_bytes: int = field(default=0, metadata={"min": 0, "max": MAX_BYTES})
    """cuBLAS/cuBLASLt: one workspace per handle and stream, from the caching allocator
    (torch makes a handle per thread: the training thread's and autograd's), and what
    the handles and their kernels take."""
    nccl_bytes: int = field(default=0, metadata={"min": 0, "max": MAX_BYTES})
    """NCCL's buffers: per connection (peer) and channel one set of LL, LL128 and Simple
    buffers; NVLink SHARP buffers on NVSwitch Hopper."""
    fragmentation_bytes: int = field(default=0, metadata={"min": 0, "max": MAX_BYTES})
    """What the caching allocator holds but cannot hand out (blocks rounded up, split
    segments)."""

    @property
    def total_bytes(self) -> int:
        return (self.unreported_bytes + self.context_bytes + self.cublas_bytes + self.nccl_bytes
                + self.fragmentation_bytes)


DEFAULT_PEER_CONTEXT_BYTES = 512 << 20
"""GPU memory of one CUDA context that an exporter process creates on a lender GPU.

Opening a peer pool makes its GPU current (torch's `_new_shared_cuda` puts a `CUDAGuard`
on the handle's device, torch/csrc/StorageSharing.cpp) before `cudaIpcOpenMemHandle` maps
the pool "into the current device address space", so each process that opens a pool on
GPU j (and the process that allocates an idle GPU's pool there) holds a primary context
on j, in memory that no plan of j's own process counts. Size: a bound, not a measurement
here. torch sets CUDA_MODULE_LOADING=LAZY since 1.13 (pytorch/pytorch#86509, which
measured a process's context at 287,047,680 bytes lazily loaded against 666,632,192
eagerly); 512 MiB covers the lazy figure with room for the copy kernels' modules and for
drivers that take more (the 300-500 MiB usually seen on recent drivers). The default of
`DeviceSpec.peer_context_bytes`."""


@dataclass(kw_only=True, frozen=True)
class DeviceSpec:
    """One accelerator (or CPU stand-in)."""

    name: str
    """Marketing name, e.g. "Tesla V100-SXM2-32GB"."""
    memory_bytes: int = field(metadata={"gt": 0, "max": MAX_BYTES})
    """Nominal device memory."""
    reserve_bytes: int = field(default=0, metadata={"min": 0, "max": MAX_BYTES})
    """What a training process cannot plan with: memory CUDA does not report, the CUDA
    context, libraries' buffers (cuBLAS, NCCL) and the caching allocator's
    fragmentation. Plans fit `memory_bytes - reserve_bytes`."""
    reserve: ReserveSpec | None = None
    """`reserve_bytes` by cause (GPU presets give it, with sources); when given,
    `reserve_bytes` must be its total."""
    peak_flops: dict[str, float] = field(metadata={"gt": 0})
    """Nominal dense peak FLOP/s per dtype: keys fp32, fp16, bf16 (bf16 may be absent)."""
    memory_gbps: float | None = field(default=None, metadata={"gt": 0})
    """Nominal device memory bandwidth, GB/s: what an operator that computes little (a
    norm, an activation, dropout) takes is its bytes read and written over this (a
    recompute's replay is mostly such operators). None: such operators cost nothing."""
    peer_context_bytes: int = field(default=DEFAULT_PEER_CONTEXT_BYTES, metadata={"min": 0, "max": MAX_BYTES})
    """Memory one exporter process's CUDA context takes on a GPU whose peer pool it
    opens (see `DEFAULT_PEER_CONTEXT_BYTES`); 0 for stand-ins whose pools are shared
    memory (no context)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.peak_flops) - {"fp32", "fp16", "bf16"})
        if unknown:
            raise ConfigError("", f"peak_flops.{unknown[0]}", "unknown dtype (allowed: fp32, fp16, bf16)")
        if "fp32" not in self.peak_flops:
            raise ConfigError("", "peak_flops.fp32", "missing required key (a number, FLOP/s)")
        if self.reserve_bytes >= self.memory_bytes:
            raise ConfigError("", "reserve_bytes", f"must be below memory_bytes ({self.memory_bytes})")
        if self.reserve is not None and self.reserve.total_bytes != self.reserve_bytes:
            raise ConfigError("", "reserve_bytes", f"must equal the sum of reserve.* ({self.reserve.total_bytes})")


@dataclass(kw_only=True, frozen=True)
class Hardware:
    """A single server: identical devices, their host, PCIe and NVLink."""

    name: str
    """Preset name."""
    num_devices: int = field(metadata={"min": 1, "max": MAX_DEVICES})
    """Number of devices (GPUs, or CPU stand-ins for cpu-local)."""
    device: DeviceSpec
    """The (identical) device model."""
    compute_efficiency: float = field(default=0.5, metadata={"gt": 0, "max": 1})
    """Fraction of peak FLOP/s that model layers achieve (analytic times = FLOPs / (peak x this))."""
    host_memory_bytes: int = field(metadata={"gt": 0, "max": MAX_BYTES})
    """Host memory (RAM) of the server."""
    pinnable_host_bytes: int | None = field(default=None, metadata={"gt": 0, "max": MAX_BYTES})
    """Host memory that can be page-locked for swap buffers: RAM less what the OS and the
    training processes need unpinned. None: all of `host_memory_bytes` (see `pinnable_bytes`)."""
    host_memory_gbps: float | None = field(default=None, metadata={"min": MIN_BANDWIDTH_GBPS})
    """Sustained host DRAM bandwidth, GB/s, shared by every GPU's host copies in both
    directions, and by the CPU optimizer steps (a plan's `optimizer_step: host`, the ZeRO
    baselines). None: DRAM never limits host copies (only PCIe does), and a CPU step
    cannot be timed (such plans are refused)."""
    nvme_bytes: int | None = field(default=None, metadata={"gt": 0, "max": MAX_BYTES})
    """Capacity of the server's local data drives (NVMe; SATA SSDs on a DGX-1) in one
    array (RAID 0), what ZeRO-Infinity may offload parameters and optimizer states to.
    None: no local drives to offload to (set with `nvme_read_gbps`)."""
    nvme_read_gbps: float | None = field(default=None, metadata={"min": MIN_BANDWIDTH_GBPS})
    """Sustained sequential read bandwidth of that array, GB/s, shared by all GPUs' traffic."""
    nvme_write_gbps: float | None = field(default=None, metadata={"min": MIN_BANDWIDTH_GBPS})
    """Sustained sequential write bandwidth of that array, GB/s (drives write slower than
    they read); None: as `nvme_read_gbps`."""
    pcie_h2d_gbps: float = field(metadata={"min": MIN_BANDWIDTH_GBPS})
    """Nominal host-to-device PCIe bandwidth per GPU, GB/s."""
    pcie_d2h_gbps: float = field(metadata={"min": MIN_BANDWIDTH_GBPS})
    """Nominal device-to-host PCIe bandwidth per GPU, GB/s."""
    pcie_efficiency: float = field(default=0.8, metadata={"gt": 0, "max": 1})
    """Achieved fraction of nominal PCIe bandwidth with pinned memory."""
    pcie_switches: list[list[int]] = field(default_factory=list)
    """Groups of GPUs behind one PCIe switch; they share its uplink in each direction.
    GPUs not listed have an uplink of their own."""
    nvswitch: bool = False
    """True when GPUs meet in an NVSwitch fabric: every pair reaches the other over all of
    its links, and a GPU's links are shared among all the peers it talks to at once."""
    nvlink_links_per_gpu: int = field(default=0, metadata={"min": 0, "max": MAX_NVLINK_LINKS})
    """NVSwitch only: NVLink links per GPU."""
    nvlink_links: list[list[int]] | None = field(default=None, metadata={"min": 0, "max": MAX_NVLINK_LINKS})
    """Mesh only: NVLink link count for each GPU pair (symmetric, zero diagonal),
    as `nvidia-smi topo -m` shows NV<n>; 0 = no NVLink (traffic goes over PCIe)."""
    nvlink_gbps_per_link: float = field(default=0.0, metadata={"min": 0})
    """Nominal bandwidth of one NVLink link per direction, GB/s."""
    nvlink_efficiency: float = field(default=0.8, metadata={"gt": 0, "max": 1})
    """Achieved fraction of nominal NVLink bandwidth."""
    pcie_latency_s: float = field(default=10e-6, metadata={"min": 0, "max": MAX_LATENCY_S})
    """Fixed cost of one PCIe copy."""
    nvlink_latency_s: float = field(default=5e-6, metadata={"min": 0, "max": MAX_LATENCY_S})
    """Fixed cost of one NVLink copy."""
    optimizer_foreach: bool = True
    """The optimizer updates a group of parameters in fused multi-tensor calls, whose
    temporaries span the whole group (torch's default on GPUs); False: one tensor at a
    time (torch's default on the CPU)."""
    source: str = ""
    """Where the nominal figures come from (datasheet citation)."""

    def __post_init__(self) -> None:
        n = self.num_devices
        if self.nvswitch:
            if self.nvlink_links is not None:
                raise ConfigError("", "nvlink_links", "not allowed with nvswitch: true (use nvlink_links_per_gpu)")
        elif self.nvlink_links is not None:
            m = self.nvlink_links
            if len(m) != n or any(len(row) != n for row in m):
                raise ConfigError("", "nvlink_links", f"must be a {n}x{n} matrix (num_devices is {n})")
            for i in range(n):
                if m[i][i] != 0:
                    raise ConfigError("", f"nvlink_links[{i}][{i}]", "diagonal must be 0")
                for j in range(n):
                    if m[i][j] < 0:
                        raise ConfigError("", f"nvlink_links[{i}][{j}]", "link counts must be >= 0")
                    if m[i][j] != m[j][i]:
                        raise ConfigError(
                            "", f"nvlink_links[{i}][{j}]",
                            f"matrix is not symmetric: [{i}][{j}]={m[i][j]} but [{j}][{i}]={m[j][i]}",
                        )
        seen: set[int] = set()
        for g, group in enumerate(self.pcie_switches):
            for d in group:
                if not 0 <= d < n:
                    raise ConfigError("", f"pcie_switches[{g}]", f"device {d} out of range 0..{n - 1}")
                if d in seen:
                    raise ConfigError("", f"pcie_switches[{g}]", f"device {d} is behind two switches")
                seen.add(d)
        if (self.nvme_bytes is None) != (self.nvme_read_gbps is None):
            key = "nvme_read_gbps" if self.nvme_read_gbps is None else "nvme_bytes"
            raise ConfigError("", key, "nvme_bytes and nvme_read_gbps are given together (or neither)")
        if self.nvme_write_gbps is not None and self.nvme_bytes is None:
            raise ConfigError("", "nvme_write_gbps", "needs nvme_bytes and nvme_read_gbps")
        if self.pinnable_host_bytes is not None and self.pinnable_host_bytes > self.host_memory_bytes:
            raise ConfigError("", "pinnable_host_bytes", f"must be at most host_memory_bytes ({self.host_memory_bytes})")

    # -- links -----------------------------------------------------------------------------
    @property
    def pinnable_bytes(self) -> int:
        """What plans may pin on the host: `pinnable_host_bytes`, else all host memory."""
        return self.host_memory_bytes if self.pinnable_host_bytes is None else self.pinnable_host_bytes

    @property
    def has_nvme(self) -> bool:
        """Whether the server states local drives to offload to (`nvme_bytes`)."""
        return self.nvme_bytes is not None

    def nvme_gbps(self, direction: Literal["read", "write"]) -> float:
        """Sustained bandwidth of the local drive array in one direction, GB/s (the server
        must have one: `has_nvme`)."""
        if self.nvme_read_gbps is None:
            raise UserError(f"hardware {self.name}: no nvme_bytes / nvme_read_gbps (no local drives stated)")
        if direction == "write" and self.nvme_write_gbps is not None:
            return self.nvme_write_gbps
        return self.nvme_read_gbps

    @property
    def usable_memory_bytes(self) -> int:
        """What a plan may fill on each device: its memory less the reserve."""
        return self.device.memory_bytes - self.device.reserve_bytes

    def links(self, i: int, j: int) -> int:
        """NVLink link count between devices i and j (0 when none or i == j)."""
        if i == j:
            return 0
        if self.nvswitch:
            return self.nvlink_links_per_gpu
        if self.nvlink_links is None:
            return 0
        return self.nvlink_links[i][j]

    def nvlink_gbps(self, i: int, j: int) -> float:
        """Effective one-direction NVLink bandwidth from i to j, GB/s (0 if not linked)."""
        return self.links(i, j) * self.nvlink_gbps_per_link * self.nvlink_efficiency

    def pcie_gbps(self, direction: Literal["h2d", "d2h"]) -> float:
        """Effective PCIe bandwidth per uplink in one direction, GB/s."""
        nominal = self.pcie_h2d_gbps if direction == "h2d" else self.pcie_d2h_gbps
        return nominal * self.pcie_efficiency

    def pcie_group(self, device: int) -> int:
        """Index of the PCIe uplink `device` sits behind (shared by a switch's GPUs)."""
        for g, group in enumerate(self.pcie_switches):
            if device in group:
                return g
        return len(self.pcie_switches) + device

    def peak_flops(self, dtype: str) -> float:
        """Nominal peak FLOP/s for `dtype`; a dtype the device lacks (bf16 on V100) is an error."""
        table = self.device.peak_flops
        if dtype in table:
            return table[dtype]
        raise UserError(f"hardware {self.name}: {self.device.name} has no {dtype} peak FLOP/s "
                        f"(it supports {', '.join(sorted(table))})")

    @property
    def symmetric(self) -> bool:
        """True when every GPU pair has the same NVLink bandwidth (NVSwitch or a uniform mesh)."""
        if self.nvswitch:
            return True
        values = {self.links(i, j) for i in range(self.num_devices) for j in range(self.num_devices) if i != j}
        return len(values) <= 1


def load_hardware(name_or_path: str | Path, *, num_devices: int | None = None,
                  memory_bytes: int | None = None) -> Hardware:
    """Load a hardware preset or file.

    num_devices/memory_bytes override the file (meant for `cpu-local`, whose device
    count and budget are chosen per run); a mesh link matrix cannot be resized.
    """
    path = resolve_config(name_or_path, HARDWARE_DIR, "hardware")
    hw = from_dict(Hardware, load_yaml(path), str(path))
    if num_devices is not None and num_devices != hw.num_devices:
        if num_devices < 1:
            raise UserError(f"--devices must be >= 1, got {num_devices}")
        if not hw.nvswitch and hw.nvlink_links is not None:
            raise UserError(f"{path}: has a fixed {hw.num_devices}-device link matrix; cannot use {num_devices} devices")
        hw = replace(hw, num_devices=num_devices,
                     pcie_switches=[[d for d in g if d < num_devices] for g in hw.pcie_switches])
    if memory_bytes is not None:
        if memory_bytes <= 0:
            raise UserError(f"device memory must be > 0 bytes, got {memory_bytes}")
        if memory_bytes <= hw.device.reserve_bytes:  # a size given without its unit reads as bytes
            raise UserError(f"--device-memory: {fmt_bytes(memory_bytes)} is not above {path}'s reserve of "
                            f"{fmt_bytes(hw.device.reserve_bytes)} (what the CUDA context and workspaces take); "
                            "a size takes its unit, e.g. 16GB")
        hw = replace(hw, device=replace(hw.device, memory_bytes=memory_bytes))
    return hw
