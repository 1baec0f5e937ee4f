"""Wrapping a stage: the user's module + a plan -> what torch's pipeline schedules run.

    stage = wrap_stage(module, plan, stage_index, device=device, input_args=x, output_args=y)
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=stage.route_loss(loss))   # torch's own engine

`MpressStage` is a `torch.distributed.pipelining.PipelineStage`: the schedules (GPipe,
1F1B, interleaved, zero bubble, V) call its `forward_one_chunk` / `backward_one_chunk`
(a whole backward B, or its input-gradient half I) / `backward_weight_one_chunk` (the
weight-gradient half W); mpress runs each
as the compute action of the rank's program (`program.py`) that it is: the program
checks it is the next one, waits for the copy-outs it releases, issues the swap-ins the
list puts before it, and the router (`router.py`) carries out what the list puts inside
it (swap-outs, drops, recomputes). Nothing here decides where a swap-in goes: the plan's
list does. `PlainStage` is torch's stage untouched, for a job without a plan.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from mpress.contract.actions import Action, Kind, moves_layer_data
from mpress.errors import PlanError, SwapError
from mpress.contract.identity import MODEL_DATA_KINDS, layer_paths
from mpress.contract.live_bytes import LiveBytes
from mpress.contract.plan import Plan
from mpress.contract.plan_check import check_plan, on_drive
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import MemoryManager
from mpress.runtime.program import RankProgram, Span
from mpress.runtime.router import SavedTensorRouter
from mpress.runtime.swap.engine import SwapEngine
from mpress.runtime.swap.nvme import NvmeStore
from mpress.runtime.swap.store import PeerStores
from mpress.config.vocabulary import OptimizerStep, Technique

@dataclass
class StageStats:
    """What one stage's runtime did in its last step(s)."""

    extra: dict[str, Any] = field(default_factory=dict)


