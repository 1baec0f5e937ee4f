"""Wrapping a stage: the user's module + a plan -> what torch's pipeline schedules run.

    stage = wrap_stage(module, plan, stage_index, device=device, input_args=x, output_args=y)
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss)   # torch's own engine

`MpressStage` is a `torch.distributed.pipelining.PipelineStage`: the schedules (GPipe,
1F1B, interleaved) call its `forward_one_chunk` / `backward_one_chunk`, which mpress
wraps to route the microbatch's saved tensors (see `router.py`) and to issue swap-ins
ahead of the backward that needs them.

Prefetch point: the stage knows its own F/B order (`warmup_order` of the plan's
schedule: GPipe or 1F1B), so after each compute action it brings back the swapped
tensors of every backward due within the next `lead` actions (`lead` = the largest
`prefetch_lead` of the stage's host rules; 1 = the next backward's tensors come in while
the action before it runs). Under the plan's default "capacity" policy it also brings
back later backwards' tensors, in order, while the budget has room: the stage's planned
peak, which leaves room for its own compute (the whole device when the plan has no
prediction). For schedules whose order it does not know (interleaved) it
prefetches at the start of the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from mpress.actions import Action, Kind, warmup_order
from mpress.errors import SwapError
from mpress.identity import layer_paths
from mpress.plan import Plan
from mpress.plan_check import check_plan
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import MemoryManager
from mpress.runtime.router import SavedTensorRouter
from mpress.runtime.swap.engine import SwapEngine
from mpress.runtime.swap.store import PeerStores
from mpress.vocabulary import ScheduleName, SwapInPolicy, Technique

MIN_POOL_BYTES = 1 << 20
"""Smallest pinned pool a stage that host-swaps allocates (the plan may say less)."""
POOL_SLACK = 1.25
"""Pool size over the plan's pinned-host bytes: block alignment, fragmentation, and
tensors autograd saves twice (the plan counts a storage once, the router swaps each
saved tensor)."""


@dataclass
class StageStats:
    """What one stage's runtime did in its last step(s)."""

    microbatches_recomputed: int = 0
    tensors_swapped: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class StageRuntime:
    """Per-stage mpress state: pool, memory manager, swap engines (host, D2D), router,
    prefetching. `peers` (the job's D2D side, from the launcher) is needed when the
    stage's plan D2D-swaps anything."""

    def __init__(self, module: nn.Module, plan: Plan, stage_index: int, device: torch.device, *, rank: int,
                 example_args: tuple[Any, ...], layers: list[str] | None = None,
                 host_pool_bytes: int | None = None, peers: PeerStores | None = None) -> None:
        self.plan = plan
        self.stage_plan = plan.stage(stage_index)
        self.device = device
        self.rank = rank
        host_rules = [r for r in self.stage_plan.rules if r.technique is Technique.HOST]
        d2d_rules = [r for r in self.stage_plan.rules if r.technique is Technique.D2D]
        self.lead = max((r.prefetch_lead for r in host_rules + d2d_rules), default=1)
        self.manager = MemoryManager(device, rank=rank)
        self.pool: PinnedHostPool | None = None
        self.engine: SwapEngine | None = None
        self.d2d_engine: SwapEngine | None = None
        if host_rules:
            size = (host_pool_bytes if host_pool_bytes is not None
                    else max(int(self.stage_plan.pinned_host_bytes * POOL_SLACK), MIN_POOL_BYTES))
            self.pool = PinnedHostPool(size)
            self.engine = SwapEngine(self.pool, self.manager, device, rank=rank, stage=stage_index)
        if d2d_rules and peers is not None:
            self.d2d_engine = SwapEngine(peers.store_for(stage_index), self.manager, device, rank=rank,
                                         stage=stage_index)
        self.router = SavedTensorRouter(module, self.stage_plan, self.engine, rank=rank, example_args=example_args,
                                        layers=layers, manager=self.manager, d2d_engine=self.d2d_engine,
                                        num_microbatches=plan.num_microbatches)
        self.order = stage_order(plan, stage_index)
        self.position = 0  # compute actions done in this step
        self.stats = StageStats()
        self.on_last_backward: list[Callable[[], None]] = []
        """Called when the stage starts its last backward of a step (optimizer prefetch)."""

    def after_compute(self) -> None:
        """Issue swap-ins: always those of the backwards due within the next `lead`
        actions; under the plan's "capacity" policy also later ones, in backward order,
        as far as the device budget allows."""
        self.position += 1
        upcoming = self.order[self.position:]
        # lead 1 = the swap-in overlaps the one action before the backward, so it starts
        # now when the backward is the action after next (as the rewriter places it)
        for action in upcoming[: self.lead + 1]:
            if action.kind is Kind.B and action.microbatch is not None:
                self.router.prefetch(action.microbatch)
        if self.engines and self.plan.swap_in_policy is SwapInPolicy.CAPACITY:
            used = self.device_used_bytes()
            for action in upcoming:
                if action.kind is not Kind.B or action.microbatch is None:
                    continue
                need = self.router.pending_bytes(action.microbatch)
                if used + need > self.budget_bytes:
                    break
                if need:
                    self.router.prefetch(action.microbatch)
                    used += need
        for engine in self.engines:
            engine.check()

    @property
    def engines(self) -> list[SwapEngine]:
        """The stage's swap engines (host, D2D) that exist."""
        return [e for e in (self.engine, self.d2d_engine) if e is not None]

    @property
    def budget_bytes(self) -> int:
        """What capacity-based prefetching may fill: the stage's planned peak (which keeps
        room for its own forwards and backwards), or the device when the plan has none."""
        return self.stage_plan.predicted_peak_bytes or self.plan.device_memory_bytes

    def cross_check(self) -> None:
        """On CUDA, check the manager's accounting against the allocator after a forward
        (the stage's fullest moment); the first violation is kept for the report."""
        if self.device.type != "cuda" or "cuda_check" in self.stats.extra:
            return
        try:
            self.manager.check_cuda_consistency()
        except SwapError as exc:
            self.stats.extra["cuda_check"] = str(exc)

    def device_used_bytes(self) -> int:
        """What the budget check counts as used: the allocator's bytes on CUDA; on CPU (a
        stand-in device) the bytes the memory manager tracks."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self.manager.device_bytes()

    def start_step(self) -> None:
        self.position = 0

    def close(self) -> None:
        self.router.close()
        for engine in self.engines:
            engine.close()
            engine.store.close()


class MpressStage(PipelineStage):
    """A `PipelineStage` whose microbatches run under an mpress plan."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device, *,
                 runtime: StageRuntime, **kwargs: Any) -> None:
        super().__init__(submodule, stage_index, num_stages, device, **kwargs)
        self.runtime = runtime

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> Any:
        rt = self.runtime
        with torch.profiler.record_function(f"mpress:{self.stage_index}F{fwd_chunk_id}"), \
                rt.router.microbatch(fwd_chunk_id):
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        rt.cross_check()
        rt.stats.tensors_swapped += rt.router.swapped(fwd_chunk_id)
        if any(rt.router.recomputes(name, fwd_chunk_id) for name in rt.router.layers):
            rt.stats.microbatches_recomputed += 1
        if fwd_chunk_id == 0:
            rt.start_step()
        rt.after_compute()
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        rt = self.runtime
        rt.router.prefetch(bwd_chunk_id)  # no-op when already issued at its prefetch point
        if last_backward:
            for callback in rt.on_last_backward:
                callback()
        with torch.profiler.record_function(f"mpress:{self.stage_index}B{bwd_chunk_id}"):
            out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                             last_backward=last_backward)
        rt.router.finish(bwd_chunk_id)
        rt.after_compute()
        return out


