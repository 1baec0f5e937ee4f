"""Where a swapped-out tensor's bytes go: the destination half of the swap engine.

The swap engine (`engine.py`) owns the life cycle of a swap: queues, worker
threads, states, errors, residency reports. A `SwapStore` owns the destination: it
reserves room for a tensor or a group of tensors (`reserve`, on the training thread, so
exhaustion is raised where the tensor is named), issues the copies of their bytes out and
back on its own CUDA streams, and releases the room. The engine hands it contiguous
device bytes only (`layout.py`: made on the compute stream), so a store never gathers or
allocates on the device. Two stores exist:

- `HostStore`: one block of the pinned host pool per swap, one out and one in stream;
- `PeerStore` (`mpress/d2d/runtime/peer_store.py`): the tensor striped over peer GPUs' pools,
  one stream per peer link and direction.

A `Placement` lists the tensor's `Slot`s: which byte range of the tensor lies in which
block of which pool. Units: bytes.
"""

from __future__ import annotations

import abc
import threading
import time
from dataclasses import dataclass
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from mpress.runtime.memory.block_pool import Block
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import Residency
from mpress.runtime.swap.layout import Layout
from mpress.config.units import round_up


@dataclass(frozen=True)
class Slot:
    """One contiguous byte range of a swapped tensor and the block that holds it."""

    peer: int | None
    """Device of the pool holding the bytes (None: host)."""
    block: Block
    tensor_offset_bytes: int
    nbytes: int


@dataclass(frozen=True)
class Placement:
    """Where all bytes of one swapped tensor are; slots cover the tensor in order."""

    slots: tuple[Slot, ...]
    entry_id: int = -1
    """The store's id for this placement (D2D: its metadata table entry)."""


@dataclass
class Copy:
    """The copies `issue_copies` enqueued on one stream."""

    done: torch.cuda.Event | None
    """CUDA: recorded on the stream right after them (a blocking-sync event: a worker
    waiting on it sleeps instead of spinning a core); None on CPU (copies finished)."""
    start: torch.cuda.Event | None
    wall_s: float

    @property
    def finished(self) -> bool:
        """Whether the copies completed when they were issued (CPU: synchronous copies)."""
        return self.done is None

    def wait_s(self) -> float:
        """Block the calling (worker) thread until the copies completed; their duration in s."""
        if self.done is None:
            return self.wall_s
        self.done.synchronize()
        return self.start.elapsed_time(self.done) / 1e3


COPY_STREAM_PRIORITY = -1
"""Swap copies run on streams from torch's high-priority pool (any negative priority maps
to it). `torch.cuda.Stream()` hands out streams round-robin from a pool of 32 per device
and priority, and ProcessGroupNCCL takes its streams from the default-priority pool
(unless `is_high_priority_stream` or TORCH_NCCL_HIGH_PRIORITY=1): a copy stream that
aliased an NCCL stream would queue swap copies behind the pipeline's sends and receives."""


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream on `device` for swap copies (`COPY_STREAM_PRIORITY`)."""
    return torch.cuda.Stream(device, priority=COPY_STREAM_PRIORITY)


def copy_events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """(start, done) events around a batch of copies; `done` is waited on by a worker
    thread, so it is made with blocking sync (`cudaEventBlockingSync`)."""
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True, blocking=True)


def issue_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream | None) -> Copy:
    """Copy each (dst, src) pair of contiguous tensors: on CPU at once, on CUDA enqueued
    on `stream` (non_blocking) between one start and one done event. Under no_grad
    whatever the calling thread's mode: a swap-out's sources are the saved tensors as
    autograd gave them (they may require grad), and a copy recorded by autograd would put
    the pool's buffer into the graph."""
    dsts, srcs = [d for d, _s in pairs], [s for _d, s in pairs]
    if stream is None:
        start_s = time.perf_counter()
        if dsts:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)  # one Python call for the batch
        return Copy(done=None, start=None, wall_s=time.perf_counter() - start_s)
    start, done = copy_events()
    start.record(stream)
    with torch.cuda.stream(stream):
        # one Python call for the batch, not one kernel: tensors on different devices
        # (pinned host and GPU) take foreach's per-tensor path, each an async copy_ here
        if dsts:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
    done.record(stream)
    return Copy(done=done, start=start, wall_s=0.0)


def wait_copies(copies: list[Copy]) -> float:
    """Wait for every copy; the longest one's time (they ran in parallel), in s."""
    return max((c.wait_s() for c in copies), default=0.0)


Pieces = Sequence[tuple[int, Layout, torch.Tensor]]
"""(byte offset in the placement, layout, dense device tensor of that layout) of each
tensor of a swap."""
Batch = dict[Any, list[tuple[torch.Tensor, torch.Tensor]]]
"""Per copy stream (a store's own key for it): the (block part, piece part) pairs of a
swap's copies on that stream."""


