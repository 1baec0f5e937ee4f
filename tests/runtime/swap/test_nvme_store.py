"""The NVMe store (`mpress/runtime/swap/nvme.py`) under a real swap engine: what it
writes to its file and reads back, checked on the file itself and on the system calls it
makes (file offsets, lengths and buffer addresses aligned to the block size, the
descriptor's O_DIRECT flag as the store claims it), and its buffered fallback where a
filesystem refuses O_DIRECT."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
import torch

from mpress.contract.identity import TensorKey
from mpress.errors import SwapError
from mpress.runtime.memory.manager import Category, MemoryManager, Residency
from mpress.runtime.swap.engine import SwapEngine
from mpress.runtime.swap.nvme import DEFAULT_BLOCK_BYTES, NvmeStore, logical_block_bytes

CPU = torch.device("cpu")


def _key(name: str) -> TensorKey:
    return TensorKey(rank=0, stage=0, microbatch=None, tensor=f"optim:{name}:states")


def _group(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Tensors of odd sizes and dtypes, one of them a transposed (non-contiguous) view."""
    g = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(1001, generator=g)), ("b", torch.randn(37, 129, generator=g).t()),
            ("c", torch.randint(0, 1 << 30, (3333,), generator=g)), ("d", torch.randn(5, generator=g).half())]


def _fd_flags(fd: int) -> tuple[int, int]:
    """The descriptor's status flags as fcntl and /proc/self/fdinfo report them."""
    text = Path(f"/proc/self/fdinfo/{fd}").read_text()
    proc = int(next(line.split()[1] for line in text.splitlines() if line.startswith("flags:")), 8)
    return fcntl.fcntl(fd, fcntl.F_GETFL), proc


def _memory_bytes(tensor: torch.Tensor) -> bytes:
    """A dense tensor's bytes in memory order (what a swap moves)."""
    flat = tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())
    return flat.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def syscalls(monkeypatch):
    """Every pwrite and preadv the process makes: (call, file offset, length, buffer
    address); the calls themselves go through."""
    calls: list[tuple[str, int, int, int]] = []
    pwrite, preadv = os.pwrite, os.preadv

    def address(view) -> int:
        return torch.frombuffer(view, dtype=torch.uint8).data_ptr() if len(view) else 0

    def logged_pwrite(fd, data, offset):
        calls.append(("write", offset, len(data), address(data)))
        return pwrite(fd, data, offset)

    def logged_preadv(fd, buffers, offset, *rest):
        calls.extend(("read", offset, len(b), address(b)) for b in buffers)
        return preadv(fd, buffers, offset, *rest)

    monkeypatch.setattr(os, "pwrite", logged_pwrite)
    monkeypatch.setattr(os, "preadv", logged_preadv)
    return calls


