"""Swaps: copy tensors off the device on side streams and back before use.

The engine drives one destination, a `SwapStore` (`store.py`): the pinned host pool
(`HostStore`) or peer GPUs' pools (`PeerStore`, D2D swap). Per direction an issuer
thread enqueues copies on the store's CUDA streams (one per direction for host, one per
peer link and direction for D2D) and a completer thread waits for them (`workers.py`);
they take work from FIFO queues filled by the training thread. A swap is one tensor or
a group (`swap_out_group`: what one layer saves under one rule), moved with one
placement and one copy batch per stream:

    training thread           out issuer / completer              in issuer / completer
    swap_out_group(key, ts)
      dense bytes of each t (layout.py; gathers here, on the compute stream)
      reserve room, record ready event ──► copy ts -> block(s) after ready
      return handle                        wait copies, drop ts, manager -> HOST/PEER ─► (out done)
    prefetch(handle)
      allocate the tensors (their layouts), record event ──────► copy block(s) -> tensors, signal
    fetch_group(handle) ◄── current stream waits on the copies' events   wait copies, free block(s)

Neither issuer ever waits for a copy, so a burst of swaps is enqueued at once and no
swap is held back by the copy of the one before it; the host work is per swap (group),
not per tensor.

Ordering is by CUDA events, never by a host-wide synchronisation: the out copy waits on an
event recorded on the compute stream when `swap_out` was called; the consumer's stream
waits on the in copy's event; at a release point (`wait_outs`, with
`hold_until_release`) the compute stream waits on the out copies' events before the
sources are let go, so the host never waits for the GPU there. Only the worker threads
block on the host (on their own copy's event), which is what lets a device tensor's
storage go back to the caching allocator when its copy completed (without
`hold_until_release`) and a pool block be reused only after the copy that read it
finished. No store calls `record_stream` on what its copies read or write (the engine
holds those tensors until the copies completed or the compute stream was ordered after
them); `fetch_group` records
the consumer's stream on what it hands over, in case that is not the stream `prefetch`
allocated on.
On CPU there are no streams or events: the same code runs with synchronous copies and the
consumer waits on a `threading.Event`.

Errors: an exception in a worker is stored with the tensor's key and raised on the
training thread as `SwapError("swap-out failed: rank R stage S microbatch M tensor T:
<cause>")` by the next `fetch`, `swap_out`, `prefetch`, `check` or `wait_idle`; the first
error is sticky (the step is broken). `fetch` waits at most `timeout_s`.

Residency: the engine reports every completed copy to the `MemoryManager` (a swap-out's
at the release point if that comes first: the allocator has the bytes back). A key the
caller did not track is tracked by `swap_out` and forgotten again by the engine when its
handle is dropped (the saved tensor died), discarded, or cancelled by `close`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from mpress.errors import SwapError
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.contract.identity import TensorKey
from mpress.runtime.memory.manager import Category, MemoryManager, Residency
from mpress.runtime.swap.record import (
    TERMINAL_STATES,
    SwapHandle,
    SwapRecord,
    SwapState,
    SwapStats,
    span_bytes,
    traced,
)
from mpress.runtime.swap.layout import Layout
from mpress.runtime.swap.store import HostStore, SwapStore
from mpress.runtime.swap.workers import POLL_S, EngineWorkers

__all__ = ["FaultHook", "SwapEngine", "SwapHandle", "SwapState", "SwapStats"]

FaultHook = Callable[[TensorKey, str], None]
"""Test hook called in a worker before each copy with the key and "out" or "in"."""


class SwapEngine(EngineWorkers):
    """Asynchronous swaps of one stage's tensors to one destination (`store`).

    `store` is a `SwapStore`, or a `PinnedHostPool` for host swap. Use as a context
    manager or call `close()`; the worker threads hold the engine alive. `fault` is a
    test hook (see `FaultHook`); it may raise or sleep.
    """

    def __init__(self, store: SwapStore | PinnedHostPool, manager: MemoryManager, device: torch.device, *,
                 rank: int, stage: int, timeout_s: float = 60.0,
                 fault: FaultHook | None = None,
                 watch: Callable[[], contextlib.AbstractContextManager] | None = None,
                 hold_until_release: bool = False) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.rank = rank
        self.stage = stage
        self.timeout_s = timeout_s
        self.store = HostStore(store, device) if isinstance(store, PinnedHostPool) else store
        self._manager = manager
        self._fault = fault
        self.trace: list[tuple[str, TensorKey, int, float, float]] | None = None
        """When a list: (what, tensor key, bytes, start, end) of every copy ("out", "in", host
        times: issued until waited for) and every wait of `fetch` ("wait"), for a trace."""
        self._hold_until_release = hold_until_release
        """Keep a swapped-out tensor's device storage until `wait_outs` (the program's
        release point) instead of dropping it when its copy completes, so the device's
        memory follows the plan exactly, whatever the copy's speed."""
        self._watch = watch or contextlib.nullcontext
        """Entered by each worker thread for its lifetime: the rank's live-bytes tracker
        counts what the workers allocate (swapped-in tensors) as it counts the trainer's."""
        self._cuda = device.type == "cuda"
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._num_pending = 0                # queued or running work items
        self._stats = SwapStats()
        self._error: SwapError | None = None
        self._closing = False
        self._owned: dict[TensorKey, SwapRecord] = {}
        self._with_block: set[SwapRecord] = set()  # records holding a placement, for close()
        self._outs: set[SwapRecord] = set()  # swap-outs not yet released (`wait_outs`)
        self._out_queue: queue.SimpleQueue[SwapRecord | None] = queue.SimpleQueue()
        self._in_queue: queue.SimpleQueue[SwapRecord | None] = queue.SimpleQueue()
        self._dropped: queue.SimpleQueue[SwapRecord] = queue.SimpleQueue()
        """Records whose handle died; a finalizer may run on any thread at any allocation,
        so it only enqueues here (reentrant-safe) and the engine releases them later."""
        kind = self.store.kind
        out_done: queue.SimpleQueue = queue.SimpleQueue()
        in_done: queue.SimpleQueue = queue.SimpleQueue()
        name = f"r{rank}s{stage}"
        self._threads = [
            threading.Thread(target=self._issuer, args=(self._out_queue, self._issue_out, self._finish_out, out_done, "swap-out"),
                             name=f"mpress-{kind}-out-{name}", daemon=True),
            threading.Thread(target=self._completer, args=(out_done, self._finish_out, "swap-out"),
                             name=f"mpress-{kind}-out-done-{name}", daemon=True),
            threading.Thread(target=self._issuer, args=(self._in_queue, self._issue_in, self._finish_in, in_done, "swap-in"),
                             name=f"mpress-{kind}-in-{name}", daemon=True),
            threading.Thread(target=self._completer, args=(in_done, self._finish_in, "swap-in"),
                             name=f"mpress-{kind}-in-done-{name}", daemon=True),
        ]
        self._out_thread = self._threads[1]
        """The thread that completes swap-outs (a swap-in waits for its swap-out's)."""
        for thread in self._threads:
            thread.start()

    # ---- training-thread API ---------------------------------------------------------

    def swap_out(self, key: TensorKey, tensor: torch.Tensor, *,
                 category: Category = Category.ACTIVATION, weights: object = None) -> SwapHandle:
        """Start copying `tensor` off the device; returns at once (see module docstring).

        The engine keeps `tensor` alive until the copy completed. Pool exhaustion, a dead
        peer, a tensor on another device or a non-strided tensor raise SwapError here.
        `weights` goes to the store (D2D: the rule's stripe weights).
        """
        return self.swap_out_group(key, [(key.tensor, tensor)], category=category, weights=weights)

    def swap_out_group(self, key: TensorKey, tensors: Sequence[tuple[str, torch.Tensor]], *,
                       category: Category = Category.ACTIVATION, weights: object = None) -> SwapHandle:
        """`swap_out` of several (name, tensor) pairs moved as one: one placement, one
        record, one copy batch per stream, under one key (a unit of the rank's program:
        what one layer saves under one rule). Host work is per group, not per tensor."""
        self.check()
        self._reap_dropped()  # frees their blocks and keys before this one needs them
        layouts: list[Layout] = []
        sources: list[torch.Tensor] = []
        device, strided, source_of = self.device, torch.strided, Layout.source
        with traced("mpress:swap_out"):
            for name, tensor in tensors:
                if tensor.layout is not strided or tensor.device != device:
                    what = key if name == key.tensor else f"{key} ({name})"
                    raise SwapError(f"cannot swap out {what}: " + (
                        f"{tensor.layout} tensors are not supported" if tensor.layout is not torch.strided else
                        f"it is on {tensor.device}, the engine serves {self.device}"))
                # dense bytes of the tensor, made here on the compute stream (`layout.py`);
                # a dense one is held as given (the workers copy it under no_grad, and the
                # engine lets it go when its copy completed or at the release point)
                layout, source = source_of(tensor)
                layouts.append(layout)
                sources.append(source)
            nbytes = sum(layout.nbytes for layout in layouts)
            # a swap-in completing frees room: waited for here, not under the lock
            self.store.await_room(key.tensor, span_bytes(layouts), weights, self.timeout_s)
            with self._lock:
                owned = self._claim_key(key, nbytes, category)
                record = SwapRecord(key, [name for name, _t in tensors], layouts, sources, None, owned)  # type: ignore[arg-type]
                try:
                    record.placement = self.store.reserve(str(key), record.span_bytes, weights, key.tensor)
                    record.out_batch = self.store.pair(record.placement, record.pieces(sources))
                except Exception as exc:
                    if owned:
                        self._owned.pop(key, None)
                        self._manager.forget(key)
                    if isinstance(exc, SwapError):
                        raise SwapError(f"swap-out failed: {key}: {exc}") from exc
                    raise
                if owned:
                    self._owned[key] = record
                self._with_block.add(record)
                self._outs.add(record)
                if self._cuda:
                    record.src_stream = torch.cuda.current_stream(self.device)  # the sources' allocation stream
                    record.ready_event = torch.cuda.Event()
                    record.ready_event.record(record.src_stream)
                self._num_pending += 1
        handle = SwapHandle(record)
        weakref.finalize(handle, self._handle_dropped, record).atexit = False
        self._out_queue.put(record)
        return handle

    def prefetch(self, handle: SwapHandle) -> None:
        """Enqueue the swap-in of `handle` (idempotent); returns at once. The device
        tensors it fills are allocated here, on the calling thread and its current
        stream, in their original layouts."""
        self.check()
        self._reap_dropped()
        record = handle._record
        with self._lock:
            self._raise_for(record)
            if record.in_requested:
                return
            record.in_requested = True
        try:  # the bytes come back now, on this thread (an out-of-memory error names the action)
            device, empty = self.device, torch.empty_strided  # (`Layout.empty`, inlined: one per tensor)
            dst = [empty(layout.shape, layout.stride, dtype=layout.dtype, device=device) for layout in record.layouts]
            with self._lock:
                placement = record.placement
            batch = self.store.pair(placement, record.pieces(dst)) if placement is not None else None
        except BaseException:
            with self._lock:
                record.in_requested = False
            raise
        with self._lock:
            record.dst = dst
            record.in_batch = batch
            if self._cuda:
                record.dst_ready = torch.cuda.Event()
                record.dst_ready.record(torch.cuda.current_stream(self.device))
            self._num_pending += 1
        self._in_queue.put(record)

    def fetch(self, handle: SwapHandle) -> torch.Tensor:
        """The swapped tensor back on the device, usable on the current stream.

        Prefetches if needed. Blocks the host only until the copy is enqueued (CUDA) or
        done (CPU), at most `timeout_s`; on CUDA the current stream then waits on the
        copy's event. The tensor is handed over: the engine keeps no reference, so its
        memory goes when the caller's last use does (as the memory model says). Called
        again while the tensor lives, returns the same tensor; after, a SwapError.
        """
        (tensor,) = self.fetch_group(handle)
        return tensor

    def fetch_group(self, handle: SwapHandle) -> list[torch.Tensor]:
        """`fetch` of every tensor of a group, in the order they were given."""
        self.prefetch(handle)
        record = handle._record
        start = time.perf_counter()
        deadline = start + self.timeout_s
        with traced("mpress:swap_in_wait"):
            while not record.in_ready.wait(POLL_S):
                self.check()
                if time.perf_counter() >= deadline:
                    raise SwapError(
                        f"timed out after {self.timeout_s:g} s waiting for swap-in of "
                        f"{record.describe()} (state {record.state.value})")
        waited = time.perf_counter()
        if self.trace is not None and waited - start > 1e-6:
            self.trace.append(("wait", record.key, record.nbytes, start, waited))
        with self._lock:
            self._stats.wait_s += waited - start
            self._raise_for(record)
            tensors = record.result if record.result is not None else (
                [ref() for ref in record.result_ref] if record.result_ref is not None else None)
            if tensors is None or any(t is None for t in tensors):
                raise SwapError(f"swap-in of {record.key} produced no tensor, or it was fetched and has died "
                                f"(state {record.state.value})")
            record.result = None
            record.result_ref = [weakref.ref(t) for t in tensors]
            if self._cuda:
                stream = torch.cuda.current_stream(self.device)
                for event in record.in_events:
                    stream.wait_event(event)
                for tensor in tensors:
                    # allocated on the stream `prefetch` ran on; if this one differs, the
                    # allocator must not hand the memory back before this stream is done
                    tensor.record_stream(stream)
        return tensors

    def wait_outs(self) -> None:
        """Give up the device storage of every swap-out issued so far: a release point of
        the rank's program. The host waits only until each copy is enqueued (the issuer
        never waits for the GPU; at most `timeout_s`); on CUDA the stream the sources were
        made on (the compute stream current at `swap_out`, not whatever is current now)
        then waits on each copy's event, and only after that are the sources let go. The
        caching allocator reuses a freed block only for work on the stream that allocated
        it, which is now ordered after the copies that read it: the memory is safe without
        draining the GPU's queue (and without `record_stream`). The memory manager is told
        the bytes left the device here, where the allocator gets them back (its check
        compares the two), not when the completer sees the copy finish. On CPU a copy is
        done when it is enqueued."""
        with self._lock:
            records = list(self._outs)
        deadline = time.perf_counter() + self.timeout_s
        for record in records:
            while not record.out_issued.wait(POLL_S):
                self.check()
                if time.perf_counter() >= deadline:
                    raise SwapError(f"timed out after {self.timeout_s:g} s waiting for the swap-out of "
                                    f"{record.describe()} to be issued (state {record.state.value})")
        self.check()
        for record in records:
            for event in record.out_events:
                record.src_stream.wait_event(event)  # type: ignore[union-attr] - events only on CUDA
        with self._lock:
            for record in records:  # held until now (`hold_until_release`): the storage goes here
                self._check_versions(record)
                record.src = None
                record.out_batch = None  # (it holds the sources too)
                if record.state not in TERMINAL_STATES:
                    self._moved_out(record)
            self._outs.difference_update(records)
        self.check()

    def discard(self, handle: SwapHandle) -> None:
        """The tensor is no longer needed: release its room off the device and its copy.

        Safe at any state; a copy in progress finishes first. Forgets the key in the
        manager if the engine tracked it. A later `fetch` raises SwapError.
        """
        self._discard(handle._record, "it was discarded")

    def check(self) -> None:
        """Raise the first worker error (sticky), SwapError if the engine is closed, or
        the store's error (a peer holding stripes died)."""
        with self._lock:
            if self._error is not None:
                raise SwapError(str(self._error)) from self._error.__cause__
            if self._closing:
                raise SwapError(f"swap engine of rank {self.rank} stage {self.stage} is closed")
        self.store.check()

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Block until every queued swap finished (tests, end of iteration); then `check`."""
        self._reap_dropped()
        limit = self.timeout_s if timeout_s is None else timeout_s
        with self._idle:
            if not self._idle.wait_for(lambda: self._num_pending == 0, timeout=limit):
                raise SwapError(f"timed out after {limit:g} s waiting for {self._num_pending} "
                                f"swaps of rank {self.rank} stage {self.stage}")
        self.check()

    @property
    def stats(self) -> SwapStats:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._stats)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the workers; idempotent.

        Copies already running finish; queued work is dropped (its handles raise
        SwapError on fetch); every placement still held is released and keys
        the engine tracked are forgotten. Joins each thread for at most `timeout_s`
        (default: the engine's), warning instead of hanging if one is stuck.
        """
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._out_queue.put(None)
        self._in_queue.put(None)
        limit = self.timeout_s if timeout_s is None else timeout_s
        for thread in self._threads:  # issuers first: each stops its completer when it stops
            thread.join(limit)
            if thread.is_alive():
                warnings.warn(f"{thread.name} did not stop within {limit:g} s", RuntimeWarning,
                              stacklevel=2)
        self._reap_dropped()
        if self._cuda:  # a thread that did not stop may have copies in flight: end them first
            with contextlib.suppress(Exception):
                self.store.synchronize()
        with self._lock:
            for record in list(self._with_block):
                if not record.busy:
                    self._cancel(record, "the swap engine was closed")

    def __enter__(self) -> SwapEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- bookkeeping (callers hold self._lock unless noted) ---------------------------

    def _claim_key(self, key: TensorKey, nbytes: int, category: Category) -> bool:
        """Track `key` as on-device if the caller did not; True if the engine did."""
        if not self._manager.is_tracked(key):
            self._manager.track(key, nbytes, category, Residency.DEVICE)
            return True
        if key in self._owned:
            raise SwapError(f"cannot swap out {key}: a swap of the same tensor is still live "
                            f"({self._owned[key].state.value})")
        where = self._manager.residency(key)
        if where is not Residency.DEVICE:
            raise SwapError(f"cannot swap out {key}: the memory manager has it on {where.value}")
        return False

    @staticmethod
    def _check_versions(record: SwapRecord) -> None:
        """A source written in place after it was handed over may have been copied half
        old, half new: torch's own check is off for tensors its saved-tensor hooks took."""
        for name, src, version in zip(record.names, record.src or (), record.src_versions):
            if src._version != version:
                raise SwapError(f"{record.key}: saved tensor {name} was modified by an inplace operation while "
                                f"it was being swapped out (version {version}, now {src._version}); the "
                                "backward needs the saved values")

    def _raise_for(self, record: SwapRecord) -> None:
        if record.error is not None:
            raise SwapError(str(record.error)) from record.error.__cause__

    def _fail(self, record: SwapRecord, direction: str, exc: BaseException) -> None:
        """Called by a worker without the lock."""
        error = SwapError(f"{direction} failed: {record.describe()}: {exc}")
        error.__cause__ = exc
        if self._cuda:  # copies of this record may be in flight: let them end before its memory goes
            with contextlib.suppress(Exception):
                self.store.synchronize()
        with self._lock:
            record.busy = False
            record.error = error
            record.state = SwapState.FAILED
            record.src = record.result = record.dst = record.out_batch = record.in_batch = None
            self._release_block(record)
            if self._error is None:
                self._error = error
            self._outs.discard(record)
            record.out_done.set()
            record.out_issued.set()
            record.in_ready.set()

    def _cancel(self, record: SwapRecord, reason: str) -> None:
        record.state = SwapState.CANCELLED
        if record.error is None:
            record.error = SwapError(f"swap of {record.key} was cancelled: {reason}")
        record.src = record.result = record.dst = record.out_batch = record.in_batch = None
        self._release_block(record)
        self._forget_owned(record)
        self._outs.discard(record)
        record.out_done.set()
        record.out_issued.set()
        record.in_ready.set()

    def _release_block(self, record: SwapRecord) -> None:
        if record.placement is not None:
            self.store.release(record.placement)
            record.placement = None
            self._with_block.discard(record)

    def _forget_owned(self, record: SwapRecord) -> None:
        if record.owned and self._owned.get(record.key) is record:
            del self._owned[record.key]
            if self._manager.is_tracked(record.key):
                self._manager.forget(record.key)

    def _discard(self, record: SwapRecord, reason: str) -> None:
        with self._lock:
            if record.busy:
                # The worker finishes the copy, then cancels; the key is free at once.
                record.discard_requested = True
                self._forget_owned(record)
            elif record.state is SwapState.FAILED:
                self._forget_owned(record)
            elif record.state is not SwapState.CANCELLED:
                self._cancel(record, reason)

    def _handle_dropped(self, record: SwapRecord) -> None:
        """weakref.finalize callback: nobody can fetch this tensor any more."""
        self._dropped.put(record)

    def _reap_dropped(self) -> None:
        """Discard the records of dropped handles (call without holding the lock)."""
        while True:
            try:
                record = self._dropped.get_nowait()
            except queue.Empty:
                return
            self._discard(record, "its handle was dropped")

