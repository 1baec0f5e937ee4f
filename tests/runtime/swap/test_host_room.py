"""Room in the pinned host pool for a swap-out issued while a swap-in's copy still runs.

On a GPU `fetch` returns once the swap-in's copies are enqueued, and the engine frees
their pool blocks only when they complete; the plan has those blocks back by then (an
optimizer chunk's at the end of its step, which its OO follows at once; a microbatch's at
the end of its backward). A swap-out reserved in between waits for those frees
(`HostStore.await_room`) instead of finding the pool short. The copies here complete
when the test says (`HeldCopy`), as a slow DMA would."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
import torch

from mpress.errors import SwapError
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import Category, MemoryManager
from mpress.runtime.swap.engine import SwapEngine
from tests.support import keys
from tests.support.cuda_fakes import HeldInStore
from tests.support.tensors import CPU

key = partial(keys.key, rank=0, stage=0)
CHUNK = 64 << 10
"""Bytes of one swapped group (an optimizer chunk's states, say)."""






def chunk() -> list[tuple[str, torch.Tensor]]:
    return [("exp_avg", torch.randn(CHUNK // 8)), ("exp_avg_sq", torch.randn(CHUNK // 8))]


def test_a_swap_out_after_a_fetch_waits_for_the_swap_ins_blocks():
    """A chunk comes home (its copy still running), its step runs, and it goes out again
    into a pool with room for one chunk and a half: the new reservation waits until the
    swap-in's copy completed and its blocks came back (before: the pool was exhausted,
    a SwapError, though the plan's figure holds what the program holds)."""
    store = HeldInStore(PinnedHostPool(CHUNK * 3 // 2))
    manager = MemoryManager(CPU, rank=0)
    manager.track(key("optim:l0:states#0"), CHUNK, Category.OPTIMIZER)  # as the offloader's keys are
    with SwapEngine(store, manager, CPU, rank=0, stage=0, timeout_s=10) as engine:
        handle = engine.swap_out_group(key("optim:l0:states#0"), chunk())
        engine.wait_idle()
        engine.prefetch(handle)  # OI
        states = engine.fetch_group(handle)  # the step: its copy still runs
        timer = threading.Timer(0.3, store.go.set)  # the DMA ends a little later
        timer.start()
        start = time.monotonic()
        back = engine.swap_out_group(key("optim:l0:states#0"), [("exp_avg", states[0]), ("exp_avg_sq", states[1])])
        assert store.go.is_set() and time.monotonic() - start >= 0.25  # it waited for the copy
        engine.wait_idle()
        engine.prefetch(back)
        store.go.set()
        assert all(torch.equal(a, b) for a, b in zip(engine.fetch_group(back), states))
        timer.join()


def test_a_pool_short_with_nothing_to_wait_for_fails_at_once():
    """Room held by swaps nobody is bringing back is never freed by waiting: the
    reservation fails at once with the pool's numbers, not after the engine's timeout."""
    store = HeldInStore(PinnedHostPool(CHUNK * 3 // 2))
    with SwapEngine(store, MemoryManager(CPU, rank=0), CPU, rank=0, stage=0, timeout_s=10) as engine:
        held = engine.swap_out_group(key("optim:l0:states#0"), chunk())
        start = time.monotonic()
        with pytest.raises(SwapError, match="pinned host pool exhausted"):
            engine.swap_out_group(key("optim:l1:states#0"), chunk())
        assert time.monotonic() - start < 1
        del held
