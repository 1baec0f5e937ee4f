"""SwapEngine: bit-identical round trips, residency, concurrency, errors, timeouts, close.

CPU tests drive the same worker code as CUDA with synchronous copies; the
`@pytest.mark.cuda` tests check the stream/event behaviour that only a GPU has.
"""

import gc
import random
import threading
import time
from functools import partial

import pytest
import torch
from torch import nn

from mpress.errors import SwapError
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.contract.identity import TensorKey
from mpress.runtime.memory.manager import Category, MemoryManager, Residency
from mpress.runtime.swap.engine import SwapEngine, SwapState
from mpress.runtime.swap.store import issue_copies
from tests.support import keys
from tests.support.tensors import CPU, DTYPES, random_tensor, same_bits, wait_until

ALIGN = 64
key = partial(keys.key, rank=2, stage=1)
"""The engines below run as rank 2 stage 1, whose keys their messages name."""


@pytest.fixture
def make_engine():
    engines = []

    def make(capacity_bytes: int = 1 << 20, timeout_s: float = 10.0, fault=None,
             device=CPU, pin_memory=False):
        pool = PinnedHostPool(capacity_bytes, pin_memory=pin_memory, alignment_bytes=ALIGN)
        manager = MemoryManager(device, rank=2)
        engine = SwapEngine(pool, manager, device, rank=2, stage=1, timeout_s=timeout_s,
                            fault=fault)
        engines.append(engine)
        return engine, pool, manager

    yield make
    for engine in engines:
        engine.close(timeout_s=5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (13,), (3, 5, 2)])
def test_round_trip_is_bit_identical(make_engine, dtype, shape):
    engine, pool, manager = make_engine()
    tensor = random_tensor(dtype, shape)
    expected = tensor.clone()
    handle = engine.swap_out(key("t#0"), tensor)
    engine.wait_idle()
    assert handle.state is SwapState.OFF_DEVICE
    assert manager.residency(key("t#0")) is Residency.HOST
    assert manager.host_bytes() == tensor.numel() * dtype.itemsize
    back = engine.fetch(handle)
    assert same_bits(back, expected)
    assert manager.residency(key("t#0")) is Residency.DEVICE
    engine.wait_idle()
    assert pool.in_use_bytes == 0  # the block went back after the swap-in


@pytest.mark.parametrize("make_view", [
    lambda t: t[:, ::2], lambda t: t.t(), lambda t: t[2:5], lambda t: t[1],
    lambda t: t[:, 3:4].expand(6, 9), lambda t: t.narrow(1, 2, 4).transpose(0, 1)],
    ids=["step", "transpose", "slice", "offset", "expand", "narrow-t"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_views_copy_only_their_elements(make_engine, make_view, dtype):
    """A view moves only its elements and comes back in its layout: a dense one (its
    elements fill a block of memory in some dimension order) with its own strides, any
    other dense with its dimensions in the same memory order, as `clone` makes it."""
    engine, pool, _ = make_engine()
    base = torch.randn(6, 8).to(dtype)  # finite, so torch.equal applies as well as bits
    view = make_view(base)
    expected = view.clone()
    handle = engine.swap_out(key("v#0"), view)
    engine.wait_idle()
    nbytes = view.numel() * dtype.itemsize
    assert pool.in_use_bytes == -(-max(nbytes, 1) // ALIGN) * ALIGN  # not the whole storage
    back = engine.fetch(handle)
    assert back.stride() == expected.stride()  # clone's preserve_format: the view's own if dense
    assert same_bits(back, expected) and torch.equal(back, expected)


def test_copies_record_no_autograd_whatever_the_calling_threads_grad_mode():
    """A swap-out's sources are the saved tensors as autograd gave them (they may require
    grad): copying one into the pool must not put the pool's buffer into the graph, even
    from a thread with grad enabled (a bool view of such a buffer cannot even be made)."""
    pool = torch.zeros(64)
    src = torch.randn(8, requires_grad=True) * 2
    with torch.enable_grad():
        issue_copies([(pool[:8], src)], None)
    assert not pool.requires_grad and pool.grad_fn is None
    assert torch.equal(pool[:8], src.detach())


def test_many_swaps_in_flight(make_engine):
    engine, pool, manager = make_engine(capacity_bytes=8 << 20)
    rng = random.Random(0)
    tensors, handles = [], []
    for i in range(200):
        dtype = rng.choice(DTYPES)
        shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3)))
        tensors.append(random_tensor(dtype, shape).clone())
        handles.append(engine.swap_out(key(f"layer{i % 7}#{i}", i % 5), tensors[-1]))
    for handle in handles[::3]:
        engine.prefetch(handle)  # some brought back early, the rest on demand
    for tensor, handle in reversed(list(zip(tensors, handles))):
        assert same_bits(engine.fetch(handle), tensor)
    engine.wait_idle()
    stats = engine.stats
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert (stats.num_out, stats.num_in, stats.bytes_out, stats.bytes_in) == (200, 200, total, total)
    assert manager.bytes_moved_out == manager.bytes_moved_in == total
    del handles, handle
    gc.collect()
    engine.wait_idle()  # releases what the dropped handles held
    assert pool.in_use_bytes == 0 and manager.report()["num_tensors"] == 0
    pool.validate()


