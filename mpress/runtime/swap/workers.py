"""The worker-thread half of the swap engine (`engine.py`): the swap-out worker, which
takes queued swap-outs in batches (issue every copy, then wait on them, so a burst of
small tensors costs one host round trip per stream), and the swap-in worker, which fills
the tensors `prefetch` made. Each reports completed copies to the memory manager, keeps
the engine's counters and, when the engine traces, the host times of each copy. The
state they move records through, the lock and the error handling are the engine's.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

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
        stop = False
        with self._watch(), torch.no_grad():
            while not stop:
                batch = [self._out_queue.get()]
                if batch[0] is None:
                    break
                while len(batch) < MAX_BATCH:
                    try:
                        item = self._out_queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        stop = True
                        break
                    batch.append(item)
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

    def _worker(self, work: queue.SimpleQueue, run: Callable[[SwapRecord], None]) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        with self._watch(), torch.no_grad():
            while (record := work.get()) is not None:
                try:
                    run(record)
                except BaseException as exc:  # noqa: BLE001 - a bug here must not kill the worker silently
                    self._fail(record, "swap", exc)
                finally:
                    del record  # so a dropped handle's record is not kept by this frame
                    with self._idle:
                        self._num_pending -= 1
                        self._idle.notify_all()
                self._reap_dropped()

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
                return self.store.copy_out(record.placement, record.src, record.ready_event)
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
                    self._manager.move(record.key, self.store.residency, peer=record.placement.peer_bytes() or None)
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

    def _run_in(self, record: SwapRecord) -> None:
        # FIFO: a prefetch waits for its own swap-out, even if later ones are ready.
        while not record.out_done.wait(POLL_S):
            if self._closing and not self._out_thread.is_alive():
                break
        with self._lock:
            if record.state in TERMINAL_STATES:
                return
            if self._closing or not record.out_done.is_set():
                self._cancel(record, "the swap engine was closed")
                return
            record.state, record.busy = SwapState.IN_COPYING, True
        record.copy_started_s = time.perf_counter()
        try:
            if self._fault is not None:
                self._fault(record.key, "in")
            self.store.check()  # a dead peer's stripes cannot come back
            tensor = record.dst
            with torch.profiler.record_function("mpress:swap_in_copy"):
                copies = self.store.copy_in(record.placement, tensor, record.dst_ready)
            record.dst = record.dst_ready = None
            with self._lock:
                if not record.discard_requested:
                    self._manager.move(record.key, Residency.DEVICE)
                record.result = tensor
                record.in_events = [c.done for c in copies if c.done is not None]
                record.state = SwapState.ON_DEVICE
                record.in_ready.set()  # consumers may go on; their stream waits on the events
            copy_s = wait_copies(copies)  # the blocks may be reused only after the copies read them
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