class StageRuntime:
    """Per-stage mpress state: pool, memory manager, swap engines (host, D2D), router.
    `program`: the rank's program, which the stage's compute actions walk. `peers` (the
    job's D2D side, from the launcher) is needed when the stage's plan D2D-swaps
    anything. `live`: the rank's live-bytes tracker (CPU), which the swap workers report
    to."""

    def __init__(self, module: nn.Module, plan: Plan, stage_index: int, device: torch.device, *, rank: int,
                 program: RankProgram, example_args: tuple[Any, ...], layers: list[str] | None = None,
                 host_pool_bytes: int | None = None, peers: PeerStores | None = None,
                 live: LiveBytes | None = None, nvme_dir: str | None = None) -> None:
        self.plan = plan
        self.stage_plan = plan.stage(stage_index)
        self.stage_index = stage_index
        self.device = device
        self.rank = rank
        self.program = program
        self.stats = StageStats()
        self.live = live
        self.layer_data = None
        """The stage's `param:`/`grad:` host layers at run time (`mpress.runtime.layer_data`),
        set by the rank's optimizer side when its host step has them."""
        techniques = {r.technique for r in self.stage_plan.rules}
        drive_stage = on_drive(self.stage_plan)
        if drive_stage and nvme_dir is None:
            raise PlanError(f"stage {stage_index}: the plan keeps optimizer states on nvme: set nvme_dir in the "
                            "training config, or pass it to apply_mpress (a directory on a local drive)")
        # its file first: opening it is what may fail, before any engine starts its threads
        drive = NvmeStore(nvme_dir, device, name=f"rank{rank}-stage{stage_index}") if drive_stage else None
        self.manager = MemoryManager(device, rank=rank)
        self.pool: PinnedHostPool | None = None
        self.engine: SwapEngine | None = None
        self.d2d_engine: SwapEngine | None = None
        self.nvme_engine: SwapEngine | None = None
        watch = live.watch if live is not None else None
        # exactly what the plan pins for its program (none where the program moves nothing
        # to the host, e.g. the last stage, whose swaps would free nothing)
        size = host_pool_bytes if host_pool_bytes is not None else self.stage_plan.pinned_host_bytes
        if Technique.HOST in techniques and size:
            self.pool = PinnedHostPool(size, device=torch.device(device))
            if live is not None:
                live.adopt(self.pool.buffer, f"stage {stage_index} pinned host pool", host=True)
            self.engine = SwapEngine(self.pool, self.manager, device, rank=rank, stage=stage_index, watch=watch,
                                     hold_until_release=True)
        if Technique.D2D in techniques and peers is not None:
            self.d2d_engine = SwapEngine(peers.store_for(stage_index), self.manager, device, rank=rank,
                                         stage=stage_index, watch=watch, hold_until_release=True)
        if drive is not None:
            self.stats.extra["nvme"] = "O_DIRECT" if drive.direct else f"buffered ({drive.why_buffered})"
            self.nvme_engine = SwapEngine(drive, self.manager, device, rank=rank, stage=stage_index, watch=watch,
                                          hold_until_release=True)
        # the stage's inspection forward (`inspect_stage`) runs here: part of the rank's
        # start-up peak, counted like a step's operators
        with live.watch() if live is not None else contextlib.nullcontext():
            self.router = SavedTensorRouter(module, self.stage_plan, program, rank=rank, example_args=example_args,
                                            layers=layers, engine=self.engine, d2d_engine=self.d2d_engine,
                                            num_microbatches=plan.num_microbatches)
        program.on(Kind.SI, stage_index, self._swap_in)
        program.on(Kind.DI, stage_index, self.router.prefetch_unit)
        program.on_release(self.release)

    def _swap_in(self, action: Action) -> None:
        """An SI the program issues: a layer's host parameters, or a unit of activations."""
        if not moves_layer_data(action):
            self.router.prefetch_unit(action)
        elif self.layer_data is None:
            raise PlanError(f"stage {self.stage_index}: the program fetches {action.tensor} but the stage keeps no "
                            "parameters on the host (its optimizer does not step there)")
        else:
            self.layer_data.fetch_listed(action)

    @property
    def engines(self) -> list[SwapEngine]:
        """The stage's swap engines (host, D2D, nvme) that exist."""
        return [e for e in (self.engine, self.d2d_engine, self.nvme_engine) if e is not None]

    def release(self) -> None:
        """A release point of the program: the copy-outs issued so far complete, so their
        device storage is gone before the next compute action starts."""
        for engine in self.engines:
            engine.wait_outs()

    def cross_check(self) -> None:
        """On CUDA, check the manager's accounting against the allocator after a forward
        (the stage's fullest moment); the first violation is kept for the report."""
        if self.device.type != "cuda" or "cuda_check" in self.stats.extra:
            return
        try:
            self.manager.check_cuda_consistency()
        except SwapError as exc:
            self.stats.extra["cuda_check"] = str(exc)

    def close(self) -> None:
        if self.layer_data is not None:
            self.layer_data.close()
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
        self._whole_in_input: set[int] = set()
        """First stage: microbatches whose whole backward ran in their I (see `backward_one_chunk`)."""
        self._input_halves = 0
        """First stage: Is run so far in this step (modulo the microbatches): the last one reduces."""

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> Any:
        rt = self.runtime
        action = Action(self.stage_index, Kind.F, fwd_chunk_id)
        rt.program.begin(action)
        if rt.layer_data is not None:
            rt.layer_data.begin(action)
        with torch.profiler.record_function(f"mpress:{action}"), rt.router.microbatch(fwd_chunk_id):
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if rt.layer_data is not None:
            rt.layer_data.end()
        rt.program.end()
        rt.cross_check()
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        """The microbatch's backward (B), or its input-gradient half (I) when the schedule
        splits it (`full_backward=False`): what the W half reads stays until W.

        The first stage has no input gradient to make: torch's I would do nothing there
        and its W the whole backward. It runs the whole backward in its I instead, where
        the plan's program puts the microbatch's recomputes and where the memory model
        gives back what the backward frees; its W is then empty. A rank runs a stage's Is
        and its Ws each in microbatch order, so every parameter's gradient accumulates
        in the same order as torch's: the same bits."""
        rt = self.runtime
        action = Action(self.stage_index, Kind.B if full_backward else Kind.I, bwd_chunk_id)
        whole = not full_backward and self.is_first and self.dw_builder is None
        rt.program.begin(action)
        if rt.layer_data is not None:
            rt.layer_data.begin(action)
        with torch.profiler.record_function(f"mpress:{action}"):
            if whole:
                self._whole_in_input.add(bwd_chunk_id)
                self._input_halves = (self._input_halves + 1) % (self.chunks or 1)
                out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=True,
                                                 last_backward=self._input_halves == 0)
            else:
                out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                                 last_backward=last_backward)
        if full_backward or whole:
            rt.router.finish(bwd_chunk_id)
        if rt.layer_data is not None:
            rt.layer_data.end()
        rt.program.end()
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> Any:
        """The weight-gradient half (W) of a split backward: the microbatch's backward ends
        here (empty on the first stage, whose I ran it whole)."""
        rt = self.runtime
        action = Action(self.stage_index, Kind.W, bwd_chunk_id)
        rt.program.begin(action)
        out = None
        if bwd_chunk_id in self._whole_in_input:
            self._whole_in_input.discard(bwd_chunk_id)
        else:
            with torch.profiler.record_function(f"mpress:{action}"):
                out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            rt.router.finish(bwd_chunk_id)
        rt.program.end()
        return out

    def scale_grads(self, grad_scale_factor: int) -> None:
        """torch's division of the step's gradients by the microbatch count: those summed
        on the host (`grad:` host rules) are divided there."""
        super().scale_grads(grad_scale_factor)
        if self.runtime.layer_data is not None and grad_scale_factor != 1:
            self.runtime.layer_data.scale(grad_scale_factor)

    def route_loss(self, loss_fn: Any) -> Any:
        """`loss_fn` for torch's schedule, with its saved tensors routed as the plan says
        (the profilers count the loss toward the stage's last layer)."""
        return self.runtime.router.route_loss(loss_fn)


