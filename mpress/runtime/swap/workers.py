"""The worker-thread half of the swap engine (`engine.py`): the swap-out worker and the
swap-in worker (which fills the tensors `prefetch` made) each take their queued swaps in
batches (issue every copy, then wait on them, so a burst of swaps costs one host round
trip per stream, and a swap-in is never held back by the copy of the one before it). Each reports completed copies to the memory manager, keeps
the engine's counters and, when the engine traces, the host times of each copy. The
state they move records through, the lock and the error handling are the engine's.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import torch

from mpress.runtime.memory.manager import Residency
from mpress.runtime.swap.record import TERMINAL_STATES, SwapRecord, SwapState
from mpress.runtime.swap.store import wait_copies

POLL_S = 0.05
"""Slice of a host wait, so waits notice errors and closing without waiting them out."""
MAX_BATCH = 32
"""Most queued swap-outs whose copies are issued together before waiting on them."""


class EngineWorkers:
    """The worker loops of `SwapEngine` (which defines every attribute they use)."""

    def _out_worker(self) -> None:
        """Takes the queued swap-outs in batches: issue all their copies, then wait."""
        if self._cuda:
            torch.cuda.set_device(self.device)
        with self._watch(), torch.no_grad():
            for batch, stop in _batches(self._out_queue):
                try:
                    issued = [(record, self._issue_out(record)) for record in batch]
                    for record, copies in issued:
                        if copies is not None:
                            self._finish_out(record, copies)
                    del issued
                except BaseException as exc:  # noqa: BLE001 - a bug here must not kill the worker silently
                    for record in batch:
                        if record.state not in TERMINAL_STATES and not record.out_done.is_set():
                            self._fail(record, "swap-out", exc)
                finally:
                    with self._idle:
                        self._num_pending -= len(batch)
                        self._idle.notify_all()
                    del batch  # so dropped handles' records are not kept by this frame
                self._reap_dropped()
                if stop:
                    break

    def _in_worker(self) -> None:
        """Takes the queued swap-ins in batches: issue all their copies (each record's
        consumers may go on once its copies are enqueued), then wait on them and free
        their blocks."""
        if self._cuda:
            torch.cuda.set_device(self.device)
        with self._watch(), torch.no_grad():
            for batch, stop in _batches(self._in_queue):
                try:
                    issued = [(record, self._issue_in(record)) for record in batch]
                    for record, copies in issued:
                        if copies is not None:
                            self._finish_in(record, copies)
                    del issued
                except BaseException as exc:  # noqa: BLE001 - a bug here must not kill the worker silently
                    for record in batch:
                        if record.state not in TERMINAL_STATES and record.busy:
                            self._fail(record, "swap-in", exc)
                finally:
                    with self._idle:
                        self._num_pending -= len(batch)
                        self._idle.notify_all()
                    del batch  # so dropped handles' records are not kept by this frame
                self._reap_dropped()
                if stop:
                    break

    def _issue_out(self, record: SwapRecord) -> list | None:
        """Enqueue `record`'s out copies; None when it needs none (cancelled or failed)."""
        with self._lock:
            if record.state in TERMINAL_STATES:
                return None
            if self._closing:
                self._cancel(record, "the swap engine was closed")
                return None
            record.state, record.busy = SwapState.OUT_COPYING, True
        record.copy_started_s = time.perf_counter()
        try:
            if self._fault is not None:
                self._fault(record.key, "out")
            with torch.profiler.record_function("mpress:swap_out_copy"):
                return self.store.copy_out(record.placement, record.pieces(record.src), record.ready_event)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the trainer
            self._fail(record, "swap-out", exc)
            return None

    def _finish_out(self, record: SwapRecord, copies: list) -> None:
        """Wait for `record`'s out copies, then free its device storage (drop `src`)."""
        try:
            copy_s = wait_copies(copies)
            self._trace("out", record)
            with self._lock:
                if not record.discard_requested:  # else the key may belong to a newer tensor
                    self._manager.move(record.key, self.store.residency, peer=record.peer_bytes() or None)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the trainer
            self._fail(record, "swap-out", exc)
            return
        with self._lock:
            self.store.completed(record.placement, "out")
            if not self._hold_until_release:
                record.src = None  # the copy completed: the storage may go back to the allocator
            record.busy = False
            record.state = SwapState.OFF_DEVICE
            self._stats.bytes_out += record.nbytes
            self._stats.num_out += 1
            self._stats.copy_s += copy_s
            if record.discard_requested:
                self._cancel(record, "it was discarded")
            if not self._hold_until_release:
                self._outs.discard(record)
            record.out_done.set()

    def _issue_in(self, record: SwapRecord) -> list | None:
        """Enqueue `record`'s in copies into the tensors `prefetch` made and let its
        consumers go on; None when it needs none (cancelled or failed)."""
        # FIFO: a prefetch waits for its own swap-out, even if later ones are ready.
        while not record.out_done.wait(POLL_S):
            if self._closing and not self._out_thread.is_alive():
                break
        with self._lock:
            if record.state in TERMINAL_STATES:
                return None
            if self._closing or not record.out_done.is_set():
                self._cancel(record, "the swap engine was closed")
                return None
            record.state, record.busy = SwapState.IN_COPYING, True
        record.copy_started_s = time.perf_counter()
        try:
            if self._fault is not None:
                self._fault(record.key, "in")
            self.store.check()  # a dead peer's stripes cannot come back
            tensors = record.dst
            with torch.profiler.record_function("mpress:swap_in_copy"):
                copies = self.store.copy_in(record.placement, record.pieces(tensors), record.dst_ready)
            record.dst = record.dst_ready = None
            with self._lock:
                if not record.discard_requested:
                    self._manager.move(record.key, Residency.DEVICE)
                record.result = tensors
                record.in_events = [c.done for c in copies if c.done is not None]
                record.state = SwapState.ON_DEVICE
                record.in_ready.set()  # consumers may go on; their stream waits on the events
            return copies
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the trainer
            self._fail(record, "swap-in", exc)
            return None

    def _finish_in(self, record: SwapRecord, copies: list) -> None:
        """Wait for `record`'s in copies, then free its blocks (the copies read them)."""
        try:
            copy_s = wait_copies(copies)
            self._trace("in", record)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the trainer
            self._fail(record, "swap-in", exc)
            return
        with self._lock:
            record.busy = False
            self.store.completed(record.placement, "in")
            self._release_block(record)
            self._stats.bytes_in += record.nbytes
            self._stats.num_in += 1
            self._stats.copy_s += copy_s
            if record.discard_requested:
                self._cancel(record, "it was discarded")

    def _trace(self, what: str, record: SwapRecord) -> None:
        if self.trace is not None:
            self.trace.append((what, str(record.key), record.copy_started_s, time.perf_counter()))


def _batches(work: queue.SimpleQueue) -> Iterator[tuple[list[SwapRecord], bool]]:
    """(the records queued now, up to `MAX_BATCH`; whether the closing sentinel followed
    them) until the sentinel: a worker blocks for the first record only."""
    while True:
        first = work.get()
        if first is None:
            return
        batch, stop = [first], False
        while len(batch) < MAX_BATCH:
            try:
                item = work.get_nowait()
            except queue.Empty:
                break
            if item is None:
                stop = True
                break
            batch.append(item)
        yield batch, stop
        del batch, first
        if stop:
            return
