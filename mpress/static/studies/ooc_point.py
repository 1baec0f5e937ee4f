"""One point of the out-of-core model: a batch on one device under both swap-in policies.

For a batch (`ooc_model.ooc_setup`: one stage, the batch as microbatches):

1. The in-memory iteration: the program without memory actions, emulated. Its time is
   the reference every other time is divided by (what the batch costs with infinite
   device memory), and its emulated peak is the batch's footprint.
2. Per swap-in policy (`SwapInPolicy`: layer-ahead as in vDNN, capacity-based): where the
   footprint exceeds the device's usable memory, the planner's host-swap strategy
   (`planner.plan_strategy`, one stage) decides what goes to the host, with the policy as
   its `swap_in_policy` and every swap-in one compute action ahead of its backward
   (`_OneAheadWriter` says why; optimizer data moved whole under both policies, without the
   planner's last step, so that only the swap-ins' timing differs), and emulates its program; where the footprint fits, nothing is
   swapped and the policy's run IS the in-memory one (the emulated walk is what the
   runtime measures; the planner's memory model, which decides its first shed, can ask
   to shed below the footprint, which would swap for nothing).
3. The result per policy: iteration time, normalised time (iteration / in-memory), samples
   per second, peak, bytes swapped, and the stalls the emulator blames on each swapped
   tensor and technique.

`reemulate` runs a point's plans again on other hardware (another host-link bandwidth):
the same rules, the program they make there.

Units: bytes, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mpress.config.vocabulary import Strategy, SwapInPolicy
from mpress.contract.plan import Plan
from mpress.hardware.server import Hardware
from mpress.static.emulate.emulator import EmulatorResult
from mpress.static.plan.evaluate import Evaluation, PipelineSetup, evaluate
from mpress.static.plan.plan_eval import evaluate_plan
from mpress.static.plan.planner import PlannerOptions, plan_strategy
from mpress.static.plan.planner_layer_data import plan_pinned_bytes
from mpress.static.studies.ooc_defaults import POLICIES
from mpress.static.studies.ooc_model import OocModel, ooc_setup

TOP_STALLS = 3
"""Tensors named per policy as where the stalls are."""


@dataclass(frozen=True, kw_only=True)
class PolicyRun:
    """One swap-in policy's emulated iteration of a batch."""

    policy: SwapInPolicy
    fits: bool
    """Its peak is within the device's usable memory."""
    swapped: bool
    """Whether anything goes to the host (False: the in-memory run)."""
    iteration_s: float
    normalised: float
    """iteration_s / the in-memory iteration_s (>= 1 when it swaps: copies only add waits)."""
    samples_per_s: float
    peak_bytes: int
    host_bytes: int
    """Host memory the plan pins: its pools, its host optimizer steps' staging slabs and
    its drive's staging buffers (`planner_layer_data.plan_pinned_bytes`, the sum the plan
    check and the planner read)."""
    stall_s: float
    """Compute stalls, all causes."""
    stall_s_by_cost: dict[str, float]
    """Stall per technique blamed (`host` for activations' swap-ins, `optimizer-offload`...)."""
    top_stalls: tuple[tuple[str, float], ...]
    """The `TOP_STALLS` swapped units with the most stall blamed on them (unit id, seconds)."""
    plan: Plan | None = field(default=None, repr=False, compare=False)
    """The host-swap plan (None when nothing is swapped)."""


@dataclass(frozen=True, kw_only=True)
class OocPoint:
    """A batch on one device: its in-memory iteration and each policy's."""

    batch_size: int
    microbatch_size: int
    num_microbatches: int
    capacity_bytes: int
    """Usable device memory."""
    in_memory_s: float
    """The iteration with infinite device memory."""
    footprint_bytes: int
    """The in-memory iteration's emulated peak."""
    runs: dict[SwapInPolicy, PolicyRun]

    @property
    def over_capacity(self) -> bool:
        """The footprint exceeds device memory: past the knee."""
        return self.footprint_bytes > self.capacity_bytes

    @property
    def in_memory_samples_per_s(self) -> float:
        return self.batch_size / self.in_memory_s


