"""The channel model of the ZeRO baselines (`zero.py`): what one GPU of a data-parallel
server can move per second on each path, and how long a layer's copies and compute take
when they overlap.

Every GPU runs the same program at once (data parallelism), so one GPU's view bounds the
server:

- PCIe, per GPU: its uplink's effective bandwidth in each direction over the GPUs behind
  the same switch, all of which copy at once (`channels.pcie_sharers`, the emulator's
  sharing rule); the slowest group bounds.
- NVLink collectives (all-gather, reduce-scatter), per GPU: a ring over NVLink puts
  (n-1)/n of the bytes on each GPU's outgoing links (`data_parallel.ring_wire_bytes`).
  On NVSwitch a GPU sends at its port (`d2d.static.ports.nvlink_port_gbps`); on a mesh
  NCCL builds rings over every link of a GPU (several rings at once, each hop one link),
  so a GPU sends at the sum of its links, the GPU with the fewest bounding. No NVLink:
  the ring hops through the host over PCIe.
- Host DRAM, for the whole server: every GPU's host copies, the drives' DMA and the CPU
  optimizer's traffic (`Hardware.host_memory_gbps`; None: DRAM does not bound copies).
- The local drive array, for the whole server: read and write (`Hardware.nvme_gbps`).

A phase takes the longest of its compute and of each channel's bytes over its rate (the
channels run in parallel, fair sharing within one): the "slower bounds" model. A pass over
the layers is a two-deep software pipeline, as DeepSpeed runs it: layer i's fetches
(parameters, checkpoints) are prefetched during layer i-1's compute and its gradients
leave during layer i+1's compute (`pipelined_s`). Per-copy latencies are not counted
(each layer moves megabytes to gigabytes).

Units: bytes, seconds, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from mpress.d2d.static.ports import nvlink_port_gbps
from mpress.hardware.server import Hardware
from mpress.static.emulate.channels import pcie_sharers


@dataclass(frozen=True, kw_only=True)
class Rates:
    """Bandwidths one GPU sees while all GPUs of the server do the same, GB/s."""

    h2d_gbps: float
    """Host to this GPU over its (shared) PCIe uplink."""
    d2h_gbps: float
    """This GPU to host over its (shared) PCIe uplink."""
    ring_gbps: float
    """What a ring collective sends out of this GPU per second."""
    host_gbps: float | None
    """Host DRAM, the whole server (None: unbounded)."""
    nvme_read_gbps: float | None
    """The drive array, the whole server (None: no drives)."""
    nvme_write_gbps: float | None


@dataclass(frozen=True, kw_only=True)
class Load:
    """Bytes one phase moves on each channel. h2d, d2h and ring are one GPU's; host and
    nvme_* the whole server's."""

    h2d: float = 0.0
    d2h: float = 0.0
    ring: float = 0.0
    host: float = 0.0
    nvme_read: float = 0.0
    nvme_write: float = 0.0

    def __add__(self, other: Load) -> Load:
        return Load(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def server_rates(hardware: Hardware) -> Rates:
    """The server's channels as one of its GPUs sees them when all copy at once."""
    everyone = range(hardware.num_devices)
    sharers = max(pcie_sharers(hardware, d, everyone) for d in everyone)
    h2d = hardware.pcie_gbps("h2d") / sharers
    d2h = hardware.pcie_gbps("d2h") / sharers
    port = nvlink_port_gbps(hardware)
    if port is not None:
        ring = port
    else:
        ring = min(sum(hardware.nvlink_gbps(d, p) for p in everyone) for d in everyone)
    if ring <= 0:  # no NVLink: each ring hop goes device -> host -> device
        ring = min(h2d, d2h)
    return Rates(h2d_gbps=h2d, d2h_gbps=d2h, ring_gbps=ring, host_gbps=hardware.host_memory_gbps,
                 nvme_read_gbps=hardware.nvme_read_gbps if hardware.has_nvme else None,
                 nvme_write_gbps=hardware.nvme_gbps("write") if hardware.has_nvme else None)


def with_host_copies(load: Load, num_devices: int) -> Load:
    """`load` with the host DRAM bytes of every GPU's PCIe copies added (each GPU moves
    `h2d` + `d2h`; the server's DRAM carries all of them)."""
    return load + Load(host=num_devices * (load.h2d + load.d2h))


def load_s(load: Load, rates: Rates) -> float:
    """Seconds the busiest channel takes for `load` (channels run in parallel)."""
    times = [load.h2d / rates.h2d_gbps, load.d2h / rates.d2h_gbps, load.ring / rates.ring_gbps]
    if rates.host_gbps is not None:
        times.append(load.host / rates.host_gbps)
    for nbytes, gbps, what in ((load.nvme_read, rates.nvme_read_gbps, "read"),
                               (load.nvme_write, rates.nvme_write_gbps, "write")):
        if nbytes:
            if gbps is None:
                raise ValueError(f"a load reads or writes drives ({what}) on a server without them")
            times.append(nbytes / gbps)
    return max(times) / 1e9


@dataclass(frozen=True, kw_only=True)
class LayerStep:
    """One layer's forward or backward in a pass: its compute, what must arrive before it
    (prefetched during the previous layer) and what leaves after it (during the next)."""

    compute_s: float
    fetch: Load = Load()
    drain: Load = Load()


def pipelined_s(steps: list[LayerStep], rates: Rates) -> float:
    """Seconds of a pass over `steps` in order: while layer i computes, layer i+1's fetch
    and layer i-1's drain share the channels; the first fetch and the last drain are
    exposed."""
    if not steps:
        return 0.0
    total = load_s(steps[0].fetch, rates)
    for i, step in enumerate(steps):
        nxt = steps[i + 1].fetch if i + 1 < len(steps) else Load()
        prev = steps[i - 1].drain if i > 0 else Load()
        total += max(step.compute_s, load_s(nxt + prev, rates))
    return total + load_s(steps[-1].drain, rates)