def test_prefetch_is_idempotent_and_fetch_returns_the_same_tensor(make_engine):
    engine, _, _ = make_engine()
    tensor = torch.randn(4, 4)
    handle = engine.swap_out(key("p#0"), tensor)
    engine.prefetch(handle)
    engine.prefetch(handle)
    engine.wait_idle()
    assert handle.state is SwapState.ON_DEVICE
    first = engine.fetch(handle)
    assert engine.fetch(handle) is first and torch.equal(first, tensor)
    assert engine.stats.num_in == 1


def test_fetch_without_prefetch(make_engine):
    engine, _, _ = make_engine()
    tensor = torch.arange(10.0)
    handle = engine.swap_out(key("f#0"), tensor)
    assert torch.equal(engine.fetch(handle), tensor)  # no wait_idle, no prefetch
    assert engine.stats.wait_s >= 0.0


def test_engine_keeps_the_tensor_only_until_its_copy_completed(make_engine):
    gate = threading.Event()
    engine, _, manager = make_engine(fault=lambda k, d: gate.wait(5))
    handle = engine.swap_out(key("g#0"), torch.ones(8))
    wait_until(lambda: handle.state is SwapState.OUT_COPYING)
    assert handle._record.src is not None  # still needed by the copy
    assert manager.residency(key("g#0")) is Residency.DEVICE
    gate.set()
    engine.wait_idle()
    assert handle._record.src is None  # the storage can go back to the allocator
    assert manager.residency(key("g#0")) is Residency.HOST


def test_saved_tensor_hooks_give_identical_gradients(make_engine):
    engine, _, _ = make_engine()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    counter = iter(range(1000))

    def pack(tensor):
        return engine.swap_out(key(f"saved#{next(counter)}"), tensor)

    with torch.autograd.graph.saved_tensors_hooks(pack, engine.fetch):
        loss = model(x).square().sum()
    loss.backward()
    assert engine.stats.num_out > 0
    for grad, want in zip((p.grad for p in model.parameters()), expected):
        assert torch.equal(grad, want)


def test_caller_tracked_keys_stay_with_the_caller(make_engine):
    engine, _, manager = make_engine()
    k = key("optim:w:exp_avg", None)
    tensor = torch.randn(16)
    manager.track(k, 64, Category.OPTIMIZER)
    handle = engine.swap_out(k, tensor, category=Category.ACTIVATION)
    engine.wait_idle()
    assert manager.report()["categories"]["optimizer"]["device_bytes"] == 0
    assert manager.host_bytes() == 64
    assert torch.equal(engine.fetch(handle), tensor)
    del handle
    gc.collect()
    engine.wait_idle()
    assert manager.residency(k) is Residency.DEVICE  # not forgotten by the engine
    manager.move(k, Residency.HOST)
    with pytest.raises(SwapError, match="has it on host"):
        engine.swap_out(k, tensor)


def test_same_tensor_cannot_be_swapped_twice_while_live(make_engine):
    engine, _, _ = make_engine()
    handle = engine.swap_out(key("d#0"), torch.ones(2))
    with pytest.raises(SwapError, match="still live"):
        engine.swap_out(key("d#0"), torch.ones(2))
    engine.discard(handle)
    engine.swap_out(key("d#0"), torch.ones(2))  # the next iteration's tensor


def test_bad_tensors_are_rejected(make_engine):
    engine, _, _ = make_engine()
    with pytest.raises(SwapError, match="tensor m#0: it is on meta"):
        engine.swap_out(key("m#0"), torch.empty(3, device="meta"))
    with pytest.raises(SwapError, match="not supported"):
        engine.swap_out(key("s#0"), torch.eye(3).to_sparse())


def test_dropped_and_discarded_handles_release_their_blocks(make_engine):
    engine, pool, manager = make_engine()
    dropped = engine.swap_out(key("a#0"), torch.ones(100))
    kept = engine.swap_out(key("b#0"), torch.ones(100))
    engine.wait_idle()
    assert pool.num_blocks == 2
    del dropped
    gc.collect()
    engine.wait_idle()
    assert pool.num_blocks == 1 and not manager.is_tracked(key("a#0"))
    engine.discard(kept)
    assert pool.num_blocks == 0 and not manager.is_tracked(key("b#0"))
    with pytest.raises(SwapError, match="b#0 was cancelled: it was discarded"):
        engine.fetch(kept)


