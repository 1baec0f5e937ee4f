"""Peer-pool slots: how a stage's D2D data sits in its quotas, read from the plan's
program, and how large each quota must be. The planner sizes quotas with this module and
the runtime's quotas allocate by it (`mpress/d2d/runtime/peer_pool.QuotaPool`), so a plan
whose quotas hold what this module asks for cannot run out of room through
fragmentation.

A D2D *unit* is what one DO action of the program moves: one layer's tensors under one
rule, for one microbatch (the runtime swaps it as one group, keyed by the unit's name).
Every microbatch of a unit has the same bytes, so each unit is a size class:

- its stripes are a fixed function of its bytes and the rule's weights (`unit_stripes`:
  every peer gets its fraction, boundaries aligned), so on each peer all of a unit's
  stripes have one size;
- on each peer a unit owns a region of `count` equal slots, where `count` is the most
  microbatches of the unit the program holds on peers at once (`unit_slot_counts`: a
  unit is held from its DO in F(s, m) until B(s, m) ends, by which point its swap-in has
  been issued and its block is given back as soon as that copy completes);
- model data a stage sends to peers (optimizer chunks, OO actions with stripes) is held
  from start-up on: one slot per tensor, each its own class (`MODEL_DATA_SLACK_BYTES`
  per chunk and peer covers the alignment of the chunk's tensors, which the plan counts
  as one).

A slot taken is given back whole, into its own region, so a free slot of the right size
exists whenever fewer than `count` microbatches of the unit are held: the quota never
fragments. The quota a stage needs on a peer is the sum of its regions there
(`quota_need`). Units are bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mpress.config.units import ALIGNMENT_BYTES, round_up
from mpress.contract.actions import Action, Kind
from mpress.d2d.static.striping import stripe_sizes

Weights = tuple[tuple[int, float], ...]
"""(peer device, fraction) per stripe, as a D2D rule gives them."""

MODEL_DATA_SLACK_BYTES = 32 << 10
"""Room per optimizer chunk and peer for its tensors' alignment (each state tensor, and
the master, takes its own slot, rounded up to `ALIGNMENT_BYTES`; 64 tensors per chunk)."""


MIN_QUOTA_BYTES = ALIGNMENT_BYTES
"""The quota of a peer a stage's rules name but none of its units' stripes reaches (they
are all too small to be cut that far): a plan's quota is never empty."""


def unit_stripes(nbytes: int, weights: Sequence[tuple[int, float]]) -> list[tuple[int, int]]:
    """(peer, bytes) of each stripe of a unit of `nbytes`: every peer its fraction (a fixed
    function of the size, so every microbatch of a unit stripes alike).

    The boundaries are those of the size rounded up to `ALIGNMENT_BYTES`, the last stripe
    ending at `nbytes`: a group's bytes at run time (its tensors at aligned offsets, the
    last one not rounded) then stripe exactly as the plan's figure for it (every tensor
    rounded), slot for slot."""
    out: list[tuple[int, int]] = []
    start = 0
    for peer, size in stripe_sizes(round_up(nbytes, ALIGNMENT_BYTES), weights, align_bytes=ALIGNMENT_BYTES):
        size = min(size, nbytes - start)
        if size > 0 or not out:
            out.append((peer, size))
        start += size
    return out


def slot_bytes(nbytes: int) -> int:
    """What a stripe of `nbytes` takes in a quota (an empty one takes one alignment unit)."""
    return round_up(max(nbytes, 1), ALIGNMENT_BYTES)


def unit_slot_counts(actions: Sequence[Action], stage: int) -> dict[str, int]:
    """Per D2D unit of `stage` (the tensor name of its DO actions), the most microbatches
    of it held on peers at once over one iteration of `actions` (the rank's program): from
    DO(s, m) until the end of B(s, m)."""
    held: dict[int, list[str]] = {}
    now: dict[str, int] = {}
    most: dict[str, int] = {}
    for a in actions:
        if a.stage != stage:
            continue
        if a.kind is Kind.DO:
            unit = a.tensor or ""
            held.setdefault(a.microbatch, []).append(unit)  # type: ignore[arg-type]
            now[unit] = now.get(unit, 0) + 1
            most[unit] = max(most.get(unit, 0), now[unit])
        elif a.kind in (Kind.B, Kind.W):  # the end of the microbatch's backward (a split one ends at W)
            for unit in held.pop(a.microbatch, []):  # type: ignore[arg-type]
                now[unit] -= 1
    return most


def slots_of(counts: Mapping[str, int], unit: str) -> int:
    """The slots a unit's class has: its count, for tensors a unit saved after its group
    left (`unit/k`, a group of their own) the unit's count, for anything else (model data,
    held from start-up) one."""
    found = counts.get(unit)
    if found is None and "/" in unit:
        found = counts.get(unit.rsplit("/", 1)[0])
    return found or 1


def quota_need(actions: Sequence[Action], stage: int, unit_bytes: Mapping[str, int],
               unit_weights: Mapping[str, Weights]) -> dict[int, int]:
    """Per peer device, the quota stage `stage` needs for the program `actions` (its rank's
    list): every D2D unit's slots (`unit_bytes`: its group's bytes in a pool, its tensors at
    aligned offsets; `unit_weights`: its stripes) and every optimizer chunk it sends to
    peers (OO with stripes), plus `MODEL_DATA_SLACK_BYTES` per chunk and peer; every peer
    the units' weights name gets at least `MIN_QUOTA_BYTES`."""
    need: dict[int, int] = {}
    for unit, count in unit_slot_counts(actions, stage).items():
        for peer, _ in unit_weights[unit]:
            need.setdefault(peer, 0)
        for peer, size in unit_stripes(unit_bytes[unit], unit_weights[unit]):
            need[peer] = need.get(peer, 0) + count * slot_bytes(size)
    chunks = {a.tensor for a in actions if a.stage == stage and a.kind is Kind.OO and unit_weights.get(a.tensor or "")}
    for chunk in sorted(chunks):  # type: ignore[type-var]
        for peer, size in unit_stripes(unit_bytes[chunk], unit_weights[chunk]):  # type: ignore[index]
            need[peer] = need.get(peer, 0) + slot_bytes(size) + MODEL_DATA_SLACK_BYTES
    return {peer: nbytes or MIN_QUOTA_BYTES for peer, nbytes in need.items()}
