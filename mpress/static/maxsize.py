"""The largest model of a family each strategy can fit on a server.

Models grow the way the presets do: the family's billion-scale presets, in order of
size, set the widths (hidden size, heads) and a ladder of depths. For each strategy the
search walks that ladder until a preset does not fit, then bisects the depth at the
width of the last preset that fit, up to the size of the next preset (past the top
preset: doubling, then bisecting). Fitting is monotone in depth at a fixed width (more
layers per stage only add bytes), which is what makes bisection exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from mpress.errors import UserError
from mpress.hardware import Hardware
from mpress.model_config import ModelConfig, load_model_config, model_presets
from mpress.models import num_parameters
from mpress.static.evaluate import setup_pipeline
from mpress.vocabulary import ScheduleName
from mpress.static.planner import (
    PlannerOptions,
    PlanResult,
    minimum_need_bytes,
    plan_strategy,
)

MAX_LAYERS = 4096
"""Depth at which the search stops doubling."""


@dataclass(frozen=True, kw_only=True)
class MaxSize:
    """The largest fitting model of one strategy (None when even the smallest fails)."""

    strategy: str
    model: ModelConfig | None
    num_parameters: int
    result: PlanResult | None
    """The strategy's plan for that model, with the full search."""
    evaluations: int
    """Plans made during the search."""


def family_ladder(family: str) -> list[ModelConfig]:
    """Billion-scale presets of `family` (names ending in `b`), smallest first."""
    configs = [load_model_config(n) for n in model_presets() if n.startswith(f"{family}-") and n.endswith("b")]
    if not configs:
        raise UserError(f"unknown family {family!r} (known: gpt, bert)")
    return sorted(configs, key=num_parameters)


def with_layers(base: ModelConfig, num_layers: int) -> ModelConfig:
    """`base` at another depth, named by its parameter count."""
    cfg = replace(base, num_layers=num_layers)
    return replace(cfg, name=f"{base.family}-{num_parameters(cfg) / 1e9:.2f}b-L{num_layers}-h{base.hidden_size}")


def find_max_size(family: str, hardware: Hardware, strategy: str, *, schedule: ScheduleName, num_stages: int,
                  microbatch_size: int, num_microbatches: int, num_ranks: int | None = None,
                  progress: Callable[[str], None] | None = None) -> MaxSize:
    """Largest model of `family` that `strategy` fits (see the module docstring)."""
    note = progress or (lambda _m: None)
    quick = PlannerOptions(max_d2d_rounds=0)  # D2D rounds buy speed, not fit: skip while searching
    count = 0
    cache: dict[tuple[int, int], bool] = {}

    def fits(cfg: ModelConfig) -> bool:
        nonlocal count
        key = (cfg.hidden_size, cfg.num_layers)
        if key not in cache:
            if cfg.num_layers + 2 < num_stages:
                cache[key] = False
                return False
            setup = setup_pipeline(cfg, hardware, schedule=schedule, num_stages=num_stages, num_ranks=num_ranks,
                                   microbatch_size=microbatch_size, num_microbatches=num_microbatches)
            if any(floor > hardware.device.memory_bytes for floor in minimum_need_bytes(setup)):
                cache[key] = False
            else:
                count += 1
                cache[key] = plan_strategy(setup, strategy, quick).fits
            note(f"{strategy}: {cfg.name} {'fits' if cache[key] else 'does not fit'}")
        return cache[key]

    ladder = family_ladder(family)
    best: ModelConfig | None = None
    nxt: ModelConfig | None = None
    for i, cfg in enumerate(ladder):
        if not fits(cfg):
            nxt = cfg
            break
        best = cfg
    if best is None:  # even the smallest preset fails: bisect its depth downwards
        base = ladder[0]
        lo, hi = 0, base.num_layers
    else:
        base = best
        lo = best.num_layers
        if nxt is not None:
            hi = next(L for L in range(lo, MAX_LAYERS + 1)
                      if num_parameters(replace(best, num_layers=L)) >= num_parameters(nxt))
        else:
            hi = lo
            while hi < MAX_LAYERS and fits(with_layers(best, min(2 * hi, MAX_LAYERS))):
                lo = hi = min(2 * hi, MAX_LAYERS)
            hi = min(2 * hi, MAX_LAYERS) if hi < MAX_LAYERS else hi
    while hi - lo > 1:  # invariant: lo fits (or is 0), hi does not (or is the next size)
        mid = (lo + hi) // 2
        if fits(with_layers(base, mid)):
            lo = mid
        else:
            hi = mid
    if lo == 0:
        return MaxSize(strategy=strategy, model=None, num_parameters=0, result=None, evaluations=count)
    model = base if lo == base.num_layers else with_layers(base, lo)
    setup = setup_pipeline(model, hardware, schedule=schedule, num_stages=num_stages, num_ranks=num_ranks,
                           microbatch_size=microbatch_size, num_microbatches=num_microbatches)
    return MaxSize(strategy=strategy, model=model, num_parameters=num_parameters(model),
                   result=plan_strategy(setup, strategy), evaluations=count + 1)
