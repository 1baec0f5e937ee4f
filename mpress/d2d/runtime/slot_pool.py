"""A block pool carved into per-class regions of equal slots: the allocator of a D2D
quota, laid out as the plan's program says (`mpress/d2d/static/pool_slots.py`).

A class (a D2D unit's name, or one model-data tensor's) gets its region the first time it
allocates: `slots` slots of that first stripe's size (rounded up to the alignment), taken
from the pool once and kept for the job's life. Every later allocation of the class takes
a free slot of its region and gives it back whole, so the pool cannot fragment: a class
finds a slot whenever fewer than `slots` of its blocks are held. The regions together
take what `pool_slots.quota_need` computed from the plan's unit sizes, which is the quota
the planner gave.

A class whose slots are all held waits (`wait_slot`) for a swap-in to give one back: the
program guarantees that, at a unit's DO, at most `slots - 1` of its other microbatches
are still before their backward, and the blocks of the others are freed by the swap-in
completer without help from the training thread (so the wait ends), but that free may
land a moment after the backward that consumed them returned.

Thread safe: the training thread allocates while the swap-in completer frees.
Units: bytes.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from mpress.config.units import ALIGNMENT_BYTES
from mpress.d2d.static.pool_slots import slot_bytes, slots_of
from mpress.errors import SwapError
from mpress.runtime.memory.block_pool import Block, BlockPool, BlockState


@dataclass
class _Region:
    unit: str
    offset_bytes: int
    slot_bytes: int
    free: list[int]
    """Indices of free slots (lowest first taken)."""
    held: dict[int, int] = field(default_factory=dict)
    """block id -> slot index of the blocks out."""


class SlotPool(BlockPool):
    """A `BlockPool` whose `allocate_slot` hands out slots of per-class regions (see the
    module docstring); `allocate` still carves first fit from what the regions left.

    counts: unit name -> its slots (`pool_slots.unit_slot_counts` of the rank's program);
        None where there is no program (a plan without action lists): `laid_out` is then
        False and its users carve first fit (`allocate`).
    """

    def __init__(self, buffer: torch.Tensor, *, counts: Mapping[str, int] | None, name: str) -> None:
        super().__init__(buffer, alignment_bytes=ALIGNMENT_BYTES, name=name)
        self.laid_out = counts is not None
        """Whether the pool is laid out by a program (its users then allocate slots)."""
        self.counts = dict(counts or {})
        self._regions: dict[str, _Region] = {}
        self._slot_of: dict[int, _Region] = {}
        self._ids = itertools.count(-1, -1)  # slot blocks: negative ids, apart from the carved ones
        self._slot_lock = threading.Condition(threading.Lock())
        self._slot_in_use = 0
        self._slot_high = 0
        self._region_bytes = 0

    @property
    def slots_in_use_bytes(self) -> int:
        """Bytes of the slots held now (whole slots)."""
        with self._slot_lock:
            return self._slot_in_use

    @property
    def used_bytes(self) -> int:
        """Bytes held now: slots out plus blocks carved outside the regions."""
        with self._slot_lock:
            return self._slot_in_use + self.in_use_bytes - self._region_bytes

    @property
    def used_high_water_bytes(self) -> int:
        """The most slot bytes held at once, plus the high-water mark of carved blocks."""
        with self._slot_lock:
            return self._slot_high + self.high_water_bytes - self._region_bytes

    def allocate_slot(self, unit: str, nbytes: int, owner: str) -> Block:
        """A slot of `unit`'s region for `nbytes` (the region is made on the class's first
        call, sized by it). Raises SwapError naming the unit when the region does not fit
        in what other classes left, when `nbytes` exceeds the class's slot, or when every
        slot is held (call `wait_slot` first)."""
        with self._slot_lock:
            region = self._regions.get(unit) or self._new_region(unit, nbytes)
            if nbytes > region.slot_bytes:
                raise SwapError(f"{self.name}: {owner} needs {nbytes} bytes, more than the {region.slot_bytes}-byte "
                                f"slots of {unit} made for its first microbatch")
            if not region.free:
                raise SwapError(f"{self.name} exhausted: {owner} needs a slot of {unit}, and all "
                                f"{len(region.held)} are held (the program holds at most that many at once)")
            index = region.free.pop(0)
            block = Block(self, next(self._ids), region.offset_bytes + index * region.slot_bytes,
                          region.slot_bytes, nbytes, owner)
            region.held[block.block_id] = index
            self._slot_of[block.block_id] = region
            self._slot_in_use += region.slot_bytes
            self._slot_high = max(self._slot_high, self._slot_in_use)
            return block

    def wait_slot(self, unit: str, timeout_s: float) -> bool:
        """Wait until `unit`'s class has a free slot (or has no region yet); False when
        `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._slot_lock:
            while True:
                region = self._regions.get(unit)
                if region is None or region.free:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._slot_lock.wait(left)

    def free(self, block: Block) -> None:
        """Give `block` back: a slot to its region, a carved block to the free list."""
        with self._slot_lock:
            region = self._slot_of.pop(block.block_id, None)
            if region is not None:
                if block.pool is not self:
                    raise SwapError(f"{self.name}: block {block.block_id} of {block.owner} belongs to another pool")
                index = region.held.pop(block.block_id)
                region.free.append(index)
                region.free.sort()
                block._state = BlockState.FREED
                self._slot_in_use -= region.slot_bytes
                self._slot_lock.notify_all()
                return
        super().free(block)

    def _new_region(self, unit: str, nbytes: int) -> _Region:
        """Carve `unit`'s region (caller holds the slot lock)."""
        count, size = slots_of(self.counts, unit), slot_bytes(nbytes)
        try:
            carved = super().allocate(count * size, f"the {count} slots of {unit}")
        except SwapError:
            raise SwapError(
                f"{self.name} exhausted: {unit} needs {count} slots of {size} bytes, {count * size} in all; the "
                f"regions of {len(self._regions)} other unit(s) take {self._region_bytes} of its "
                f"{self.capacity_bytes} bytes (the plan sized the quota from the profiled unit sizes: re-plan "
                "with a profile of this model)") from None
        region = _Region(unit, carved.offset_bytes, size, list(range(count)))
        self._regions[unit] = region
        self._region_bytes += carved.size_bytes
        return region