@pytest.mark.parametrize("block", [None, 4096])
def test_groups_go_to_the_file_aligned_and_come_back_equal(tmp_path, syscalls, block):
    """Three groups larger than the staging buffer go out and back twice: every I/O is
    block-aligned in offset, length and buffer address, the file holds each tensor's
    bytes where its extent says, the second round reuses the first's extents (the file
    does not grow), and the tensors come back equal, in their layouts."""
    store = NvmeStore(tmp_path, CPU, name="t", staging_bytes=5000, block_bytes=block)
    assert store.block_bytes == (block or logical_block_bytes(tmp_path))
    assert store.staging_bytes % store.block_bytes == 0 and store.staging_bytes >= 5000
    manager = MemoryManager(CPU, rank=0)
    with SwapEngine(store, manager, CPU, rank=0, stage=0) as engine:
        sizes = []
        for round_ in range(2):
            groups = {f"l{i}": _group(10 * round_ + i) for i in range(3)}
            expected = {layer: [t.clone() for _n, t in g] for layer, g in groups.items()}
            handles = {layer: engine.swap_out_group(_key(layer), g, category=Category.OPTIMIZER)
                       for layer, g in groups.items()}
            del groups
            engine.wait_idle()
            assert all(manager.residency(_key(layer)) is Residency.DISK for layer in handles)
            assert manager.report()["disk_bytes"] == sum(t.numel() * t.element_size()
                                                         for ts in expected.values() for t in ts)
            with open(store.path, "rb") as f:  # the bytes are in the file (read past any cache of ours)
                for layer, handle in handles.items():
                    (slot,) = handle._record.placement.slots
                    for offset, tensor in zip(handle._record.offsets, expected[layer]):
                        f.seek(slot.block.offset_bytes + offset)
                        raw = f.read(tensor.numel() * tensor.element_size())
                        assert raw == _memory_bytes(tensor), (layer, offset)
            sizes.append(os.path.getsize(store.path))
            for layer, handle in handles.items():
                back = engine.fetch_group(handle)
                for got, want in zip(back, expected[layer]):
                    assert torch.equal(got, want) and got.stride() == want.stride()
            del handles, handle, back  # as OptimizerOffload.home lets a chunk's handles go
            engine.wait_idle()
    assert sizes[0] == sizes[1] > 0
    assert {call for call, *_ in syscalls} == {"write", "read"}
    for call, offset, length, addr in syscalls:
        assert offset % store.block_bytes == 0 and length % store.block_bytes == 0, (call, offset, length)
        assert 0 < length <= store.staging_bytes and addr % store.block_bytes == 0, (call, length, addr)
    store.close()
    assert not store.path.exists()


def test_the_descriptor_carries_o_direct_as_the_store_claims(tmp_path):
    """On a filesystem that takes O_DIRECT the descriptor has it (fcntl and the kernel's
    fdinfo agree), and the store says so."""
    store = NvmeStore(tmp_path, CPU, name="t")
    try:
        flags, proc = _fd_flags(store.fd)
        assert bool(flags & os.O_DIRECT) == bool(proc & os.O_DIRECT) == store.direct
        if not store.direct:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: {store.why_buffered}")
        assert store.why_buffered is None
    finally:
        store.close()


def test_a_filesystem_refusing_o_direct_gets_buffered_io_and_says_so(tmp_path, monkeypatch, syscalls):
    """Where open(O_DIRECT) fails with EINVAL (tmpfs on older kernels, some network
    mounts), the file is opened buffered, the store records why and warns, the
    descriptor has no O_DIRECT, and swaps still round-trip."""
    real_open = os.open

    def refusing_open(path, flags, *rest):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *rest)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.warns(RuntimeWarning, match="refuses O_DIRECT"):
        store = NvmeStore(tmp_path, CPU, name="t", staging_bytes=4096)
    monkeypatch.setattr(os, "open", real_open)
    assert not store.direct and "O_DIRECT refused" in store.why_buffered
    assert not _fd_flags(store.fd)[0] & os.O_DIRECT
    with SwapEngine(store, MemoryManager(CPU, rank=0), CPU, rank=0, stage=0) as engine:
        group = _group(3)
        expected = [t.clone() for _n, t in group]
        handle = engine.swap_out_group(_key("x"), group)
        assert all(torch.equal(a, b) for a, b in zip(engine.fetch_group(handle), expected))
    store.close()


def test_a_bounded_file_refuses_a_group_beyond_it_by_name(tmp_path):
    store = NvmeStore(tmp_path, CPU, name="t", capacity_bytes=8 * DEFAULT_BLOCK_BYTES, block_bytes=DEFAULT_BLOCK_BYTES)
    with SwapEngine(store, MemoryManager(CPU, rank=0), CPU, rank=0, stage=0) as engine, \
            pytest.raises(SwapError, match=r"no room for .*optim:big:states"):
        engine.swap_out_group(_key("big"), [("a", torch.zeros(9 * DEFAULT_BLOCK_BYTES // 4))])
    store.close()
