"""The server's copy channels as the emulator sees them: PCIe up/down per switch group,
NVLink per directed pair (or NVSwitch egress per GPU), with effective bandwidths.
Units: bytes, seconds, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from mpress.hardware import Hardware
from mpress.static.program import Channel, Transfer


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
