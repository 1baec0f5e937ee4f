"""Evaluate a plan: check it belongs to a pipeline, rewrite, lower, emulate.

Shared by the planner (every candidate) and `mpress emulate plan.yaml`.
"""

from __future__ import annotations

from dataclasses import replace

from mpress.plan import Plan
from mpress.plan_check import Shape, check_plan
from mpress.static.emulator import emulate
from mpress.static.evaluate import Evaluation, PipelineSetup
from mpress.static.lowering import build_program
from mpress.static.memory import memory_model
from mpress.static.rewriter import offloaded_optim_bytes, rewrite, stash_offloaded


def check_plan_for_setup(plan: Plan, setup: PipelineSetup, source: str = "plan") -> None:
    """Refuse a plan made for another model, hardware, pipeline shape or profile (all that
    a pipeline setup knows, given to the one plan check)."""
    sched = setup.schedule
    check_plan(plan, source=source, model=setup.model, hardware=setup.hardware,
               shape=Shape(sched.name, sched.num_stages, sched.num_microbatches, setup.microbatch_size),
               ranges=setup.ranges,
               stage_tensors={c.stage: [t.id for t in c.saved] for c in setup.costs},
               stage_layers={c.stage: [x.name for x in c.layers] for c in setup.costs})


def evaluate_plan(setup: PipelineSetup, plan: Plan) -> Evaluation:
    """Emulate one iteration of `setup` under `plan` (its stage-to-device map included)."""
    rw = rewrite(plan, setup.schedule, setup.costs, setup.hardware)
    offloaded = offloaded_optim_bytes(plan, setup.costs)
    if setup.schedule.weight_stashing:  # the live weights stay when the stashed versions go
        offloaded = [o - (c.param_bytes if gone else 0)
                     for o, c, gone in zip(offloaded, setup.costs, stash_offloaded(plan, setup.costs))]
    pools = [0] * setup.hardware.num_devices
    for device, nbytes in plan.peer_pool_bytes_by_device().items():
        pools[device] = nbytes
    devices = list(plan.stage_to_device)
    program = build_program(
        setup.profile, setup.ranges, rw.schedule, setup.hardware, microbatch_size=setup.microbatch_size,
        stage_to_device=devices, tensors=rw.tensors, offloaded_bytes=offloaded, pool_bytes=pools,
        swap_in_policy=plan.swap_in_policy,
    )
    placed = replace(setup, stage_to_device=devices,
                     memory=memory_model(setup.costs, setup.schedule, setup.hardware, devices))
    return Evaluation(setup=placed, program=program, result=emulate(program))
