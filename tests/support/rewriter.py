"""The toy pipeline of the rewriter tests (tests/static/test_rewriter*.py): its profile,
a plan for it, `Case` (a schedule, a plan and the rewritten schedule, placed, lowered and
emulated on demand the way `evaluate_plan` does it), and helpers for expected action
strings and memory figures.

Toy profile (MB = 1e6 bytes), layer i = 0..7 named `layers.i` (most tests use 0..3):
  saved `layers.i.ln#0`: the layer's input (IN[i]: the previous layer's output, or for
  layer 0 the token ids, 0.05 MB), `layers.i.fc#0` 4 MB, `layers.i.fc#1` 1 MB,
  `layers.i.act#0` (i+1) MB: its own activations ACT[i] = 6, 7, 8, 9 MB, ...;
  output OUT[i] = (i+1) x 0.1 MB; forward (10+i) x 0.1 ms, backward twice that;
  parameters 1 MB (250k fp32), gradients 1 MB, Adam 2 MB, master weights 1 MB.
Its memory (`LayerMemory`, as the probe would count it):
  kept: what it saved that is new plus its output, ACT[i] + OUT[i] (its input exists
    already and stays, saved, until its backward: saves_input); no transient in forward;
  backward: makes the gradient of its input (IN[i], none for the token ids) and the
    parameters' gradients, nothing else;
  recomputed (checkpointed): keeps its input and output only (OUT[i]); its forward and
    its backward (which recomputes) hold ACT[i] on top for a moment.
"""

from __future__ import annotations

from dataclasses import replace

from mpress.contract.actions import Schedule, format_actions
from mpress.hardware.server import Hardware, load_hardware
from mpress.config.model_config import load_model_config
from mpress.contract.plan import Plan, StagePlan, TensorRule
from mpress.static.emulate.emulator import EmulatorResult
from mpress.static.plan.evaluate import Evaluation, PipelineSetup, evaluate
from mpress.static.memory.model import memory_model
from mpress.static.memory.stage_costs import stage_costs
from mpress.static.plan.plan_eval import evaluate_plan
from mpress.static.profile.profile import LayerMemory, LayerProfile, Profile, SavedTensor
from mpress.static.emulate.program import Program, walk_peaks
from mpress.static.plan.rewriter import Rewritten, rewrite
from mpress.static.schedules import build_schedule

MB = 10**6
OUT = [(i + 1) * 100_000 for i in range(8)]
"""Output bytes of layer i (the next layer's input)."""
IDS = 50_000
"""Token ids of one microbatch (layer 0's input) and its targets."""
IN = [IDS] + OUT[:-1]
"""Input bytes of layer i."""
ACT = [(6 + i) * 10**6 for i in range(8)]
"""What layer i saves besides its input: fc#0 + fc#1 + act#0."""
FWD = [(10 + i) * 1e-4 for i in range(8)]
"""Forward seconds of layer i."""
PARAM = GRAD = MASTER = 1 * MB
ADAM = 2 * MB
NUM_PARAMS = 250_000
DGX1 = load_hardware("dgx1-v100")
FAST = replace(DGX1, pcie_h2d_gbps=1e6, pcie_d2h_gbps=1e6, nvlink_gbps_per_link=1e6,
               pcie_latency_s=0.0, nvlink_latency_s=0.0)
"""DGX-1 with copies so fast that they never bound anything."""


def toy_memory(i: int) -> tuple[LayerMemory, LayerMemory]:
    """Layer i's memory kept and recomputed (see the module docstring)."""
    input_grad = 0 if i == 0 else IN[i]
    plain = LayerMemory(kept_bytes=ACT[i] + OUT[i], forward_peak_bytes=ACT[i] + OUT[i], saves_input=True,
                        backward_peak_bytes=input_grad + GRAD, input_grad_bytes=input_grad, output_bytes=OUT[i])
    recomputed = LayerMemory(kept_bytes=OUT[i], forward_peak_bytes=ACT[i] + OUT[i], saves_input=True,
                             backward_peak_bytes=ACT[i] + input_grad + GRAD, input_grad_bytes=input_grad,
                             output_bytes=OUT[i])
    return plain, recomputed


