"""The variants of `bench/host_swap.py` (see its docstring): one GPT stage run plain,
under `save_on_cpu(pin_memory=True)`, with mpress host swap and with mpress recompute,
each on its own copy of the stage, the mpress ones driven by a one-microbatch program as
`MpressStage` drives its stage; the microbatch they all train on, and the census of what
its forward saves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mpress.contract.actions import Action, Kind, UnitId, UnitKind, format_actions
from mpress.contract.live_bytes import LiveBytes
from mpress.config.model_config import ModelConfig
from mpress.models import build_stage, lm_loss
from mpress.models.transformer import TORCH_DTYPES
from mpress.contract.plan import StagePlan, TensorRule
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import MemoryManager
from mpress.runtime.program import RankProgram
from mpress.runtime.router import SavedTensorRouter
from mpress.runtime.swap.engine import SwapEngine, SwapStats
from mpress.config.units import ALIGNMENT_BYTES

POOL_SLACK = 1.25
"""Pinned pool over the census's activation bytes (alignment, blocks of a step still
held when the next one starts)."""
FWD, BWD = Action(0, Kind.F, 0), Action(0, Kind.B, 0)
"""The stage's one forward and one backward per step."""


@dataclass(kw_only=True)
class Batch:
    """One microbatch, the same for every variant and step."""

    x: torch.Tensor
    """(B, T) int64 ids for a stage with the embedding, else (B, T, h) hidden states."""
    targets: torch.Tensor | None
    """(B, T) int64 next tokens when the stage ends with the head."""
    upstream: torch.Tensor | None
    """(B, T, h) gradient of the stage's output when it has no head (as the next stage
    would send it)."""

    def leaf(self) -> torch.Tensor:
        """A fresh input for one step (hidden states require grad, as a received
        activation does in a pipeline)."""
        return self.x.detach().requires_grad_() if self.x.is_floating_point() else self.x

    def loss(self, out: torch.Tensor) -> torch.Tensor:
        if self.targets is not None:
            return lm_loss(out, self.targets)
        return (out.float() * self.upstream).sum()


@dataclass(kw_only=True)
class Census:
    """What autograd saves in one forward of the stage (counted by hooks that keep all)."""

    num_activations: int
    activation_bytes: int
    """Per saved tensor, parameters and the stage's input excluded: what a per-tensor swap
    moves each way."""
    activation_storage_bytes: int
    """Distinct storages of those: what keeping them holds on the device."""
    input_bytes: int
    """Saved tensors sharing the stage input's storage (the pipeline holds it, so mpress
    never moves it; save_on_cpu copies these too)."""
    parameter_bytes: int
    """Saved tensors sharing a parameter's storage (save_on_cpu copies these too)."""


@dataclass(kw_only=True)
class Variant:
    """One way of running the step, on its own copy of the stage."""

    name: str
    stage: torch.nn.Module
    step: Callable[[Variant, Batch], torch.Tensor]
    """Forward + backward of one microbatch; returns the input leaf (for its grad)."""
    router: SavedTensorRouter | None = None
    program: RankProgram | None = None
    engine: SwapEngine | None = None
    live: LiveBytes | None = None
    """CPU: the variant's live-bytes tracker (None: not measured)."""
    times_s: list[float] = field(default_factory=list)
    peaks_bytes: list[int] = field(default_factory=list)
    max_diff: float = 0.0
    """Largest |gradient - plain's| over every checked step (0: all equal)."""
    grads_equal: bool = True
    stats_start: SwapStats | None = None
    stats_end: SwapStats | None = None

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
        if self.engine is not None:
            self.engine.close()
            self.engine.store.close()


# ---- steps ------------------------------------------------------------------------------

def step_plain(v: Variant, batch: Batch) -> torch.Tensor:
    x = batch.leaf()
    batch.loss(v.stage(x)).backward()
    return x


def step_save_on_cpu(v: Variant, batch: Batch) -> torch.Tensor:
    x = batch.leaf()
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        out = v.stage(x)
    batch.loss(out).backward()
    return x


def step_mpress(prefetch: str) -> Callable[[Variant, Batch], torch.Tensor]:
    """One step of the variant's program, driven as `MpressStage` drives it; the
    backward begins (issuing the program's SIs and releasing its copy-outs) right after
    the forward for `after-forward`, after the loss otherwise."""
    def step(v: Variant, batch: Batch) -> torch.Tensor:
        program, router = v.program, v.router
        x = batch.leaf()
        program.begin(FWD)
        with router.microbatch(0):
            out = v.stage(x)
        program.end()
        if prefetch == "after-forward":
            program.begin(BWD)
        loss = batch.loss(out)
        if prefetch != "after-forward":
            program.begin(BWD)
        loss.backward()  # on-demand: the list has no SI, each unpack fetches its own tensor
        router.finish(0)
        program.end()
        program.end_step()
        if program.last_log != program.actions:
            raise RuntimeError(f"{v.name}: the step executed {format_actions(program.last_log)!r}, "
                               f"its program lists {format_actions(program.actions)!r}")
        return x
    return step


def unit(layer: str, rule: int) -> str:
    """The stage's unit of `layer`'s saved tensors that rule `rule` decides."""
    return str(UnitId(0, UnitKind.ACTIVATIONS, layer=layer, rule=rule))


