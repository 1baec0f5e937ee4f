"""The worker-thread half of the swap engine (`engine.py`). Per direction two threads:
an *issuer* takes the queued swaps in order and enqueues their copies (swap-in: into the
tensors `prefetch` made), never waiting for one, so a burst of swaps is issued at once
and a swap is never held back by the copy before it; a *completer* waits for each
issued swap's copies in order (copies that finished when issued, as CPU copies do, are
completed by the issuer itself: a hand-off costs a thread wake-up), then reports it to the memory manager, frees what the
copy no longer needs (the device storage after a swap-out, the pool blocks after a
swap-in) and keeps the engine's counters and, when the engine traces, the host times of
each copy. The state they move records through, the lock and the error handling are the
engine's.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import torch

from mpress.runtime.memory.manager import Residency
from mpress.runtime.swap.record import TERMINAL_STATES, SwapRecord, SwapState, traced
from mpress.runtime.swap.store import wait_copies

POLL_S = 0.05
"""Slice of a host wait, so waits notice errors and closing without waiting them out."""


class EngineWorkers:
    """The worker loops of `SwapEngine` (which defines every attribute they use)."""

    def _issuer(self, work: queue.SimpleQueue, issue: Callable[[SwapRecord], list | None],
                finish: Callable[[SwapRecord, list], None], done: queue.SimpleQueue, direction: str) -> None:
        """Issues the copies of every queued swap of one direction, in order, and hands
        them to that direction's completer: issuing never waits for a copy, so a swap is
        never held back by the copy of the one before it."""
        if self._cuda:
            torch.cuda.set_device(self.device)
        try:
            with self._watch(), torch.no_grad():
                while (record := work.get()) is not None:
                    copies = None
                    try:
                        copies = issue(record)
                    except BaseException as exc:  # noqa: BLE001 - a bug here must not kill the worker silently
                        if record.state not in TERMINAL_STATES:
                            self._fail(record, direction, exc)
                    if copies is None:  # failed or cancelled: nothing to wait for
                        self._settled(1)
                    elif all(c.finished for c in copies):  # CPU: done at issue, finish here
                        self._complete(record, copies, finish, direction)  # (a hand-off costs a thread wake)
                    else:
                        done.put((record, copies))
                    del record, copies  # so dropped handles' records are not kept by this frame
        finally:
            done.put(None)  # the completer stops after what was handed over

    def _completer(self, done: queue.SimpleQueue, finish: Callable[[SwapRecord, list], None],
                   direction: str) -> None:
        """Waits for each handed-over swap's copies, in issue order, and finishes it."""
        if self._cuda:
            torch.cuda.set_device(self.device)
        with self._watch(), torch.no_grad():
            while (item := done.get()) is not None:
                self._complete(*item, finish, direction)
                del item
                self._reap_dropped()

    def _complete(self, record: SwapRecord, copies: list, finish: Callable[[SwapRecord, list], None],
                  direction: str) -> None:
        try:
            finish(record, copies)
        except BaseException as exc:  # noqa: BLE001 - a bug here must not kill the worker silently
            if record.state not in TERMINAL_STATES:
                self._fail(record, direction, exc)
        finally:
            self._settled(1)

    def _settled(self, count: int) -> None:
        """`count` queued swaps are finished (or failed): `wait_idle` may return."""
        with self._idle:
            self._num_pending -= count
            self._idle.notify_all()

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
            with traced("mpress:swap_out_copy"):
                copies = self.store.copy_out(record.placement, record.out_batch, record.ready_event)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the trainer
            self._fail(record, "swap-out", exc)
            return None
        with self._lock:  # the release point may now order the compute stream after these copies
            record.out_events = [c.done for c in copies if c.done is not None]
            record.out_issued.set()
        return copies

    def _finish_out(self, record: SwapRecord, copies: list) -> None:
        """Wait for `record`'s out copies, then free its device storage (drop `src`)."""
        try:
            copy_s = wait_copies(copies)
            self._trace("out", record)
            with self._lock:
                self._moved_out(record)  # unless the release point did already
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the trainer
            self._fail(record, "swap-out", exc)
            return
        with self._lock:
            self.store.completed(record.placement, "out")
            if not self._hold_until_release:
                record.src = None  # the copy completed: the storage may go back to the allocator
            record.out_batch = None  # (it holds the sources too)
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

    def _moved_out(self, record: SwapRecord) -> None:
        """Tell the manager `record`'s bytes are off the device (once: at the release point
        or when the copy completed, whichever comes first)."""
        if not record.moved_out and not record.discard_requested:  # else the key may be a newer tensor's
            self._manager.move(record.key, self.store.residency, peer=record.peer_bytes() or None)
        record.moved_out = True

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
            with traced("mpress:swap_in_copy"):
                copies = self.store.copy_in(record.placement, record.in_batch, record.dst_ready)
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
            record.in_batch = None  # the copies read the blocks and wrote the tensors: done
            self.store.completed(record.placement, "in")
            self._release_block(record)
            self._stats.bytes_in += record.nbytes
            self._stats.num_in += 1
            self._stats.copy_s += copy_s
            if record.discard_requested:
                self._cancel(record, "it was discarded")

    def _trace(self, what: str, record: SwapRecord) -> None:
        if self.trace is not None:
            self.trace.append((what, record.key, record.nbytes, record.copy_started_s, time.perf_counter()))

