"""The toy pipeline of the rewriter tests (tests/static/test_rewriter*.py): its profile,
a plan for it, `Case` (a schedule, a plan and the rewritten schedule, lowered and
emulated on demand), and helpers for expected action strings and memory timelines.

Toy profile (MB = 1e6 bytes), layer i = 0..7 named `layers.i` (most tests use 0..3):
  saved `layers.i.fc#0` 4 MB, `layers.i.fc#1` 1 MB, `layers.i.act#0` (i+1) MB -> 6, 7, 8, 9 MB, ...
  output (i+1) x 0.1 MB; forward (10+i) x 0.1 ms, backward twice that;
  parameters 1 MB (250k fp32), gradients 1 MB, Adam 2 MB, master weights 1 MB.
"""

from __future__ import annotations

from dataclasses import replace

from mpress.actions import Schedule, format_actions
from mpress.hardware import Hardware, load_hardware
from mpress.plan import Plan, StagePlan, TensorRule
from mpress.static.emulator import EmulatorResult, emulate
from mpress.static.lowering import build_program
from mpress.static.memory import stage_costs
from mpress.static.profile import LayerProfile, Profile, SavedTensor
from mpress.static.rewriter import (
    Rewritten,
    offloaded_optim_bytes,
    rewrite,
    stash_offloaded,
)
from mpress.static.schedules import build_schedule

MB = 10**6
OUT = [(i + 1) * 100_000 for i in range(8)]
"""Output bytes of layer i (the next layer's input)."""
FWD = [(10 + i) * 1e-4 for i in range(8)]
"""Forward seconds of layer i."""
PARAM = GRAD = MASTER = 1 * MB
ADAM = 2 * MB
NUM_PARAMS = 250_000
DGX1 = load_hardware("dgx1-v100")
FAST = replace(DGX1, pcie_h2d_gbps=1e6, pcie_d2h_gbps=1e6, nvlink_gbps_per_link=1e6,
               pcie_latency_s=0.0, nvlink_latency_s=0.0)
"""DGX-1 with copies so fast that they never bound anything."""


def toy_profile(num_layers: int = 4) -> Profile:
    layers = [
        LayerProfile(
            name=f"layers.{i}", forward_flops=1e9, backward_flops=2e9,
            forward_time_s=FWD[i], backward_time_s=2 * FWD[i],
            saved=[SavedTensor(module=f"layers.{i}.fc", index=0, bytes=4 * MB),
                   SavedTensor(module=f"layers.{i}.fc", index=1, bytes=1 * MB),
                   SavedTensor(module=f"layers.{i}.act", index=0, bytes=(i + 1) * MB)],
            param_bytes=PARAM, grad_bytes=GRAD, optim_bytes=ADAM, master_bytes=MASTER, output_bytes=OUT[i],
        )
        for i in range(num_layers)
    ]
    return Profile(model="toy", model_fingerprint="toy", source="analytic", device="dgx1-v100", dtype="fp32",
                   microbatch_size=1, layers=layers)


def make_plan(rules: dict[int, list[TensorRule]], ranges: list[tuple[int, int]], schedule: Schedule) -> Plan:
    devices = [schedule.stage_to_rank[s] for s in range(schedule.num_stages)]
    stages = [StagePlan(stage=s, device=devices[s], first_layer=a, end_layer=b, rules=list(rules.get(s, [])))
              for s, (a, b) in enumerate(ranges)]
    return Plan(strategy="test", model="toy", model_fingerprint="m", profile_fingerprint="p", hardware="dgx1-v100",
                hardware_fingerprint="h", num_devices=8, device_memory_bytes=DGX1.device.memory_bytes,
                schedule=schedule.name,  # type: ignore[arg-type]
                num_stages=schedule.num_stages, num_ranks=schedule.num_ranks,
                num_microbatches=schedule.num_microbatches, microbatch_size=1, stage_to_device=devices,
                stages=stages, fits=True)


class Case:
    """A toy pipeline, a plan for it, and the rewritten schedule."""

    def __init__(self, name: str, ranges: list[tuple[int, int]], num_microbatches: int,
                 rules: dict[int, list[TensorRule]], hardware: Hardware = DGX1, **sched_kw: int) -> None:
        self.profile = toy_profile(ranges[-1][1])
        self.ranges = ranges
        self.hardware = hardware
        self.schedule = build_schedule(name, len(ranges), num_microbatches, **sched_kw)  # type: ignore[arg-type]
        self.costs = stage_costs(self.profile, ranges)
        self.plan = make_plan(rules, ranges, self.schedule)
        self.rw: Rewritten = rewrite(self.plan, self.schedule, self.costs, hardware)

    def rank(self, r: int) -> str:
        return format_actions(list(self.rw.schedule.ranks[r]))

    def program(self, rewritten: bool = True, policy: str = "capacity"):
        devices = [self.schedule.stage_to_rank[s] for s in range(self.schedule.num_stages)]
        if not rewritten:
            return build_program(self.profile, self.ranges, self.schedule, self.hardware, microbatch_size=1,
                                 stage_to_device=devices, swap_in_policy=policy)
        offloaded = offloaded_optim_bytes(self.plan, self.costs)
        if self.schedule.weight_stashing:  # the live weights stay on the device when the stashed versions go
            offloaded = [o - (c.param_bytes if gone else 0)
                         for o, c, gone in zip(offloaded, self.costs, stash_offloaded(self.plan, self.costs))]
        return build_program(self.profile, self.ranges, self.rw.schedule, self.hardware, microbatch_size=1,
                             stage_to_device=devices, tensors=self.rw.tensors, offloaded_bytes=offloaded,
                             swap_in_policy=policy)

    def emulate(self, rewritten: bool = True, policy: str = "capacity") -> EmulatorResult:
        return emulate(self.program(rewritten, policy))


def bytes_at(res: EmulatorResult, device: int, t: float) -> int:
    """Bytes in use on `device` once everything that happened at time `t` is done."""
    return [b for ts, b in res.timeline[device] if ts <= t][-1]


def expand(text: str, **names: str) -> str:
    """`{T}`-style placeholders keep the expected strings readable."""
    return " ".join(text.split()).format(**names)
