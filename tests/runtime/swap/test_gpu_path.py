"""The swap path's GPU-facing decisions (issue 12, items 7-12): where device memory is
allocated and gathered, how copies are waited for, batching, layouts, tensors on other
devices, lazy conjugate views. CPU tests show what can be shown on CPU (the engine's
threads, the records' contents at each point); the `cuda` tests show the rest.
"""

from __future__ import annotations

import contextlib
import threading
import time
from functools import partial

import pytest
import torch
from torch import nn

from mpress.contract.actions import Action, Kind, UnitId, UnitKind, parse_actions
from mpress.errors import SwapError
from mpress.contract.plan import TensorRule
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import MemoryManager
from mpress.runtime.swap.engine import SwapEngine
from tests.support import keys
from tests.support.cuda_fakes import HeldInStore
from tests.support.router import make_router
from tests.support.tensors import CPU, random_tensor, same_bits, wait_until

key = partial(keys.key, rank=0, stage=0)
CUDA_SLEEP_CYCLES = 2_000_000_000  # about a second of busy stream






def engine_over(store, **kw) -> SwapEngine:
    return SwapEngine(store, MemoryManager(CPU, rank=0), CPU, rank=0, stage=0, **kw)


def test_a_swap_in_is_issued_while_the_one_before_is_still_copying():
    """Item 9: the in worker issues every queued swap-in before it waits on any copy
    (before: it waited for each copy before issuing the next, serializing them)."""
    store = HeldInStore(PinnedHostPool(1 << 20))
    with engine_over(store) as engine:
        tensors = [torch.randn(64) for _ in range(3)]
        handles = [engine.swap_out(key(f"t#{i}"), t) for i, t in enumerate(tensors)]
        engine.wait_idle()
        for handle in handles:
            engine.prefetch(handle)
        wait_until(lambda: store.issued == 3)  # before: the second waited for the first's copy
        backs = [engine.fetch(h) for h in handles]  # usable once enqueued, as on CUDA
        store.go.set()
        engine.wait_idle()
        assert all(torch.equal(b, t) for b, t in zip(backs, tensors))


def blocked_out_worker() -> tuple[threading.Event, threading.Event, callable]:
    """A fault hook holding the out worker before its copy until `go` is set."""
    entered, go = threading.Event(), threading.Event()

    def fault(_key, direction):
        if direction == "out":
            entered.set()
            go.wait(10)
    return entered, go, fault


@pytest.mark.parametrize("make", [lambda b: b[:, ::2], lambda b: b[:, 3:4].expand(6, 9)], ids=["step", "expand"])
def test_a_view_with_gaps_is_gathered_by_the_caller_before_the_worker_copies(make):
    """Item 7: what the store copies is dense and was made by `swap_out` on the calling
    thread (on CUDA: the compute stream, before the ready event), so no copy stream
    allocates device memory the caching allocator would then keep for that stream only
    (before: the store's copy gathered the view on its own stream)."""
    entered, go, fault = blocked_out_worker()
    with engine_over(PinnedHostPool(1 << 20), fault=fault) as engine:
        base = torch.randn(6, 8)
        view = make(base)
        handle = engine.swap_out(key("v#0"), view)
        assert entered.wait(5)  # the worker has the record, its copy not issued yet
        (src,) = handle._record.src
        assert src.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()  # gathered already
        assert src.stride() == view.clone().stride()  # dense, in the view's dimension order
        go.set()
        assert torch.equal(engine.fetch(handle), view)


def test_swap_in_targets_are_allocated_by_prefetch_in_the_tensors_layouts():
    """Items 7 and 10: `prefetch` allocates the tensors a swap-in fills, on its calling
    thread, with the strides they left with (a transposed operand and a channels-last
    activation come back as they were)."""
    entered, go = threading.Event(), threading.Event()

    def fault(_key, direction):
        if direction == "in":
            entered.set()
            go.wait(10)

    with engine_over(PinnedHostPool(1 << 20), fault=fault) as engine:
        tensors = [torch.randn(8, 16).t(), torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
                   torch.randn(7)]
        handle = engine.swap_out_group(key("u#0"), [(f"t{i}", t) for i, t in enumerate(tensors)])
        engine.wait_outs()
        engine.prefetch(handle)
        assert entered.wait(5)
        assert [t.stride() for t in handle._record.dst] == [t.stride() for t in tensors]
        go.set()
        backs = engine.fetch_group(handle)
        assert [b.stride() for b in backs] == [t.stride() for t in tensors]
        assert all(same_bits(b, t) for b, t in zip(backs, tensors))


