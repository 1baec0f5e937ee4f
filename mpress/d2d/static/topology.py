"""Local GPU topology: detect it through NVML and compare it with a hardware config.

`detect_local_hardware()` asks NVML (package `nvidia-ml-py`, module `pynvml`, imported
lazily) for the GPUs of this machine, their NVLink links and PCIe layout, and builds a
`mpress.hardware.server.Hardware` from them. On a machine without NVIDIA GPUs (no driver, no
library, zero devices) it returns `(None, reason)` instead of raising, so callers can
say why there is nothing to show.

The NVML-free parts are pure functions tested without a GPU:
`normalize_bus_id`, `link_matrix_from_remote_ids`, `nvlink_gbps_per_link_for_version`,
`compare_topology`.

Units: bytes, GB/s (GB = 1e9 bytes), FLOP/s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from mpress.errors import TopologyError
from mpress.hardware.gpu_reserve import gpu_reserve
from mpress.hardware.server import DeviceSpec, Hardware

DETECTED_COMPUTE_EFFICIENCY = 0.4
"""Default compute efficiency of a detected machine: an assumption (not measured), in the
range the shipped presets use for transformer training; pass another to override."""

# Nominal per-link bandwidth per direction, GB/s, by the value nvmlDeviceGetNvLinkVersion
# returns. Older drivers return the major version (1..4), newer ones the
# nvmlNvlinkVersion_t enum (1=1.0, 2=2.0, 3=2.2, 4=3.0, 5=3.1, 6=4.0, 7=5.0). The two
# readings agree on every value below: NVLink1 20 GB/s (P100 whitepaper), NVLink2/3/4
# 25 GB/s (V100, A100, H100 whitepapers), NVLink5 50 GB/s (Blackwell: 1.8 TB/s over 18 links).
_NVLINK_GBPS_BY_VERSION = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 25.0, 6: 25.0, 7: 50.0}

# Nominal PCIe bandwidth per lane per direction, GB/s, by generation
# (transfer rate x encoding efficiency / 8 bits; PCI Express Base Specifications).
_PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 8 * 128 / 130 / 8, 4: 16 * 128 / 130 / 8,
                       5: 32 * 128 / 130 / 8, 6: 64 * 242 / 256 / 8}

# Vendor peak FLOP/s for GPU models NVML names (substring of nvmlDeviceGetName, first
# match wins; datasheet dense figures, no sparsity). Models not listed fall back to
# fp32 = CUDA cores x 2 x max SM clock (what NVML can report) and no tensor figures.
_KNOWN_PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("V100-SXM2", {"fp32": 15.7e12, "fp16": 125e12}),          # V100 datasheet, SXM2
    ("V100-PCIE", {"fp32": 14e12, "fp16": 112e12}),            # V100 datasheet, PCIe
    ("A100-SXM", {"fp32": 19.5e12, "fp16": 312e12, "bf16": 312e12}),   # A100 datasheet
    ("A100-PCIE", {"fp32": 19.5e12, "fp16": 312e12, "bf16": 312e12}),  # A100 datasheet
    ("H100 80GB HBM3", {"fp32": 67e12, "fp16": 989e12, "bf16": 989e12}),  # H100 SXM datasheet
    ("H100 PCIe", {"fp32": 51e12, "fp16": 756e12, "bf16": 756e12}),     # H100 PCIe datasheet
)


def normalize_bus_id(bus_id: str | bytes) -> str:
    """Canonical PCI bus id `dddd:bb:dd.f` (lower-case hex, 4-digit domain).

    NVML reports `00000000:07:00.0` (8-digit domain) in `busId` and `0000:07:00.0` in
    `busIdLegacy`; sysfs and CUDA use other widths. A missing domain means domain 0.
    Raises TopologyError for text that is not a bus id.
    """
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    text = text.strip().rstrip("\x00").lower()
    parts = text.split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    try:
        domain, bus, rest = parts
        device, function = rest.split(".")
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function, 16):x}"
    except ValueError:
        raise TopologyError(f"not a PCI bus id: {text!r} (expected domain:bus:device.function)") from None


def link_matrix_from_remote_ids(own_bus_ids: list[str],
                                remote_ids_per_gpu: list[list[str]]) -> tuple[list[list[int]], bool]:
    """NVLink link counts per GPU pair from the remote PCI id of each active link.

    own_bus_ids[i] is GPU i's PCI bus id; remote_ids_per_gpu[i] lists, for each active
    NVLink link of GPU i, the PCI bus id at its far end. A remote id equal to another
    GPU's id is a direct link to that GPU; a remote id that matches no GPU is an NVSwitch
    (or another non-GPU endpoint), reported as `nvswitch=True`. Bus-id formats are
    normalised first. The matrix is as reported: symmetry is the caller's check.
    """
    if len(own_bus_ids) != len(remote_ids_per_gpu):
        raise TopologyError(f"{len(own_bus_ids)} GPU bus ids but {len(remote_ids_per_gpu)} remote-id lists")
    own = [normalize_bus_id(b) for b in own_bus_ids]
    index = {bus: i for i, bus in enumerate(own)}
    if len(index) != len(own):
        raise TopologyError(f"two GPUs report the same PCI bus id: {own}")
    n = len(own)
    matrix = [[0] * n for _ in range(n)]
    nvswitch = False
    for i, remotes in enumerate(remote_ids_per_gpu):
        for remote in remotes:
            j = index.get(normalize_bus_id(remote))
            if j is None:
                nvswitch = True
            elif j != i:  # a link looping back to its own GPU carries no peer traffic
                matrix[i][j] += 1
    return matrix, nvswitch


def nvlink_gbps_per_link_for_version(version: int) -> float | None:
    """Nominal GB/s per link per direction for an NVML NVLink version value (None if unknown)."""
    return _NVLINK_GBPS_BY_VERSION.get(version)


def known_peak_flops(name: str) -> dict[str, float] | None:
    """Datasheet peak FLOP/s per dtype for a GPU model name as NVML reports it, or None."""
    for key, peaks in _KNOWN_PEAK_FLOPS:
        if key.lower() in name.lower():
            return dict(peaks)
    return None


def compare_topology(expected: Hardware, detected: Hardware) -> list[str]:
    """Differences that make a plan for `expected` wrong on `detected` (empty if none).

    Compares the device count, NVSwitch versus mesh, and the NVLink link count of every
    GPU pair (links per GPU under NVSwitch). Device names, memory and bandwidth figures
    are not compared: presets state nominal figures a real machine never reports exactly.
    """
    problems: list[str] = []
    if expected.num_devices != detected.num_devices:
        problems.append(f"device count: expected {expected.num_devices}, found {detected.num_devices}")
    if expected.nvswitch != detected.nvswitch:
        problems.append(f"NVSwitch: expected {_fabric(expected)}, found {_fabric(detected)}")
        return problems
    if expected.nvswitch:
        if expected.nvlink_links_per_gpu != detected.nvlink_links_per_gpu:
            problems.append(f"NVLink links per GPU: expected {expected.nvlink_links_per_gpu}, "
                            f"found {detected.nvlink_links_per_gpu}")
        return problems
    n = min(expected.num_devices, detected.num_devices)
    for i in range(n):
        for j in range(i + 1, n):
            want, got = expected.links(i, j), detected.links(i, j)
            if want != got:
                problems.append(f"GPU{i}-GPU{j}: expected {want} NVLink link(s), found {got}")
    return problems


def _fabric(hw: Hardware) -> str:
    return "NVSwitch" if hw.nvswitch else "point-to-point NVLink mesh"


@dataclass(kw_only=True, frozen=True)
class DetectedGpu:
    """What NVML reports about one GPU."""

    index: int
    """NVML device index (not the CUDA index: NVML numbers every GPU of the machine)."""
    name: str
    """Model name, e.g. "Tesla V100-SXM2-32GB"."""
    memory_bytes: int
    """Total device memory."""
    pci_bus_id: str
    """Normalised PCI bus id (`dddd:bb:dd.f`)."""
    nvlink_remote_bus_ids: list[str] = field(default_factory=list)
    """Far-end PCI bus id of each active NVLink link (GPU-to-CPU links left out)."""
    nvlink_versions: list[int] = field(default_factory=list)
    """NVML NVLink version value of each active link, same order."""
    cuda_total_bytes: int = 0
    """What CUDA reports as the total (NVML's total less what the driver reserves,
    `nvmlDeviceGetMemoryInfo_v2`); 0: as `memory_bytes` (older drivers)."""
    hopper: bool = False
    """Compute capability 9.x (larger cuBLAS workspace, NVLink SHARP buffers)."""


@dataclass(kw_only=True, frozen=True)
class DetectedTopology:
    """The local machine as NVML sees it, and the `Hardware` built from it."""

    gpus: list[DetectedGpu]
    """One entry per device of `hardware`, in its order (NVML's, or the visible order asked for)."""
    link_matrix: list[list[int]]
    """Direct GPU-to-GPU NVLink link counts (symmetric, zero diagonal)."""
    nvswitch: bool
    """True when NVLink links end at an NVSwitch."""
    hardware: Hardware
    """The `Hardware` this machine amounts to (efficiencies are labelled defaults)."""
    notes: list[str] = field(default_factory=list)
    """Assumptions made while building `hardware` (fallbacks, non-uniform devices)."""


def detect_local_hardware(*, nvml: Any = None,
                          compute_efficiency: float = DETECTED_COMPUTE_EFFICIENCY,
                          visible_bus_ids: list[str] | None = None,
                          ) -> tuple[DetectedTopology | None, str]:
    """Detect this machine's GPUs and NVLink topology through NVML.

    visible_bus_ids: describe only these GPUs (PCI bus ids, any format NVML or CUDA
    writes), in this order: device i of the result is the GPU with visible_bus_ids[i].
    Pass the bus ids of the CUDA devices a process sees (CUDA_VISIBLE_DEVICES, SLURM and
    containers leave it a subset, numbered its own way; NVML numbers the whole machine in
    PCI order), so that device i is cuda:i. Their links are NVML's: a link to a GPU left
    out is not mistaken for a switch. None = every GPU, in NVML's order.

    Returns `(topology, "")`, or `(None, reason)` when there is nothing to detect: the
    `pynvml` module or the NVML library is missing, NVML fails to initialise (no driver),
    or it reports zero GPUs. `nvml` replaces the `pynvml` module (tests pass a fake).
    Raises TopologyError when NVML answers but the answers are inconsistent (e.g. GPU i
    sees two links to GPU j but j sees one), or a visible bus id is not one of NVML's GPUs.
    """
    if nvml is None:
        try:
            import pynvml as nvml  # lazy: mpress must import and run without it
        except ImportError:
            return None, "no NVIDIA GPU found: pynvml (package nvidia-ml-py) is not installed"
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, OSError, ...
        return None, f"no NVIDIA GPU found: NVML not available ({_describe(exc)})"
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            return None, "no NVIDIA GPU found: NVML reports 0 devices"
        return _detect(nvml, count, compute_efficiency, visible_bus_ids), ""
    except nvml.NVMLError as exc:
        return None, f"NVML query failed: {_describe(exc)}"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # shutdown failures change nothing we report
            pass


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _detect(nvml: Any, count: int, compute_efficiency: float,
            visible_bus_ids: list[str] | None) -> DetectedTopology:
    every = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    bus_ids = [_bus_id(nvml.nvmlDeviceGetPciInfo(h)) for h in every]
    order = list(range(count)) if visible_bus_ids is None else _nvml_order(bus_ids, visible_bus_ids)
    handles = [every[i] for i in order]
    gpus = [_detect_gpu(nvml, i, every[i]) for i in order]
    # Remote ids are matched against every GPU NVML lists, so a link to a GPU left out
    # ends at a GPU (not at a switch); then only the links between the chosen GPUs count.
    remotes: list[list[str]] = [[] for _ in range(count)]
    for i, g in zip(order, gpus):
        remotes[i] = g.nvlink_remote_bus_ids
    every_matrix, nvswitch = link_matrix_from_remote_ids(bus_ids, remotes)
    matrix = [[every_matrix[i][j] for j in order] for i in order]
    count = len(order)
    for i in range(count):
        for j in range(count):
            if matrix[i][j] != matrix[j][i]:
                raise TopologyError(f"NVML reports {matrix[i][j]} NVLink link(s) from GPU{i} to GPU{j} "
                                    f"but {matrix[j][i]} back; a link may be down on one side")
    notes: list[str] = []
    names = sorted({g.name for g in gpus})
    if len(names) > 1:
        notes.append(f"mixed GPU models {names}: using {gpus[0].name} and the smallest memory")
    peaks = known_peak_flops(gpus[0].name)
    if peaks is None:
        peaks = _peak_from_cores(nvml, handles[0])
        if peaks is None:
            raise TopologyError(f"peak FLOP/s of {gpus[0].name!r} unknown: not in mpress's table and "
                                "NVML reports no core count; describe the machine in a hardware YAML")
        notes.append(f"{gpus[0].name}: fp32 peak from CUDA cores x 2 x max SM clock; no tensor-core figures")

    versions = sorted({v for g in gpus for v in g.nvlink_versions})
    per_link_gbps = 0.0
    if versions:
        known = [nvlink_gbps_per_link_for_version(v) for v in versions]
        if any(k is None for k in known):
            notes.append(f"unknown NVLink version value(s) {versions}: assuming 25 GB/s per link")
        per_link_gbps = min((k for k in known if k is not None), default=25.0)

    links_per_gpu = 0
    if nvswitch:
        counts = [len(g.nvlink_remote_bus_ids) for g in gpus]
        links_per_gpu = min(counts)
        if len(set(counts)) > 1:
            notes.append(f"NVLink links per GPU differ {counts}: using the smallest, {links_per_gpu}")
        if any(any(row) for row in matrix):
            notes.append("some links join GPUs directly besides the NVSwitch: counted as switch links")

    pcie_gbps, pcie_note = _pcie_gbps(nvml, handles[0])
    if pcie_note:
        notes.append(pcie_note)
    # what a plan leaves free: the same causes as the presets' reserves (mpress.hardware.gpu_reserve)
    memory_bytes = min(g.memory_bytes for g in gpus)
    reserve = gpu_reserve(memory_bytes=memory_bytes,
                          cuda_total_bytes=min(g.cuda_total_bytes or g.memory_bytes for g in gpus),
                          hopper=any(g.hopper for g in gpus), nvswitch_gpus=count if nvswitch else 0)
    hardware = Hardware(
        name="local",
        source="detected through NVML; peak FLOP/s from datasheets, efficiencies are defaults",
        num_devices=count,
        device=DeviceSpec(name=gpus[0].name, memory_bytes=memory_bytes, peak_flops=peaks,
                          reserve_bytes=reserve.total_bytes, reserve=reserve),
        compute_efficiency=compute_efficiency,
        host_memory_bytes=_host_memory_bytes(),
        pcie_h2d_gbps=pcie_gbps,
        pcie_d2h_gbps=pcie_gbps,
        pcie_switches=_pcie_switch_groups(nvml, handles),
        nvswitch=nvswitch,
        nvlink_links_per_gpu=links_per_gpu,
        nvlink_links=None if nvswitch or not any(any(r) for r in matrix) else matrix,
        nvlink_gbps_per_link=per_link_gbps,
    )
    return DetectedTopology(gpus=gpus, link_matrix=matrix, nvswitch=nvswitch, hardware=hardware, notes=notes)


def _nvml_order(bus_ids: list[str], visible_bus_ids: list[str]) -> list[int]:
    """NVML index of each visible GPU, in the visible order."""
    index = {b: i for i, b in enumerate(bus_ids)}
    order: list[int] = []
    for k, raw in enumerate(visible_bus_ids):
        bus = normalize_bus_id(raw)
        if bus not in index:
            raise TopologyError(f"CUDA device {k} (PCI {bus}) is not one of the {len(bus_ids)} GPUs NVML lists "
                                f"({', '.join(bus_ids)})")
        if index[bus] in order:
            raise TopologyError(f"CUDA devices {order.index(index[bus])} and {k} are the same GPU (PCI {bus}; MIG "
                                "instances?): mpress plans whole GPUs, one per CUDA device")
        order.append(index[bus])
    return order


def _bus_id(pci: Any) -> str:
    """Bus id of an nvmlPciInfo_t (`busId`, or `busIdLegacy` on old structs)."""
    raw = getattr(pci, "busId", "") or getattr(pci, "busIdLegacy", "")
    return normalize_bus_id(raw)


def _detect_gpu(nvml: Any, index: int, handle: Any) -> DetectedGpu:
    name = nvml.nvmlDeviceGetName(handle)
    name = name.decode() if isinstance(name, bytes) else str(name)
    remotes: list[str] = []
    versions: list[int] = []
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    cpu_type = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_IBMNPU", None)
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != enabled:
                continue
            # POWER9 machines link GPUs to the CPU over NVLink: neither a peer nor a switch.
            if cpu_type is not None and hasattr(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType"):
                try:
                    if nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link) == cpu_type:
                        continue
                except nvml.NVMLError:
                    pass  # old drivers: fall back to the PCI id alone
            remote = _bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link))
            version = nvml.nvmlDeviceGetNvLinkVersion(handle, link)
        except nvml.NVMLError:
            # NotSupported / InvalidArgument: this GPU has no such link (or no NVLink at all).
            continue
        remotes.append(remote)
        versions.append(int(version))
    total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    return DetectedGpu(
        index=index, name=name, memory_bytes=total,
        pci_bus_id=_bus_id(nvml.nvmlDeviceGetPciInfo(handle)),
        nvlink_remote_bus_ids=remotes, nvlink_versions=versions,
        cuda_total_bytes=total - _driver_reserved_bytes(nvml, handle), hopper=_compute_major(nvml, handle) == 9,
    )


