"""The server's copy channels as the emulator sees them, with effective bandwidths:

- PCIe up (device->host) and down (host->device) per uplink; the GPUs behind one PCIe
  switch share it (`Hardware.pcie_group`).
- Host DRAM (`host-mem`, where the hardware states `host_memory_gbps`): every host copy,
  both directions, of every GPU.
- The local drive array (`nvme-read`, `nvme-write`, where the hardware states one): every
  GPU's optimizer states a plan keeps on the drive (`nvme` rules) cross it besides PCIe.
- NVLink: on a mesh one channel per directed linked pair; on NVSwitch one egress and one
  ingress port per GPU (`mpress.d2d.static.ports`, the device mapper's port model), so a
  copy from p to d runs on p's egress and d's ingress at once.

A copy that crosses several channels is one `Transfer` per channel, all of its bytes on
each (cut-through): it ends when the last part ends, so the busiest channel bounds it.
This is the mapper's cut model (`maxflow.py`: bytes over a capacity per port and link).

`host_roundtrip_s` and `pcie_sharers` are the one PCIe sharing rule: the planner charges a
host round trip with them, and they are what these channels make of it when that many
GPUs behind one switch copy at once (fair sharing; host DRAM, wider than the uplinks
together on every preset, does not bound a round trip then).

Units: bytes, seconds, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from mpress.d2d.static.ports import nvlink_port_gbps
from mpress.hardware.server import Hardware
from mpress.static.emulate.program import Channel, Transfer

Direction = Literal["h2d", "d2h"]
HOST_MEMORY = "host-mem"
"""Channel id of host DRAM, which every host copy of every GPU reads or writes."""
NVME_READ, NVME_WRITE = "nvme-read", "nvme-write"
"""Channel ids of the server's local drive array, one per direction, shared by all GPUs."""


def pcie_up(hardware: Hardware, device: int) -> str:
    """Channel id of the device->host direction of `device`'s PCIe uplink."""
    return f"pcie-up:{hardware.pcie_group(device)}"


def pcie_down(hardware: Hardware, device: int) -> str:
    """Channel id of the host->device direction of `device`'s PCIe uplink."""
    return f"pcie-down:{hardware.pcie_group(device)}"


def nvlink_path(hardware: Hardware, src: int, dst: int) -> tuple[str, ...]:
    """Channel ids a copy src->dst over NVLink occupies: the directed link on a mesh; src's
    egress and dst's ingress port on NVSwitch."""
    if hardware.nvswitch:
        return (f"nvswitch-out:{src}", f"nvswitch-in:{dst}")
    return (f"nvlink:{src}->{dst}",)


def pcie_channel(hardware: Hardware, direction: Direction, device: int = 0) -> Channel:
    """The PCIe channel of `device`'s uplink in one direction."""
    cid = pcie_down(hardware, device) if direction == "h2d" else pcie_up(hardware, device)
    return Channel(cid, hardware.pcie_gbps(direction), hardware.pcie_latency_s)


def build_channels(hardware: Hardware) -> dict[str, Channel]:
    """Every copy channel of the server with its effective bandwidth."""
    n = hardware.num_devices
    channels: dict[str, Channel] = {}
    port = nvlink_port_gbps(hardware)
    if hardware.host_memory_gbps is not None:
        channels[HOST_MEMORY] = Channel(HOST_MEMORY, hardware.host_memory_gbps, 0.0)
    if hardware.has_nvme:
        channels[NVME_READ] = Channel(NVME_READ, hardware.nvme_gbps("read"), 0.0)
        channels[NVME_WRITE] = Channel(NVME_WRITE, hardware.nvme_gbps("write"), 0.0)
    for d in range(n):
        for direction in ("d2h", "h2d"):
            ch = pcie_channel(hardware, direction, d)
            channels[ch.id] = ch
        if port is not None:
            out_id, in_id = f"nvswitch-out:{d}", f"nvswitch-in:{d}"
            channels[out_id] = Channel(out_id, port, hardware.nvlink_latency_s)
            channels[in_id] = Channel(in_id, port, hardware.nvlink_latency_s)
            continue
        for p in range(n):
            if p != d and hardware.links(d, p) > 0:
                (cid,) = nvlink_path(hardware, d, p)
                channels[cid] = Channel(cid, hardware.nvlink_gbps(d, p), hardware.nvlink_latency_s)
    return channels


def host_transfers(hardware: Hardware, device: int, direction: Direction, num_bytes: int) -> tuple[Transfer, ...]:
    """Transfers of a host copy of `num_bytes` to (h2d) or from (d2h) `device`: its PCIe
    uplink, and host DRAM where the hardware states its bandwidth."""
    pcie = Transfer(pcie_channel(hardware, direction, device).id, num_bytes)
    return (pcie,) if hardware.host_memory_gbps is None else (pcie, Transfer(HOST_MEMORY, num_bytes))


def drive_transfers(hardware: Hardware, device: int, direction: Direction, num_bytes: int) -> tuple[Transfer, ...]:
    """Transfers of a copy of `num_bytes` between `device` and the local drive array (d2h:
    a write, h2d: a read), staged through host memory: the host copy's channels and the
    drive's, cut-through, so the slowest bounds it. The hardware must state a drive."""
    drive = Transfer(NVME_WRITE if direction == "d2h" else NVME_READ, num_bytes)
    return (*host_transfers(hardware, device, direction, num_bytes), drive)


def nvlink_transfers(hardware: Hardware, src: int, dst: int, num_bytes: int) -> tuple[Transfer, ...]:
    """Transfers of an NVLink copy src->dst (the pair must be linked)."""
    return tuple(Transfer(cid, num_bytes) for cid in nvlink_path(hardware, src, dst))


def peer_transfers(hardware: Hardware, src: int, dst: int, num_bytes: int) -> tuple[Transfer, ...]:
    """Transfers that move `num_bytes` from device src to dst: NVLink when linked, else
    through host over both PCIe uplinks (cut-through: the slower one bounds the time)."""
    if src == dst or num_bytes == 0:
        return ()
    if hardware.links(src, dst) > 0:
        return nvlink_transfers(hardware, src, dst, num_bytes)
    return host_transfers(hardware, src, "d2h", num_bytes) + host_transfers(hardware, dst, "h2d", num_bytes)


def pcie_sharers(hardware: Hardware, device: int, copying: Collection[int]) -> int:
    """GPUs that share `device`'s PCIe uplink at once: `device` and those of `copying`
    (devices that move data to or from the host) behind the same switch. >= 1."""
    group = hardware.pcie_group(device)
    return len({device} | {d for d in copying if hardware.pcie_group(d) == group})


def host_roundtrip_s(hardware: Hardware, num_bytes: int, sharers: int = 1) -> float:
    """Seconds of a swap-out then swap-in of `num_bytes` over one PCIe uplink while
    `sharers` GPUs copy on it at once: each direction's channel gives each of them
    1/sharers of its bandwidth (fair sharing), after its latency."""
    total = 0.0
    for direction in ("d2h", "h2d"):
        ch = pcie_channel(hardware, direction)
        total += ch.latency_s + num_bytes * sharers / (ch.gbps * 1e9)
    return total