def wrap_stage(module: nn.Module, plan: Plan, stage_index: int, *, device: torch.device,
               input_args: Any, output_args: Any = None, group: dist.ProcessGroup | None = None,
               model_fingerprint: str | None = None, host_pool_bytes: int | None = None,
               peers: PeerStores | None = None, program: RankProgram | None = None,
               live: LiveBytes | None = None, optimizer_by_job: bool = False,
               nvme_dir: str | None = None) -> MpressStage:
    """The user's stage module under `plan`, as a `PipelineStage` for torch's schedules.

    input_args/output_args: example tensors of one microbatch (static shapes; on gloo
    they avoid shape inference, which can deadlock there).
    model_fingerprint: when given, the plan must have been made for that model.
    peers: the job's D2D side (`mpress.d2d.runtime.peer_pool.setup_peer_pools`, called on
    every rank), needed when the plan D2D-swaps.
    program: the rank's program, shared by the stages of a rank that runs several
        (default: this rank's list in the plan, for one stage per rank).
    live: the rank's live-bytes tracker, when the caller counts the device's bytes.
    optimizer_by_job: the caller carries out the plan's model-data decisions (`optim:` and
        `stash:` rules, `optimizer_step: host`) around its optimizer -- `PipelineJob` does.
        A stage wrapped on its own cannot: a plan with such decisions is refused rather
        than half executed (use `mpress.own_loop`, whose `wrap_optimizer` carries them out
        in a loop of your own, `mpress.runtime.trainer.PipelineJob`, or `mpress train`).
    nvme_dir: where the plan's `nvme` rules keep optimizer states (a directory on a local
        drive; the train config's `nvme_dir`).
    Pass `stage.route_loss(loss_fn)` to the schedule of the last stage.
    """
    if not optimizer_by_job:
        _refuse_model_data(plan, stage_index)
    world = dist.get_world_size(group) if dist.is_initialized() else None
    example_args = input_args if isinstance(input_args, tuple) else (input_args,)
    plan.stage(stage_index)  # in range
    layers = layer_paths(module, example_args)
    check_plan(plan, model_fingerprint=model_fingerprint, world_size=world, stage_layers={stage_index: layers},
               runtime=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if program is None:
        program = RankProgram(plan.program(rank), rank=rank)
    runtime = StageRuntime(module, plan, stage_index, device, rank=rank, program=program, example_args=example_args,
                           layers=layers, host_pool_bytes=host_pool_bytes, peers=peers, live=live,
                           nvme_dir=nvme_dir)
    return MpressStage(module, stage_index, plan.num_stages, device, runtime=runtime,
                       input_args=meta_examples(input_args), output_args=meta_examples(output_args), group=group)


def meta_examples(examples: Any) -> Any:
    """`examples` (a tensor, a tuple of them, or None) as meta tensors of the same shape,
    dtype, strides and requires_grad: what `PipelineStage` needs of its example
    microbatch. torch <= 2.11 keeps the tensors it is given for the stage's life (2.13
    keeps only their metadata), so real ones would pin one microbatch's input and output
    -- the last stage's B x T x vocab logits -- on the device for the whole job."""
    if examples is None:
        return None
    if isinstance(examples, tuple):
        return tuple(meta_examples(x) for x in examples)
    if isinstance(examples, torch.Tensor):
        return torch.empty_strided(examples.shape, examples.stride(), dtype=examples.dtype,
                                   device="meta").requires_grad_(examples.requires_grad)
    return examples


def _refuse_model_data(plan: Plan, stage_index: int) -> None:
    """A plan's model-data decisions for stage `stage_index` need the job's optimizer (see
    `wrap_stage`): refuse them in one line naming the first."""
    stage_plan = plan.stage(stage_index)
    if stage_plan.optimizer_step is OptimizerStep.HOST:
        raise PlanError(f"stage {stage_index}: the plan steps the optimizer on the host (optimizer_step: host), which a "
                        "stage wrapped on its own cannot do: use mpress.own_loop (apply_mpress, wrap_optimizer), "
                        "or train with PipelineJob or mpress train")
    for i, rule in enumerate(stage_plan.rules):
        if rule.tensor.startswith(tuple(f"{kind}:" for kind in MODEL_DATA_KINDS)):
            raise PlanError(f"stage {stage_index}: rule {i} ({rule.tensor} -> {rule.technique}) moves model data, "
                            "which a stage wrapped on its own cannot do: use mpress.own_loop (apply_mpress, "
                            "wrap_optimizer), or train with PipelineJob or mpress train")


class PlainStage(PipelineStage):
    """torch's stage, untouched, that tells the rank's live-bytes tracker which action
    runs (an out-of-memory error of a plain run names it too) and records it for the trace."""

    def __init__(self, *args: object, live: LiveBytes | None, spans: list[Span], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.live = live
        self.spans = spans

    def _run(self, action: Action, run: Callable[[], object]) -> object:
        if self.live is not None:
            self.live.context = str(action)
        start = time.perf_counter()
        out = run()
        self.spans.append(Span(action, start, time.perf_counter()))
        return out

    def forward_one_chunk(self, fwd_chunk_id: int, *args: object, **kwargs: object) -> object:
        return self._run(Action(self.stage_index, Kind.F, fwd_chunk_id),
                         lambda: super(PlainStage, self).forward_one_chunk(fwd_chunk_id, *args, **kwargs))

    def backward_one_chunk(self, bwd_chunk_id: int, *args: object, **kwargs: object) -> object:
        kind = Kind.B if kwargs.get("full_backward", True) else Kind.I
        return self._run(Action(self.stage_index, kind, bwd_chunk_id),
                         lambda: super(PlainStage, self).backward_one_chunk(bwd_chunk_id, *args, **kwargs))

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: object, **kwargs: object) -> object:
        return self._run(Action(self.stage_index, Kind.W, bwd_chunk_id),
                         lambda: super(PlainStage, self).backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs))
