"""Your own loop's stages under a plan: load the plan, wrap each stage module.

    plan = load_plan("plan.yaml")                     # from `mpress plan --module ...`
    stage = apply_mpress(stage_module, plan, stage_index, device=device,
                         input_args=x, output_args=y) # a torch `PipelineStage`
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=stage.route_loss(loss_fn))

`apply_mpress` is `mpress.runtime.stage.wrap_stage` for a loop that also wraps its
optimizer (`mpress.own_loop.optimizer.wrap_optimizer`): the plan's model-data decisions
(optimizer-state offload, the optimizer step on the host) are then carried out by the
wrapped optimizer, so they are accepted here. What the loop cannot carry out is refused
here, in one line naming what is missing: a plan without a program, a plan for another
world size or microbatch size, a stage module whose layers are not the plan's, a rank of several stages
whose plan D2D-swaps without the peer pools set up for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mpress.contract.plan import Plan
from mpress.d2d.runtime.peer_pool import setup_peer_pools
from mpress.errors import PlanError
from mpress.runtime.program import RankProgram
from mpress.runtime.stage import MpressStage, wrap_stage
from mpress.runtime.swap.store import PeerStores


def load_plan(path: str | Path) -> Plan:
    """The plan file `path` (`mpress plan --out`), with the program of every rank: a plan
    written by hand has none (`mpress train` makes it at start-up; a loop of your own
    takes the planner's plan)."""
    plan = Plan.load(str(path))
    if not plan.actions:
        raise PlanError(f"{path}: the plan has no program (actions:), which a loop of your own needs: "
                        "make the plan with mpress plan")
    return plan


def rank_program(plan: Plan, rank: int | None = None) -> RankProgram:
    """The program of `rank` (default: this process's rank), for a rank that runs several
    stages: pass it to `apply_mpress` for each of them, so they walk one list."""
    rank = (dist.get_rank() if dist.is_initialized() else 0) if rank is None else rank
    return RankProgram(plan.program(rank), rank=rank)


def apply_mpress(module: nn.Module, plan: Plan | str | Path, stage_index: int, *, device: torch.device | str,
                 input_args: Any, output_args: Any = None, group: dist.ProcessGroup | None = None,
                 peers: PeerStores | None = None, program: RankProgram | None = None,
                 model_fingerprint: str | None = None, nvme_dir: str | None = None) -> MpressStage:
    """Stage `stage_index` of `plan` (a `Plan` or a plan file) over the user's stage
    module, as a `PipelineStage` for the user's own torch schedule.

    input_args/output_args: one microbatch's example input and output (static shapes;
    on gloo they avoid shape inference). group: the pipeline's process group.
    peers: the job's D2D side, when the plan D2D-swaps or lends peer pools: set up here
    (a collective over `group`) for a rank that runs one stage; a rank that runs several
    passes `mpress.d2d.runtime.peer_pool.setup_peer_pools(plan, stage_ids, device)`,
    called once on every rank. program: the rank's program when it runs several stages
    (`rank_program`).
    model_fingerprint: when given, the plan must have been made for that model.
    nvme_dir: a directory on a local drive, for a plan whose `nvme` rules keep optimizer
    states there.
    Pass `stage.route_loss(loss_fn)` as the last stage's loss, and wrap the optimizer
    over the rank's stages with `wrap_optimizer`: the plan lists the optimizer's steps
    among the stage's actions, and only the wrapped optimizer runs them.
    """
    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    elif not plan.actions:
        raise PlanError("the plan has no program (actions:), which a loop of your own needs: make the plan "
                        "with mpress plan")
    first = next((t for t in (input_args if isinstance(input_args, tuple) else (input_args,))
                  if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if first is not None and first.shape[0] != plan.microbatch_size:
        raise PlanError(f"stage {stage_index}: the plan is made for microbatches of {plan.microbatch_size}, the "
                        f"stage's example input holds {first.shape[0]} (input_args: one microbatch)")
    device = torch.device(device)
    owned = None
    if plan.uses_peer_pools and peers is None:
        if program is not None:
            raise PlanError(f"stage {stage_index}: the plan D2D-swaps or lends peer pools; a rank running several "
                            "stages sets them up once: pass peers=mpress.d2d.runtime.peer_pool.setup_peer_pools("
                            "plan, stage_ids, device), called on every rank")
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        # a collective: every rank wraps its stage, so every rank is here
        peers = owned = setup_peer_pools(plan, plan.stages_of_rank(rank), device, group=group)
    try:
        stage = wrap_stage(module, plan, stage_index, device=device, input_args=input_args,
                           output_args=output_args, group=group, model_fingerprint=model_fingerprint,
                           peers=peers, program=program, optimizer_by_job=True, nvme_dir=nvme_dir)
    except BaseException:
        if owned is not None:
            owned.close()
        raise
    _OWNED_PEERS[id(stage)] = owned
    return stage


_OWNED_PEERS: dict[int, PeerStores | None] = {}
"""Peer pools `apply_mpress` set up for a stage (by the stage's id), which `close` frees."""


def close(stages: list[MpressStage]) -> None:
    """Stop the stages' swap workers and free their pools, the peer pools `apply_mpress`
    set up among them (at the end of training, on every rank: that is a collective)."""
    for stage in stages:
        stage.runtime.close()
        peers = _OWNED_PEERS.pop(id(stage), None)
        if peers is not None:
            peers.close(barrier=True)


__all__ = ["apply_mpress", "close", "load_plan", "rank_program"]
