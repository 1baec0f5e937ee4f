"""Per-GPU NVLink ports: the one model of what a GPU can send and receive over NVLink at
once, shared by the device mapper (`mapping.MappingProblem.from_hardware`) and the
emulator's channels (`mpress.static.channels`).

- NVSwitch: each GPU's links end at the switches, so every peer it talks to shares them:
  one port per GPU and direction (egress, ingress) at links x per-link rate x efficiency.
  A copy from p to d is bounded by p's egress and d's ingress.
- Mesh (DGX-1): each link joins one pair and carries only that pair's traffic; a GPU's
  links are disjoint, so the per-pair link is the only limit (no port).

Units: GB/s (1e9 bytes/s) per direction.
"""

from __future__ import annotations

from mpress.hardware import Hardware


def nvlink_port_gbps(hw: Hardware) -> float | None:
    """Effective per-direction NVLink port of each GPU, GB/s, shared by all its peers;
    None where links are disjoint (a mesh) or absent."""
    port = hw.nvlink_links_per_gpu * hw.nvlink_gbps_per_link * hw.nvlink_efficiency
    return port if hw.nvswitch and port > 0 else None


def port_gbps_per_device(hw: Hardware) -> tuple[float, ...] | None:
    """`nvlink_port_gbps` for each device (the mapper's `port_gbps`), or None."""
    port = nvlink_port_gbps(hw)
    return None if port is None else (port,) * hw.num_devices