def stage_order(plan: Plan, stage_index: int) -> list[Action]:
    """This stage's F/B order under the plan's schedule (empty when not known here)."""
    if plan.schedule in (ScheduleName.ONE_F_ONE_B, ScheduleName.PIPEDREAM):
        warmup = plan.num_stages - 1 - stage_index
    elif plan.schedule is ScheduleName.GPIPE:
        warmup = plan.num_microbatches - 1
    else:
        return []
    return warmup_order(stage_index, plan.num_microbatches, warmup)


def wrap_stage(module: nn.Module, plan: Plan, stage_index: int, *, device: torch.device,
               input_args: Any, output_args: Any = None, group: dist.ProcessGroup | None = None,
               model_fingerprint: str | None = None, host_pool_bytes: int | None = None,
               peers: PeerStores | None = None) -> MpressStage:
    """The user's stage module under `plan`, as a `PipelineStage` for torch's schedules.

    input_args/output_args: example tensors of one microbatch (static shapes; on gloo
    they avoid shape inference, which can deadlock there).
    model_fingerprint: when given, the plan must have been made for that model.
    peers: the job's D2D side (`mpress.d2d.runtime.peer_pool.setup_peer_pools`, called on
    every rank), needed when the plan D2D-swaps.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else None
    example_args = input_args if isinstance(input_args, tuple) else (input_args,)
    plan.stage(stage_index)  # in range
    layers = layer_paths(module, example_args)
    check_plan(plan, model_fingerprint=model_fingerprint, world_size=world, stage_layers={stage_index: layers},
               runtime=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    runtime = StageRuntime(module, plan, stage_index, device, rank=rank, example_args=example_args, layers=layers,
                           host_pool_bytes=host_pool_bytes, peers=peers)
    return MpressStage(module, stage_index, plan.num_stages, device, runtime=runtime,
                       input_args=input_args, output_args=output_args, group=group)
