"""The largest model of a family each strategy can fit on a server, and what bounds it.

Models grow the way the family's presets do: width and depth together. The family's
billion-scale presets set the rule (`ShapeRule`): depth = scale x width^exponent, fitted
to the presets by least squares in log-log space; heads of the base preset's head size;
sequence, vocabulary and precision of the base preset (the precision unless a setting
overrides it: `family_rule(..., precision=)`, as `--setting` does). The base is the
family's largest preset, or the preset named instead of the family (`family_rule("llama-2-7b")`:
Llama 2's sequence, vocabulary and plain multi-head attention). The Llama family keeps
its own knobs as it grows (`ShapeRule.model`): the MLP width in the base's proportion to
the hidden size, rounded up to Meta's multiple (`LLAMA_FFN_MULTIPLE`), and, under
grouped-query attention, the base's key/value head count (Llama 3 keeps 8 from 8B to
70B), so its widths step by that many heads (`ShapeRule.step`: 1,024 for Llama 3, as its
presets' widths do); plain multi-head attention stays so; rotary base, norm epsilon and
attention kernel as the base's. The candidates are the widths that are multiples of the
step (the head size, but for grouped-query Llama), each at the rule's depth; bigger width means
more parameters, more bytes per stage and wider activations, so fitting is taken as
monotone in width: the search doubles the width from the smallest preset's until a size
does not fit, then bisects.

A size fits when the strategy's plan fits (`PlanResult.fits`): every device's emulated
peak within its usable memory (`Hardware.usable_memory_bytes`: nominal less the reserve)
and the pinned host buffers within what the server can pin (`Hardware.pinnable_bytes`).
The ZeRO baselines (`mpress.static.baselines.zero.ZERO_VARIANTS`) are searched the same way, a
size fitting when `plan_zero`'s result does (GPU peak, pinned host, drives).
What bounds the answer (`Bound`) is why the smallest size that fails failed; or the
search's time budget; or the largest shape searched.

`mpress` is searched with the host as its only tier (host vs host beside ZeRO-Offload and
ZeRO-Infinity); `mpress-nvme` (`MPRESS_NVME`, where the server states drives) lets the
planner move optimizer data to the local drive when the pins exceed the host's
(`planner_nvme`), beside ZeRO-Infinity-NVMe. A row's `drive_bytes` and `drive_s` name
the drive's bounds: what it holds (against `Hardware.nvme_bytes`) and the time one
iteration's drive traffic takes at its bandwidth (every byte written once and read once).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

from mpress.errors import UserError
from mpress.hardware.server import Hardware
from mpress.config.limits import MAX_WIDTH
from mpress.config.model_config import LLAMA_FFN_MULTIPLE, ModelConfig, load_model_config, model_presets
from mpress.models import num_parameters
from mpress.static.plan.evaluate import PipelineSetup, setup_pipeline
from mpress.static.plan.balance_choice import minimum_need_bytes
from mpress.static.plan.planner import PlannerOptions, PlanResult, plan_strategy
from mpress.static.baselines.zero import ZERO_VARIANTS, BaselineResult, plan_zero
from mpress.config.vocabulary import MPRESS_NVME, ScheduleName, Strategy, Technique, Word


def drive_searches(hardware: Hardware) -> tuple[str, ...]:
    """`MPRESS_NVME` where the server states drives, else nothing."""
    return (MPRESS_NVME,) if hardware.has_nvme else ()


class Bound(Word):
    """What keeps the next size up from fitting."""

    DEVICE_MEMORY = "device memory"
    """A device's peak (or what no technique can move) exceeds its usable memory."""
    PINNED_HOST = "pinned host"
    """The host-swap buffers exceed what the server can pin."""
    HOST_RAM = "host RAM"
    """The host-swap buffers exceed the host's memory (a preset that states no pinnable limit)."""
    PEER_MEMORY = "peer memory"
    """D2D data finds no spare peer memory over NVLink."""
    DRIVES = "drives"
    """The data ZeRO-Infinity (or mpress-nvme) puts on the local drives exceeds their capacity."""
    PIPELINE_DEPTH = "pipeline depth"
    """The rule's depth is too shallow for the pipeline's stages (small widths only)."""
    TIME = "time"
    """The search's time budget ran out: larger sizes were not tried."""
    LARGEST_SHAPE = "largest shape"
    """The widest shape the search tries fits."""


