"""The D2D metadata table: where each swapped tensor's stripes are, and how far its
round trip has come.

One entry per swap (the paper's metadata table): the tensor's `Placement` (its slots:
peer, block in that peer's pool, byte range of the tensor) and its state, written at
swap-out, read by the swap-in, updated when each completes. Entries are keyed by the
placement's id, not by the tensor's identity: a tensor that was discarded while its
copy still ran may be swapped out again under the same identity before the old entry
is gone. Thread safe.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, replace

from mpress.errors import SwapError
from mpress.runtime.swap.store import Placement, Slot


class StripeState(enum.Enum):
    """Where a D2D-swapped tensor is in its round trip."""

    RESERVED = "reserved"
    WRITING = "writing"
    ON_PEERS = "on-peers"
    READING = "reading"
    READ = "read"


@dataclass(frozen=True)
class StripeEntry:
    """Metadata of one swapped tensor."""

    owner: str
    """The tensor's identity (rank, stage, microbatch, tensor)."""
    placement: Placement
    state: StripeState

    @property
    def stripes(self) -> tuple[Slot, ...]:
        """The stripes in tensor order: peer, block (its pool offset), tensor range."""
        return self.placement.slots

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.placement.slots)


class StripeTable:
    """The metadata table of one exporter: placement id -> `StripeEntry`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, StripeEntry] = {}

    def add(self, owner: str, placement: Placement) -> StripeEntry:
        """Record a reserved placement."""
        entry = StripeEntry(owner=owner, placement=placement, state=StripeState.RESERVED)
        with self._lock:
            if placement.entry_id in self._entries:
                raise SwapError(f"D2D table: entry {placement.entry_id} ({owner}) exists already")
            self._entries[placement.entry_id] = entry
        return entry

    def update(self, entry_id: int, state: StripeState) -> StripeEntry:
        """Set the entry's state; returns the new entry."""
        with self._lock:
            entry = replace(self._lookup(entry_id), state=state)
            self._entries[entry_id] = entry
            return entry

    def remove(self, entry_id: int) -> StripeEntry:
        with self._lock:
            entry = self._lookup(entry_id)
            del self._entries[entry_id]
            return entry

    def entries(self) -> list[StripeEntry]:
        """Snapshot, oldest first (reports, tests)."""
        with self._lock:
            return list(self._entries.values())

    def _lookup(self, entry_id: int) -> StripeEntry:
        entry = self._entries.get(entry_id)
        if entry is None:
            raise SwapError(f"D2D table has no entry {entry_id}")
        return entry
