"""D2D swap destination: a tensor striped over peer GPUs' pools.

`PeerStore` is the `SwapStore` the swap engine drives for D2D rules. For each tensor it
asks the rule's `StripeSpreader` for the stripes (bandwidth-weighted; small tensors
whole, on the peer furthest behind its share), carves a block per stripe out of this
stage's quota of that peer's pool, and records the stripes in its `StripeTable`. Copies
run one stream per peer link and direction, so stripes to different peers move in
parallel:

- out: stripe k of the swap's bytes -> its block on peer k, on this GPU's out stream
  for peer k (a peer-to-peer write over NVLink; torch enables peer access); the engine
  hands over contiguous bytes made on the compute stream, so nothing is gathered here;
- in: each block -> its range of the tensors the engine allocated on this GPU; torch runs a cross-device
  copy on the *source* device's current stream, so the copy is issued on a stream of
  the peer's device, with this GPU's in stream for peer k as the destination's current
  stream (it waits for the copy); the consumer waits on events recorded there.

On CPU (shared-memory pools) the copies are plain memcpys on the worker thread.
Before each reservation and swap-in, and at most every `check_interval_s` from `check`,
the store checks that the processes holding its peers' pools are alive.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from mpress.d2d.runtime.slot_pool import SlotPool
from mpress.d2d.runtime.stripe_table import StripeState, StripeTable
from mpress.d2d.static.pool_slots import unit_stripes
from mpress.d2d.static.striping import DEFAULT_MIN_STRIPE_BYTES, StripeSpreader
from mpress.errors import PlanError, SwapError
from mpress.runtime.memory.block_pool import BlockPool
from mpress.runtime.memory.manager import Residency
from mpress.runtime.swap.store import (
    Batch,
    Copy,
    Pieces,
    Placement,
    Slot,
    SwapStore,
    copy_events,
    copy_stream,
    issue_copies,
    segments,
)


def peer_device(device: torch.device, peer: int, node_devices: Sequence[int] | None = None) -> torch.device:
    """Where the plan's device `peer` is for a rank on `device`: on CUDA, the GPU that
    plays it in the rank's replica (`node_devices[peer]`: the CUDA index of each of the
    plan's devices, a slot of the launcher's `StartPlan.replica_devices`; without one, the
    plan's number), so replicas sharing a node stripe to GPUs of their own; on CPU,
    `device` itself (shared-memory pools)."""
    if device.type != "cuda":
        return device
    if node_devices is None:
        return torch.device("cuda", peer)
    if not 0 <= peer < len(node_devices):
        raise PlanError(f"the plan stripes to its device {peer}; this replica has GPUs for devices "
                        f"0-{len(node_devices) - 1}")
    return torch.device("cuda", node_devices[peer])


class PoolQuotas(Protocol):
    """What a store needs of the job's peer pools: `peer_pool.PeerPools`, which builds the
    stores (`PeerPools.store_for`), so this module does not import it back."""

    def quota(self, stage: int, device: int) -> BlockPool:
        """Stage `stage`'s quota on device `device`'s pool (raises when the plan gave none)."""
        ...

    def check_peer(self, device: int) -> None:
        """Raise SwapError if the process holding device `device`'s pool is gone."""
        ...

Weights = tuple[tuple[int, float], ...]
"""(peer device, fraction) per stripe, as a D2D rule gives them."""