def policy_run(policy: SwapInPolicy, result: EmulatorResult, in_memory_s: float, *, plan: Plan | None,
               setup: PipelineSetup) -> PolicyRun:
    """What one policy's emulated iteration says (`result`), normalised by `in_memory_s`;
    `plan` (None: nothing swapped) pins host memory as read from `setup`'s costs."""
    host_bytes = plan_pinned_bytes(plan, setup.costs) if plan is not None else 0
    by_tensor = sorted(((t, s) for t, s in result.stall_s_by_tensor.items() if s > 0), key=lambda x: -x[1])
    return PolicyRun(policy=policy, fits=result.fits, swapped=plan is not None, iteration_s=result.iteration_s,
                     normalised=result.iteration_s / in_memory_s, samples_per_s=result.samples_per_s,
                     peak_bytes=result.peak_bytes[0], host_bytes=host_bytes, stall_s=result.stall_s,
                     stall_s_by_cost={str(k): v for k, v in result.stall_s_by_cost.items() if v > 0},
                     top_stalls=tuple(by_tensor[:TOP_STALLS]), plan=plan)


def plan_host_swap(setup: PipelineSetup, policy: SwapInPolicy) -> tuple[Plan, Evaluation]:
    """The planner's host-swap search for a one-stage setup under `policy` and the plan's
    evaluation. Every swap-in starts one compute action ahead of its consumer
    (`prefetch_lead` 1), the out-of-core model's definition of both policies: layer-ahead
    brings a tensor back right before the backward that needs it (vDNN), and capacity
    placement (`placement.place_by_capacity`) moves it earlier from there as far as memory
    allows. The planner's derived lead (enough compute actions to cover one microbatch's
    copy back, up to 8) suits a pipeline stage; on one stage, where the backward of
    microbatch 0 follows the last forward, it would bring the swapped tensors back during
    the forwards, so nothing would be saved."""
    # model data placed alike under both policies: only the swap-ins' timing differs
    result = plan_strategy(setup, Strategy.HOST_SWAP, PlannerOptions(swap_in_policy=policy, prefetch_lead=1,
                                                                     optimizer_keep=False))
    return result.plan, result.evaluation


def evaluate_point(model: OocModel, hardware: Hardware, batch_size: int) -> OocPoint:
    """A batch of `batch_size` samples of `model` on `hardware` (one device), both
    policies (see the module docstring)."""
    setup = ooc_setup(model, hardware, batch_size)
    base = evaluate(setup).result
    capacity = hardware.usable_memory_bytes
    runs: dict[SwapInPolicy, PolicyRun] = {}
    for policy in POLICIES:
        if base.peak_bytes[0] <= capacity:
            runs[policy] = policy_run(policy, base, base.iteration_s, plan=None, setup=setup)
            continue
        plan, ev = plan_host_swap(setup, policy)
        runs[policy] = policy_run(policy, ev.result, base.iteration_s, plan=plan, setup=setup)
    return OocPoint(batch_size=batch_size, microbatch_size=model.microbatch_size,
                    num_microbatches=setup.schedule.num_microbatches, capacity_bytes=capacity,
                    in_memory_s=base.iteration_s, footprint_bytes=base.peak_bytes[0], runs=runs)


def reemulate(point: OocPoint, model: OocModel, hardware: Hardware) -> OocPoint:
    """`point`'s plans (what each policy swaps) emulated on `hardware` (same device and
    memory, another host link): the in-memory iteration again, and each plan's rules
    lowered and placed there (its carried program is dropped: the program is re-derived
    from the rules, as `mpress emulate --swap-in-policy` does)."""
    setup = ooc_setup(model, hardware, point.batch_size)
    base = evaluate(setup).result
    runs: dict[SwapInPolicy, PolicyRun] = {}
    for policy, run in point.runs.items():
        if run.plan is None:
            runs[policy] = policy_run(policy, base, base.iteration_s, plan=None, setup=setup)
            continue
        ev = evaluate_plan(setup, replace(run.plan, actions=[]))
        runs[policy] = policy_run(policy, ev.result, base.iteration_s, plan=run.plan, setup=setup)
    return replace(point, in_memory_s=base.iteration_s, footprint_bytes=base.peak_bytes[0], runs=runs)