def test_discard_during_a_copy_waits_for_the_copy(make_engine):
    gate = threading.Event()
    engine, pool, manager = make_engine(fault=lambda k, d: gate.wait(5))
    handle = engine.swap_out(key("c#0"), torch.ones(100))
    wait_until(lambda: handle.state is SwapState.OUT_COPYING)
    engine.discard(handle)
    assert pool.num_blocks == 1  # the worker is still writing into it
    assert not manager.is_tracked(key("c#0"))  # but the name is free at once
    newer = engine.swap_out(key("c#0"), torch.full((100,), 2.0))
    gate.set()
    engine.wait_idle()
    assert handle.state is SwapState.CANCELLED
    assert pool.num_blocks == 1 and manager.residency(key("c#0")) is Residency.HOST
    assert manager.host_bytes() == 400
    assert torch.equal(engine.fetch(newer), torch.full((100,), 2.0))
    engine.discard(newer)
    assert not manager.is_tracked(key("c#0"))
    engine.wait_idle()  # its in copy's completer frees the block once it saw the copy done
    assert pool.num_blocks == 0


def test_pool_exhaustion_names_the_tensor_and_is_not_sticky(make_engine):
    engine, _, manager = make_engine(capacity_bytes=1024)
    with pytest.raises(SwapError) as info:
        engine.swap_out(key("big#0", 1), torch.empty(512, dtype=torch.float32))
    assert str(info.value).startswith(
        "swap-out failed: rank 2 stage 1 microbatch 1 tensor big#0: pinned host pool exhausted: "
        "rank 2 stage 1 microbatch 1 tensor big#0 needs 2048 bytes")
    assert not manager.is_tracked(key("big#0", 1))
    small = torch.randn(8)
    assert torch.equal(engine.fetch(engine.swap_out(key("small#0"), small)), small)


def _fail_on(name: str, direction: str):
    def fault(k: TensorKey, d: str) -> None:
        if k.tensor == name and d == direction:
            raise RuntimeError("injected copy error")
    return fault


def test_fault_in_swap_out_reaches_the_training_thread(make_engine):
    engine, pool, _ = make_engine(timeout_s=5, fault=_fail_on("bad#0", "out"))
    good = engine.swap_out(key("good#0"), torch.ones(4))
    bad = engine.swap_out(key("bad#0", 3), torch.ones(4))
    start = time.monotonic()
    with pytest.raises(SwapError) as info:
        engine.fetch(bad)
    assert time.monotonic() - start < 5  # raised, not timed out
    assert str(info.value) == (
        "swap-out failed: rank 2 stage 1 microbatch 3 tensor bad#0: injected copy error")
    assert isinstance(info.value.__cause__, RuntimeError)
    # Sticky: the step is broken, every later call says why.
    for call in (engine.check, lambda: engine.fetch(good), lambda: engine.prefetch(good),
                 lambda: engine.swap_out(key("later#0"), torch.ones(1))):
        with pytest.raises(SwapError, match="swap-out failed: .*tensor bad#0"):
            call()
    engine.close(timeout_s=5)
    assert pool.num_blocks == 0


def test_fault_surfaces_at_check_without_a_fetch(make_engine):
    engine, _, _ = make_engine(fault=_fail_on("bad#0", "out"))
    engine.swap_out(key("bad#0"), torch.ones(4))

    def raised() -> bool:
        try:
            engine.check()
        except SwapError as exc:
            return "swap-out failed: rank 2 stage 1 microbatch 0 tensor bad#0" in str(exc)
        return False

    wait_until(raised)
    with pytest.raises(SwapError, match="bad#0"):
        engine.wait_idle()


def test_fault_in_swap_in_reaches_the_training_thread(make_engine):
    engine, _, _ = make_engine(timeout_s=5, fault=_fail_on("x#0", "in"))
    handle = engine.swap_out(key("x#0", 2), torch.ones(4))
    with pytest.raises(SwapError, match=r"^swap-in failed: rank 2 stage 1 microbatch 2 tensor "
                                        r"x#0: injected copy error$"):
        engine.fetch(handle)
    assert handle.state is SwapState.FAILED


def test_fetch_times_out_instead_of_hanging(make_engine):
    gate = threading.Event()

    def stuck(k: TensorKey, direction: str) -> None:
        if direction == "in":
            gate.wait(10)

    engine, _, _ = make_engine(timeout_s=0.2, fault=stuck)
    handle = engine.swap_out(key("slow#0", 4), torch.ones(4))
    start = time.monotonic()
    with pytest.raises(SwapError, match=r"timed out after 0.2 s waiting for swap-in of rank 2 "
                                        r"stage 1 microbatch 4 tensor slow#0 \(state in-copying\)"):
        engine.fetch(handle)
    assert time.monotonic() - start < 5
    gate.set()
    engine.close(timeout_s=5)


