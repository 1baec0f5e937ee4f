"""What a device holds at its emulated peak, by category: parameters, gradients,
optimizer state, activations, and buffers/other (torch's receive buffers, the batch, a
lent peer pool, the workspace of the running layer).

The emulator's memory is a walk of each rank's tasks (`program.walk`); this is the same
walk with every byte given a category by what took it: the static bytes split by the
stage costs (parameters; Adam states and master weights not offloaded; the rest is
buffers), a forward's and a recompute's bytes are activations (a weight version
PipeDream stashes is parameters), the stage's first backward makes its layers'
parameter gradients (the rest of a backward's bytes are activations), the optimizer step
frees the gradients, a copy's bytes are those of what it moves (an optimizer unit:
optimizer state; stashed weights: parameters; saved tensors: activations; a host step's
gradients and parameters: those) and leave at the release point that gives them back. A
stage whose optimizer steps on the host (its step copies `grads` units out) holds no
optimizer state. A layer's parameters that a `param:` rule keeps on the host are no
static bytes: its fetches take them and its evictions give them back; a layer whose
gradients a `grad:` rule drains makes them in every backward. `peak_breakdown` checks that the categories
sum to the walk at every task, so it cannot drift from the lowering unseen.

Units: bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from mpress.contract.actions import Kind, UnitId, UnitKind
from mpress.errors import MpressError
from mpress.static.emulate.emulator import EmulatorResult
from mpress.static.memory.stage_costs import StageCosts
from mpress.static.emulate.program import Task

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "buffers/other")
PARAMS, GRADS, OPTIM, ACTS, OTHER = CATEGORIES


_MOVED = {UnitKind.STASH: PARAMS, UnitKind.PARAMS: PARAMS, UnitKind.GRADS: GRADS, UnitKind.OPTIM: OPTIM}


def _unit(task: Task) -> UnitId | None:
    try:
        return UnitId.parse(task.action.tensor or "")
    except MpressError:
        return None


def _moved(task: Task) -> str:
    """The category of what a copy moves."""
    unit = _unit(task)
    if unit is not None and unit.kind in _MOVED:
        return _MOVED[unit.kind]
    return OPTIM if task.action.kind in (Kind.OO, Kind.OI) else ACTS


def rank_breakdown(tasks: Sequence[Task], static_bytes: int, costs: Sequence[StageCosts], *,
                   weight_stashing: bool) -> dict[str, int]:
    """The categories of one rank's bytes at its walk's peak (the first task reaching it).
    costs: every stage's costs, indexed by stage."""
    stages = sorted({t.action.stage for t in tasks})
    offloaded = {s: 0 for s in stages}
    # layers whose parameters live on the host, and whose gradients each backward drains
    # to it (`param:`/`grad:` rules: copies with a microbatch)
    on_host = {(t.action.stage, u.kind, u.layer) for t in tasks
               if t.action.microbatch is not None and (u := _unit(t)) is not None
               and u.kind in (UnitKind.PARAMS, UnitKind.GRADS)}
    names = {s: [x.name for x in costs[s].layers] for s in stages}
    for t in tasks:
        if t.action.kind is Kind.OI:
            offloaded[t.action.stage] += t.alloc_bytes
    for s in {t.action.stage for t in tasks if (u := _unit(t)) is not None and u.kind is UnitKind.GRADS}:
        offloaded[s] = costs[s].optimizer_data_bytes  # stepped on the host
    mem = dict.fromkeys(CATEGORIES, 0)
    mem[PARAMS] = 0 if weight_stashing else sum(x.param_bytes for s in stages for x in costs[s].layers
                                                if (s, UnitKind.PARAMS, x.name) not in on_host)
    mem[OPTIM] = sum(costs[s].optimizer_data_bytes - offloaded[s] for s in stages)
    mem[OTHER] = static_bytes - mem[PARAMS] - mem[OPTIM]
    pending: list[tuple[str, int]] = []  # copy-outs since the last release point
    first_backward: dict[int, object] = {}  # stage -> its first backward action
    best, best_total = dict(mem), -1

    for t in tasks:
        a = t.action
        if a.is_compute:
            left = t.release_bytes
            for k, (cat, nbytes) in enumerate(pending):
                part = left if k == len(pending) - 1 else min(nbytes, left)
                mem[cat] -= part
                left -= part
            pending.clear()
            stash = costs[a.stage].param_bytes if weight_stashing and t.layer == 0 and a.kind in (Kind.F, Kind.B) else 0
            grads = 0
            if a.kind in (Kind.B, Kind.W) and t.layer is not None and (
                    first_backward.setdefault(a.stage, a) == a
                    or (a.stage, UnitKind.GRADS, names[a.stage][t.layer]) in on_host):
                grads = costs[a.stage].layers[t.layer].grad_bytes
            if a.kind is Kind.F:
                mem[PARAMS] += stash
                mem[ACTS] += t.alloc_bytes - stash
            else:
                mem[GRADS] += grads
                mem[ACTS] += t.alloc_bytes - grads
            if sum(mem.values()) + t.transient_bytes > best_total:
                best = {**mem, OTHER: mem[OTHER] + t.transient_bytes}
                best_total = sum(best.values())
            if a.kind is Kind.OPT:
                mem[GRADS] -= t.free_bytes
            elif a.kind is Kind.B:
                mem[PARAMS] -= stash
                mem[ACTS] -= t.free_bytes - stash
            else:
                mem[ACTS] -= t.free_bytes
        else:
            cat = _moved(t)
            mem[cat] += t.alloc_bytes
            if sum(mem.values()) > best_total:
                best, best_total = dict(mem), sum(mem.values())
            mem[cat] -= t.free_bytes
            if a.kind in (Kind.SO, Kind.DO, Kind.OO) and not t.free_bytes:
                pending.append((cat, sum(x.bytes for x in t.transfers)))
        if min(mem.values()) < 0:
            raise MpressError(f"memory breakdown of stage {a.stage}: {min(mem, key=mem.__getitem__)} below 0 "
                              f"after {t.label()} (the categories no longer follow the lowering)")
    return best


def peak_breakdown(result: EmulatorResult, costs: Sequence[StageCosts], *, weight_stashing: bool) -> list[dict[str, int]]:
    """Per device (indexed by device): its bytes at its emulated peak, by category
    (`CATEGORIES`); they sum to `result.peak_bytes[d]`. Devices no rank uses: all 0.
    costs: every stage's costs (`PipelineSetup.costs`)."""
    program = result.program
    out = [dict.fromkeys(CATEGORIES, 0) for _ in result.peak_bytes]
    for r, tasks in enumerate(program.ranks):
        d = program.rank_device[r]
        part = rank_breakdown(tasks, program.static_bytes[r], costs, weight_stashing=weight_stashing)
        if sum(part.values()) > sum(out[d].values()):
            out[d] = part
    return out
