"""The release point (`SwapEngine.wait_outs`) on the engine's CUDA path, with CUDA's
streams and events faked (`tests/support/cuda_fakes.py`): which stream is ordered after
the copy-outs, when the sources go, and when the memory manager hears that the bytes
left the device. The copies' completion is the test's to decide (a gated event), as a
slow DMA would delay it on a GPU."""

from __future__ import annotations

import threading
import weakref
from functools import partial

import torch

from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import MemoryManager, Residency
from mpress.runtime.swap.engine import SwapEngine
from mpress.runtime.swap.store import Copy, HostStore
from tests.support import keys
from tests.support.cuda_fakes import FakeEvent, FakeStream
from tests.support.tensors import CPU

key = partial(keys.key, rank=0, stage=0)


class GatedEvent(FakeEvent):
    """A copy's CUDA event whose `synchronize` returns when the test opens `gate` (the
    copy is still running on its stream until then)."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def synchronize(self) -> None:
        if not self.gate.wait(10):
            raise TimeoutError("the test never let the copy finish")


class EventOutStore(HostStore):
    """The host store whose out copies report a CUDA event (`GatedEvent`) instead of
    having finished: what the engine sees on a GPU while a copy-out runs."""

    def __init__(self, pool: PinnedHostPool, gate: threading.Event) -> None:
        super().__init__(pool, CPU)
        self.gate = gate
        self.events: list[GatedEvent] = []

    def copy_out(self, placement, batch, ready):
        super().copy_out(placement, batch, ready)  # the bytes move at once on CPU
        self.events.append(GatedEvent(self.gate))
        return [Copy(done=self.events[-1], start=FakeEvent(), wall_s=0.0)]


class Streams:
    """torch.cuda.current_stream, faked: `current` is what it returns now."""

    def __init__(self, monkeypatch, current: FakeStream) -> None:
        self.current = current
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)


def cuda_engine(store: HostStore, manager: MemoryManager) -> SwapEngine:
    """An engine over `store` taking its CUDA path (events, streams) on this machine."""
    engine = SwapEngine(store, manager, CPU, rank=0, stage=0, hold_until_release=True, timeout_s=2)
    engine._cuda = True  # the fakes stand in for CUDA's streams and events
    return engine


def test_a_release_point_orders_the_sources_stream_after_the_copies_without_waiting(monkeypatch):
    """At a release point the host does not wait for the copy-outs to finish (draining
    the GPU's queue): the stream the sources were made on waits on each copy's event,
    and the sources are let go only after that. That is the stream current at
    `swap_out`, not the one current at the release (before: the latter, whose ordering
    does not cover blocks the allocator hands back to the former)."""
    gate = threading.Event()
    store = EventOutStore(PinnedHostPool(1 << 20), gate)
    source: list[weakref.ref] = []
    made_on = FakeStream(on_wait=lambda: source[0]() is not None)
    streams = Streams(monkeypatch, made_on)
    with cuda_engine(store, MemoryManager(CPU, rank=0)) as engine:
        x = torch.randn(256)
        expected = x.clone()
        source.append(weakref.ref(x))
        handle = engine.swap_out(key("x#0"), x)
        del x
        streams.current = other = FakeStream()
        engine.wait_outs()  # blocked until the copy completed before issue 29 (here: never, so a timeout)
        assert not gate.is_set() and not handle._record.out_done.is_set()  # the copy still runs
        assert made_on.waited == store.events and made_on.seen == [True]  # waited on, the source held then
        assert other.waited == []
        assert source[0]() is None  # and let go after
        gate.set()
        engine.wait_idle()
        assert torch.equal(engine.fetch(handle), expected)


def test_the_manager_hears_the_bytes_left_when_the_allocator_gets_them_back(monkeypatch):
    """The release point gives the sources back to the allocator before the copy has
    finished on the GPU; the manager must not count them on the device after that (its
    check against the allocator would fail on a correct run), and the completer must not
    count the move a second time (before: the manager kept them on the device until the
    completer saw the copy finish)."""
    gate = threading.Event()
    store = EventOutStore(PinnedHostPool(1 << 20), gate)
    Streams(monkeypatch, FakeStream())
    manager = MemoryManager(CPU, rank=0)
    with cuda_engine(store, manager) as engine:
        x = torch.randn(256)
        handle = engine.swap_out(key("x#0"), x)
        del x
        assert manager.device_bytes() == 1024
        engine.wait_outs()
        assert not handle._record.out_done.is_set()  # the copy still runs
        assert manager.residency(key("x#0")) is Residency.HOST and manager.device_bytes() == 0
        gate.set()
        engine.wait_idle()
        assert manager.residency(key("x#0")) is Residency.HOST
        assert manager.bytes_moved_out == 1024  # once
        engine.fetch(handle)
        assert manager.residency(key("x#0")) is Residency.DEVICE and manager.device_bytes() == 1024


def test_a_copy_finishing_before_the_release_tells_the_manager_once(monkeypatch):
    """The other order: the completer sees the copy finish first and moves the key; the
    release point then leaves it alone (one move, the key still on the host)."""
    gate = threading.Event()
    gate.set()
    store = EventOutStore(PinnedHostPool(1 << 20), gate)
    Streams(monkeypatch, FakeStream())
    manager = MemoryManager(CPU, rank=0)
    with cuda_engine(store, manager) as engine:
        handle = engine.swap_out(key("x#0"), torch.randn(256))
        assert handle._record.out_done.wait(5)
        assert manager.residency(key("x#0")) is Residency.HOST
        engine.wait_outs()
        assert manager.residency(key("x#0")) is Residency.HOST and manager.bytes_moved_out == 1024