def test_close_with_pending_work_drops_it_cleanly(make_engine):
    gate = threading.Event()
    engine, pool, manager = make_engine(fault=lambda k, d: gate.wait(5))
    handles = [engine.swap_out(key(f"q#{i}"), torch.full((32,), float(i))) for i in range(20)]
    for handle in handles[:5]:
        engine.prefetch(handle)
    wait_until(lambda: handles[0].state is SwapState.OUT_COPYING)
    closer = threading.Thread(target=engine.close, kwargs={"timeout_s": 5})
    closer.start()

    def closing() -> bool:
        try:
            engine.check()
        except SwapError:
            return True
        return False

    wait_until(closing)
    gate.set()  # the copy in progress finishes; everything queued is dropped
    closer.join(10)
    assert not closer.is_alive()
    assert not any(thread.is_alive() for thread in engine._threads)
    assert engine.stats.num_out == 1 and engine.stats.num_in == 0
    assert all(h.state is SwapState.CANCELLED for h in handles)
    assert pool.num_blocks == 0 and manager.report()["num_tensors"] == 0
    with pytest.raises(SwapError, match="closed"):
        engine.fetch(handles[3])
    with pytest.raises(SwapError, match="closed"):
        engine.swap_out(key("late#0"), torch.ones(1))
    engine.close()  # idempotent


def test_context_manager_closes(make_engine):
    engine, _, _ = make_engine()
    with engine:
        engine.swap_out(key("w#0"), torch.ones(3))
    with pytest.raises(SwapError, match="closed"):
        engine.check()


# ---- CUDA ----------------------------------------------------------------------------

CUDA_SLEEP_CYCLES = 2_000_000_000  # about a second of busy compute stream


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_round_trip_with_views(make_engine, dtype):
    device = torch.device("cuda")
    engine, pool, _ = make_engine(device=device, pin_memory=None)
    assert pool.pinned
    base = random_tensor(dtype, (64, 48), device=device)
    for i, tensor in enumerate((base, base[:, ::3], base.t()[5:], base[7])):
        expected = tensor.clone()
        back = engine.fetch(engine.swap_out(key(f"c#{i}"), tensor))
        assert back.device.type == "cuda" and same_bits(back, expected)


@pytest.mark.cuda
def test_cuda_swap_out_does_not_block_the_compute_stream(make_engine):
    device = torch.device("cuda")
    engine, _, _ = make_engine(device=device, pin_memory=None)
    x = torch.randn(1 << 20, device=device)
    torch.cuda._sleep(CUDA_SLEEP_CYCLES)
    y = x * 2  # produced after the sleep: the copy must wait for it
    handle = engine.swap_out(key("y#0"), y)
    assert not torch.cuda.current_stream().query()  # no host sync on the training thread
    assert engine.store._out_stream != torch.cuda.current_stream()
    expected = x * 2
    assert torch.equal(engine.fetch(handle), expected)


@pytest.mark.cuda
def test_cuda_fetch_orders_by_event_not_by_host_sync(make_engine):
    device = torch.device("cuda")
    engine, _, _ = make_engine(device=device, pin_memory=None, capacity_bytes=1 << 30)
    x = random_tensor(torch.float32, (1 << 26,), device=device)  # 256 MiB
    expected = x.clone()
    handle = engine.swap_out(key("x#0"), x)
    del x
    engine.wait_idle()
    torch.cuda._sleep(CUDA_SLEEP_CYCLES)
    back = engine.fetch(handle)
    assert not torch.cuda.current_stream().query()  # fetch did not wait for the compute stream
    copy = back.clone()  # queued on the compute stream behind the in copy's event
    torch.cuda.synchronize()
    assert same_bits(copy, expected)


@pytest.mark.cuda
def test_cuda_memory_is_released_after_swap_out(make_engine):
    device = torch.device("cuda")
    torch.cuda.synchronize()
    engine, _, manager = make_engine(device=device, pin_memory=None, capacity_bytes=128 << 20)
    size = 64 << 20
    tensor = torch.full((size,), 7, dtype=torch.uint8, device=device)
    before = torch.cuda.memory_allocated(device)
    manager.check_cuda_consistency(tolerance_bytes=0)
    handle = engine.swap_out(key("big#0"), tensor)
    del tensor
    engine.wait_idle()
    assert torch.cuda.memory_allocated(device) <= before - size
    assert manager.device_bytes() == 0
    back = engine.fetch(handle)
    assert torch.cuda.memory_allocated(device) >= before
    manager.check_cuda_consistency(tolerance_bytes=0)
    assert bool((back == 7).all())
