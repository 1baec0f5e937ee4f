"""The state of one swap: its record (engine-internal) and its handle (the caller's).

`SwapEngine` (`engine.py`) creates both; a record carries the swap through the
states of `SwapState` under the engine's lock; the handle is the ticket the caller keeps
(in the autograd graph, for a saved tensor) and passes back to prefetch or fetch.
"""

from __future__ import annotations

import enum
import threading
import weakref
from dataclasses import dataclass

import torch

from mpress.errors import SwapError
from mpress.identity import TensorKey
from mpress.runtime.swap.store import Placement


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
    """Engine-internal state of one swap; guarded by the engine's lock."""

    def __init__(self, key: TensorKey, src: torch.Tensor, placement: Placement, owned: bool) -> None:
        self.key = key
        self.dtype = src.dtype
        self.shape = tuple(src.shape)
        self.nbytes = src.numel() * src.element_size()
        self.owned = owned                   # the engine tracked the key, so it forgets it
        self.state = SwapState.OUT_QUEUED
        self.src: torch.Tensor | None = src  # dropped once the out copy completed
        self.placement: Placement | None = placement
        self.ready_event: torch.cuda.Event | None = None  # compute stream, at swap_out
        self.in_events: list[torch.cuda.Event] = []       # in streams, after the in copies
        self.out_done = threading.Event()    # out copy completed (or failed/cancelled)
        self.in_ready = threading.Event()    # in copy enqueued (or failed/cancelled)
        self.in_requested = False
        self.copy_started_s = 0.0            # when a worker issued its latest copy (traces)
        self.busy = False                    # a worker is using the placement right now
        self.discard_requested = False
        self.dst: torch.Tensor | None = None  # made by `prefetch`, filled by the in worker
        self.dst_ready: torch.cuda.Event | None = None  # compute stream, after `dst` was made
        self.result: torch.Tensor | None = None
        """The swapped-in tensor until `fetch` hands it over (then only `result_ref`)."""
        self.result_ref: weakref.ref[torch.Tensor] | None = None
        self.error: SwapError | None = None


class SwapHandle:
    """Ticket for one swapped-out tensor: pass it to `prefetch`, `fetch` or `discard`.

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
        return self._record.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._record.shape

    @property
    def nbytes(self) -> int:
        return self._record.nbytes

    @property
    def state(self) -> SwapState:
        return self._record.state

    def __repr__(self) -> str:
        return f"SwapHandle({self.key}, {self.state.value})"
