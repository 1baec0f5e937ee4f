"""One rank of a pipeline training job over torch.distributed.pipelining.

`PipelineJob` builds this rank's stage of a reference model (or takes a user module),
wraps it with mpress when a plan is given (plain `PipelineStage` otherwise, which is the
baseline every mpress run must match bit for bit), picks torch's schedule, and runs
steps. The launcher (`mpress.train`) and the multi-process tests drive it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from mpress.errors import PlanError, SwapError, UserError
from mpress.contract.actions import stage_to_rank
from mpress.contract.identity import layer_paths
from mpress.contract.live_bytes import LiveBytes
from mpress.config.model_config import ModelConfig
from mpress.models import build_stage, lm_loss
from mpress.models.transformer import TORCH_DTYPES
from mpress.models.user import UserModel
from mpress.contract.plan import Plan
from mpress.contract.plan_check import Shape, check_plan
from mpress.runtime.data_parallel import replicate_stages
from mpress.runtime.grad_clip import StepGuard, StepPlace, check_step
from mpress.runtime.job_state import load_state, save_state
from mpress.runtime.lr_schedule import LrSchedule
from mpress.runtime.master_weights import Kind as MasterKind
from mpress.runtime.layer_data.host_layers import refuse_unrun
from mpress.runtime.optimizer_offload import RankOptimizer, layer_params
from mpress.runtime.param_groups import DEFAULT_NO_DECAY, build_optimizer, no_decay_names
from mpress.runtime.program import RankProgram, Span
from mpress.runtime.stage import MpressStage, PlainStage, meta_examples, wrap_stage
from mpress.runtime.swap.store import PeerStores
from mpress.runtime.tied_grads import TiedGrads
from mpress.config.vocabulary import RUNNABLE_SCHEDULES, V_SCHEDULES, ScheduleName, as_word

SCHEDULES = {ScheduleName.GPIPE: ScheduleGPipe, ScheduleName.ONE_F_ONE_B: Schedule1F1B}
"""torch's schedules for one stage per rank."""
MULTI_STAGE_SCHEDULES = {ScheduleName.INTERLEAVED: ScheduleInterleaved1F1B,
                         ScheduleName.INTERLEAVED_ZB: ScheduleInterleavedZeroBubble,
                         ScheduleName.LOOPED_BFS: ScheduleLoopedBFS,
                         ScheduleName.ZBV: ScheduleZBVZeroBubble, ScheduleName.DUALPIPEV: ScheduleDualPipeV}
"""torch's schedules that take a rank's list of stages (looped round-robin, or two in a V)."""


@dataclass(kw_only=True)
class JobSpec:
    """What one pipeline job trains and how (identical on every rank)."""

    model: ModelConfig | UserModel
    """A reference model (GPT/BERT preset) or a user's own module (`mpress.models.user`)."""
    schedule: ScheduleName
    ranges: list[tuple[int, int]]
    """Layer range [start, end) of each stage (on the rank `stage_to_rank` says)."""
    microbatch_size: int
    num_microbatches: int
    seed: int = 0
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    optimizer: Literal["adam", "adamw"] = "adam"
    """adam or adamw (`mpress.runtime.param_groups.build_optimizer`)."""
    no_decay: tuple[str, ...] = DEFAULT_NO_DECAY
    """Parameters exempt from weight decay: categories and name globs (`param_groups`)."""
    lr_schedule: LrSchedule | None = None
    """The learning rate of each step (its `lr` must be `lr`); None: `lr` throughout."""
    clip_grad_norm: float | None = None
    """Clip gradients to this global norm over the pipeline (`grad_clip`); None or 0: off."""
    max_skipped_steps: int = 3
    """Consecutive steps skipped for a non-finite loss (or, with clipping, gradient norm)
    before the run stops."""
    host_pool_bytes: int | None = None
    """Pinned pool per stage; None = the plan's pinned-host bytes (with slack)."""
    peer_pool_bytes: int | None = None
    """Peer pool per importer device; None = the plan's (a smaller one fails at start-up)."""
    nvme_dir: str | None = None
    """Where the plan's `nvme` rules keep optimizer states (a directory on a local drive)."""
    device_capacity_bytes: int | None = None
    """CPU runs: the capacity of each rank's stand-in device. Live bytes over it stop the
    run with `DeviceOutOfMemory` (None: unbounded, still counted)."""

    def __post_init__(self) -> None:
        if self.schedule not in RUNNABLE_SCHEDULES:
            raise UserError(f"schedule {self.schedule!r} does not run here (torch runs "
                            f"{', '.join(RUNNABLE_SCHEDULES)})")
        as_word(self, "schedule", ScheduleName)
        if self.lr_schedule is not None and self.lr_schedule.lr != self.lr:
            raise UserError(f"lr_schedule.lr ({self.lr_schedule.lr}) differs from lr ({self.lr})")


