"""Optimizer states on a local drive: a swap store whose room is a file (`nvme` rules).

`NvmeStore` is the `SwapStore` (`store.py`) of a stage's `nvme` engine: the optimizer
chunks an `optim:LAYER` nvme rule names (their Adam states and masters, swapped as groups
by `OptimizerOffload`) are written to one file per stage in the train config's `nvme_dir`
when they go out (`OO`) and read back when they come in (`OI`), so between steps they
take neither device nor host memory. The I/O:

- **Direct.** The file is opened with `O_DIRECT` (the page cache is bypassed: the drive's
  bandwidth, not the host's free memory, bounds the tier). A filesystem that refuses it
  (tmpfs, some network and overlay mounts: `EINVAL`) gets buffered I/O instead, and the
  store says so (`direct`, `why_buffered`, one warning), so nobody takes a page-cache
  figure for the drive's.
- **Aligned.** Every read and write starts at a file offset and has a length that are
  multiples of the drive's logical block size (`logical_block_bytes`: the block
  device's `queue/logical_block_size` from sysfs, else `DEFAULT_BLOCK_BYTES`), from a
  buffer whose address is aligned the same way: what `O_DIRECT` requires.
- **Staged.** Bytes go device -> staging buffer -> file and back through one bounded
  buffer per direction (`staging_bytes` each, page-locked when CUDA is available, plain
  host memory otherwise: a `PinnedHostPool`); a group larger than it moves window by
  window. The default is the contract's `NVME_STAGING_BYTES`, which the plan counts in
  what it pins (`mpress.contract.plan_check.host_bytes`): a power of two, so a block size divides it
  and the store pins exactly what the plan says.
- **Asynchronous.** The copies run on the engine's swap-out and swap-in issuer threads
  (`workers.py`), never on the training thread: an `OO` returns at once, and `OI` is
  issued ahead of the chunk's step by the plan's prefetch, as for host swap. Each
  direction's staging buffer is used by its own thread only.

Room in the file: one extent per swap, its size the group's bytes rounded up to the
block; a freed extent is reused by the next group of the same size (an optimizer chunk
goes out with the same sizes every step), else the file grows. `capacity_bytes` bounds
the file (None: the drive's free space; a full drive fails the swap-out with its error).
The file is removed when the store closes: checkpoints hold the states (they bring each
chunk home from the drive to save it, `OptimizerOffload.chunk_home`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mpress.config.units import round_up
from mpress.contract.plan_check import NVME_STAGING_BYTES
from mpress.errors import SwapError
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import Residency
from mpress.runtime.swap.store import (
    Batch,
    Copy,
    Pieces,
    Placement,
    Slot,
    SwapStore,
    copy_stream,
)

DEFAULT_BLOCK_BYTES = 4096
"""Alignment where the drive's logical block size cannot be read (tmpfs, overlays)."""


def logical_block_bytes(directory: str | Path) -> int:
    """The logical block size of the block device holding `directory` (sysfs
    `queue/logical_block_size` of the disk, or of the disk a partition belongs to);
    `DEFAULT_BLOCK_BYTES` when there is none to read."""
    dev = os.stat(directory).st_dev
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (base / "queue", base.parent / "queue"):  # a partition's queue is its disk's
        try:
            size = int((queue / "logical_block_size").read_text())
        except (OSError, ValueError):
            continue
        if size > 0 and size & (size - 1) == 0:
            return size
    return DEFAULT_BLOCK_BYTES


@dataclass(frozen=True)
class Extent:
    """A swap's bytes in the store's file (what a `Slot.block` is in the other stores)."""

    offset_bytes: int
    """Where they start: a multiple of the block size."""
    size_bytes: int
    """What they take: the group's bytes rounded up to the block size."""


