"""A buffer allocated once and carved into aligned blocks.

`BlockPool` carves any flat uint8 buffer: the pinned host pool (`host_pool.py`), and the
quota an exporter holds in a peer GPU's pool (`mpress/d2d/runtime/peer_pool.py`), where
the buffer is a CUDA IPC mapping of the importer's memory or a shared-memory segment on
CPU. Allocating once and carving avoids per-tensor allocation calls (pinning takes a
global lock and milliseconds per call) and the fragmentation they cause:

- first fit over a free list kept sorted by offset; a freed block is merged with free
  neighbours at once, so the free list never holds two adjacent regions;
- every block starts on a multiple of `alignment_bytes` (a power of two >= 16) counted
  from an aligned base address, so a block can be viewed as any dtype (element sizes are
  at most 16 bytes) and DMA engines see aligned addresses;
- each block carries an explicit state (`BlockState`); freeing twice is an error, not a
  silent corruption.

All methods are thread safe: the swap-out worker allocates while the swap-in worker
frees. Units: bytes.
"""

from __future__ import annotations

import enum
import math
import threading
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import torch

from mpress.errors import SwapError, UserError
from mpress.config.units import ALIGNMENT_BYTES, round_up

_MIN_ALIGNMENT_BYTES = 16
"""Largest element size torch has (complex128); smaller alignments break dtype views."""


class BlockState(enum.Enum):
    """Life cycle of a `Block`: allocated once, freed once."""

    ALLOCATED = "allocated"
    FREED = "freed"


