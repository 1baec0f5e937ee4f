"""Capacity-based swap-in placement (the out-of-core model's "capacity" policy): each
swap-in of activations is issued as early as the device has room for it.

The rewriter places a swap-in `prefetch_lead` compute actions ahead of the backward that
needs it. Memory in a program is a walk of each rank's list (`emulator.py`), so a swap-in
moved before an earlier compute action holds its bytes over every task in between, and
nothing else changes. This pass moves each swap-in (in list order) before the earliest
compute action where the walk, with its bytes added, stays within the device's usable
memory, and never before its swap-out's release point (the compute action after the
forward that produced it), so the bytes are never on the device twice. Fetches of a
layer's host parameters (`param:` rules) stay where the rewriter put them.

Pure: action lists and lowered tasks in, action lists out. Units: bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from mpress.contract.actions import Action, Kind, moves_layer_data
from mpress.static.emulate.program import Task, walk

SWAP_INS = (Kind.SI, Kind.DI)


def place_by_capacity(actions: Sequence[Action], tasks: Sequence[Task], origins: Sequence[int], *,
                      static_bytes: int, capacity_bytes: int) -> list[Action]:
    """`actions` (one rank's list) with its activation swap-ins moved as early as the
    memory walk allows; `tasks`/`origins` are its lowering (`lower_rank_traced`).

    A swap-in moved before compute action q holds its bytes from the moment q is reached
    (before q gives back what its release point frees) to where it stood, so the walk
    with its bytes added must stay within capacity at q's entry and at every peak from q
    on."""
    out = list(actions)
    peaks = [0] * len(out)  # per list position: the highest walk value of its tasks
    entries = [-1] * len(out)  # per list position: the walk value when it is reached
    for (entry, task_peak), origin in zip(walk(tasks, static_bytes), origins):
        peaks[origin] = max(peaks[origin], task_peak)
        if entries[origin] < 0:
            entries[origin] = entry
    alloc = {i: t.alloc_bytes for t, i in zip(tasks, origins) if t.action.kind in SWAP_INS}
    bytes_of = [alloc.get(i, 0) for i in range(len(out))]
    done: set[Action] = set()
    p = 0
    while p < len(out):
        a = out[p]
        if a.kind not in SWAP_INS or a in done or moves_layer_data(a):  # a layer's host parameters: one layer ahead
            p += 1
            continue
        done.add(a)
        earliest = _after_release(out, a)
        target, high = p, 0
        for q in range(p - 1, earliest - 1, -1):
            high = max(high, peaks[q])
            if max(high, entries[q]) + bytes_of[p] > capacity_bytes:
                break
            if _starts_action(out[q]):
                target = q
        if target < p:
            for q in range(target, p):
                peaks[q] += bytes_of[p]
                if q > target:
                    entries[q] += bytes_of[p]
            moved = out.pop(p)
            out.insert(target, moved)
            peaks.insert(target, peaks.pop(p))
            entries.insert(target, entries.pop(p))
            peaks[target] = entries[target + 1] + bytes_of[p]  # issued right before that action
            entries[target] = entries[target + 1]
            entries[target + 1] += bytes_of[p]
            bytes_of.insert(target, bytes_of.pop(p))
        p += 1
    return out


def _starts_action(action: Action) -> bool:
    """A compute action memory actions may stand before (a recompute is inside its backward)."""
    return action.is_compute and action.kind is not Kind.RC


def _after_release(actions: Sequence[Action], swap_in: Action) -> int:
    """The first list position a swap-in may take: after the compute action that follows
    the forward producing its tensor (its swap-out's release point)."""
    forward = next(i for i, x in enumerate(actions)
                   if x.kind is Kind.F and (x.stage, x.microbatch) == (swap_in.stage, swap_in.microbatch))
    release = next((i for i in range(forward + 1, len(actions)) if _starts_action(actions[i])), len(actions))
    return release + 1
