"""PinnedHostPool: carving, alignment, coalescing, exhaustion, counters, thread safety."""

import gc
import re
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpress.errors import SwapError, UserError
from mpress.runtime.memory.block_pool import BlockState
from mpress.runtime.memory.host_pool import PinnedHostPool
from tests.support.cuda_fakes import FakeCudart

ALIGN = 512


def make_pool(capacity_bytes: int = 8 * ALIGN, **kwargs) -> PinnedHostPool:
    return PinnedHostPool(capacity_bytes, pin_memory=False, alignment_bytes=ALIGN, **kwargs)


def test_blocks_are_aligned_and_carved_in_order():
    pool = make_pool()
    a = pool.allocate(1, "a")
    b = pool.allocate(ALIGN, "b")
    c = pool.allocate(ALIGN + 1, "c")
    assert [(x.offset_bytes, x.size_bytes) for x in (a, b, c)] == [
        (0, ALIGN), (ALIGN, ALIGN), (2 * ALIGN, 2 * ALIGN)]
    assert c.nbytes == ALIGN + 1
    assert pool.buffer.data_ptr() % ALIGN == 0
    for block in (a, b, c):
        assert block.view(torch.uint8, (1,)).data_ptr() % ALIGN == 0
    assert pool.free_regions() == [(4 * ALIGN, 4 * ALIGN)]
    pool.validate()


def test_capacity_rounds_up_and_zero_bytes_get_one_unit():
    pool = PinnedHostPool(ALIGN + 3, pin_memory=False, alignment_bytes=ALIGN)
    assert pool.capacity_bytes == 2 * ALIGN
    assert pool.allocate(0, "empty").size_bytes == ALIGN
    empty = PinnedHostPool(0, pin_memory=False)
    with pytest.raises(SwapError, match="exhausted"):
        empty.allocate(1, "x")


def test_first_fit_reuses_the_lowest_hole():
    pool = make_pool()
    blocks = [pool.allocate(ALIGN, str(i)) for i in range(6)]
    pool.free(blocks[1])
    pool.free(blocks[4])
    again = pool.allocate(10, "small")
    assert again.offset_bytes == blocks[1].offset_bytes
    # A request larger than the first hole skips it.
    big = pool.allocate(2 * ALIGN, "big")
    assert big.offset_bytes == 6 * ALIGN
    pool.validate()


def test_free_coalesces_with_both_neighbours():
    pool = make_pool()
    a, b, c, d = (pool.allocate(ALIGN, x) for x in "abcd")
    pool.free(a)
    pool.free(c)
    assert pool.free_regions() == [(0, ALIGN), (2 * ALIGN, ALIGN), (4 * ALIGN, 4 * ALIGN)]
    pool.free(b)  # merges a, b and c into one region
    assert pool.free_regions() == [(0, 3 * ALIGN), (4 * ALIGN, 4 * ALIGN)]
    pool.free(d)
    assert pool.free_regions() == [(0, 8 * ALIGN)]
    assert pool.in_use_bytes == 0 and pool.num_blocks == 0
    pool.validate()


def test_exhaustion_message_names_owner_and_numbers():
    pool = make_pool(4 * ALIGN)
    blocks = [pool.allocate(ALIGN, str(i)) for i in range(4)]
    pool.free(blocks[0])
    pool.free(blocks[2])  # 2 units free, but not contiguous
    with pytest.raises(SwapError) as info:
        pool.allocate(2 * ALIGN, "rank 0 stage 1 microbatch 2 tensor fc#0")
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        f"pinned host pool exhausted: rank 0 stage 1 microbatch 2 tensor fc#0 needs "
        f"{2 * ALIGN} bytes, largest free block {ALIGN}, in use {2 * ALIGN} of capacity "
        f"{4 * ALIGN}")