class Block:
    """One aligned region of a `BlockPool`. Made by `allocate`, ended by `free`.

    `size_bytes` is what the block occupies (the request rounded up to the alignment);
    `nbytes` is what was asked for.
    """

    __slots__ = ("_pool", "_state", "block_id", "nbytes", "offset_bytes", "owner", "size_bytes")

    def __init__(self, pool: BlockPool, block_id: int, offset_bytes: int,
                 size_bytes: int, nbytes: int, owner: str) -> None:
        self._pool = pool
        self.block_id = block_id
        self.offset_bytes = offset_bytes
        self.size_bytes = size_bytes
        self.nbytes = nbytes
        self.owner = owner
        self._state = BlockState.ALLOCATED

    @property
    def state(self) -> BlockState:
        return self._state

    @property
    def pool(self) -> BlockPool:
        return self._pool

    def view(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A contiguous tensor of `dtype` and `shape` over this block's bytes (no copy).

        The view aliases the pool buffer: it is valid only until the block is freed, and
        it is pinned exactly when the pool is. Raises SwapError if the block was freed or
        is too small for `shape`.
        """
        shape = tuple(int(d) for d in shape)
        need_bytes = math.prod(shape) * dtype.itemsize
        if self._state is not BlockState.ALLOCATED:
            raise SwapError(f"{self._pool.name} block {self.block_id} of {self.owner} used after free")
        if need_bytes > self.size_bytes:
            raise SwapError(f"{self._pool.name} block of {self.owner} holds {self.size_bytes} bytes, "
                            f"a {dtype} tensor of shape {list(shape)} needs {need_bytes}")
        start = self.offset_bytes
        flat = self._pool.buffer[start:start + need_bytes]  # (need_bytes,) uint8
        return flat.view(dtype).view(shape)

    def strided(self, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...], offset_bytes: int,
                nbytes: int) -> torch.Tensor:
        """A tensor of `dtype`, `shape` and `stride` (dense: it spans `nbytes` from its
        first element) over this block's bytes from `offset_bytes` (a multiple of the
        element size) on; no copy, one view op (the pool keeps a typed view per dtype).
        Same validity and errors as `view`."""
        if self._state is not BlockState.ALLOCATED:
            raise SwapError(f"{self._pool.name} block {self.block_id} of {self.owner} used after free")
        if offset_bytes + nbytes > self.size_bytes:
            raise SwapError(f"{self._pool.name} block of {self.owner} holds {self.size_bytes} bytes, "
                            f"{nbytes} bytes from offset {offset_bytes} do not fit")
        typed, start = self._pool.typed_start(dtype)
        return typed.as_strided(shape, stride, start + (self.offset_bytes + offset_bytes) // dtype.itemsize)

    def strided_pairs(self, pieces: Sequence[tuple[int, Any, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(`strided` over this block, tensor) for each (offset_bytes, layout, tensor) of
        `pieces`, where a layout has `dtype`, `shape`, `stride` and `nbytes` (`mpress.
        runtime.swap.layout.Layout`): a group's views in one call, the block's checks made
        once for the group, one view op per piece. Same validity and errors as `strided`."""
        if self._state is not BlockState.ALLOCATED:
            raise SwapError(f"{self._pool.name} block {self.block_id} of {self.owner} used after free")
        base, size, typed = self.offset_bytes, self.size_bytes, self._pool.typed_start
        out = []
        last = None  # (dtype, its typed view, its start in elements, its item size): groups repeat dtypes
        for offset_bytes, layout, tensor in pieces:
            if offset_bytes + layout.nbytes > size:
                raise SwapError(f"{self._pool.name} block of {self.owner} holds {size} bytes, "
                                f"{layout.nbytes} bytes from offset {offset_bytes} do not fit")
            dtype = layout.dtype
            if last is None or last[0] is not dtype:
                last = (dtype, *typed(dtype), dtype.itemsize)
            out.append((last[1].as_strided(layout.shape, layout.stride, last[2] + (base + offset_bytes) // last[3]),
                        tensor))
        return out

    def __repr__(self) -> str:
        return (f"Block(id={self.block_id}, offset={self.offset_bytes}, "
                f"size={self.size_bytes}, owner={self.owner!r}, state={self._state.value})")


class BlockPool:
    """A flat uint8 `buffer` (any device) handed out as aligned blocks.

    `buffer` must start on an `alignment_bytes` boundary and its length must be a
    multiple of it; `name` is used in messages ("pinned host pool", "peer pool of ...").
    """

    def __init__(self, buffer: torch.Tensor, *, alignment_bytes: int = ALIGNMENT_BYTES, name: str = "block pool") -> None:
        check_alignment(name, alignment_bytes)
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise UserError(f"{name}: the buffer must be a flat uint8 tensor, got {buffer.dtype} {list(buffer.shape)}")
        if buffer.numel() % alignment_bytes or (buffer.numel() and buffer.data_ptr() % alignment_bytes):
            raise UserError(f"{name}: the buffer ({buffer.numel()} bytes at {buffer.data_ptr():#x}) is not "
                            f"aligned to {alignment_bytes} bytes")
        self.name = name
        self.alignment_bytes = alignment_bytes
        self.buffer = buffer
        """The whole pool as one (capacity_bytes,) uint8 tensor; blocks are slices of it."""
        self._capacity_bytes = buffer.numel()
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = (
            [(0, self._capacity_bytes)] if self._capacity_bytes else [])
        """Free regions (offset, size), sorted by offset, never adjacent to each other."""
        self._blocks: dict[int, Block] = {}
        self._next_id = 0
        self._in_use_bytes = 0
        self._high_water_bytes = 0
        self._typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
        """The buffer viewed as each dtype a block was viewed as, and its storage offset
        (`typed_start`)."""

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole buffer as a flat tensor of `dtype` (made once per dtype)."""
        return self.typed_start(dtype)[0]

    def typed_start(self, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """`typed(dtype)` and its storage offset (in elements of `dtype`), made once per dtype."""
        found = self._typed.get(dtype)
        if found is None:
            flat = self.buffer.view(dtype)
            found = self._typed[dtype] = (flat, flat.storage_offset())
        return found

    # ---- counters --------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def in_use_bytes(self) -> int:
        """Bytes occupied by allocated blocks (rounded sizes)."""
        with self._lock:
            return self._in_use_bytes

    @property
    def high_water_bytes(self) -> int:
        """Largest `in_use_bytes` ever seen."""
        with self._lock:
            return self._high_water_bytes

    @property
    def num_blocks(self) -> int:
        """Number of allocated (not yet freed) blocks."""
        with self._lock:
            return len(self._blocks)

    @property
    def largest_free_bytes(self) -> int:
        with self._lock:
            return max((size for _, size in self._free), default=0)

    def free_regions(self) -> list[tuple[int, int]]:
        """Snapshot of the free list as (offset_bytes, size_bytes), sorted by offset."""
        with self._lock:
            return list(self._free)

    # ---- allocation ------------------------------------------------------------------

    def allocate(self, nbytes: int, owner: str) -> Block:
        """First-fit block of at least `nbytes` (zero gets one alignment unit).

        `owner` names the tensor in messages. Raises SwapError when no free region fits.
        """
        if nbytes < 0:
            raise SwapError(f"{self.name} block for {owner}: negative size {nbytes}")
        size = round_up(max(nbytes, 1), self.alignment_bytes)
        with self._lock:
            for i, (offset, free_size) in enumerate(self._free):
                if free_size >= size:
                    break
            else:
                largest = max((s for _, s in self._free), default=0)
                raise SwapError(
                    f"{self.name} exhausted: {owner} needs {nbytes} bytes, largest free "
                    f"block {largest}, in use {self._in_use_bytes} of capacity "
                    f"{self._capacity_bytes}")
            if free_size == size:
                del self._free[i]
            else:
                self._free[i] = (offset + size, free_size - size)
            block = Block(self, self._next_id, offset, size, nbytes, owner)
            self._next_id += 1
            self._blocks[block.block_id] = block
            self._in_use_bytes += size
            self._high_water_bytes = max(self._high_water_bytes, self._in_use_bytes)
            return block

    def free(self, block: Block) -> None:
        """Return `block` to the pool, merging it with free neighbours.

        Raises SwapError on a double free or a block of another pool.
        """
        if block.pool is not self:
            raise SwapError(f"{self.name}: block {block.block_id} of {block.owner} belongs to another pool")
        with self._lock:
            if block.state is not BlockState.ALLOCATED or block.block_id not in self._blocks:
                raise SwapError(f"{self.name}: double free of block {block.block_id} of {block.owner}")
            del self._blocks[block.block_id]
            block._state = BlockState.FREED
            self._in_use_bytes -= block.size_bytes
            offset, size = block.offset_bytes, block.size_bytes
            i = bisect_left(self._free, (offset, 0))
            # Merge with the following region, then with the preceding one.
            if i < len(self._free) and self._free[i][0] == offset + size:
                size += self._free[i][1]
                del self._free[i]
            if i > 0 and sum(self._free[i - 1]) == offset:
                prev_offset, prev_size = self._free[i - 1]
                self._free[i - 1] = (prev_offset, prev_size + size)
            else:
                self._free.insert(i, (offset, size))

    def validate(self) -> None:
        """Check the pool's invariants; raise SwapError naming the first one broken.

        Free regions sorted, aligned, non-empty, non-adjacent; no overlap between any two
        regions or blocks; free + allocated = capacity. Reads only; for tests and debugging.
        """
        with self._lock:
            regions = [(o, s, "free") for o, s in self._free]
            regions += [(b.offset_bytes, b.size_bytes, f"block {b.block_id}")
                        for b in self._blocks.values()]
            regions.sort()
            end = 0
            for offset, size, what in regions:
                if size <= 0 or offset % self.alignment_bytes or size % self.alignment_bytes:
                    raise SwapError(f"{self.name}: {what} at {offset} size {size} is not aligned")
                if offset < end:
                    raise SwapError(f"{self.name}: {what} at {offset} overlaps the region before")
                end = offset + size
            if end > self._capacity_bytes:
                raise SwapError(f"{self.name}: regions end at {end} past capacity {self._capacity_bytes}")
            covered = sum(s for _, s, _ in regions)
            if covered != self._capacity_bytes:
                raise SwapError(f"{self.name}: regions cover {covered} of {self._capacity_bytes} bytes")
            for (o1, s1), (o2, _) in zip(self._free, self._free[1:]):
                if o1 + s1 >= o2:
                    raise SwapError(f"{self.name}: free regions at {o1} and {o2} not coalesced")
            if self._in_use_bytes != sum(b.size_bytes for b in self._blocks.values()):
                raise SwapError(f"{self.name}: in-use counter disagrees with the allocated blocks")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name}, capacity={self._capacity_bytes}, "
                f"in_use={self._in_use_bytes}, blocks={len(self._blocks)})")


def check_alignment(name: str, alignment_bytes: int) -> None:
    if alignment_bytes < _MIN_ALIGNMENT_BYTES or alignment_bytes & (alignment_bytes - 1):
        raise UserError(f"{name}: alignment must be a power of two >= "
                        f"{_MIN_ALIGNMENT_BYTES} bytes, got {alignment_bytes}")
