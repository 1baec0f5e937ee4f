"""Per-GPU NVLink ports: the one model of what a GPU can send and receive over NVLink at
once, shared by the device mapper (`mapping.MappingProblem.from_hardware`) and the
emulator's channels (`mpress.static.emulate.channels`).

- NVSwitch: each GPU's links end at the switches, so every peer it talks to shares them:
  one port per GPU and direction (egress, ingress) at links x per-link rate x efficiency.
  A copy from p to d is bounded by p's egress and d's ingress.
- Mesh (DGX-1): each link joins one pair and carries only that pair's traffic; a GPU's
  links are disjoint, so the per-pair link is the only limit (no port).

Units: GB/s (1e9 bytes/s) per direction.
"""

from __future__ import annotations

from mpress.hardware.server import Hardware


def nvlink_port_gbps(hw: Hardware) -> float | None:
    """Effective per-direction NVLink port of each GPU, GB/s, shared by all its peers;
    None where links are disjoint (a mesh) or absent."""
    port = hw.nvlink_links_per_gpu * hw.nvlink_gbps_per_link * hw.nvlink_efficiency
    return port if hw.nvswitch and port > 0 else None


def port_gbps_per_device(hw: Hardware) -> tuple[float, ...] | None:
    """`nvlink_port_gbps` for each device (the mapper's `port_gbps`), or None."""
    port = nvlink_port_gbps(hw)
    return None if port is None else (port,) * hw.num_devices


def nvlink_egress_gbps(hw: Hardware, device: int, peers: list[int] | None = None) -> float:
    """What `device` can send over NVLink at once, GB/s: its port on NVSwitch; on a mesh
    the sum of its links to `peers` (default: every device), each link carrying only its
    pair's traffic. 0 when it has no NVLink."""
    port = nvlink_port_gbps(hw)
    targets = range(hw.num_devices) if peers is None else peers
    links = sum(hw.nvlink_gbps(device, p) for p in targets if p != device)
    return min(port, links) if port is not None else links
