"""The pinned host pool: one page-locked host buffer, carved into aligned blocks.

Host swap needs page-locked (pinned) memory so that device<->host copies can run
asynchronously on a side stream. Pinning is expensive and pinned memory fragments badly,
so the runtime pins ONE buffer at start-up, exactly the plan's size (page-locked in place
with `cudaHostRegister`, not through torch's power-of-two pinned allocator), and hands out
blocks of it through `BlockPool` (`block_pool.py`). Units: bytes.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Any

import torch

from mpress.errors import UserError
from mpress.runtime.memory.block_pool import BlockPool, check_alignment
from mpress.config.units import ALIGNMENT_BYTES, round_up


class PinnedHostPool(BlockPool):
    """One host buffer, pinned when CUDA is available, handed out as aligned blocks.

    `capacity_bytes` is rounded up to a multiple of `alignment_bytes`, and exactly that is
    pinned: the buffer is allocated as ordinary host memory and page-locked in place with
    `cudaHostRegister` (torch's pinned allocator would round each allocation up to a power
    of two, up to twice what the plan says). `pin_memory=None` pins when CUDA is
    available; True without CUDA is a UserError. `cudart`: the CUDA runtime bindings
    (default `torch.cuda.cudart()`; tests pass a fake). `device`: the GPU whose context
    registers the memory (default: the current one). Never pins per tensor. Call
    `close()` to unpin; a pool dropped without it is unpinned when it is collected (or at
    exit), so its range is never left registered for glibc to hand out again (a later
    `cudaHostRegister` of it would fail with cudaErrorHostMemoryAlreadyRegistered).
    """

    def __init__(self, capacity_bytes: int, *, pin_memory: bool | None = None,
                 alignment_bytes: int = ALIGNMENT_BYTES, cudart: Any = None,
                 device: torch.device | None = None) -> None:
        if capacity_bytes < 0:
            raise UserError(f"pinned host pool: capacity must be >= 0 bytes, got {capacity_bytes}")
        check_alignment("pinned host pool", alignment_bytes)
        cuda = torch.cuda.is_available() or cudart is not None
        if pin_memory and not cuda:
            raise UserError("pinned host pool: pin_memory=True needs CUDA, which is not available")
        self.pinned = cuda if pin_memory is None else bool(pin_memory)
        capacity = round_up(capacity_bytes, alignment_bytes)
        # Over-allocate so the usable part starts on a page (and alignment) boundary
        # whatever the allocator returned: page-locking works on whole pages.
        start_alignment = max(alignment_bytes, PAGE_BYTES)
        self._raw = torch.empty(capacity + start_alignment, dtype=torch.uint8)
        pad = (-self._raw.data_ptr()) % start_alignment
        buffer = self._raw[pad:pad + capacity]
        self._cudart = None
        self._unpin: weakref.finalize | None = None
        self.pinned_bytes = 0
        """What is page-locked: the capacity, to the byte."""
        if self.pinned and capacity:
            self._cudart = cudart if cudart is not None else torch.cuda.cudart()
            # Under the GPU that copies from it: registering makes the current device's
            # context, and another GPU's would cost that GPU a context nobody planned for.
            where = torch.cuda.device(device) if device is not None and device.type == "cuda" else nullcontext()
            with where:
                _check(self._cudart, self._cudart.cudaHostRegister(buffer.data_ptr(), capacity,
                                                                   HOST_REGISTER_PORTABLE),
                       f"pinning {capacity} bytes of host memory")
            # The finalizer holds the raw buffer: the memory stays allocated until unpinned.
            self._unpin = weakref.finalize(self, _unregister, self._cudart, buffer.data_ptr(), self._raw)
            self.pinned_bytes = capacity
        super().__init__(buffer, alignment_bytes=alignment_bytes, name="pinned host pool")

    def close(self) -> None:
        """Unpin the buffer (idempotent); no copy may still use it."""
        if self._unpin is not None and self._unpin.alive:
            self.pinned_bytes = 0
            _check(self._cudart, self._unpin(), "unpinning the host pool")


PAGE_BYTES = 4096
"""Host page size page-locking works in."""
HOST_REGISTER_PORTABLE = 1
"""`cudaHostRegisterPortable`: the memory counts as pinned in every CUDA context, not only
the current device's (a copy from another device's context is still asynchronous)."""


def _unregister(cudart: Any, ptr: int, _raw: torch.Tensor) -> Any:
    """Unpin the range at `ptr` (`_raw`, the memory under it, is freed after this returns);
    the CUDA error code."""
    return cudart.cudaHostUnregister(ptr)


def _check(cudart: Any, error: Any, what: str) -> None:
    if int(error) != 0:  # cudaSuccess
        raise UserError(f"pinned host pool: {what} failed: {cudart.cudaGetErrorString(error)}")