class PeerStore(SwapStore):
    """Swaps one stage's tensors into its quotas of peer pools (see the module docstring).

    weights: the stripe weights tensors get when `reserve` is called without any (the
        stage's first D2D rule); a reservation may name other weights.
    """

    residency = Residency.PEER
    kind = "d2d"

    def __init__(self, pools: PoolQuotas, stage: int, device: torch.device, weights: Sequence[tuple[int, float]], *,
                 min_stripe_bytes: int = DEFAULT_MIN_STRIPE_BYTES, check_interval_s: float = 0.5,
                 node_devices: Sequence[int] | None = None) -> None:
        super().__init__(device)
        self.pools = pools
        self.stage = stage
        self.node_devices = node_devices
        """The GPU of each of the plan's devices in this replica (`peer_device`)."""
        self.default_weights: Weights = tuple(weights)
        self.min_stripe_bytes = min_stripe_bytes
        self.check_interval_s = check_interval_s
        self.table = StripeTable()
        self._spreaders: dict[Weights, StripeSpreader] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._checked_at = 0.0
        self._peers: set[int] = set()
        self._streams: dict[tuple[str, int], torch.cuda.Stream] = {}
        self.spreader(self.default_weights)

    def spreader(self, weights: Weights) -> StripeSpreader:
        """The spreader of one weight set; opens the quotas and streams it needs (one
        stream per peer link and direction, shared by every weight set)."""
        with self._lock:
            found = self._spreaders.get(weights)
            if found is None:
                for peer, _ in weights:
                    self.pools.quota(self.stage, peer)  # raises when the plan gave no quota
                    if peer in self._peers:
                        continue
                    self._peers.add(peer)
                    if self.cuda:
                        own = self.device
                        other = peer_device(own, peer, self.node_devices)
                        self._streams[("out", peer)] = copy_stream(own)
                        self._streams[("in", peer)] = copy_stream(own)
                        self._streams[("in-src", peer)] = (copy_stream(other) if other != own
                                                            else self._streams[("in", peer)])
                        self._streams[("out-dst", peer)] = (copy_stream(other) if other != own
                                                             else self._streams[("out", peer)])
                found = self._spreaders[weights] = StripeSpreader(weights, min_stripe_bytes=self.min_stripe_bytes)
            return found

    # ---- SwapStore ---------------------------------------------------------------------

    def reserve(self, owner: str, nbytes: int, weights: Weights | None = None, unit: str | None = None) -> Placement:
        """Stripes of `nbytes` in this stage's quotas. With `unit` and quotas laid out by the
        program (`SlotPool`), each stripe takes a slot of the unit's region (`pool_slots.
        unit_stripes`: a fixed split); otherwise (no program) the spreader decides and
        blocks are carved first fit."""
        weights = weights or self.default_weights
        spreader = self.spreader(weights)
        slotted = unit is not None and all(getattr(self.pools.quota(self.stage, p), "laid_out", False)
                                               for p, _ in weights)
        stripes = unit_stripes(nbytes, weights) if slotted else spreader.split(nbytes)
        slots: list[Slot] = []
        offset = 0
        try:
            for peer, _ in stripes:
                self.pools.check_peer(peer)
            for peer, size in stripes:
                quota = self.pools.quota(self.stage, peer)
                block = quota.allocate_slot(unit, size, owner) if slotted else quota.allocate(size, owner)  # type: ignore[attr-defined]
                slots.append(Slot(peer, block, offset, size))
                offset += size
            placement = Placement(tuple(slots), entry_id=next(self._ids))
            self.table.add(owner, placement)
        except SwapError:
            for slot in slots:
                slot.block.pool.free(slot.block)
            if not slotted:
                spreader.undo(stripes)
            raise
        return placement

    def await_room(self, unit: str, nbytes: int, weights: Weights | None, timeout_s: float) -> None:
        """Wait for a free slot of `unit` in the quota of each peer the reservation stripes
        over (`weights`), within one deadline for them all; a peer this store never
        reserved on has all its slots free."""
        deadline = time.monotonic() + timeout_s
        for peer, _ in weights or self.default_weights:
            if peer not in self._peers:
                continue
            quota = self.pools.quota(self.stage, peer)
            if isinstance(quota, SlotPool) and quota.laid_out:
                quota.wait_slot(unit, max(0.0, deadline - time.monotonic()))

    def release(self, placement: Placement) -> None:
        for slot in placement.slots:
            slot.block.pool.free(slot.block)
        self.table.remove(placement.entry_id)

    def pair(self, placement: Placement, pieces: Pieces) -> Batch:
        return _by_peer(segments(placement, pieces))

    def copy_out(self, placement: Placement, batch: Batch, ready: torch.cuda.Event | None) -> list[Copy]:
        self.table.update(placement.entry_id, StripeState.WRITING)
        copies = []
        for peer, pairs in batch.items():
            stream = self._streams.get(("out", peer))  # no record_stream: see `SwapStore`
            if stream is None:
                copies.append(issue_copies(pairs, None))
                continue
            stream.wait_event(ready)
            # torch runs a cross-device copy on the source's (this GPU's) current stream and
            # fences it with the destination device's current stream: a stream of our own
            # there, not the peer's default stream (which would tie every swap to whatever
            # this process runs on it)
            with torch.cuda.stream(self._streams[("out-dst", peer)]):
                copies.append(issue_copies(pairs, stream))
        return copies

    def copy_in(self, placement: Placement, batch: Batch, ready: torch.cuda.Event | None) -> list[Copy]:
        for slot in placement.slots:  # a dead peer's pool must not be read (CUDA: freed IPC memory)
            self.pools.check_peer(slot.peer)
        self.table.update(placement.entry_id, StripeState.READING)
        copies = []
        for peer, pairs in batch.items():
            pairs = [(data, block) for block, data in pairs]
            stream = self._streams.get(("in", peer))
            if stream is None:
                copies.append(issue_copies(pairs, None))
                continue
            stream.wait_event(ready)  # the pieces were allocated on the compute stream
            copies.append(_peer_copy_in(pairs, stream, self._streams[("in-src", peer)]))
        return copies

    def completed(self, placement: Placement, direction: str) -> None:
        self.table.update(placement.entry_id, StripeState.ON_PEERS if direction == "out" else StripeState.READ)

    def synchronize(self) -> None:
        for stream in list(self._streams.values()):
            stream.synchronize()

    def check(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self.check_interval_s:
            return
        self._checked_at = now
        for peer in sorted(self._peers):
            self.pools.check_peer(peer)


def _by_peer(overlaps: Iterable[tuple[Slot, torch.Tensor, torch.Tensor]]
             ) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(block bytes, piece bytes) pairs grouped by the peer holding the block."""
    out: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for slot, block, data in overlaps:
        out.setdefault(slot.peer, []).append((block, data))  # type: ignore[arg-type]
    return out


def _peer_copy_in(pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream,
                  source_stream: torch.cuda.Stream) -> Copy:
    """Copy peer blocks into this GPU's tensors ((dst, src) pairs): issued on the peer
    device's `source_stream` (torch runs cross-device copies on the source's current
    stream) with `stream` as the destination's current stream, which torch makes wait
    for each copy; the returned events are recorded on `stream`."""
    start, done = copy_events()
    start.record(stream)
    with torch.cuda.stream(stream), torch.cuda.stream(source_stream):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
    done.record(stream)
    return Copy(done=done, start=start, wall_s=0.0)
