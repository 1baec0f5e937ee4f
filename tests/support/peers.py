"""Helpers shared by the peer-pool tests: byte units and alignment, a process id that is
certainly dead, making a rank look dead to its pools, a tensor's stripe-table entry, and
replaying a program's D2D allocations on the runtime's allocator in one process.

`replay` walks one stage's action list as the runtime does: each DO reserves the unit's
room through a real `PeerStore` over real `QuotaPool`s (CPU buffers, one per peer), each
DI makes the unit's room free-able (its swap-in copy is in flight), and the swap-in
completer gives it back at a moment the caller's RNG picks: any time after the DI, and at
the latest when a later reservation needs it and the unit's backward has run
(`SwapEngine.swap_out_group` waits for exactly those, `SwapStore.await_room`). A placement
never released before its backward is the worst case the runtime can meet."""

from __future__ import annotations

import dataclasses
import random
import subprocess
from collections.abc import Mapping, Sequence

import torch

from mpress.config.units import ALIGNMENT_BYTES
from mpress.contract.actions import Action, Kind
from mpress.d2d.runtime.liveness import ProcessId
from mpress.d2d.runtime.peer_pool import PeerPools, QuotaPool
from mpress.d2d.runtime.peer_store import PeerStore
from mpress.d2d.runtime.pool_layout import Quota
from mpress.d2d.runtime.stripe_table import StripeEntry
from mpress.d2d.static.pool_slots import unit_slot_counts
from mpress.errors import SwapError
from tests.support.tensors import CPU

KiB, MiB = 1 << 10, 1 << 20


def round_up(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


def exited_process() -> ProcessId:
    """The id of a child that ran, exited and was reaped."""
    child = subprocess.Popen(["sleep", "0"])
    child.wait()
    return ProcessId(child.pid, 0)


def kill_rank(pools: PeerPools, rank: int) -> ProcessId:
    """Make `rank` look dead to `pools`: its published process id becomes an exited one."""
    dead = exited_process()
    pools._infos[rank] = dataclasses.replace(pools._infos[rank], process=dead)
    return dead


def find(store: PeerStore, owner: str) -> StripeEntry:
    """The newest metadata entry of tensor `owner`."""
    return [e for e in store.table.entries() if e.owner == owner][-1]


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A flat uint8 CPU tensor of `nbytes` starting on an `ALIGNMENT_BYTES` boundary."""
    raw = torch.empty(nbytes + ALIGNMENT_BYTES, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGNMENT_BYTES
    return raw[start:start + nbytes]


class Quotas:
    """One stage's quotas (peer device -> bytes) as the store's `PoolQuotas`: laid out by
    the program (`counts`), or, with `counts=None`, carved first fit (no program)."""

    def __init__(self, stage: int, quotas: Mapping[int, int], counts: Mapping[str, int] | None) -> None:
        self.pools = {d: QuotaPool(aligned_buffer(n), quota=Quota(stage, d, 0, n),
                                   ledger=torch.zeros(3, dtype=torch.int64), slot=0, counts=counts)
                      for d, n in quotas.items()}

    def quota(self, stage: int, device: int) -> QuotaPool:
        return self.pools[device]

    def check_peer(self, device: int) -> None:
        """Every peer is alive here."""


def replay(actions: Sequence[Action], stage: int, quotas: Mapping[int, int], unit_bytes: Mapping[str, int],
           unit_weights: Mapping[str, tuple[tuple[int, float], ...]], rng: random.Random, *,
           laid_out: bool = True, iterations: int = 2) -> Quotas:
    """Run `iterations` of `stage`'s D2D allocations in `actions` (see the module
    docstring); raises the store's SwapError when a reservation finds no room although
    every block the runtime could give back was given back. `unit_bytes`: the group bytes
    each DO reserves (what the runtime's group spans)."""
    pools = Quotas(stage, quotas, unit_slot_counts(actions, stage) if laid_out else None)
    first = next(unit_weights[a.tensor] for a in actions if a.stage == stage and a.kind is Kind.DO)  # type: ignore[index]
    store = PeerStore(pools, stage, CPU, first)
    held: dict[tuple[str, int], object] = {}
    in_flight: dict[tuple[str, int], object] = {}  # DI issued: the completer may free it
    done: set[tuple[str, int]] = set()  # and its backward ran: a reservation may wait for it
    for _ in range(iterations):
        for a in actions:
            if a.stage != stage:
                continue
            for k in [k for k in in_flight if rng.random() < 0.3]:  # copies completing at their own pace
                store.release(in_flight.pop(k))  # type: ignore[arg-type]
                done.discard(k)
            unit_key = (a.tensor or "", a.microbatch)
            if a.kind is Kind.DO:
                owner = f"stage {stage} microbatch {a.microbatch} tensor {a.tensor}"
                args = (owner, unit_bytes[a.tensor], unit_weights[a.tensor], a.tensor)  # type: ignore[index]
                try:
                    held[unit_key] = store.reserve(*args)  # type: ignore[index]
                except SwapError:  # the engine waits here for swap-ins past their backward
                    for k in list(done):
                        store.release(in_flight.pop(k))  # type: ignore[arg-type]
                    done.clear()
                    held[unit_key] = store.reserve(*args)  # type: ignore[index]
            elif a.kind is Kind.DI:
                in_flight[unit_key] = held.pop(unit_key)  # type: ignore[index]
            elif a.kind is Kind.B:
                done |= {k for k in in_flight if k[1] == a.microbatch}
        for placement in in_flight.values():  # a step ends with every swap-in complete
            store.release(placement)  # type: ignore[arg-type]
        in_flight.clear()
        done.clear()
    return pools