def segments(placement: Placement, pieces: Pieces) -> Iterator[tuple[Slot, torch.Tensor, torch.Tensor]]:
    """Every overlap of a piece with a slot: (the slot, the block's part of it, the
    piece's part of it). A piece within one slot (always, on the host) is one pair of
    same-layout tensors, so its copy is one memcpy with no view of its bytes; a piece
    spanning slots (a D2D stripe boundary) is split as bytes in memory order."""
    for slot in placement.slots:
        first, end = slot.tensor_offset_bytes, slot.tensor_offset_bytes + slot.nbytes
        block = None
        for offset, layout, tensor in pieces:
            lo, hi = max(first, offset), min(end, offset + layout.nbytes)
            if lo >= hi:
                continue
            if hi - lo == layout.nbytes:  # the whole piece
                yield slot, slot.block.strided(layout.dtype, layout.shape, layout.stride, offset - first,
                                               layout.nbytes), tensor
                continue
            block = slot.block.view(torch.uint8, (slot.nbytes,)) if block is None else block
            yield slot, block[lo - first:hi - first], layout.flat(tensor)[lo - offset:hi - offset]


class SwapStore(abc.ABC):
    """Destination of one swap engine (see the module docstring). Thread safety: `reserve`
    and `release` may be called from any thread, `pair` from the training thread;
    `copy_out` only from the swap-out issuer and `copy_in` only from the swap-in issuer. The engine keeps the device tensors a copy reads
    or writes alive until it has seen that copy complete on the host, so a store does not
    `record_stream` them (a recorded side-stream use would hold their memory back from
    the compute stream until every copy queued behind it had finished)."""

    residency: Residency
    """Where the manager is told the bytes are once the out copy completed."""
    kind: str
    """"host" or "d2d", for thread names and messages."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    @abc.abstractmethod
    def reserve(self, owner: str, nbytes: int, weights: Any = None, unit: str | None = None) -> Placement:
        """Room for `nbytes`; raises SwapError naming `owner` when there is none.
        `weights`: how to spread it (D2D stripe weights; the host store ignores it).
        `unit`: the program's name of what is swapped (its size class in a store that
        allocates by the program, `PeerStore`; the host store ignores it)."""

    def await_room(self, unit: str, nbytes: int, weights: Any, timeout_s: float) -> None:  # noqa: B027
        """Wait (without the engine's lock) until a `reserve` of `nbytes` for `unit` (with
        `weights`, as `reserve` gets them) can find room that is only held by swaps whose
        release needs no help from the training thread (a swap-in completing); at most
        `timeout_s` in all, then `reserve` says what is short. A store whose room is
        never held that way does not wait."""

    @abc.abstractmethod
    def release(self, placement: Placement) -> None:
        """Give the room back (once per placement)."""

    @abc.abstractmethod
    def pair(self, placement: Placement, pieces: Pieces) -> Batch:
        """The copies between `placement` and `pieces` (device tensors), per stream: what
        `copy_out` / `copy_in` issue. Called on the training thread, where the engine
        already does its per-tensor work, so the workers make one call per stream and do
        not trade the GIL with the compute thread tensor by tensor."""

    @abc.abstractmethod
    def copy_out(self, placement: Placement, batch: Batch, ready: torch.cuda.Event | None) -> list[Copy]:
        """Issue the copies of `batch` (from `pair`; its pieces are device bytes made on
        the compute stream) into `placement`, after `ready` (CUDA: recorded on the compute
        stream after them)."""

    @abc.abstractmethod
    def copy_in(self, placement: Placement, batch: Batch, ready: torch.cuda.Event | None) -> list[Copy]:
        """Issue the copies filling `batch`'s pieces (device tensors the engine allocated
        on the compute stream when the swap-in was issued) from `placement`, after `ready`
        (CUDA: recorded on the compute stream after the allocation)."""

    def completed(self, placement: Placement, direction: str) -> None:
        """The engine saw the "out" or "in" copies of `placement` complete."""

    def synchronize(self) -> None:
        """Block until every copy issued on this store's streams has finished (failure
        and shutdown paths, before the memory those copies use is let go)."""

    def check(self) -> None:
        """Raise SwapError if the destination became unusable (a peer died). Host: never."""

    def close(self) -> None:
        """Release what the store holds beyond its placements."""


class HostStore(SwapStore):
    """Swaps to the pinned host pool: one block per swap, one stream per direction."""

    residency = Residency.HOST
    kind = "host"

    def __init__(self, pool: PinnedHostPool, device: torch.device) -> None:
        super().__init__(device)
        self.pool = pool
        self._room = threading.Condition()
        """Notified when `release` gave blocks back (every free of the pool comes through
        here: the pool is the stage's, the store its one user)."""
        self._reading: set[int] = set()
        """Blocks a swap-in copy was issued from and that are not released yet: freed by
        the engine when the copy completes (on a GPU: after `fetch` returned)."""
        self._out_stream = copy_stream(device) if self.cuda else None
        self._in_stream = copy_stream(device) if self.cuda else None
        self._views: dict[int, list[tuple[Layout, torch.Tensor]]] = {}
        """Block id -> (layout, view over the block) of each piece the swap-out's `pair`
        placed there, until the swap-in's `pair` of the same pieces takes them: one view
        op per tensor per swap, not per copy. Dict operations only (atomic): `release`
        runs on worker threads."""

    def reserve(self, owner: str, nbytes: int, weights: Any = None, unit: str | None = None) -> Placement:
        return Placement((Slot(None, self.pool.allocate(nbytes, owner=owner), 0, nbytes),))

    def await_room(self, unit: str, nbytes: int, weights: Any, timeout_s: float) -> None:
        """On a GPU the swap-in's copies finish after `fetch` returned (it waits only until
        they are enqueued), and only then are their blocks freed: a swap-out reserved right
        after (an optimizer chunk's OO after its step, a microbatch's SO after a backward)
        would find the pool short by them, where the plan had them back. Wait for those
        frees while the room is short and some are pending."""
        size = round_up(max(nbytes, 1), self.pool.alignment_bytes)
        deadline = time.monotonic() + timeout_s
        with self._room:
            while self._reading and self.pool.largest_free_bytes < size:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._room.wait(left)

    def release(self, placement: Placement) -> None:
        for slot in placement.slots:
            self._views.pop(slot.block.block_id, None)
            self.pool.free(slot.block)
        with self._room:
            for slot in placement.slots:
                self._reading.discard(slot.block.block_id)
            self._room.notify_all()

    def pair(self, placement: Placement, pieces: Pieces) -> Batch:
        (slot,) = placement.slots
        block_id = slot.block.block_id
        made = self._views.pop(block_id, None)
        if made is not None and len(made) == len(pieces) and all(
                layout is m[0] for (_offset, layout, _t), m in zip(pieces, made)):
            return {None: [(view, data) for (_layout, view), (_offset, _l, data) in zip(made, pieces)]}
        pairs = _in_block(placement, pieces)
        self._views[block_id] = [(layout, view) for (_offset, layout, _t), (view, _d) in zip(pieces, pairs)]
        return {None: pairs}

    def copy_out(self, placement: Placement, batch: Batch, ready: torch.cuda.Event | None) -> list[Copy]:
        # No record_stream on the pieces: the engine holds them until it saw this copy
        # complete on the host (`SwapStore` contract), and a recorded use would keep their
        # memory from the compute stream until everything queued behind it here finished.
        stream = self._out_stream
        if stream is not None:
            stream.wait_event(ready)
        return [issue_copies(batch[None], stream)]

    def copy_in(self, placement: Placement, batch: Batch, ready: torch.cuda.Event | None) -> list[Copy]:
        with self._room:
            self._reading.update(slot.block.block_id for slot in placement.slots)
        stream = self._in_stream  # no record_stream: see copy_out
        if stream is not None:
            stream.wait_event(ready)
        return [issue_copies([(data, block) for block, data in batch[None]], stream)]

    def synchronize(self) -> None:
        for stream in (self._out_stream, self._in_stream):
            if stream is not None:
                stream.synchronize()

    def close(self) -> None:
        self.pool.close()  # unpin


def _in_block(placement: Placement, pieces: Pieces) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(the block's part, the piece) for each piece of a one-block placement (`segments`
    for the host's case, where every piece is whole)."""
    (slot,) = placement.slots
    return slot.block.strided_pairs(pieces)


class PeerStores(Protocol):
    """The job's D2D side as the runtime sees it. The launcher sets it up (a collective:
    `mpress.d2d.runtime.peer_pool.setup_peer_pools`) and hands it to the job; the runtime
    never builds it, so it does not depend on how peer memory is reached."""

    def store_for(self, stage: int) -> SwapStore:
        """The D2D swap destination of `stage`, which this rank runs."""

    def pool_on(self, device: int) -> torch.Tensor | None:
        """The peer pool this rank allocated for device `device` (memory that device lends
        to others), if any."""

    def dead_ranks(self) -> list[str]:
        """One line per other rank of the job whose process is gone."""

    def close(self, *, barrier: bool = False) -> None:
        """Free and unmap the pools (`barrier`: first wait for every rank)."""
