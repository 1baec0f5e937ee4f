"""Helpers shared by the peer-pool tests: byte units and alignment, a process id that is
certainly dead, making a rank look dead to its pools, and a tensor's stripe-table entry."""

from __future__ import annotations

import dataclasses
import subprocess

from mpress.d2d.runtime.liveness import ProcessId
from mpress.d2d.runtime.peer_pool import PeerPools
from mpress.d2d.runtime.peer_store import PeerStore
from mpress.d2d.runtime.stripe_table import StripeEntry
from mpress.config.units import ALIGNMENT_BYTES

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
