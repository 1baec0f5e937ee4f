"""The pinned host pool: one page-locked host buffer, carved into aligned blocks.

Host swap needs page-locked (pinned) memory so that device<->host copies can run
asynchronously on a side stream. Pinning is expensive and pinned memory fragments badly,
so the runtime pins ONE buffer at start-up, sized from the plan, and hands out blocks of
it through `BlockPool` (`block_pool.py`). Units: bytes.
"""

from __future__ import annotations

import torch

from mpress.errors import UserError
from mpress.runtime.memory.block_pool import BlockPool, check_alignment
from mpress.units import ALIGNMENT_BYTES, round_up


class PinnedHostPool(BlockPool):
    """One host buffer, pinned when CUDA is available, handed out as aligned blocks.

    `capacity_bytes` is rounded up to a multiple of `alignment_bytes`. `pin_memory=None`
    pins when CUDA is available; True without CUDA is a UserError. Never pins per tensor.
    """

    def __init__(self, capacity_bytes: int, *, pin_memory: bool | None = None,
                 alignment_bytes: int = ALIGNMENT_BYTES) -> None:
        if capacity_bytes < 0:
            raise UserError(f"pinned host pool: capacity must be >= 0 bytes, got {capacity_bytes}")
        check_alignment("pinned host pool", alignment_bytes)
        cuda = torch.cuda.is_available()
        if pin_memory and not cuda:
            raise UserError("pinned host pool: pin_memory=True needs CUDA, which is not available")
        self.pinned = cuda if pin_memory is None else bool(pin_memory)
        capacity = round_up(capacity_bytes, alignment_bytes)
        # Over-allocate by one alignment unit so the usable part starts on an aligned
        # address whatever the allocator returned.
        self._raw = torch.empty(capacity + alignment_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        pad = (-self._raw.data_ptr()) % alignment_bytes
        super().__init__(self._raw[pad:pad + capacity], alignment_bytes=alignment_bytes, name="pinned host pool")