def test_counters_and_high_water():
    pool = make_pool()
    a = pool.allocate(3 * ALIGN, "a")
    b = pool.allocate(100, "b")
    assert (pool.in_use_bytes, pool.high_water_bytes, pool.num_blocks) == (4 * ALIGN, 4 * ALIGN, 2)
    pool.free(a)
    assert (pool.in_use_bytes, pool.high_water_bytes, pool.num_blocks) == (ALIGN, 4 * ALIGN, 1)
    assert pool.free_regions() == [(0, 3 * ALIGN), (4 * ALIGN, 4 * ALIGN)]
    assert pool.largest_free_bytes == 4 * ALIGN
    pool.free(b)
    assert pool.high_water_bytes == 4 * ALIGN
    assert pool.largest_free_bytes == pool.capacity_bytes


def test_double_free_and_foreign_block_raise():
    pool, other = make_pool(), make_pool()
    block = pool.allocate(10, "t")
    pool.free(block)
    assert block.state is BlockState.FREED
    with pytest.raises(SwapError, match="double free .* t"):
        pool.free(block)
    mine = pool.allocate(1, "v")
    with pytest.raises(SwapError, match="another pool"):
        other.free(mine)
    assert mine.state is BlockState.ALLOCATED


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.int64, torch.float16, torch.bfloat16, torch.float32,
                                   torch.float64, torch.complex64, torch.complex128])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5, 2)])
def test_view_aliases_pool_memory_for_every_dtype(dtype, shape):
    pool = make_pool()
    pool.allocate(3, "pad")  # the block under test does not start at offset 0
    numel = 1
    for d in shape:
        numel *= d
    block = pool.allocate(numel * dtype.itemsize, "t")
    view = block.view(dtype, shape)
    assert view.dtype == dtype and tuple(view.shape) == shape and view.is_contiguous()
    if numel:
        assert view.data_ptr() == pool.buffer.data_ptr() + block.offset_bytes
        source = torch.arange(numel).reshape(shape).to(dtype)
        view.copy_(source)
        start = block.offset_bytes
        raw = pool.buffer[start:start + numel * dtype.itemsize]
        assert torch.equal(raw, source.reshape(-1).view(torch.uint8))


def test_view_rejects_too_large_shape_and_use_after_free():
    pool = make_pool()
    block = pool.allocate(ALIGN, "t")
    block.view(torch.float32, (ALIGN // 4,))  # the rounded size is usable
    with pytest.raises(SwapError, match="needs"):
        block.view(torch.float32, (ALIGN // 4 + 1,))
    pool.free(block)
    with pytest.raises(SwapError, match="after free"):
        block.view(torch.uint8, (1,))


def test_bad_arguments_are_user_errors():
    with pytest.raises(UserError, match="power of two"):
        PinnedHostPool(1024, pin_memory=False, alignment_bytes=100)
    with pytest.raises(UserError, match="power of two"):
        PinnedHostPool(1024, pin_memory=False, alignment_bytes=8)
    with pytest.raises(UserError, match=">= 0"):
        PinnedHostPool(-1, pin_memory=False)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="needs CUDA"):
            PinnedHostPool(1024, pin_memory=True)
        assert not PinnedHostPool(1024).pinned


def test_validate_detects_corruption():
    pool = make_pool()
    pool.allocate(ALIGN, "a")
    pool._free.append((0, ALIGN))  # a free region overlapping an allocated block
    with pytest.raises(SwapError, match="overlaps|cover"):
        pool.validate()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5 * ALIGN), st.integers(0, 1000)),
                max_size=60))
def test_random_alloc_free_sequences_keep_the_pool_consistent(ops):
    pool = make_pool(16 * ALIGN)
    live = []  # (block, fill byte)
    for step, (do_alloc, nbytes, pick) in enumerate(ops):
        if do_alloc or not live:
            try:
                block = pool.allocate(nbytes, f"t{step}")
            except SwapError:
                assert pool.largest_free_bytes < max(nbytes, 1)
                continue
            fill = step % 251 + 1
            pool.buffer[block.offset_bytes:block.offset_bytes + block.size_bytes].fill_(fill)
            live.append((block, fill))
        else:
            block, _ = live.pop(pick % len(live))
            pool.free(block)
        pool.validate()
        assert pool.in_use_bytes == sum(b.size_bytes for b, _ in live)
        assert pool.num_blocks == len(live)
        # No block was overwritten by another one: each still holds its own fill byte.
        for block, fill in live:
            region = pool.buffer[block.offset_bytes:block.offset_bytes + block.size_bytes]
            assert bool((region == fill).all())
    for block, _ in live:
        pool.free(block)
    assert pool.free_regions() == [(0, pool.capacity_bytes)]


