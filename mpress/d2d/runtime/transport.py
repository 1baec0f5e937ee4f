"""Allocating, exporting and opening peer-pool memory: the two transports.

- `CudaIpcTransport`: the pool is a CUDA allocation on the importer's GPU, exported
  with torch's CUDA IPC (`torch.multiprocessing.reductions.reduce_tensor`, i.e.
  `cudaIpcGetMemHandle`) and opened by exporters as a tensor on that GPU, so a copy into
  it is a peer-to-peer copy over NVLink;
- `SharedMemoryTransport`: the pool is a `multiprocessing.shared_memory` segment, so the
  whole protocol runs on CPU-only machines and in CI (a test vehicle, not a fast path).

A payload can only be opened by a process other than the one that created it: CUDA IPC
maps memory exported by *another* process (`cudaIpcOpenMemHandle`; in one process torch
keeps the producer's storage under `shared_cache[handle]` but looks it up under `(handle,
offset)`, misses, and calls `cudaIpcOpenMemHandle` on its own handle, which fails). Both
transports refuse such an open with a `SwapError` (the shared-memory one could map its own
segment twice, but then a CPU run would pass where a GPU job crashes): the process that
allocated a pool uses the buffer `create` returned (`peer_pool.py`).

CUDA contexts: `open` rebuilds the storage with `_new_shared_cuda`, which makes the
handle's device current (`CUDAGuard` in torch/csrc/StorageSharing.cpp) before
`cudaIpcOpenMemHandle` maps the memory "into the current device address space", so every
process that opens a pool of GPU j creates its primary context on GPU j (and so does the
process that allocates an idle GPU's pool in `create`). What that costs on the lender is
counted at plan time (`DeviceSpec.peer_context_bytes`, `d2d/static/mapping.py`).

Names: every shared-memory segment of a run (pools and ledgers) is named
`mpress-<run id>-<random>` (`segment_name`), the run id being `$MPRESS_RUN_ID` (set by
`mpress train`) or torchrun's `$TORCHELASTIC_RUN_ID`, so that the launcher can remove
whatever a killed rank left in /dev/shm once every rank is gone (`sweep_segments`).
"""

from __future__ import annotations

import _posixshmem  # POSIX shared memory, as multiprocessing.shared_memory uses it
import abc
import mmap
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from multiprocessing import shared_memory
from typing import Any

import torch

from mpress.d2d.runtime.liveness import RUN_ID_ENV, ProcessId
from mpress.errors import SwapError
from mpress.config.units import ALIGNMENT_BYTES


class PoolTransport(abc.ABC):
    """Allocates, exports and opens pool memory. `create` runs on the pool's holder,
    `open` on exporters in other processes; payloads must pickle (they travel through
    `all_gather_object`)."""

    name: str

    @abc.abstractmethod
    def create(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any]:
        """A flat uint8 buffer of `nbytes` (aligned start) and its picklable export."""

    @abc.abstractmethod
    def open(self, payload: Any, device: torch.device) -> torch.Tensor:
        """The buffer another process exported, mapped into this process. Raises
        SwapError when this process created `payload` itself (see the module docstring)."""

    def close(self) -> None:
        """Unmap what was opened and free what was created (after the job)."""


class SharedMemoryTransport(PoolTransport):
    """Pools in POSIX shared memory (CPU stand-in for GPU memory)."""

    name = "shm"

    def __init__(self) -> None:
        self._created: list[shared_memory.SharedMemory] = []
        self._opened: list[mmap.mmap] = []
        self._buffers: list[torch.Tensor] = []

    def create(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any]:
        try:
            # exactly the pool (a segment is mapped at a page boundary, so it is aligned): a
            # CPU rank counts what it lends as a GPU would
            shm = create_segment(max(nbytes, 1))
        except OSError as exc:
            raise SwapError(f"cannot allocate a {nbytes}-byte shared-memory peer pool: {exc}") from exc
        self._created.append(shm)
        fd = getattr(shm, "_fd", -1)
        if fd >= 0 and hasattr(os, "posix_fallocate"):
            # the segment is sparse until written: reserve it now, so a full /dev/shm is a
            # start-up error here and not a SIGBUS at the first swap
            try:
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            except OSError as exc:
                raise SwapError(f"cannot reserve a {nbytes}-byte shared-memory peer pool in /dev/shm: "
                                f"{exc.strerror}") from exc
        buffer = self._aligned(shm, nbytes)
        return buffer, (shm.name, nbytes, ProcessId.current())

    def open(self, payload: Any, device: torch.device) -> torch.Tensor:
        name, nbytes, creator = payload
        _refuse_own_export(f"shared-memory segment {name}", creator)
        segment = attach_shared_memory(name)
        self._opened.append(segment)
        return self._aligned(segment, nbytes)

    def _aligned(self, shm: shared_memory.SharedMemory | mmap.mmap, nbytes: int) -> torch.Tensor:
        raw = torch.frombuffer(shm.buf if isinstance(shm, shared_memory.SharedMemory) else shm, dtype=torch.uint8)
        if raw.data_ptr() % ALIGNMENT_BYTES:
            raise SwapError(f"shared-memory peer pool mapped at {raw.data_ptr():#x}, not a multiple of "
                            f"{ALIGNMENT_BYTES} bytes")
        buffer = raw[:nbytes]
        self._buffers.append(buffer)
        return buffer

    def close(self) -> None:
        self._buffers.clear()
        release_segments([*self._opened, *self._created], unlink=self._created)
        self._opened.clear()
        self._created.clear()