def swap_program(layers: list[str], prefetch: str) -> list[Action]:
    """Host swap of every layer's saved tensors (rule 0): SO inside the forward, SI
    before the backward, last layer first (none for `on-demand`)."""
    units = [unit(name, 0) for name in layers]
    ins = [] if prefetch == "on-demand" else [Action(0, Kind.SI, 0, u) for u in reversed(units)]
    return [FWD, *(Action(0, Kind.SO, 0, u) for u in units), *ins, BWD]


def recompute_program(layers: list[str]) -> list[Action]:
    """Layer i dropped by rule i inside the forward, recomputed inside the backward."""
    units = [unit(name, i) for i, name in enumerate(layers)]
    return [FWD, *(Action(0, Kind.DR, 0, u) for u in units), BWD,
            *(Action(0, Kind.RC, 0, u) for u in reversed(units))]


# ---- set-up -----------------------------------------------------------------------------

def make_batch(cfg: ModelConfig, first_layer: int, end_layer: int, microbatch_size: int,
               device: torch.device, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed + 1)
    b, t, h = microbatch_size, cfg.seq_len, cfg.hidden_size
    dtype = TORCH_DTYPES[cfg.precision]
    if first_layer == 0:
        x = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    else:
        x = torch.randn(b, t, h, generator=g).to(dtype)  # (B, T, h)
    has_head = end_layer == cfg.num_layers + 2
    targets = torch.randint(0, cfg.vocab_size, (b, t), generator=g).to(device) if has_head else None
    upstream = None if has_head else (torch.randn(b, t, h, generator=g) / (b * t)).to(device)  # (B, T, h)
    return Batch(x=x.to(device), targets=targets, upstream=upstream)


def take_census(stage: torch.nn.Module, batch: Batch) -> Census:
    """Count what one forward saves (parameters apart), keeping everything."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    x = batch.leaf()
    stage_input = x.untyped_storage().data_ptr()
    storages: dict[int, int] = {}
    counts = {"n": 0, "act": 0, "input": 0, "param": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        ptr = t.untyped_storage().data_ptr()
        if ptr in params:
            counts["param"] += nbytes
        elif ptr == stage_input:
            counts["input"] += nbytes
        else:
            counts["n"] += 1
            counts["act"] += nbytes
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x)
    del out
    return Census(num_activations=counts["n"], activation_bytes=counts["act"],
                  activation_storage_bytes=sum(storages.values()), input_bytes=counts["input"],
                  parameter_bytes=counts["param"])


def stage_plan(first_layer: int, end_layer: int, rules: list[TensorRule], pinned_bytes: int = 0) -> StagePlan:
    return StagePlan(stage=0, device=0, first_layer=first_layer, end_layer=end_layer, rules=rules,
                     pinned_host_bytes=pinned_bytes)


def build_variants(cfg: ModelConfig, first_layer: int, end_layer: int, device: torch.device, seed: int,
                   prefetch: str, census: Census, batch: Batch) -> list[Variant]:
    def stage() -> torch.nn.Module:
        return build_stage(cfg, first_layer, end_layer, seed=seed, device=device)

    def live() -> LiveBytes | None:
        return LiveBytes(rank=0) if device.type == "cpu" else None

    plain = Variant(name="plain (keep all)", stage=stage(), step=step_plain, live=live())
    soc = Variant(name="save_on_cpu(pin_memory=True)", stage=stage(), step=step_save_on_cpu)

    # the engine, router and program wired as `StageRuntime` wires them
    host_stage = stage()
    host_live = live()
    pool_bytes = int(census.activation_bytes * POOL_SLACK)
    # one alignment unit per tensor for block rounding; pinned when CUDA is there
    pool = PinnedHostPool(pool_bytes + census.num_activations * ALIGNMENT_BYTES)
    if host_live is not None:
        host_live.adopt(pool.buffer, "pinned host pool", host=True)
    # No `watch=` for the workers (the runtime's CPU ranks pass one): a dispatch hook on
    # them for their lifetime would slow every timed step's copies, and on the host path
    # they make no storage (swap-ins are allocated on the training thread, copies are
    # in place), so the measured step's LiveBytes counts everything without it.
    engine = SwapEngine(pool, MemoryManager(device, rank=0), device, rank=0, stage=0, hold_until_release=True)
    host_plan = stage_plan(first_layer, end_layer, [TensorRule(tensor="*", technique="host")], pool_bytes)
    host_program = RankProgram(swap_program(host_stage.layer_names(), prefetch), rank=0, live=host_live)
    host_router = SavedTensorRouter(host_stage, host_plan, host_program, rank=0, example_args=(batch.x,),
                                    engine=engine)
    host_program.on(Kind.SI, 0, host_router.prefetch_unit)
    host_program.on_release(engine.wait_outs)
    host = Variant(name=f"mpress host swap ({prefetch})", stage=host_stage, step=step_mpress(prefetch),
                   router=host_router, program=host_program, engine=engine, live=host_live)

    rc_stage = stage()
    rc_live = live()
    rc_rules = [TensorRule(tensor=f"{name}.**", technique="recompute") for name in rc_stage.layer_names()]
    rc_program = RankProgram(recompute_program(rc_stage.layer_names()), rank=0, live=rc_live)
    recompute = Variant(name="mpress recompute", stage=rc_stage, step=step_mpress("before-backward"),
                        router=SavedTensorRouter(rc_stage, stage_plan(first_layer, end_layer, rc_rules), rc_program,
                                                 rank=0, example_args=(batch.x,)),
                        program=rc_program, live=rc_live)
    return [plain, soc, host, recompute]