@dataclass
class StepResult:
    """What one step produced on this rank (loss only on the last stage)."""

    loss: float | None
    peak_bytes: int
    """The rank's device: every byte live at the step's fullest moment (CUDA: the
    allocator's `max_memory_allocated`; CPU: `LiveBytes`)."""
    peak_context: str = ""
    """CPU: the action the rank was running at its peak."""
    grad_norm: float | None = None
    """With clipping: the global gradient norm over the pipeline before clipping."""
    skipped: bool = False
    """The optimizer step was skipped (a non-finite loss or gradient norm): nothing changed."""
    lr: float | None = None
    """The learning rate of the step (its first parameter group's)."""


class PipelineJob:
    """This rank's stage(s), schedule and optimizer.

    GPipe and 1F1B: stage s on rank s. Interleaved 1F1B and zero bubble: stage s on rank
    s % world, so a rank holds num_stages / world stages (torch's `ScheduleInterleaved1F1B`,
    `ScheduleInterleavedZeroBubble`; ZB-H1 with one stage per rank). ZB-V: 2 * world
    stages in a V, rank r runs r and 2 * world - 1 - r (`ScheduleZBVZeroBubble`).
    """

    def __init__(self, spec: JobSpec, plan: Plan | None, device: torch.device, *,
                 group: dist.ProcessGroup | None = None, peers: PeerStores | None = None,
                 dp_group: dist.ProcessGroup | None = None) -> None:
        """group: the pipeline's process group (send/recv). peers: the job's D2D side, set
        up by every rank before (`mpress.launcher.job.start_job` does both); needed when
        the plan reserves peer pools or D2D-swaps. The job owns it and closes it.
        dp_group: this rank's stage replicas when the job runs several replicas of the
        pipeline (`mpress.runtime.data_parallel`): gradients are averaged over it."""
        self.spec = spec
        self.plan = plan
        self.device = device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.num_stages = len(spec.ranges)
        looped = spec.schedule in MULTI_STAGE_SCHEDULES and spec.schedule not in V_SCHEDULES
        wrong, need = (self.num_stages != 2 * self.world, "two stages per rank") if spec.schedule in V_SCHEDULES \
            else (self.num_stages % self.world != 0, "a multiple of the ranks") if looped \
            else (self.num_stages != self.world, "one stage per rank")
        if wrong:
            raise UserError(f"{self.num_stages} stages cannot run on {self.world} ranks with {spec.schedule} ({need})")
        if plan is not None:
            check_plan(plan, shape=Shape(spec.schedule, self.num_stages, spec.num_microbatches, spec.microbatch_size),
                       ranges=spec.ranges, world_size=self.world, runtime=True)
        if plan is not None:
            refuse_unrun(plan, clipping=bool(spec.clip_grad_norm), replicas=dp_group is not None,
                         tied=bool(getattr(spec.model, "tied_groups", [])))
        self.stage_ranks = stage_to_rank(spec.schedule, self.num_stages, self.world)
        self.stage_ids = [s for s, r in enumerate(self.stage_ranks) if r == self.rank]
        if plan is not None and plan.uses_peer_pools and peers is None:
            raise PlanError("the plan reserves peer pools or D2D-swaps, but no peer pools were set up "
                            "(mpress.launcher.job.start_job sets them up on every rank)")
        self.peers = peers
        self.live = LiveBytes(rank=self.rank, capacity_bytes=spec.device_capacity_bytes) \
            if device.type == "cpu" else None
        """CPU: every storage on the rank's stand-in device (see `mpress.contract.live_bytes`)."""
        self.program = RankProgram(plan.program(self.rank), rank=self.rank, live=self.live) \
            if plan is not None else None
        if self.live is not None:
            self._adopt_peer_pool()
        self.spans: list[Span] = self.program.spans if self.program is not None else []
        """Executed actions (with start and end times), for the run's trace; the caller clears it."""
        self.modules: list[nn.Module] = []
        self.stages: list[PipelineStage] = []
        self.params: dict[int, dict[str, list[str]]] = {}
        """Per stage: its parameter names per layer (the optimizer steps one layer at a time)."""
        self.inputs_meta: dict[int, tuple[torch.Tensor, ...]] = {}
        """Per stage: its inputs of one microbatch, as meta tensors (evaluation receives them)."""
        self._user_stages: list[tuple[nn.Module, tuple, tuple]] = []
        """A user's model: every stage's module and example (inputs, outputs), from one split."""
        if isinstance(spec.model, UserModel):
            split = spec.model.split(spec.ranges)
            self._user_stages = [(m, i, o) for m, (i, o) in zip(split, spec.model.stage_io(split))]
        for s in self.stage_ids:
            module, stage, layers = self._build_stage(s, group)
            self.modules.append(module)
            self.stages.append(stage)
            self.params[s] = layer_params(module, layers)
        self._user_stages.clear()  # the other stages' modules are not this rank's to keep
        if dp_group is not None:  # before the schedule runs them; the modules keep their names
            replicate_stages(self.stages, dp_group, device)
        self.tied = TiedGrads(getattr(spec.model, "tied_groups", []), stage_ids=self.stage_ids,
                              modules=self.modules, world=self.world, group=group,
                              stage_ranks=self.stage_ranks)
        """Copies of a weight several stages use (tied embeddings): gradients summed each step."""
        last = self.stages[-1]
        self.loss = loss = spec.model.loss if isinstance(spec.model, UserModel) else lm_loss
        loss_fn = last.route_loss(loss) if isinstance(last, MpressStage) else loss
        if spec.schedule in MULTI_STAGE_SCHEDULES:
            self.schedule = MULTI_STAGE_SCHEDULES[spec.schedule](self.stages, spec.num_microbatches, loss_fn=loss_fn)
        else:
            self.schedule = SCHEDULES[spec.schedule](self.stages[0], spec.num_microbatches, loss_fn=loss_fn)
        # Adam steps the fp32 parameters themselves, fp32 masters of half-precision ones, or
        # host copies for stages the plan steps on the host; one optimizer over all of
        # them in parameter order, so checkpoints read the same whatever the plan. torch's
        # default Adam (one tensor at a time on host copies; static/emulate/host_step_time.py costs
        # that): fused=True would change the last bits the bit-for-bit tests compare.
        # Parameter groups (weight decay or not) by the whole model's parameter names, so
        # every rank and every plan has the same groups.
        tied = {name for g in getattr(spec.model, "tied_groups", []) for _s, name in g}
        exempt = no_decay_names(self.modules, spec.no_decay, tied=tied)
        runtimes = [st.runtime if isinstance(st, MpressStage) else None for st in self.stages]
        self.model_data = RankOptimizer(self.modules, self.stage_ids, runtimes, self.program, self.params,
                                        lambda names, tensors: build_optimizer(
                                            spec.optimizer, names, tensors, lr=spec.lr, betas=spec.betas,
                                            eps=spec.eps, weight_decay=spec.weight_decay, no_decay=exempt))
        self.masters = self.model_data.masters
        self.optimizer = self.masters.optimizer
        self.base_lrs = [spec.lr for _g in self.optimizer.param_groups]
        """Each group's peak rate, which the schedule scales (`LambdaLR`'s `base_lrs`)."""
        self.next_step = 0
        """The index of the next step (its learning rate); a resume sets it."""
        self.guard = StepGuard(max_skipped=spec.max_skipped_steps)
        """Steps skipped for a non-finite loss or gradient norm (saved with the state)."""
        self.group = group
        self.place = StepPlace(device, self.stage_ids, self.num_stages, group, dp_group)
        self.offloads = self.model_data.offloads
        self.host_steps = self.model_data.host_steps
        if self.live is not None:
            self._adopt_model_data()
        # the offload makes the masters it sends out, one layer at a time: counted as a
        # step's operators are
        with self.live.watch() if self.live is not None else contextlib.nullcontext():
            self.model_data.start()
        self.startup_peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" \
            else self.live.peak_bytes
        """The device at its fullest before the first step (CUDA: the allocator's peak since the
        process began; CPU: `LiveBytes`, what start-up makes counted from when it is made)."""

    def _adopt_model_data(self) -> None:
        """Count what exists before training on the rank's device: the peer pool it lends,
        parameters, buffers, masters and optimizer states (host copies are host memory)."""
        live = self.live
        self._adopt_peer_pool()
        for m in self.modules:
            self._adopt_module(m)
        for buffer in self.masters.host_buffers():  # host-step staging and home copies
            live.adopt(buffer, "host buffer", host=True)
        for name in self.masters.names():
            target = self.masters.target(name)
            host = self.masters.kind(name) is MasterKind.HOST_COPY
            if target.numel():  # a released master's storage is away
                live.adopt(target, f"master {name}", host=host)
            for part, state in self.optimizer.state.get(target, {}).items():
                # Adam's step counter is a host scalar (non-capturable optimizers keep it
                # on the CPU), as when Adam makes it itself
                if isinstance(state, torch.Tensor) and state.dim() > 0:
                    live.adopt(state, f"optimizer {part} {name}", host=host)

    def _adopt_peer_pool(self) -> None:
        """Count the peer pool this rank's device lends to other stages (made before the job)."""
        device = self.plan.stage(self.stage_ids[0]).device if self.plan is not None else self.rank
        pool = self.peers.pool_on(device) if self.peers is not None else None
        if pool is not None:
            self.live.adopt(pool, f"peer pool of device {device}")

    def _adopt_module(self, module: nn.Module) -> None:
        """Count a stage module's parameters and buffers (made before any watch)."""
        for name, p in module.named_parameters():
            self.live.adopt(p, f"parameter {name}")
        for name, b in module.named_buffers():
            self.live.adopt(b, f"buffer {name}")

    def _build_stage(self, s: int, group: dist.ProcessGroup | None) -> tuple[nn.Module, PipelineStage, list[str]]:
        spec, cfg, device = self.spec, self.spec.model, self.device
        if isinstance(cfg, UserModel):
            module, inputs, outputs = self._user_stages[s]
            module = module.to(device)
            x = tuple(t.to(device).requires_grad_(t.requires_grad) for t in inputs)
            y = tuple(t.to(device).requires_grad_(t.is_floating_point()) for t in outputs)
            y = y[0] if len(y) == 1 else y
        else:
            module, x, y = self._reference_stage(s)
        self.inputs_meta[s] = meta_examples(x if isinstance(x, tuple) else (x,))
        if self.live is not None:  # the start-up peak counts them from here
            self._adopt_module(module)
            for what, t in (("example input", x), ("example output", y)):
                for tensor in t if isinstance(t, tuple) else (t,):
                    self.live.adopt(tensor, f"{what} of stage {s}")
        if self.plan is not None:
            stage = wrap_stage(module, self.plan, s, device=device, input_args=x, output_args=y, group=group,
                               model_fingerprint=cfg.fingerprint(), host_pool_bytes=spec.host_pool_bytes,
                               peers=self.peers, program=self.program, live=self.live, optimizer_by_job=True,
                               nvme_dir=spec.nvme_dir)
            return module, stage, list(stage.runtime.router.layers)
        stage = PlainStage(module, s, self.num_stages, device, input_args=meta_examples(x),
                            output_args=meta_examples(y), group=group, live=self.live, spans=self.spans)
        return module, stage, layer_paths(module, (x,))

    def _reference_stage(self, s: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
        """Stage `s` of the GPT/BERT reference model and one microbatch's example input and output."""
        spec, cfg, device = self.spec, self.spec.model, self.device
        start, end = spec.ranges[s]
        module = build_stage(cfg, start, end, seed=spec.seed, device=device)
        module.train()
        b, t = spec.microbatch_size, cfg.seq_len
        dtype = TORCH_DTYPES[cfg.precision]
        first, last = s == 0, s == self.num_stages - 1
        # static shapes of one microbatch (gloo's shape inference can deadlock); torch takes
        # requires_grad from them: activations and outputs carry gradients in training
        x = (torch.zeros(b, t, dtype=torch.long, device=device) if first
             else torch.zeros(b, t, cfg.hidden_size, dtype=dtype, device=device, requires_grad=True))
        y = torch.zeros(b, t, cfg.vocab_size if last else cfg.hidden_size, dtype=dtype, device=device,
                        requires_grad=True)
        return module, x, y

    @property
    def stage(self) -> PipelineStage:
        """This rank's first stage (its only one outside interleaved schedules)."""
        return self.stages[0]

    @property
    def module(self) -> nn.Module:
        return self.modules[0]

    @property
    def stage_index(self) -> int:
        return self.stage_ids[0]

    @property
    def runtimes(self) -> list:
        """The mpress runtimes of this rank's stages (none without a plan)."""
        return [st.runtime for st in self.stages if isinstance(st, MpressStage)]

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    @property
    def last_rank(self) -> int:
        """The rank holding the last stage (it computes the loss)."""
        return self.stage_ranks[-1]

    def step(self, inputs: torch.Tensor | tuple[torch.Tensor, ...], targets: torch.Tensor, *,
             step: int | None = None) -> StepResult:
        """One training step on the global batch (every rank passes the same batch): the
        schedule's forwards and backwards, then (with clipping) the global gradient norm
        and clipping, the step's learning rate, and the optimizer steps of the rank's
        program (one layer at a time without a plan). step: the step's 0-based index in
        the job, which sets its learning rate (default: `next_step`); `next_step` becomes
        step + 1. A non-finite norm skips the optimizer step on every rank (raises
        `UserError` after `max_skipped_steps` in a row), and so does a non-finite loss
        with or without clipping (`grad_clip.check_step`)."""
        index = self.next_step if step is None else step
        live = self.live
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            live.reset_peak()
        with live.watch() if live is not None else contextlib.nullcontext():
            losses = self._run_schedule(inputs, targets)
            self.tied.sum_gradients()
            grad_norm, skipped = check_step(self.guard, index, self.place, self.modules, losses,
                                            max_norm=self.spec.clip_grad_norm, skip=self.tied.repeated())
            if self.spec.lr_schedule is not None:
                self.spec.lr_schedule.apply(self.optimizer, index, self.base_lrs)
            self._optimizer_steps(skip=skipped)
        self.next_step = index + 1
        loss = float(torch.stack(losses).detach().mean()) if losses else None
        extra = {"grad_norm": grad_norm, "skipped": skipped, "lr": self.optimizer.param_groups[0]["lr"]}
        if self.device.type == "cuda":
            return StepResult(loss=loss, peak_bytes=torch.cuda.max_memory_allocated(self.device), **extra)
        return StepResult(loss=loss, peak_bytes=live.peak_bytes, peak_context=live.peak_context, **extra)

    def _optimizer_steps(self, *, skip: bool = False) -> None:
        """The optimizer steps of the rank's stages (`RankOptimizer.step`)."""
        def on_stage(s: int) -> None:
            if self.live is not None:
                self.live.context = f"{s}OPT"
        self.model_data.step(skip=skip, on_stage=on_stage)

    def _run_schedule(self, inputs: torch.Tensor | tuple[torch.Tensor, ...],
                      targets: torch.Tensor) -> list[torch.Tensor]:
        """The pipeline's forwards and backwards; the last stage's losses. `inputs`: the
        first stage's positional inputs (one tensor or several). A failure while a rank of
        the job is dead is reported as that rank's death (the pipeline's own error is then
        only a broken connection)."""
        losses: list[torch.Tensor] = []
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        if self.live is not None:  # on CPU `.to` keeps the caller's storage: count it here
            if self.is_first:
                for t in args:
                    self.live.adopt(t, "input batch")
            if self.is_last:
                self.live.adopt(targets, "targets")
        args = tuple(t.to(self.device) for t in args) if self.is_first else ()
        try:
            if self.is_first and self.is_last:
                self.schedule.step(*args, target=targets.to(self.device), losses=losses, return_outputs=False)
            elif self.is_first:
                self.schedule.step(*args, return_outputs=False)
            elif self.is_last:
                self.schedule.step(target=targets.to(self.device), losses=losses, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        except Exception as exc:
            dead = self._dead_ranks()
            if dead:
                stages = ", ".join(str(s) for s in self.stage_ids)
                raise SwapError(f"rank {dist.get_rank()} stage {stages}: {'; '.join(dead)}; the step stopped "
                                f"({exc})") from exc
            raise
        return losses

    def _dead_ranks(self, wait_s: float = 1.0) -> list[str]:
        """Other ranks found dead (one line each), waiting up to `wait_s` for a process
        whose sockets already closed to show as gone; [] without peer pools."""
        if self.peers is None:
            return []
        deadline = time.monotonic() + wait_s
        while not (dead := self.peers.dead_ranks()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return dead

    def state(self) -> dict[str, dict]:
        """Model and optimizer state of this rank keyed by parameter name, plus `masters`
        (fp32 master weights) under mixed precision, built on the host one tensor at a
        time; offloaded optimizer data comes to the device one layer's chunk at a time
        (`mpress.runtime.job_state`). Parameter names are the whole model's, so the
        ranks' states merge into the whole model's (a checkpoint resumes on another
        world size or stage split: `mpress.launcher.checkpoints.checkpoint`); and `skips`, the
        steps skipped so far (`StepGuard.state_dict`), so a resume counts on."""
        return {**save_state(self.modules, self.masters, self.model_data.chunks()), "skips": self.guard.state_dict()}

    def load_state(self, state: dict[str, dict]) -> None:
        """Copy `state` (host tensors in `state()`'s layout; it may hold parameters of
        other ranks, which are not read) into this rank's tensors in place, offloaded
        chunks one at a time."""
        load_state(self.modules, self.masters, self.model_data.chunks(), state)
        if "skips" in state:  # the skipped-step counts (a checkpoint older than them: none)
            self.guard.load_state_dict(state["skips"])
        self.model_data.after_change()
        if self.live is not None:
            self._adopt_model_data()  # the loaded states were made outside a step

    def close(self) -> None:
        for rt in self.runtimes:
            rt.close()
        self.masters.close()
        if self.peers is not None:
            self.peers.close(barrier=True)