@dataclass(frozen=True, kw_only=True)
class ShapeRule:
    """A family's shape rule: depth = scale x width^exponent (rounded, >= 1); heads of
    `head_dim`; everything else as `base` (the family's largest preset)."""

    family: str
    base: ModelConfig
    head_dim: int
    scale: float
    exponent: float

    def depth(self, width: int) -> int:
        """Blocks of the model of this width."""
        return max(1, round(self.scale * width ** self.exponent))

    @property
    def grouped(self) -> bool:
        """The base is a Llama with grouped-query attention (fewer key/value heads)."""
        return self.base.family == "llama" and self.base.kv_heads != self.base.num_heads

    @property
    def step(self) -> int:
        """What widths step by: a head, or under grouped-query attention as many heads as
        the base has key/value heads (each width then groups its heads alike)."""
        return self.head_dim * (self.base.kv_heads if self.grouped else 1)

    def model(self, width: int) -> ModelConfig:
        """The family's model of this width (a multiple of `step`), named by its size:
        the base's heads of `head_dim`, its MLP width in proportion (Llama: rounded up to
        `LLAMA_FFN_MULTIPLE`) and, for Llama, its key/value heads (the base's)."""
        if width <= 0 or width % self.step:
            what = f"{self.base.kv_heads} key/value heads x head size" if self.grouped else "head size"
            raise UserError(f"width {width} is not a positive multiple of the {self.family} {what} {self.step}")
        b = self.base
        heads = width // self.head_dim
        ffn = None if b.ffn_hidden_size is None else round(b.ffn_hidden_size * width / b.hidden_size)
        if ffn is not None and b.family == "llama":
            ffn = -(-ffn // LLAMA_FFN_MULTIPLE) * LLAMA_FFN_MULTIPLE
        cfg = replace(b, hidden_size=width, num_heads=heads, num_layers=self.depth(width), ffn_hidden_size=ffn,
                      num_kv_heads=b.kv_heads if self.grouped else None)
        return replace(cfg, name=f"{b.family}-{num_parameters(cfg) / 1e9:.2f}b-L{cfg.num_layers}-h{width}")


FAMILIES = ("gpt", "bert", "llama")
"""The families maxsize scales (`ModelConfig.family`)."""


def family_ladder(family: str) -> list[ModelConfig]:
    """Billion-scale presets of `family` (names ending in `b`), smallest first."""
    configs = [load_model_config(n) for n in model_presets() if n.startswith(f"{family}-") and n.endswith("b")]
    if family not in FAMILIES or not configs:
        raise UserError(f"unknown family {family!r} (known: {', '.join(FAMILIES)}, or a preset of one of them)")
    return sorted(configs, key=num_parameters)


def family_of(model: str) -> str:
    """The family of `model`: a family's name, or a model preset's (one line otherwise)."""
    if model in FAMILIES:
        return model
    if model in model_presets():
        return load_model_config(model).family
    raise UserError(f"{model!r} is neither a family ({', '.join(FAMILIES)}) nor a model preset "
                    f"({', '.join(model_presets())})")


def family_rule(model: str, precision: str | None = None) -> ShapeRule:
    """`ShapeRule` fitted to the billion-scale presets of `model`'s family (least squares of
    log depth on log width; a single width, or one preset: depth in proportion to width).
    model: a family (its largest preset is the base) or a preset (itself the base).
    precision: the models' training precision (None: the base's)."""
    family = family_of(model)
    ladder = family_ladder(family)
    top = ladder[-1] if model == family else load_model_config(model)
    if precision is not None:
        top = replace(top, precision=precision)
    xs = [math.log(c.hidden_size) for c in ladder]
    ys = [math.log(c.num_layers) for c in ladder]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    exponent = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 1.0
    return ShapeRule(family=family, base=top, head_dim=top.hidden_size // top.num_heads,
                     scale=math.exp(my - exponent * mx), exponent=exponent)


@dataclass(frozen=True, kw_only=True)
class MaxSize:
    """The largest fitting model of one strategy (None when even the smallest fails)."""

    strategy: str
    model: ModelConfig | None
    num_parameters: int
    result: PlanResult | None
    """The strategy's plan for that model, with the full search (None for a ZeRO baseline)."""
    evaluations: int
    """Plans made during the search."""
    bound: Bound | None = None
    """What keeps the next size up from fitting (None: a row not found by the search)."""
    bound_detail: str = ""
    """The next size up and why it does not fit (the planner's reason)."""
    baseline: BaselineResult | None = None
    """A ZeRO baseline's result for that model (None for a planner strategy)."""

    @property
    def drive_bytes(self) -> int:
        """Bytes the largest model keeps on the local drives (0: none)."""
        if self.result is not None:
            return sum(c.optimizer_data_bytes for c, sp in zip(self.result.evaluation.setup.costs,
                                                                       self.result.plan.stages)
                       if any(r.technique is Technique.NVME for r in sp.rules))
        return self.baseline.nvme_bytes if self.baseline is not None else 0

    def drive_s(self, hardware: Hardware) -> float:
        """Time of one iteration's drive traffic at the drives' bandwidth: `drive_bytes`
        written once and read once (0 without a drive)."""
        if not self.drive_bytes or not hardware.has_nvme:
            return 0.0
        gb = self.drive_bytes / 1e9
        return gb / hardware.nvme_gbps("write") + gb / hardware.nvme_gbps("read")

    @property
    def iteration_s(self) -> float:
        """The largest model's iteration (nan when nothing fits)."""
        if self.result is not None:
            return self.result.evaluation.result.iteration_s
        return self.baseline.iteration_s if self.baseline is not None else math.nan

    @property
    def samples_per_s(self) -> float:
        if self.result is not None:
            return self.result.evaluation.result.samples_per_s
        return self.baseline.samples_per_s if self.baseline is not None else math.nan


def plan_bound(hardware: Hardware, result: PlanResult) -> Bound:
    """Why a plan that does not fit fails, as a `Bound`."""
    if result.host_bytes > hardware.pinnable_bytes:
        if result.draft is not None and result.draft.drive_full:
            return Bound.DRIVES  # the pins needed more moved to the drive than it holds
        return Bound.PINNED_HOST if hardware.pinnable_host_bytes is not None else Bound.HOST_RAM
    if result.reason.startswith("host memory"):  # the host steps' fp32 copies and states (`planner_layer_data.host_why`)
        return Bound.HOST_RAM
    if result.draft is not None and result.draft.unplaced_bytes:
        return Bound.PEER_MEMORY  # what no peer took stays on its device, which may overflow it then
    if any(p > hardware.usable_memory_bytes for p in result.evaluation.result.peak_bytes):
        return Bound.DEVICE_MEMORY
    return Bound.PEER_MEMORY if "D2D" in result.reason else Bound.DEVICE_MEMORY


def zero_bound(hardware: Hardware, result: BaselineResult) -> Bound:
    """Why a ZeRO baseline that does not fit fails, as a `Bound` (checked in the order
    `plan_zero` gives its reason)."""
    if result.peak_bytes > hardware.usable_memory_bytes:
        return Bound.DEVICE_MEMORY
    if result.host_bytes > hardware.pinnable_bytes:
        return Bound.PINNED_HOST if hardware.pinnable_host_bytes is not None else Bound.HOST_RAM
    if hardware.nvme_bytes is not None and result.nvme_bytes > hardware.nvme_bytes:
        return Bound.DRIVES
    raise UserError(f"{result.strategy} on {hardware.name}: {result.reason}")


def unmovable_why(setup: PipelineSetup, strategy: str) -> str | None:
    """Why no plan of planner strategy `strategy` can fit `setup`: a stage's bytes that
    none of its techniques move exceed the usable memory (mpress, with or without the
    drive, moves layers' parameters and gradients too: `minimum_need_bytes`); None when
    the floor fits."""
    floor = max(minimum_need_bytes(setup, strategy == Strategy.MPRESS.value))
    usable = setup.hardware.usable_memory_bytes
    return f"a stage needs {floor} bytes no technique can move, above the {usable} usable" if floor > usable else None


def find_max_size(family: str, hardware: Hardware, strategy: str, *, schedule: ScheduleName, num_stages: int,
                  microbatch_size: int, num_microbatches: int, num_ranks: int | None = None,
                  precision: str | None = None, time_budget_s: float | None = None,
                  progress: Callable[[str], None] | None = None) -> MaxSize:
    """Largest model of `family` (a family, or a preset that is the base of its family's
    rule: `family_rule`) that `strategy` (a planner strategy or a ZeRO variant) fits (see
    the module docstring).
    precision: train the family in this precision (None: its presets').
    time_budget_s: stop trying larger sizes after this many seconds (None: no limit)."""
    note = progress or (lambda _m: None)
    zero = strategy in ZERO_VARIANTS
    drive = strategy == MPRESS_NVME
    if drive and not hardware.has_nvme:
        raise UserError(f"{MPRESS_NVME}: hardware {hardware.name} states no local drive (nvme_bytes, nvme_read_gbps)")
    planned = Strategy.MPRESS.value if drive else strategy
    if zero and hardware.host_memory_gbps is None:
        raise UserError(f"{strategy}: hardware {hardware.name} states no host_memory_gbps, so its CPU optimizer "
                        "step cannot be timed")
    # D2D rounds and the optimizer step (`planner_optim_keep`) buy speed, not fit: skipped while searching
    quick = PlannerOptions(max_d2d_rounds=0, drive=drive, layer_data=True, optimizer_keep=False)
    rule = family_rule(family, precision)
    shape = dict(schedule=schedule, num_stages=num_stages, num_ranks=num_ranks, microbatch_size=microbatch_size,
                 num_microbatches=num_microbatches)
    t0 = time.monotonic()
    count = 0
    why: dict[int, tuple[Bound, str]] = {}  # width index -> why it does not fit

    def fits(i: int) -> bool:
        nonlocal count
        if i in why:
            return False
        cfg = rule.model(i * rule.step)
        if cfg.num_layers + 2 < num_stages:
            why[i] = (Bound.PIPELINE_DEPTH, f"{cfg.name}: {cfg.num_layers} blocks for {num_stages} stages")
            return False
        setup = setup_pipeline(cfg, hardware, **shape)
        if zero:
            count += 1
            base = plan_zero(setup, strategy)
            note(f"{strategy}: {cfg.name} {'fits' if base.fits else 'does not fit'}")
            if not base.fits:
                why[i] = (zero_bound(hardware, base), f"{cfg.name}: {base.reason}")
            return base.fits
        floor = unmovable_why(setup, planned)
        if floor is not None:
            why[i] = (Bound.DEVICE_MEMORY, f"{cfg.name}: {floor}")
            return False
        count += 1
        res = plan_strategy(setup, planned, quick)
        note(f"{strategy}: {cfg.name} {'fits' if res.fits else 'does not fit'}")
        if not res.fits:
            why[i] = (plan_bound(hardware, res), f"{cfg.name}: {res.reason}")
        return res.fits

    def out_of_time() -> bool:
        return time_budget_s is not None and time.monotonic() - t0 >= time_budget_s

    top = MAX_WIDTH // rule.step
    start = max(1, family_ladder(rule.family)[0].hidden_size // rule.step)
    lo, hi = (start, None) if fits(start) else (0, start)  # lo fits (or is 0), hi does not (or is None)
    timed_out = False
    while hi is None and lo < top:
        if out_of_time():
            timed_out = True
            break
        nxt = min(2 * lo, top)
        if fits(nxt):
            lo = nxt
        else:
            hi = nxt
    while hi is not None and hi - lo > 1 and not timed_out:
        if out_of_time():
            timed_out = True
            break
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    if timed_out:
        bound, detail = Bound.TIME, f"stopped after {time_budget_s} s"
    elif hi is None:
        bound, detail = Bound.LARGEST_SHAPE, f"width {lo * rule.step} is the widest searched"
    else:
        bound, detail = why[hi]
    if lo == 0:
        return MaxSize(strategy=strategy, model=None, num_parameters=0, result=None, evaluations=count,
                       bound=bound, bound_detail=detail)
    model = rule.model(lo * rule.step)
    setup = setup_pipeline(model, hardware, **shape)
    if zero:
        return MaxSize(strategy=strategy, model=model, num_parameters=num_parameters(model), result=None,
                       evaluations=count, bound=bound, bound_detail=detail, baseline=plan_zero(setup, strategy))
    result = plan_strategy(setup, planned, PlannerOptions(drive=drive, layer_data=True))
    count += 1
    if not result.fits:  # the full search never loses the fit the quick one found; if it did, keep that
        result = plan_strategy(setup, planned, quick)
        count += 1
    return MaxSize(strategy=strategy, model=model, num_parameters=num_parameters(model),
                   result=result, evaluations=count, bound=bound, bound_detail=detail)