def toy_profile(num_layers: int = 4) -> Profile:
    layers = []
    for i in range(num_layers):
        plain, recomputed = toy_memory(i)
        layers.append(LayerProfile(
            name=f"layers.{i}", forward_flops=1e9, backward_flops=2e9,
            forward_time_s=FWD[i], backward_time_s=2 * FWD[i],
            saved=[SavedTensor(module=f"layers.{i}.ln", index=0, bytes=IN[i], input=True),
                   SavedTensor(module=f"layers.{i}.fc", index=0, bytes=4 * MB),
                   SavedTensor(module=f"layers.{i}.fc", index=1, bytes=1 * MB),
                   SavedTensor(module=f"layers.{i}.act", index=0, bytes=(i + 1) * MB)],
            param_bytes=PARAM, grad_bytes=GRAD, optim_bytes=ADAM, master_bytes=MASTER, largest_param_bytes=PARAM,
            output_bytes=OUT[i], memory=plain, recompute_memory=recomputed,
        ))
    return Profile(model="toy", model_fingerprint="toy", source="analytic", device="dgx1-v100", dtype="fp32",
                   microbatch_size=1, layers=layers, input_bytes=IDS, target_bytes=IDS)


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
    """A toy pipeline, a plan for it, and the rewritten schedule; `evaluation` places,
    lowers and emulates it as `evaluate_plan` does (policy: the plan's swap-in policy;
    `layer-ahead` keeps the rewriter's placement, `capacity` moves swap-ins earlier)."""

    def __init__(self, name: str, ranges: list[tuple[int, int]], num_microbatches: int,
                 rules: dict[int, list[TensorRule]], hardware: Hardware = DGX1, **sched_kw: int) -> None:
        self.profile = toy_profile(ranges[-1][1])
        self.ranges = ranges
        self.hardware = hardware
        self.schedule = build_schedule(name, len(ranges), num_microbatches, **sched_kw)  # type: ignore[arg-type]
        self.costs = stage_costs(self.profile, ranges)
        self.plan = make_plan(rules, ranges, self.schedule)
        self.rw: Rewritten = rewrite(self.plan, self.schedule, self.costs, hardware)
        devices = [self.schedule.stage_to_rank[s] for s in range(self.schedule.num_stages)]
        self.setup = PipelineSetup(model=load_model_config("gpt-tiny"), hardware=hardware, profile=self.profile,
                                   microbatch_size=1, ranges=ranges, schedule=self.schedule, stage_to_device=devices,
                                   costs=self.costs, memory=memory_model(self.costs, self.schedule, hardware, devices))

    def rank(self, r: int) -> str:
        return format_actions(list(self.rw.schedule.ranks[r]))

    def evaluation(self, rewritten: bool = True, policy: str = "layer-ahead") -> Evaluation:
        if not rewritten:
            return evaluate(self.setup)
        return evaluate_plan(self.setup, replace(self.plan, swap_in_policy=policy))  # type: ignore[arg-type]

    def program(self, rewritten: bool = True, policy: str = "layer-ahead") -> Program:
        return self.evaluation(rewritten, policy).program

    def emulate(self, rewritten: bool = True, policy: str = "layer-ahead") -> EmulatorResult:
        return self.evaluation(rewritten, policy).result


def walk(program: Program, rank: int) -> list[tuple[str, int]]:
    """Rank `rank`'s memory walk: (task label, its peak) per task (`walk_peaks`)."""
    tasks = program.ranks[rank]
    return [(t.label(), b) for t, b in zip(tasks, walk_peaks(tasks, program.static_bytes[rank]))]


def rise(program: Program, rank: int) -> dict[str, int]:
    """Rank `rank`'s memory walk as {task label: its peak less the rank's static bytes}
    (labels are unique where each microbatch's actions appear once)."""
    static = program.static_bytes[rank]
    return {label: b - static for label, b in walk(program, rank)}


def expand(text: str, **names: str) -> str:
    """`{T}`-style placeholders keep the expected strings readable."""
    return " ".join(text.split()).format(**names)
