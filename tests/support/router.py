"""A stage's saved-tensor router in one process, wired as `StageRuntime` wires it, and one
GPipe step driven as the pipeline stage drives it (tests of the router and of what it
hands the swap engines)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mpress.contract.actions import Action, B, F, Kind
from mpress.models import lm_loss
from mpress.contract.plan import StagePlan, TensorRule
from mpress.runtime.program import RankProgram
from mpress.runtime.router import SavedTensorRouter
from mpress.runtime.swap.engine import SwapEngine


def make_router(model: nn.Module, rules: list[TensorRule], actions: list[Action], example: torch.Tensor, *,
                engine: SwapEngine | None = None, d2d: SwapEngine | None = None,
                end: int) -> tuple[SavedTensorRouter, RankProgram]:
    """A router of stage 0 (layers [0, end)) under `rules`, on rank 0's program `actions`,
    wired as `StageRuntime` wires it (SI / DI issue `prefetch_unit`; release points wait
    for the engines' copy-outs)."""
    program = RankProgram(actions, rank=0)
    router = SavedTensorRouter(model, StagePlan(stage=0, device=0, first_layer=0, end_layer=end, rules=rules),
                               program, rank=0, example_args=(example,), engine=engine, d2d_engine=d2d)
    program.on(Kind.SI, 0, router.prefetch_unit)
    program.on(Kind.DI, 0, router.prefetch_unit)
    for e in (engine, d2d):
        if e is not None:
            program.on_release(e.wait_outs)
    return router, program


def step(model: nn.Module, router: SavedTensorRouter | None, program: RankProgram | None, batches, loss_fn=lm_loss,
         after_forwards: Callable[[], None] = lambda: None,
         after_backward: Callable[[int], None] = lambda m: None) -> list[float]:
    """One GPipe step (the reference run when `router` is None); the callbacks run after
    the last forward and after each backward."""
    if router is None:
        outs = [loss_fn(model(x), y) for x, y in batches]
    else:
        outs = []
        for m, (x, y) in enumerate(batches):
            program.begin(F(0, m))
            with router.microbatch(m):
                out = model(x)
            program.end()
            outs.append(router.route_loss(loss_fn)(out, y))  # as torch's schedule computes it
    after_forwards()
    for m, loss in enumerate(outs):
        if program is not None:
            program.begin(B(0, m))
        loss.backward()
        if router is not None:
            router.finish(m)
            program.end()
        after_backward(m)
    if program is not None:
        program.end_step()
    return [o.item() for o in outs]
