"""What a plan keeps in host memory, and whether the server's host holds it: one sum for
the planner (`planner_layer_data.host_why`, which calls a plan unfit) and for the plan
check (`plan_check`, which refuses a plan), so the two never disagree about a plan.

A plan takes host memory in four parts:

- **pools**: each stage's pinned host pool (`StagePlan.pinned_host_bytes`), which the
  stage's host swaps use;
- **slabs**: the pinned staging slabs of the stages whose optimizer steps on the host
  (gradients in, parameters out; the static side's `rewriter.host_step_pinned_bytes`);
- **drive staging**: the pinned staging buffers of each stage with `nvme` rules: the
  runtime's drive store (`mpress/runtime/swap/nvme.py`) moves every byte between the
  device and the file through one buffer per direction of `NVME_STAGING_BYTES`, pinned
  apart from the pool (`drive_staging_bytes`: what both the plan and the store read);
- **pageable**: the host-step stages' fp32 copies and Adam states (not pinned).

The first three are pinned: they must fit what the server lets plans pin
(`Hardware.pinnable_bytes`); all four its host memory. Units: bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mpress.config.vocabulary import OptimizerStep, Technique
from mpress.contract.plan import Plan, StagePlan
from mpress.hardware.server import Hardware

NVME_STAGING_BYTES = 8 << 20
"""Pinned staging buffer of a drive store, per direction (device -> file, file -> device):
large enough for sequential drive I/O, small beside the pools a large model's plan pins.
A power of two, so every drive's logical block size (a power of two, at most this)
divides it: the store pins exactly twice this, no more."""

PINNED, MEMORY = "pinned", "memory"
"""What `HostBytes.exceeds` names: the server's pinnable memory, or its host memory."""


def on_drive(sp: StagePlan) -> bool:
    """Whether stage `sp` keeps optimizer states on the local drive (it has `nvme` rules;
    a stage stepping on the host has none, `StagePlan` refuses them)."""
    return sp.optimizer_step is not OptimizerStep.HOST and any(r.technique is Technique.NVME for r in sp.rules)


def drive_staging_bytes(sp: StagePlan) -> int:
    """Pinned bytes of stage `sp`'s drive staging buffers: both directions' (0 without a drive)."""
    return 2 * NVME_STAGING_BYTES if on_drive(sp) else 0


@dataclass(frozen=True)
class HostBytes:
    """A plan's host memory in its parts (see the module docstring)."""

    pools: int
    slabs: int
    drive: int
    pageable: int

    @property
    def pinned(self) -> int:
        """What is page-locked: pools, host steps' slabs and drive staging."""
        return self.pools + self.slabs + self.drive

    @property
    def total(self) -> int:
        return self.pinned + self.pageable

    def exceeds(self, hardware: Hardware) -> str | None:
        """`PINNED` when the pinned parts exceed what `hardware` lets plans pin, else
        `MEMORY` when all parts exceed its host memory, else None (it holds them)."""
        if self.pinned > hardware.pinnable_bytes:
            return PINNED
        if self.total > hardware.host_memory_bytes:
            return MEMORY
        return None


def host_bytes(plan: Plan, host_step_bytes: Mapping[int, tuple[int, int]]) -> HostBytes:
    """The host memory of `plan`, given per stage stepping its optimizer on the host the
    (pinned, pageable) bytes of that step (the static side's figures from the profile)."""
    return HostBytes(pools=sum(sp.pinned_host_bytes for sp in plan.stages),
                     slabs=sum(p for p, _h in host_step_bytes.values()),
                     drive=sum(drive_staging_bytes(sp) for sp in plan.stages),
                     pageable=sum(h for _p, h in host_step_bytes.values()))