def test_a_lazy_conjugate_is_resolved_by_the_caller_before_the_copy():
    """Item 12: a lazy conjugate (or negative) view has the unconjugated values in its
    storage; `swap_out` resolves it on the calling thread (CUDA: the compute stream,
    ordered before the ready event), so the copy never reads a view whose resolution
    is left to the host while the DMA runs."""
    entered, go, fault = blocked_out_worker()
    with engine_over(PinnedHostPool(1 << 20), fault=fault) as engine:
        z = torch.randn(5, dtype=torch.complex64)
        views = [z.conj(), torch.randn(5, dtype=torch.complex64).conj().imag]  # conj, and a neg view
        expected = [v.clone().resolve_conj().resolve_neg() for v in views]
        handle = engine.swap_out_group(key("z#0"), [("conj", views[0]), ("neg", views[1])])
        assert entered.wait(5)
        assert views[0].is_conj() and views[1].is_neg()
        assert not any(s.is_conj() or s.is_neg() for s in handle._record.src)
        go.set()
        assert all(torch.equal(b, e) for b, e in zip(engine.fetch_group(handle), expected))


class ConjugatesAStorage(nn.Module):
    """Saves z (by sin) and z.conj() (by cos): one storage, two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x * self.w
        return (z.sin() + z.conj().cos()).real


class WritesASavedTensor(nn.Module):
    """Saves y (exp saves its output), then writes it in place: a program torch rejects
    at backward, unless saved-tensor hooks took y (its check is off then)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x * self.w).exp()
        out = y * 2
        y.add_(1)
        return out


def routed_step(model: nn.Module, x: torch.Tensor, engine: SwapEngine | None = None) -> None:
    """Forward and backward of `model` with every saved tensor host-swapped by the router
    (through `engine`, or a CPU one)."""
    unit = str(UnitId(0, UnitKind.ACTIVATIONS, layer="", rule=0))
    with contextlib.nullcontext(engine) if engine is not None else engine_over(PinnedHostPool(1 << 20)) as engine:
        router, program = make_router(model, [TensorRule(tensor="**", technique="host")],
                                      parse_actions(f"0F0 0SO0:{unit} 0SI0:{unit} 0B0"), x, engine=engine, end=1)
        try:
            program.begin(Action(0, Kind.F, 0))
            with router.microbatch(0):
                out = model(x)
            program.end()
            program.begin(Action(0, Kind.B, 0))
            out.sum().backward()
            router.finish(0)
            program.end()
        finally:
            router.close()


def test_a_conjugate_view_of_a_swapped_storage_is_not_taken_for_the_storage():
    """Item 12, the router's half: `z` and `z.conj()` share a storage but not their values;
    the second save must not be served the first one's swapped tensor (before: the view
    identity left the conjugate bit out, and cos's backward got sin's input)."""
    torch.manual_seed(0)
    model, reference = ConjugatesAStorage(), ConjugatesAStorage()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 8, dtype=torch.complex64)
    reference(x).sum().backward()
    routed_step(model, x)
    assert torch.equal(model.w.grad, reference.w.grad)


