"""Evaluate a plan: check it belongs to a pipeline, rewrite, lower, emulate.

Shared by the planner (every candidate) and `mpress emulate plan.yaml`.

D2D quotas and peer pools are sized as the plan's program needs them: the planner's side
of `mpress.d2d.static.pool_slots`, the layout the runtime's quotas allocate by.
`program_quotas` reads the program (the rewriter's action lists and what each memory
action moves) and gives, per stage and peer device, the quota its D2D data takes there;
the planner writes those quotas into the plan (`with_peer_quotas`), the emulator charges
each lender the pool they make (`pool_bytes_by_device`), and a finished plan whose quotas
are smaller is refused (`check_quotas`), so a plan that passes cannot run a quota out of
room at run time. Units: bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from mpress.config.units import fmt_bytes
from mpress.config.vocabulary import SwapInPolicy, Technique
from mpress.contract.actions import Kind, Schedule, format_actions
from mpress.contract.plan import PeerQuota, Plan, StagePlan
from mpress.contract.plan_check import Shape, check_plan
from mpress.d2d.static.pool_slots import MIN_QUOTA_BYTES, quota_need
from mpress.errors import PlanError
from mpress.static.emulate.emulator import emulate
from mpress.static.emulate.host_memory import pinned_bytes
from mpress.static.emulate.lowering import (
    TensorInfo,
    build_program,
    late_frees,
    lower_rank_traced,
    rank_static_bytes,
)
from mpress.static.emulate.placement import place_by_capacity
from mpress.static.emulate.program import Program
from mpress.static.memory.model import memory_model
from mpress.static.plan.evaluate import Evaluation, PipelineSetup, profile_fingerprint
from mpress.static.plan.rewriter import (
    host_step_bytes,
    host_step_stages,
    offloaded_optim_bytes,
    rewrite,
    stash_offloaded,
)


def check_plan_for_setup(plan: Plan, setup: PipelineSetup, source: str = "plan") -> None:
    """Refuse a plan made for another model, hardware, pipeline shape or profile (all that
    a pipeline setup knows, given to the one plan check)."""
    sched = setup.schedule
    check_plan(plan, source=source, model=setup.model, hardware=setup.hardware,
               shape=Shape(sched.name, sched.num_stages, sched.num_microbatches, setup.microbatch_size),
               ranges=setup.ranges,
               stage_tensors={c.stage: [t.id for t in c.saved] for c in setup.costs},
               stage_layers={c.stage: [x.name for x in c.layers] for c in setup.costs},
               host_step_bytes=host_step_bytes(plan, setup.costs))


def evaluate_plan(setup: PipelineSetup, plan: Plan) -> Evaluation:
    """Emulate one iteration of `setup` under `plan` (its stage-to-device map included):
    the program its rules make here (swap-ins placed by its policy), which must be the one
    the plan carries when it carries one."""
    rw = rewrite(plan, setup.schedule, setup.costs, setup.hardware)
    offloaded = offloaded_optim_bytes(plan, setup.costs)
    if setup.schedule.weight_stashing:  # the live weights stay when the stashed versions go
        offloaded = [o - (c.param_bytes if gone else 0)
                     for o, c, gone in zip(offloaded, setup.costs, stash_offloaded(rw.schedule))]
    quotas = program_quotas(rw.schedule, rw.tensors)
    if plan.actions:  # a finished plan: its quotas must hold what its program puts in them
        check_quotas(plan, quotas)
    pools = pool_bytes_by_device(plan, quotas, setup.hardware.num_devices)
    devices = list(plan.stage_to_device)

    def lower(schedule: Schedule) -> Program:
        return build_program(setup.profile, setup.ranges, schedule, setup.hardware,
                             microbatch_size=setup.microbatch_size, stage_to_device=devices, tensors=rw.tensors,
                             offloaded_bytes=offloaded, pool_bytes=pools, data_parallel=setup.data_parallel)

    schedule = rw.schedule
    if plan.swap_in_policy is SwapInPolicy.CAPACITY:
        # the static bytes alone: lowering every rank here would be thrown away
        _devices, static = rank_static_bytes(setup.costs, schedule, setup.hardware, devices,
                                             offloaded_bytes=offloaded, pool_bytes=pools,
                                             data_parallel=setup.data_parallel)
        placed = []
        for r, actions in enumerate(schedule.ranks):
            tasks, origins = lower_rank_traced(actions, costs=setup.costs, devices=devices, hardware=setup.hardware,
                                               tensors=rw.tensors, weight_stashing=schedule.weight_stashing,
                                               late=late_frees(schedule, setup.costs))
            placed.append(place_by_capacity(actions, tasks, origins, static_bytes=static[r],
                                            capacity_bytes=setup.hardware.usable_memory_bytes))
        schedule = schedule.with_ranks(placed)
    if plan.actions:  # the program the plan carries is the one its rules make here
        for r, (carried, made) in enumerate(zip(plan.actions, schedule.ranks)):
            if carried != format_actions(list(made)):
                have, want = carried.split(), format_actions(list(made)).split()
                i = next((k for k, (x, y) in enumerate(zip(have, want)) if x != y), min(len(have), len(want)))
                raise PlanError(f"plan: rank {r}'s program differs from what its rules make on this pipeline at "
                                f"action {i} ({have[i] if i < len(have) else 'end'} where the rules give "
                                f"{want[i] if i < len(want) else 'end'}); re-plan, or drop `actions` to re-derive it")
    program = lower(schedule)
    placed_setup = replace(setup, stage_to_device=devices,
                           memory=memory_model(setup.costs, setup.schedule, setup.hardware, devices,
                                               setup.data_parallel, host_step_stages=host_step_stages(plan)))
    return Evaluation(setup=placed_setup, schedule=schedule, program=program, result=emulate(program),
                      tensors=rw.tensors, peer_quotas=quotas)


def complete_plan(setup: PipelineSetup, plan: Plan) -> tuple[Plan, Evaluation]:
    """`plan` with what a plan written by hand leaves out, and its evaluation: the program
    its rules make on `setup` (`actions`, checked against the carried one when there is
    one), each stage's pinned pool sized for that program where it gives none, its D2D
    quotas and peer pools sized for that program where no stage gives any, each stage's
    predicted peak (its device's emulated peak) where it gives none, and the plan's
    predicted iteration where it gives none.

    A peak the plan gives must be the one its program has here, as the planner emulated
    it (`PlanError` naming `stages[S].predicted_peak_bytes` otherwise), and so must its
    iteration time and whether it fits (`predicted_iteration_s`, `fits`): a plan made from
    this profile (its `profile_fingerprint` is the setup's) states figures that follow
    from its content, and an edited one no longer does. A plan made from another profile
    (a measured one) keeps its peaks: this profile cannot recompute them."""
    return _completed(setup, *_with_program_pools(setup, plan, evaluate_plan(setup, plan)))


def plan_from_rules(setup: PipelineSetup, plan: Plan) -> Plan:
    """`plan` whose rules were written or changed by hand (tests, benches), with every
    figure its program has on `setup`: program, pools, quotas, peaks, iteration and
    whether it fits. None is kept from before: a figure the planner wrote for other
    rules is stale, and `complete_plan` refuses stale figures. One emulation, or two where
    the program resizes the peer pools."""
    bare = replace(plan, actions=[], predicted_iteration_s=0.0,
                   stages=[replace(sp, predicted_peak_bytes=0) for sp in plan.stages])
    bare, ev = _with_program_pools(setup, bare, evaluate_plan(setup, bare))
    return _completed(setup, replace(bare, fits=ev.result.fits), ev)[0]


def _with_program_pools(setup: PipelineSetup, plan: Plan, ev: Evaluation) -> tuple[Plan, Evaluation]:
    """`plan` (emulated as `ev`) with its D2D quotas and peer pools sized for its program
    where no stage gives any (`with_peer_quotas`), and its emulation with those pools: a
    pool is device memory its lender holds from start-up, so the peaks count the pools the
    runtime will allocate, not the ones the plan was first emulated with."""
    if any(sp.peer_quotas for sp in plan.stages):
        return plan, ev
    sized = replace(plan, stages=with_peer_quotas(plan.stages, ev.peer_quotas))
    if [sp.peer_pool_bytes for sp in sized.stages] == [sp.peer_pool_bytes for sp in plan.stages]:
        return sized, ev
    return sized, evaluate_plan(setup, sized)


def _completed(setup: PipelineSetup, plan: Plan, ev: Evaluation) -> tuple[Plan, Evaluation]:
    """`complete_plan` given the plan's evaluation."""
    pinned = pinned_bytes(ev.schedule, ev.tensors)
    peaks = ev.result.peak_bytes
    if plan.profile_fingerprint == profile_fingerprint(setup):
        for sp in plan.stages:
            if sp.predicted_peak_bytes and sp.predicted_peak_bytes != peaks[sp.device]:
                raise PlanError(f"stages[{sp.stage}].predicted_peak_bytes: {sp.predicted_peak_bytes} in the plan, but "
                                f"its program peaks at {peaks[sp.device]} bytes on device {sp.device} (the planner's "
                                "emulation of this plan's rules on its profile); plan again, or drop the key to "
                                "re-derive it")
        if plan.predicted_iteration_s and plan.predicted_iteration_s != ev.result.iteration_s:
            raise PlanError(f"predicted_iteration_s: {plan.predicted_iteration_s} s in the plan, but its program "
                            f"takes {ev.result.iteration_s} s (the planner's emulation of this plan's rules on its "
                            "profile); plan again, or drop the key to re-derive it")
        if plan.fits != ev.result.fits:
            raise PlanError(f"fits: {str(plan.fits).lower()} in the plan, but its program "
                            f"{'fits' if ev.result.fits else 'does not fit'} the devices' memory (the planner's "
                            "emulation of this plan's rules on its profile); plan again")
    stages = [replace(sp, pinned_host_bytes=sp.pinned_host_bytes or pinned[sp.stage],
                      predicted_peak_bytes=sp.predicted_peak_bytes or peaks[sp.device]) for sp in plan.stages]
    if not any(sp.peer_quotas for sp in plan.stages):  # D2D quotas and pools as the program needs them
        stages = with_peer_quotas(stages, ev.peer_quotas)
    actions = plan.actions or [format_actions(list(r)) for r in ev.schedule.ranks]
    iteration_s = plan.predicted_iteration_s or ev.result.iteration_s
    return replace(plan, stages=stages, actions=actions, predicted_iteration_s=iteration_s), ev


def program_quotas(schedule: Schedule, tensors: dict[str, TensorInfo]) -> list[dict[int, int]]:
    """Per stage, per peer device: the quota the stage's D2D units and chunks need under
    `schedule` (empty for a stage that sends nothing to peers)."""
    unit_bytes = {name: t.pool_bytes for name, t in tensors.items()}
    weights = {name: t.stripes for name, t in tensors.items() if t.stripes}
    out: list[dict[int, int]] = [{} for _ in range(schedule.num_stages)]
    for actions in schedule.ranks:
        for stage in sorted({a.stage for a in actions if a.kind in (Kind.DO, Kind.OO)}):
            out[stage] = quota_need(actions, stage, unit_bytes, weights)
    return out


def check_quotas(plan: Plan, quotas: Sequence[dict[int, int]]) -> None:
    """Refuse, in one line naming the plan's key, a stage whose quota on a peer is smaller
    than its program needs there (or missing)."""
    for sp in plan.stages:
        given = {q.device: (k, q.quota_bytes) for k, q in enumerate(sp.peer_quotas)}
        for device, need in sorted(quotas[sp.stage].items()):
            if device not in given:
                raise PlanError(f"plan: stages[{sp.stage}].peer_quotas: the program puts {fmt_bytes(need)} of D2D "
                                f"data on device {device} and the stage has no quota there (allowed: a quota of at "
                                f"least {need} bytes; `mpress plan` writes them)")
            k, nbytes = given[device]
            if nbytes < need:
                raise PlanError(f"plan: stages[{sp.stage}].peer_quotas[{k}].quota_bytes: {nbytes} bytes on device "
                                f"{device}, the program's D2D slots there need {need} (allowed: >= {need})")


def pool_bytes_by_device(plan: Plan, quotas: Sequence[dict[int, int]], num_devices: int) -> list[int]:
    """Per device, the peer pool the runtime allocates there for `plan`: the plan's pool,
    or its exporters' quotas (the plan's, at least what the program needs) when larger."""
    pools = [0] * num_devices
    for device, nbytes in plan.peer_pool_bytes_by_device().items():
        pools[device] = nbytes
    held = [0] * num_devices
    for sp in plan.stages:
        given = {q.device: q.quota_bytes for q in sp.peer_quotas}
        for device in set(given) | set(quotas[sp.stage]):
            held[device] += max(given.get(device, 0), quotas[sp.stage].get(device, 0))
    return [max(p, h) for p, h in zip(pools, held)]


def with_peer_quotas(stages: Sequence[StagePlan], quotas: Sequence[dict[int, int]]) -> list[StagePlan]:
    """`stages` with each one's quotas set to what its program needs (the smallest quota,
    `MIN_QUOTA_BYTES`, on a peer its D2D rules name and its program sends nothing to: the
    runtime opens a quota on every peer a rule names) and each device's peer pool (on the
    first stage running there) to its exporters' quotas."""
    given: list[dict[int, int]] = []
    for sp in stages:
        named = {st.device for r in sp.rules if r.technique is Technique.D2D for st in r.stripes}
        given.append({d: quotas[sp.stage].get(d, MIN_QUOTA_BYTES) for d in named | set(quotas[sp.stage])})
    on_device: dict[int, int] = {}
    for q in given:
        for device, nbytes in q.items():
            on_device[device] = on_device.get(device, 0) + nbytes
    out = []
    for sp, q in zip(stages, given):
        first = min(s.stage for s in stages if s.device == sp.device)  # one pool per device: on its first stage
        out.append(replace(sp, peer_quotas=[PeerQuota(device=d, quota_bytes=b) for d, b in sorted(q.items())],
                           peer_pool_bytes=on_device.get(sp.device, 0) if sp.stage == first else 0))
    return out