class NvmeStore(SwapStore):
    """Swaps to one file in `directory` (see the module docstring). `name` tells the file
    apart from other stages' and processes'; `block_bytes` overrides the queried block
    size (a power of two, at least 512)."""

    residency = Residency.DISK
    kind = "nvme"

    def __init__(self, directory: str | Path, device: torch.device, *, name: str,
                 staging_bytes: int = NVME_STAGING_BYTES, capacity_bytes: int | None = None,
                 block_bytes: int | None = None) -> None:
        super().__init__(torch.device(device))
        directory = Path(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SwapError(f"nvme store: cannot make the directory {directory}: {exc.strerror}") from None
        self.block_bytes = block_bytes or logical_block_bytes(directory)
        if self.block_bytes < 512 or self.block_bytes & (self.block_bytes - 1):
            raise SwapError(f"nvme store: block size must be a power of two >= 512, got {self.block_bytes}")
        self.path = directory / f"{name}-{os.getpid()}.mpress-optim"
        self.fd, self.why_buffered = _open(self.path)
        self.direct = self.why_buffered is None
        """Whether the file is open with O_DIRECT (else buffered: `why_buffered` says why)."""
        if not self.direct:
            warnings.warn(f"nvme store: {directory} refuses O_DIRECT ({self.why_buffered}); optimizer states go "
                          "through the page cache there", RuntimeWarning, stacklevel=2)
        self.capacity_bytes = capacity_bytes
        window = max(round_up(staging_bytes, self.block_bytes), self.block_bytes)
        self._staging = PinnedHostPool(2 * window, alignment_bytes=self.block_bytes,
                                       device=self.device if self.cuda else None)
        self.staging_bytes = window
        """Bytes of each direction's staging buffer."""
        buffer = self._staging.buffer
        self._out_buffer, self._in_buffer = buffer[:window], buffer[window:]
        self._out_stream = copy_stream(self.device) if self.cuda else None
        self._in_stream = copy_stream(self.device) if self.cuda else None
        self._lock = threading.Lock()
        self._free: dict[int, list[int]] = {}
        """Extent size -> offsets of freed extents of that size."""
        self._end = 0
        """Bytes of the file its extents have used (the file's size)."""
        self.in_use_bytes = 0
        self.high_water_bytes = 0

    # ---- room ------------------------------------------------------------------------

    def reserve(self, owner: str, nbytes: int, weights: Any = None, unit: str | None = None) -> Placement:
        size = round_up(max(nbytes, 1), self.block_bytes)
        with self._lock:
            offsets = self._free.get(size)
            if offsets:
                offset = offsets.pop()
            else:
                if self.capacity_bytes is not None and self._end + size > self.capacity_bytes:
                    raise SwapError(f"nvme store {self.path}: no room for {owner} ({size} bytes; the file may hold "
                                    f"{self.capacity_bytes}, {self._end} are used)")
                offset, self._end = self._end, self._end + size
            self.in_use_bytes += size
            self.high_water_bytes = max(self.high_water_bytes, self.in_use_bytes)
        return Placement((Slot(None, Extent(offset, size), 0, nbytes),))  # type: ignore[arg-type]

    def release(self, placement: Placement) -> None:
        with self._lock:
            for slot in placement.slots:
                extent: Extent = slot.block  # type: ignore[assignment]
                self._free.setdefault(extent.size_bytes, []).append(extent.offset_bytes)
                self.in_use_bytes -= extent.size_bytes

    # ---- copies ----------------------------------------------------------------------

    def pair(self, placement: Placement, pieces: Pieces) -> Batch:
        """(offset in the placement, the piece's bytes in memory order) of each piece."""
        return {None: [(offset, layout.flat(tensor)) for offset, layout, tensor in pieces]}  # type: ignore[misc]

    def copy_out(self, placement: Placement, batch: Batch, ready: torch.cuda.Event | None) -> list[Copy]:
        start = time.perf_counter()
        stream = self._out_stream
        if stream is not None:
            stream.wait_event(ready)  # the pieces were made on the compute stream
        (slot,) = placement.slots
        extent: Extent = slot.block  # type: ignore[assignment]
        staging = self._out_buffer
        for window, length in self._windows(extent):
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for lo, hi, offset, data in _overlaps(batch[None], window, length):  # type: ignore[arg-type]
                    staging[lo - window:hi - window].copy_(data[lo - offset:hi - offset], non_blocking=True)
            if stream is not None:
                stream.synchronize()  # the staging bytes are complete before the drive reads them
            _write_all(self.fd, staging[:length], extent.offset_bytes + window)
        return [Copy(done=None, start=None, wall_s=time.perf_counter() - start)]

    def copy_in(self, placement: Placement, batch: Batch, ready: torch.cuda.Event | None) -> list[Copy]:
        start = time.perf_counter()
        stream = self._in_stream
        if stream is not None:
            stream.wait_event(ready)  # the pieces were allocated on the compute stream
        (slot,) = placement.slots
        extent: Extent = slot.block  # type: ignore[assignment]
        staging = self._in_buffer
        for window, length in self._windows(extent):
            _read_all(self.fd, staging[:length], extent.offset_bytes + window)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for lo, hi, offset, data in _overlaps(batch[None], window, length):  # type: ignore[arg-type]
                    data[lo - offset:hi - offset].copy_(staging[lo - window:hi - window], non_blocking=True)
            if stream is not None:
                stream.synchronize()  # the pieces are filled before the next window's read
        return [Copy(done=None, start=None, wall_s=time.perf_counter() - start)]

    def _windows(self, extent: Extent) -> list[tuple[int, int]]:
        """(offset in the extent, length) of each staging window over it: lengths are
        whole blocks, so every I/O starts and ends on a block boundary."""
        step = self.staging_bytes
        return [(w, min(step, extent.size_bytes - w)) for w in range(0, extent.size_bytes, step)]

    def synchronize(self) -> None:
        for stream in (self._out_stream, self._in_stream):
            if stream is not None:
                stream.synchronize()

    def close(self) -> None:
        """Close and remove the file (idempotent) and let the staging buffer go."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)
        self._staging.close()


def _open(path: Path) -> tuple[int, str | None]:
    """The file's descriptor, and why it is not open with O_DIRECT (None: it is)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return os.open(path, flags, 0o600), "this platform has no O_DIRECT"
    try:
        return os.open(path, flags | direct, 0o600), None
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # not a refusal of O_DIRECT: a real problem with the path
            raise SwapError(f"nvme store: cannot open {path}: {exc.strerror}") from None
        return os.open(path, flags, 0o600), f"O_DIRECT refused: {exc.strerror}"


def _overlaps(pieces: list[tuple[int, torch.Tensor]], window: int, length: int):
    """(first, end, piece offset, piece bytes) of each piece's part in the placement bytes
    [window, window + length)."""
    for offset, data in pieces:
        lo, hi = max(offset, window), min(offset + data.numel(), window + length)
        if lo < hi:
            yield lo, hi, offset, data


def _write_all(fd: int, data: torch.Tensor, offset: int) -> None:
    """Write all of `data` (host bytes) at `offset`; a short write goes on from where it
    stopped."""
    view = memoryview(data.numpy())
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise SwapError(f"nvme store: write of {len(view)} bytes at {offset} stopped after {done}")
        done += n


def _read_all(fd: int, data: torch.Tensor, offset: int) -> None:
    """Fill `data` (host bytes) from `offset`; a short read goes on from where it stopped,
    and the end of the file is an error (every extent read was written first)."""
    view = memoryview(data.numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise SwapError(f"nvme store: read of {len(view)} bytes at {offset} found the file's end after {done}")
        done += n
