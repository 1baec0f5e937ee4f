"""The single owner of residency state: where every planned tensor of one rank lives.

The saved-tensor router, the swap engine, the D2D path and the optimizer-state mover all
report to one `MemoryManager` instead of keeping their own flags (and never as attributes
on tensors). It knows, per `TensorKey`, the tensor's size, its category and its residency
(device, host, peer k), and keeps per-category device totals and their peaks, so
a run can be compared with the emulator's prediction of the same plan.

The manager accounts; it does not move bytes. Callers `track` a tensor when it is
created, `move` it when a copy completed (the device bytes are really freed or really
allocated at that moment) and `forget` it when it dies. All methods are thread safe: swap
workers report from their own threads. Units: bytes.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mpress.errors import SwapError
from mpress.contract.identity import TensorKey


class Residency(enum.Enum):
    """Where a tracked tensor's bytes are."""

    DEVICE = "device"
    HOST = "host"
    PEER = "peer"
    DISK = "disk"
    """A file on a local drive (`mpress/runtime/swap/nvme.py`)."""


class Category(enum.Enum):
    """What a tracked tensor is, for per-category accounting."""

    ACTIVATION = "activation"
    OPTIMIZER = "optimizer"
    MASTER = "master"


_OFF_DEVICE = (Residency.HOST, Residency.PEER, Residency.DISK)
"""Residencies a move out of (into) the device counts in bytes_moved_out (_in)."""


@dataclass
class _Record:
    nbytes: int
    category: Category
    residency: Residency
    peer: dict[int | None, int] | None
    """PEER only: bytes per peer device."""


def _peer_split(key: TensorKey, nbytes: int, peer: int | Mapping[int, int] | None) -> dict[int | None, int]:
    if peer is None or isinstance(peer, int):
        return {peer: nbytes}
    split = dict(peer)
    if sum(split.values()) != nbytes:
        raise SwapError(f"{key}: stripes hold {sum(split.values())} bytes, the tensor has {nbytes}")
    return split


@dataclass(frozen=True)
class CudaConsistency:
    """Result of `MemoryManager.check_cuda_consistency`."""

    tracked_device_bytes: int
    """Device bytes the manager believes planned tensors occupy."""
    allocated_delta_bytes: int
    """`torch.cuda.memory_allocated` now minus its value when the manager was built."""
    tolerance_bytes: int


