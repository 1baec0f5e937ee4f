"""The state of one swap: its record (engine-internal) and its handle (the caller's).

`SwapEngine` (`engine.py`) creates both; a record carries the swap through the
states of `SwapState` under the engine's lock; the handle is the ticket the caller keeps
(in the autograd graph, for a saved tensor) and passes back to prefetch or fetch.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import weakref
from dataclasses import dataclass

import torch

from mpress.errors import SwapError
from mpress.contract.identity import TensorKey
from mpress.runtime.swap.layout import Layout
from mpress.runtime.swap.store import Batch, Placement
from mpress.config.units import ALIGNMENT_BYTES, round_up


class SwapState(enum.Enum):
    """Where a swapped tensor's data is."""

    OUT_QUEUED = "out-queued"
    OUT_COPYING = "out-copying"
    OFF_DEVICE = "off-device"
    """On host (host store) or striped over peers (D2D store)."""
    IN_COPYING = "in-copying"
    ON_DEVICE = "on-device"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATES = (SwapState.FAILED, SwapState.CANCELLED)


@dataclass
class SwapStats:
    """Counters of one engine. Times in seconds, sizes in bytes."""

    bytes_out: int = 0
    bytes_in: int = 0
    num_out: int = 0
    num_in: int = 0
    wait_s: float = 0.0
    """Host time `fetch` spent blocked waiting for a swap-in to be enqueued (CPU: done)."""
    copy_s: float = 0.0
    """Copy time: CUDA event time on the side streams; wall time of the copy on CPU."""


class SwapRecord:
    """Engine-internal state of one swap: one tensor, or a group of tensors moved
    together (one placement, one copy per stream and direction); guarded by the engine's
    lock. The group's tensors lie one after another in the placement's bytes, each at
    an offset rounded up to the pools' alignment (as the plan's pool sizes count them)."""

    def __init__(self, key: TensorKey, names: list[str], layouts: list[Layout], sources: list[torch.Tensor],
                 placement: Placement, owned: bool) -> None:
        self.key = key
        self.names = names                   # each tensor's name (its key's tensor when alone)
        self.layouts = layouts
        self.offsets = part_offsets(layouts)
        self.nbytes = sum(layout.nbytes for layout in layouts)
        self.owned = owned                   # the engine tracked the key, so it forgets it
        self.state = SwapState.OUT_QUEUED
        self.src: list[torch.Tensor] | None = sources  # dense; dropped once the out copies completed
        self.src_versions = [t._version for t in sources]  # a write after this is a torn copy
        self.placement: Placement | None = placement
        self.out_batch: Batch | None = None  # the out copies, paired by the training thread
        self.in_batch: Batch | None = None   # the in copies, paired by `prefetch`
        self.ready_event: torch.cuda.Event | None = None  # compute stream, at swap_out
        self.src_stream: torch.cuda.Stream | None = None  # where the sources were made (CUDA): the release waits there
        self.moved_out = False               # the manager was told the bytes left the device
        self.in_events: list[torch.cuda.Event] = []       # in streams, after the in copies
        self.out_done = threading.Event()    # out copy completed (or failed/cancelled)
        self.out_issued = threading.Event()  # out copy enqueued, `out_events` recorded (CPU: done; or failed/cancelled)
        self.out_events: list[torch.cuda.Event] = []  # out streams, after the out copies
        self.in_ready = threading.Event()    # in copy enqueued (or failed/cancelled)
        self.in_requested = False
        self.copy_started_s = 0.0            # when a worker issued its latest copy (traces)
        self.busy = False                    # a worker is using the placement right now
        self.discard_requested = False
        self.dst: list[torch.Tensor] | None = None  # made by `prefetch` (their layouts), filled by the swap-in issuer
        self.dst_ready: torch.cuda.Event | None = None  # compute stream, after `dst` was made
        self.result: list[torch.Tensor] | None = None
        """The swapped-in tensors until `fetch` hands them over (then only `result_ref`)."""
        self.result_ref: list[weakref.ref[torch.Tensor]] | None = None
        self.error: SwapError | None = None

    def describe(self) -> str:
        """The key, and for a group the names of its tensors (the first few), for errors."""
        if self.names == [self.key.tensor]:
            return str(self.key)
        shown = ", ".join(self.names[:4]) + (f" and {len(self.names) - 4} more" if len(self.names) > 4 else "")
        return f"{self.key} (tensors {shown})"

    @property
    def span_bytes(self) -> int:
        """Bytes of the placement: the tensors at their aligned offsets (the store rounds
        the whole up to its own alignment)."""
        return span_bytes(self.layouts)

    def peer_bytes(self) -> dict[int, int]:
        """The tensors' bytes (not the alignment gaps) per peer device holding them;
        empty for a host placement."""
        out: dict[int, int] = {}
        for slot in self.placement.slots if self.placement is not None else ():
            if slot.peer is None:
                continue
            first, end = slot.tensor_offset_bytes, slot.tensor_offset_bytes + slot.nbytes
            held = sum(max(0, min(end, o + layout.nbytes) - max(first, o))
                       for o, layout in zip(self.offsets, self.layouts))
            out[slot.peer] = out.get(slot.peer, 0) + held
        return out

    def pieces(self, tensors: list[torch.Tensor]) -> list[tuple[int, Layout, torch.Tensor]]:
        """(offset in the placement, layout, tensor) of each (dense) tensor of the group."""
        return list(zip(self.offsets, self.layouts, tensors))


def span_bytes(layouts: list[Layout]) -> int:
    """Bytes of a group's placement: its tensors at their `part_offsets`."""
    return part_offsets(layouts)[-1] + layouts[-1].nbytes if layouts else 0


def part_offsets(layouts: list[Layout]) -> list[int]:
    """Byte offset of each tensor of a group in its placement: packed in order, each
    rounded up to the pools' alignment."""
    offsets, at = [], 0
    for layout in layouts:
        offsets.append(at)
        at += round_up(layout.nbytes, ALIGNMENT_BYTES)
    return offsets


class SwapHandle:
    """Ticket for one swapped-out tensor or group: pass it to `prefetch`, `fetch` or `discard`.

    Dropping the last reference to a handle releases its host block (the tensor died).
    """

    __slots__ = ("__weakref__", "_record")

    def __init__(self, record: SwapRecord) -> None:
        self._record = record

    @property
    def key(self) -> TensorKey:
        return self._record.key

    @property
    def dtype(self) -> torch.dtype:
        """The (first) tensor's dtype."""
        return self._record.layouts[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The (first) tensor's shape."""
        return self._record.layouts[0].shape

    @property
    def names(self) -> list[str]:
        """Each swapped tensor's name (one for a single tensor)."""
        return list(self._record.names)

    @property
    def nbytes(self) -> int:
        """Bytes of the swapped tensors (their elements; alignment not counted)."""
        return self._record.nbytes

    @property
    def state(self) -> SwapState:
        return self._record.state

    def __repr__(self) -> str:
        return f"SwapHandle({self.key}, {self.state.value})"


def traced(name: str) -> contextlib.AbstractContextManager:
    """`torch.profiler.record_function(name)` while a profiler records, else nothing: the
    swap path runs it per swap on worker threads, where each of its two op calls would
    hand the GIL to the training thread and back for no trace at all."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