def test_concurrent_allocate_and_free():
    pool = make_pool(64 * ALIGN)
    errors = []

    def worker(tag: int) -> None:
        try:
            for i in range(300):
                blocks = [pool.allocate((i % 3 + 1) * ALIGN, f"w{tag}") for _ in range(2)]
                views = [b.view(torch.uint8, (b.size_bytes,)) for b in blocks]
                for view in views:
                    view.fill_(tag)
                time.sleep(0)  # let other workers allocate and write meanwhile
                if not all(bool((view == tag).all()) for view in views):
                    errors.append(f"block of worker {tag} was overwritten")
                for block in blocks:
                    pool.free(block)
        except SwapError as exc:  # 8 workers x 2 x 3 units never exceed 64 units
            errors.append(str(exc))

    threads = [threading.Thread(target=worker, args=(t + 1,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    pool.validate()
    assert pool.in_use_bytes == 0 and pool.free_regions() == [(0, 64 * ALIGN)]
    assert 2 * ALIGN <= pool.high_water_bytes <= 8 * 2 * 3 * ALIGN


def test_repr_mentions_usage():
    pool = make_pool()
    pool.allocate(1, "x")
    assert re.search(r"in_use=512", repr(pool))


@pytest.mark.cuda
def test_pool_is_pinned_when_cuda_is_available():
    pool = PinnedHostPool(1 << 20)
    assert pool.pinned and pool.buffer.is_pinned()
    block = pool.allocate(4096, "t")
    assert block.view(torch.bfloat16, (2048,)).is_pinned()
    assert not PinnedHostPool(1 << 20, pin_memory=False).buffer.is_pinned()


@pytest.mark.parametrize("capacity", [ALIGN, 3 * ALIGN + 1, 10 * 4096 + 7])
def test_exactly_the_capacity_is_page_locked_in_place(capacity):
    cudart = FakeCudart()
    pool = PinnedHostPool(capacity, pin_memory=True, alignment_bytes=ALIGN, cudart=cudart)
    expected = -(-capacity // ALIGN) * ALIGN  # the capacity rounded up to the alignment, nothing more
    assert pool.capacity_bytes == pool.pinned_bytes == expected
    assert cudart.registered == {pool.buffer.data_ptr(): expected}  # the pool's own buffer, whole pages first
    assert pool.buffer.data_ptr() % 4096 == 0
    pool.close()
    pool.close()  # idempotent
    assert cudart.calls == [f"register {expected} flags 1", "unregister"]  # portable: pinned for every context
    assert pool.pinned_bytes == 0


def test_a_failed_pinning_is_one_clear_error():
    with pytest.raises(UserError, match=f"pinned host pool: pinning {4 * ALIGN} bytes of host memory failed: "
                                        "out of memory"):
        PinnedHostPool(4 * ALIGN, pin_memory=True, alignment_bytes=ALIGN, cudart=FakeCudart(fail=True))


def test_an_unpinned_pool_registers_nothing():
    pool = make_pool()
    assert pool.pinned_bytes == 0
    pool.close()


def test_a_pool_dropped_without_close_is_unpinned():
    """A registered range left behind when its pool is collected would make a later
    cudaHostRegister of the same range (glibc hands it out again) fail."""
    cudart = FakeCudart()
    pool = PinnedHostPool(4 * ALIGN, pin_memory=True, alignment_bytes=ALIGN, cudart=cudart)
    ptr = pool.buffer.data_ptr()
    assert cudart.registered == {ptr: 4 * ALIGN}
    del pool
    gc.collect()
    assert cudart.registered == {}
    assert cudart.calls[-1] == "unregister"


def test_a_closed_pool_is_not_unpinned_again_when_collected():
    cudart = FakeCudart()
    pool = PinnedHostPool(4 * ALIGN, pin_memory=True, alignment_bytes=ALIGN, cudart=cudart)
    pool.close()
    del pool
    gc.collect()
    assert cudart.calls == [f"register {4 * ALIGN} flags 1", "unregister"]
