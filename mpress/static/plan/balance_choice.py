"""Which split of the layers to plan on, chosen before planning, from the memory model.

`mpress plan` without `--balance` lays out the stages balanced by compute (PipeDream,
DAPPLE: `partition.py`), unless the strategy it writes cannot fit them and can fit the
stages balanced by memory. Whether a strategy can fit a split is first a question for
the memory model (`mpress.static.memory.model`): per stage, what the strategy's
techniques cannot take off the device (its floor, `floor_bytes`) against the device's
usable memory. A floor above it rules the split out before any planning
(`ruled_out`); a floor within it leaves the answer to the planner, which emulates.

`choose_balance` reads the verdicts once, up front:

- compute ruled out, memory not: memory, and the strategy is planned there only;
- both ruled out: compute, the default split, where the other strategies are compared
  (the strategy is planned once, and does not fit);
- compute not ruled out: compute; only when the planner then finds no fitting plan on
  it, and the memory model does not rule memory out, is the strategy planned again on
  memory (the floors cannot see every byte the emulation finds: host pins, copies in
  flight). Where the strategy fits neither split, the split where another strategy
  fits, compute first.

The floors: `none` moves nothing (the stage's whole need); `recompute` and
`megatron-selective` rebuild activations only (model states, PipeDream's stashed
weights, torch's buffers and the largest transient stay); the swapping strategies
(`host-swap`, `d2d`, `mpress`) can move all but parameters, gradients, buffers and the
largest transient (`minimum_need_bytes`), and where even that floor exceeds the usable
memory nothing is planned (`check_fits_at_all`). Units: bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from mpress.config.units import fmt_bytes
from mpress.config.vocabulary import Strategy
from mpress.static.plan.evaluate import PipelineSetup
from mpress.errors import UserError
from mpress.static.plan.planner import PlanResult

Balance = Literal["compute", "memory"]

PlanOn = Callable[[Balance, list[str]], dict[str, PlanResult]]
"""(split, strategies) -> every result planned on that split so far: the caller plans
each strategy once per split (the strategies share what they emulate)."""


def floor_bytes(setup: PipelineSetup, strategy: str) -> list[int]:
    """Per stage, the bytes the memory model says `strategy` leaves on its device
    whatever it moves (see the module docstring)."""
    s = Strategy(strategy)
    if s is Strategy.NONE:
        return [m.total_bytes for m in setup.memory]
    if s in (Strategy.RECOMPUTE, Strategy.MEGATRON_SELECTIVE):
        return [m.static_bytes + m.transient_bytes for m in setup.memory]
    return minimum_need_bytes(setup)


def ruled_out(setup: PipelineSetup, strategy: str) -> str:
    """Why the memory model says `strategy` cannot fit `setup`'s stages, in words (the
    stage whose floor exceeds the usable memory most); "" when it may fit."""
    usable = setup.hardware.usable_memory_bytes
    floors = floor_bytes(setup, strategy)
    worst = max(range(len(floors)), key=lambda s: (floors[s] - usable, -s))
    if floors[worst] <= usable:
        return ""
    return f"stage {worst} keeps at least {fmt_bytes(floors[worst])} of {fmt_bytes(usable)} usable"


def choose_balance(by_compute: PipelineSetup, by_memory: Callable[[], PipelineSetup], strategy: str,
                   plan: PlanOn, say: Callable[[str], None]) -> Balance:
    """The split to plan every strategy on (see the module docstring): `strategy`'s
    planned first on memory only where the memory model rules out compute and not
    memory, and on the other split only where the model could not tell and the first
    does not fit. `by_memory`: lays out the memory split, asked only where the answer
    needs it (a split laid out anew may profile the model again: `--hf-config`). `say`:
    one line per decision."""
    compute_out = ruled_out(by_compute, strategy)
    if compute_out:
        memory_out = ruled_out(by_memory(), strategy)
        if memory_out:
            say(f"{strategy} cannot fit the layers balanced by compute nor by memory by the memory model "
                f"({compute_out}; balanced by memory, {memory_out}); keeping them balanced by compute")
            return "compute"
        say(f"{strategy} cannot fit the layers balanced by compute by the memory model ({compute_out}); "
            "planning them balanced by memory (--balance memory)")
        return "memory" if plan("memory", [strategy])[strategy].fits else _neither(strategy, plan, say)
    if plan("compute", [strategy])[strategy].fits:
        return "compute"
    memory_out = ruled_out(by_memory(), strategy)
    if memory_out:
        say(f"{strategy} does not fit with the layers balanced by compute, and the memory model rules out "
            f"balancing them by memory ({memory_out}); keeping them balanced by compute")
        return "compute"
    say(f"{strategy} does not fit with the layers balanced by compute; trying them balanced by memory "
        "(--balance memory)")
    return "memory" if plan("memory", [strategy])[strategy].fits else _neither(strategy, plan, say)


def _neither(strategy: str, plan: PlanOn, say: Callable[[str], None]) -> Balance:
    """`strategy` fits neither split: compute where another strategy fits it, else memory."""
    if any(r.fits for r in plan("compute", Strategy.words()).values()):
        say(f"{strategy} fits neither split; keeping the layers balanced by compute, where another strategy fits")
        return "compute"
    return "memory"


def minimum_need_bytes(setup: PipelineSetup, layer_data: bool = False) -> list[int]:
    """Per stage, bytes no technique can move: parameters and gradients (with `layer_data`,
    as `mpress` plans: two layers' worth), torch's pipeline buffers, the largest transient."""
    return [m.buffer_bytes + m.transient_bytes + (m.param_bytes + m.grad_bytes if not layer_data else 2 * max(
        x.param_bytes + x.grad_bytes for x in c.layers)) for m, c in zip(setup.memory, setup.costs)]


def check_fits_at_all(setup: PipelineSetup, strategy: str = Strategy.MPRESS, layer_data: bool = False) -> None:
    """A one-line `UserError` when even moving every movable byte (`layer_data`: as the option) cannot fit."""
    cap = setup.hardware.usable_memory_bytes
    for m, floor in zip(setup.memory, minimum_need_bytes(setup, layer_data and strategy == Strategy.MPRESS)):
        if floor > cap:
            raise UserError(
                f"does not fit even with every tensor swapped: stage {m.stage} needs {floor / 1e9:.1f} GB of "
                f"parameters, gradients and pipeline buffers where {cap / 1e9:.1f} GB are usable")