class MemoryManager:
    """Residency table and device accounting for one rank's planned tensors."""

    def __init__(self, device: torch.device, *, rank: int) -> None:
        self.device = torch.device(device)
        self.rank = rank
        self._lock = threading.RLock()
        self._records: dict[TensorKey, _Record] = {}
        self._forgotten: set[TensorKey] = set()
        """Keys that died; kept so a late move says 'forgotten', not 'unknown'."""
        self._device_bytes = {c: 0 for c in Category}
        self._peak_device_bytes = {c: 0 for c in Category}
        self._total_device_bytes = 0
        self._peak_total_device_bytes = 0
        self._host_bytes = 0
        self._disk_bytes = 0
        self._peer_bytes: dict[int | None, int] = {}
        self._bytes_moved_out = 0
        self._bytes_moved_in = 0
        self._baseline_allocated_bytes = (
            torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0)

    # ---- updates ---------------------------------------------------------------------

    def released_before(self, nbytes: int) -> None:
        """`nbytes` the device held before this manager started were given back (the
        parameters a plan keeps on the host, emptied at start-up): the allocator's
        baseline `check_cuda_consistency` compares against drops by them."""
        if self.device.type == "cuda":
            self._baseline_allocated_bytes -= nbytes

    def track(self, key: TensorKey, nbytes: int, category: Category,
              residency: Residency = Residency.DEVICE, *, peer: int | Mapping[int, int] | None = None) -> None:
        """Start accounting for `key`. Raises SwapError if it is already tracked."""
        if nbytes < 0:
            raise SwapError(f"cannot track {key}: negative size {nbytes}")
        with self._lock:
            if key in self._records:
                raise SwapError(f"{key} is already tracked (as "
                                f"{self._records[key].residency.value})")
            self._forgotten.discard(key)
            record = _Record(nbytes, category, residency,
                             _peer_split(key, nbytes, peer) if residency is Residency.PEER else None)
            self._records[key] = record
            self._add(record, +1)

    def move(self, key: TensorKey, residency: Residency, *,
             peer: int | Mapping[int, int] | None = None) -> None:
        """Record that `key`'s bytes now live in `residency`. For PEER, `peer` is the
        peer device, or {device: bytes} for a tensor striped over several peers."""
        with self._lock:
            record = self._get(key, f"move to {residency.value}")
            old = record.residency
            self._add(record, -1)
            record.residency = residency
            record.peer = _peer_split(key, record.nbytes, peer) if residency is Residency.PEER else None
            self._add(record, +1)
            if old is Residency.DEVICE and residency in _OFF_DEVICE:
                self._bytes_moved_out += record.nbytes
            elif old in _OFF_DEVICE and residency is Residency.DEVICE:
                self._bytes_moved_in += record.nbytes

    def forget(self, key: TensorKey) -> None:
        """Stop accounting for `key` (the tensor died); its bytes leave every total."""
        with self._lock:
            record = self._get(key, "forget")
            self._add(record, -1)
            del self._records[key]
            self._forgotten.add(key)

    def _get(self, key: TensorKey, action: str) -> _Record:
        record = self._records.get(key)
        if record is None:
            why = "was forgotten" if key in self._forgotten else "is not tracked"
            raise SwapError(f"memory manager of rank {self.rank}: {key} {why} (cannot {action})")
        return record

    def _add(self, record: _Record, sign: int) -> None:
        nbytes = sign * record.nbytes
        if record.residency is Residency.DEVICE:
            cat = record.category
            self._device_bytes[cat] += nbytes
            self._total_device_bytes += nbytes
            self._peak_device_bytes[cat] = max(self._peak_device_bytes[cat], self._device_bytes[cat])
            self._peak_total_device_bytes = max(self._peak_total_device_bytes,
                                                self._total_device_bytes)
        elif record.residency is Residency.HOST:
            self._host_bytes += nbytes
        elif record.residency is Residency.DISK:
            self._disk_bytes += nbytes
        elif record.residency is Residency.PEER:
            for peer, part in record.peer.items():
                self._peer_bytes[peer] = self._peer_bytes.get(peer, 0) + sign * part

    # ---- queries ---------------------------------------------------------------------

    def is_tracked(self, key: TensorKey) -> bool:
        with self._lock:
            return key in self._records

    def residency(self, key: TensorKey) -> Residency:
        with self._lock:
            return self._get(key, "look up").residency

    def device_bytes(self, category: Category | None = None) -> int:
        """Tracked bytes on this device now, in `category` or in all."""
        with self._lock:
            return self._total_device_bytes if category is None else self._device_bytes[category]

    def peak_device_bytes(self, category: Category | None = None) -> int:
        """Highest `device_bytes(category)` so far (the all-category peak is the peak of
        the sum, not the sum of per-category peaks)."""
        with self._lock:
            if category is None:
                return self._peak_total_device_bytes
            return self._peak_device_bytes[category]

    def host_bytes(self) -> int:
        with self._lock:
            return self._host_bytes

    def peer_bytes(self, peer: int | None = None) -> int:
        """Bytes parked on peer `peer`, or on all peers."""
        with self._lock:
            if peer is None:
                return sum(self._peer_bytes.values())
            return self._peer_bytes.get(peer, 0)

    @property
    def bytes_moved_out(self) -> int:
        """Bytes moved device -> host or peer so far."""
        with self._lock:
            return self._bytes_moved_out

    @property
    def bytes_moved_in(self) -> int:
        """Bytes moved host or peer -> device so far."""
        with self._lock:
            return self._bytes_moved_in

    def reset_peaks(self) -> None:
        """Start peak tracking afresh from the current totals (e.g. per iteration)."""
        with self._lock:
            self._peak_device_bytes = dict(self._device_bytes)
            self._peak_total_device_bytes = self._total_device_bytes

    def report(self) -> dict:
        """Plain data for a table: per category and total bytes, peaks, moves."""
        with self._lock:
            counts = {c: 0 for c in Category}
            for record in self._records.values():
                counts[record.category] += 1
            return {
                "rank": self.rank,
                "device": str(self.device),
                "categories": {
                    c.value: {"num_tensors": counts[c],
                              "device_bytes": self._device_bytes[c],
                              "peak_device_bytes": self._peak_device_bytes[c]}
                    for c in Category},
                "num_tensors": len(self._records),
                "device_bytes": self._total_device_bytes,
                "peak_device_bytes": self._peak_total_device_bytes,
                "host_bytes": self._host_bytes,
                "peer_bytes": sum(self._peer_bytes.values()),
                "disk_bytes": self._disk_bytes,
                "bytes_moved_out": self._bytes_moved_out,
                "bytes_moved_in": self._bytes_moved_in,
            }

    # ---- checks ----------------------------------------------------------------------

    def check_cuda_consistency(self, tolerance_bytes: int = 0) -> CudaConsistency | None:
        """Sanity check of the accounting against the CUDA caching allocator.

        Every tracked device byte should be a real allocation made since this manager was
        built, so `tracked <= memory_allocated() - baseline + tolerance`. The converse does
        not hold (untracked tensors, allocator rounding), so only this direction is
        checked. Raises SwapError when it fails; returns the numbers when it holds; a
        no-op returning None on a non-CUDA device.
        """
        if self.device.type != "cuda":
            return None
        delta = torch.cuda.memory_allocated(self.device) - self._baseline_allocated_bytes
        tracked = self.device_bytes()
        result = CudaConsistency(tracked_device_bytes=tracked, allocated_delta_bytes=delta,
                                 tolerance_bytes=tolerance_bytes)
        if tracked > delta + tolerance_bytes:
            raise SwapError(
                f"rank {self.rank}: memory manager tracks {tracked} device bytes but only "
                f"{delta} were allocated on {self.device} since it started (tolerance "
                f"{tolerance_bytes}): residency state is out of date")
        return result