class CudaIpcTransport(PoolTransport):
    """Pools in GPU memory, shared with CUDA IPC through torch's tensor reductions."""

    name = "cuda-ipc"

    def __init__(self) -> None:
        self._keep: list[torch.Tensor] = []

    def create(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        try:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:
            free, total = torch.cuda.mem_get_info(device)
            raise SwapError(f"cannot allocate the {nbytes}-byte peer pool on {device}: {free} of {total} "
                            "bytes free") from exc
        self._keep.append(buffer)  # the exporters' mappings need it alive
        return buffer, (*reduce_tensor(buffer), ProcessId.current(), str(device))

    def open(self, payload: Any, device: torch.device) -> torch.Tensor:
        # the handle names the holder's GPU by index: every rank must see the GPUs
        # numbered alike (the same CUDA_VISIBLE_DEVICES), which torchrun's default gives
        rebuild, args, creator, where = payload
        _refuse_own_export(f"on {where}", creator)
        buffer = rebuild(*args)  # creates this process's context on the pool's GPU
        self._keep.append(buffer)
        return buffer

    def close(self) -> None:
        self._keep.clear()


def _refuse_own_export(what: str, creator: ProcessId) -> None:
    """Raise SwapError when this process is `creator` (pid and start time: two ranks in
    separate pid namespaces may share a pid)."""
    if creator == ProcessId.current():
        raise SwapError(f"the peer pool {what} was exported by this process (pid {creator.pid}): use the buffer "
                        "it allocated; an IPC handle opens only in another process")


def make_transport(device: torch.device) -> PoolTransport:
    """CUDA IPC for CUDA devices, shared memory otherwise."""
    return CudaIpcTransport() if device.type == "cuda" else SharedMemoryTransport()


def attach_shared_memory(name: str) -> mmap.mmap:
    """Map an existing shared-memory segment without registering it with the resource
    tracker: `SharedMemory(name=...)` does register it (before Python 3.13), and the
    tracker would then unlink the importer's segment when this process exits."""
    fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


SHM_DIR = Path("/dev/shm")
"""Where Linux keeps POSIX shared-memory segments (one file per name)."""


def run_prefix(run_id: str | None = None) -> str:
    """`mpress-<run id>-`: the start of every segment name of the run (`run_id`, default
    from the environment: $MPRESS_RUN_ID, else torchrun's $TORCHELASTIC_RUN_ID, else this
    process's parent pid, which the ranks of one launcher share)."""
    if run_id is None:
        run_id = os.environ.get(RUN_ID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID") or f"ppid{os.getppid()}"
    return f"mpress-{re.sub(r'[^A-Za-z0-9_.]', '_', run_id)[:40]}-"


def segment_name() -> str:
    """A fresh segment name of this run (`run_prefix` + 16 random hex digits)."""
    return run_prefix() + secrets.token_hex(8)


def create_segment(nbytes: int) -> shared_memory.SharedMemory:
    """A new shared-memory segment of `nbytes`, named as this run's (`segment_name`)."""
    while True:
        try:
            return shared_memory.SharedMemory(name=segment_name(), create=True, size=nbytes)
        except FileExistsError:  # 64 random bits met another segment: draw again
            continue


def sweep_segments(run_id: str) -> list[str]:
    """Remove every segment of run `run_id` left in /dev/shm (ranks killed before they
    could unlink theirs); return the names removed. Call only once every rank of the run
    is gone: a live rank's segments would be removed under it."""
    removed = []
    prefix = run_prefix(run_id)
    for path in SHM_DIR.glob(prefix + "*") if SHM_DIR.is_dir() else ():
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:  # its process's resource tracker was first
            pass
    return removed


def release_segments(segments: Sequence[shared_memory.SharedMemory | mmap.mmap],
             unlink: Sequence[shared_memory.SharedMemory] = ()) -> None:
    """Unmap `segments` and remove the names of those this process created (`unlink`)."""
    for segment in segments:
        try:
            segment.close()
        except BufferError:  # a tensor view is still alive somewhere; the OS unmaps at exit
            pass
    for shm in unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