def test_a_saved_tensor_written_in_place_stops_the_step_with_its_name():
    """Torch does not check saved tensors' versions when saved-tensor hooks took them, so
    the router does: the swap would otherwise carry the new values into the backward."""
    x = torch.randn(4, 8)
    with pytest.raises(SwapError, match=r"saved tensor #\d was modified by an inplace operation"):
        routed_step(WritesASavedTensor(), x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        WritesASavedTensor()(x).sum().backward()  # what torch says without mpress


# ---- CUDA ------------------------------------------------------------------------------------

@pytest.fixture
def cuda_engine():
    device = torch.device("cuda")
    pool = PinnedHostPool(64 << 20)
    engine = SwapEngine(pool, MemoryManager(device, rank=0), device, rank=0, stage=0, hold_until_release=True)
    yield engine, device
    engine.close(timeout_s=5)
    pool.close()


@pytest.mark.cuda
def test_cuda_workers_sleep_while_their_copies_run(cuda_engine):
    """Item 8: a worker waiting for a copy sleeps (blocking-sync event) instead of
    spinning a core: over a second in which a swap-out waits behind a busy stream, the
    process uses well under a second of CPU."""
    engine, device = cuda_engine
    x = torch.randn(1 << 20, device=device)
    torch.cuda._sleep(CUDA_SLEEP_CYCLES)
    y = x * 2  # after the sleep: the copy waits for it
    cpu, wall = time.process_time(), time.perf_counter()
    handle = engine.swap_out(key("y#0"), y)
    engine.wait_outs()  # orders the compute stream after the copy: no host wait
    engine.wait_idle()  # the completer waits for it
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert wall > 0.2 and cpu < 0.5 * wall, (cpu, wall)
    assert torch.equal(engine.fetch(handle), x * 2)


@pytest.mark.cuda
def test_cuda_swaps_leave_no_memory_cached_for_side_streams(cuda_engine):
    """Item 7: under a tight memory fraction, swapping a step's worth of activations out
    and back makes the caching allocator neither retry (a device-wide sync and free)
    nor reserve much beyond what it allocated: nothing is allocated on a copy stream."""
    engine, device = cuda_engine
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_allocated(device) + (256 << 20)) / total),
                                               device)
    try:
        for step in range(4):
            tensors = [torch.randn(1 << 20, device=device)[::2] for _ in range(16)]  # views: gathered
            handle = engine.swap_out_group(key(f"s{step}#0"), [(f"t{i}", t) for i, t in enumerate(tensors)])
            expected = [t.clone() for t in tensors]
            del tensors
            engine.wait_outs()
            backs = engine.fetch_group(handle)
            assert all(torch.equal(b, e) for b, e in zip(backs, expected))
            del backs, expected, handle
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats(device)
        assert stats["num_alloc_retries"] == 0
        assert torch.cuda.max_memory_reserved(device) <= 1.1 * torch.cuda.max_memory_allocated(device) + (2 << 20)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


@pytest.mark.cuda
def test_cuda_a_lazy_conjugate_survives_the_async_host_path(cuda_engine):
    """Item 12 on a GPU: the conjugation is resolved before the non-blocking D2H copy."""
    engine, device = cuda_engine
    z = random_tensor(torch.complex64, (1 << 16,), device=device)
    view = z.conj()
    expected = view.resolve_conj().clone()
    torch.cuda._sleep(CUDA_SLEEP_CYCLES // 4)
    back = engine.fetch(engine.swap_out(key("z#0"), view))
    assert torch.equal(back, expected)


class ScalesByACpuScalar(nn.Module):
    """Saves a CPU scalar, as `x * torch.tensor(0.5)` in a user's forward does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).sin() * torch.tensor(0.5)


@pytest.mark.cuda
def test_cuda_a_cpu_tensor_saved_under_a_host_rule_is_left_alone():
    """Item 11: a saved tensor not on the stage's device is not the device's memory: the
    router keeps it (before: the engine refused it and the step crashed)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = ScalesByACpuScalar().to(device)
    reference = ScalesByACpuScalar().to(device)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 16, device=device)
    reference(x).sum().backward()
    pool = PinnedHostPool(1 << 20)
    engine = SwapEngine(pool, MemoryManager(device, rank=0), device, rank=0, stage=0)
    try:
        routed_step(model, x, engine)
        assert torch.equal(model.fc.weight.grad, reference.fc.weight.grad)
    finally:
        engine.close(timeout_s=5)
        pool.close()


@pytest.mark.cuda
def test_cuda_the_profile_counts_no_device_bytes_for_a_cpu_tensor_a_layer_saves():
    """Item 11, the plan-time half: profiled on the GPU, the CPU scalar is named (so names
    agree with the router's) but holds no device bytes, so no plan moves it."""
    from mpress.static.profile.measured import measure_profile

    profile = measure_profile(ScalesByACpuScalar(), torch.randn(4, 16), model_name="scales", fingerprint="t",
                              microbatch_size=4, device="cuda", warmup=0, iters=1)
    saved = [t for layer in profile.layers for t in layer.saved]
    on_cpu = [t for t in saved if "not device memory" in t.what]
    assert len(on_cpu) == 1 and on_cpu[0].bytes == 0 and on_cpu[0].shape == []