def _driver_reserved_bytes(nvml: Any, handle: Any) -> int:
    """Device memory the driver keeps (NVML's `reserved`, memory info v2); 0 where the
    driver or pynvml cannot say."""
    try:
        return int(nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2).reserved)
    except (AttributeError, TypeError, nvml.NVMLError):
        return 0


def _compute_major(nvml: Any, handle: Any) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetCudaComputeCapability(handle)[0])
    except (AttributeError, nvml.NVMLError):
        return None


def _peak_from_cores(nvml: Any, handle: Any) -> dict[str, float] | None:
    try:
        cores = nvml.nvmlDeviceGetNumGpuCores(handle)
        clock_mhz = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)
    except (AttributeError, nvml.NVMLError):
        return None
    if cores <= 0 or clock_mhz <= 0:
        return None
    return {"fp32": 2.0 * cores * clock_mhz * 1e6}  # one FMA = 2 FLOP per core per clock


def _pcie_gbps(nvml: Any, handle: Any) -> tuple[float, str]:
    """Nominal PCIe GB/s per direction of the GPU's link (max generation x width)."""
    try:
        gen = int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
        width = int(nvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
    except nvml.NVMLError:
        gen, width = 0, 0
    per_lane = _PCIE_GBPS_PER_LANE.get(gen)
    if per_lane is None or width <= 0:
        return 16 * _PCIE_GBPS_PER_LANE[3], "PCIe generation/width unknown: assuming gen3 x16"
    return width * per_lane, ""


def _pcie_switch_groups(nvml: Any, handles: list[Any]) -> list[list[int]]:
    """GPUs that meet below a host bridge (behind one or more PCIe switches) share an uplink."""
    n = len(handles)
    shared = {getattr(nvml, "NVML_TOPOLOGY_SINGLE", 10), getattr(nvml, "NVML_TOPOLOGY_MULTIPLE", 20)}
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i in range(n):
        for j in range(i + 1, n):
            try:
                level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
            except (AttributeError, nvml.NVMLError):
                return []  # unknown layout: treat every GPU as having its own uplink
            if level in shared:
                parent[root(j)] = root(i)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(root(i), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def _host_memory_bytes() -> int:
    """Physical host memory (POSIX sysconf; CUDA training hosts are Linux)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        raise TopologyError("cannot read the host memory size (sysconf); "
                            "describe the machine in a hardware YAML") from None
