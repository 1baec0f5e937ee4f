"""mpress.d2d.runtime.peer_store: PeerStore behind a SwapEngine on CPU, over pools from
`make_pools` (conftest): bit-identical round trips, stripes by weight, stripe-table
states, quota exhaustion and dead peers."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mpress.d2d.runtime.peer_pool import PeerPools
from mpress.d2d.runtime.peer_store import PeerStore
from mpress.d2d.runtime.stripe_table import StripeState
from mpress.errors import SwapError
from mpress.contract.identity import TensorKey
from mpress.contract.plan import Plan
from mpress.runtime.memory.manager import MemoryManager, Residency
from mpress.runtime.swap.engine import SwapEngine, SwapState
from tests.support.keys import key
from tests.support.peers import KiB, MiB, Quotas, find, kill_rank
from tests.support.plans import three_stage_d2d_plan
from tests.support.tensors import CPU, DTYPES, random_tensor, same_bits, wait_until


@pytest.fixture
def make_d2d(make_pools):
    """(engine, store, pools, manager) for stage 0 of `plan` (default: 3:1 over devices 1, 2)."""
    engines: list[SwapEngine] = []

    def make(plan: Plan | None = None, *, min_stripe_bytes: int = 64 * KiB, check_interval_s: float = 0.0,
             fault=None) -> tuple[SwapEngine, PeerStore, PeerPools, MemoryManager]:
        plan = plan or three_stage_d2d_plan()
        pools = make_pools(plan)
        weights = tuple((s.device, s.fraction) for s in plan.stages[0].rules[0].stripes)
        store = PeerStore(pools, 0, CPU, weights, min_stripe_bytes=min_stripe_bytes,
                          check_interval_s=check_interval_s)
        manager = MemoryManager(CPU, rank=0)
        engine = SwapEngine(store, manager, CPU, rank=0, stage=0, timeout_s=10, fault=fault)
        engines.append(engine)
        return engine, store, pools, manager

    yield make
    for engine in engines:
        engine.close(timeout_s=5)


def test_round_trips_are_bit_identical(make_d2d):
    engine, store, pools, manager = make_d2d(min_stripe_bytes=256)
    tensors = []
    for dtype in DTYPES:
        base = random_tensor(dtype, (24, 40))
        tensors.extend((random_tensor(dtype, ()), random_tensor(dtype, (0,)), random_tensor(dtype, (13,)),
                        base, base[:, ::3], base.t()[5:], base[7]))
    expected = [t.clone() for t in tensors]
    handles = [engine.swap_out(key(f"t#{i}"), t) for i, t in enumerate(tensors)]
    engine.wait_idle()
    assert all(h.state is SwapState.OFF_DEVICE for h in handles)
    assert manager.device_bytes() == 0
    assert manager.peer_bytes() == sum(t.numel() * t.element_size() for t in tensors)
    striped = [e for e in store.table.entries() if len(e.stripes) == 2]
    assert striped, "tensors of at least two minimum stripes are cut"
    for t in tensors:  # the swapped-out source is not touched
        t.zero_() if t.dtype != torch.bool else t.fill_(False)
    for handle, want in zip(reversed(handles), reversed(expected)):
        back = engine.fetch(handle)
        assert back.stride() == want.stride() and same_bits(back, want)  # clone's layout: the view's own if dense
    engine.wait_idle()
    assert store.table.entries() == [] and manager.peer_bytes() == 0
    assert all(u["in_use_bytes"] == 0 for u in pools.pool_usage().values())


def test_stripes_follow_the_weights_and_residency_follows_the_stripes(make_d2d):
    engine, store, pools, manager = make_d2d(min_stripe_bytes=MiB)
    tensor = random_tensor(torch.float32, (1 << 20,))  # 4 MiB: four minimum stripes, two peers
    expected = tensor.clone()
    nbytes = 4 * MiB
    handle = engine.swap_out(key("big#0"), tensor)
    entry = find(store, str(key("big#0")))
    assert [(s.peer, s.tensor_offset_bytes, s.nbytes) for s in entry.stripes] == [(1, 0, 3 * MiB), (2, 3 * MiB, MiB)]
    engine.wait_idle()
    entry = find(store, str(key("big#0")))
    assert entry.state is StripeState.ON_PEERS and entry.nbytes == nbytes
    assert manager.residency(key("big#0")) is Residency.PEER
    assert (manager.peer_bytes(1), manager.peer_bytes(2), manager.device_bytes()) == (3 * MiB, MiB, 0)
    usage = pools.pool_usage()
    assert (usage[1]["in_use_bytes"], usage[2]["in_use_bytes"]) == (3 * MiB, MiB)
    # each stripe's bytes are in its peer's pool, at the offset the table records
    flat = expected.view(torch.uint8)
    for stripe in entry.stripes:
        quota = pools.quota(0, stripe.peer)
        held = quota.buffer[stripe.block.offset_bytes:stripe.block.offset_bytes + stripe.nbytes]
        assert torch.equal(held, flat[stripe.tensor_offset_bytes:stripe.tensor_offset_bytes + stripe.nbytes])
    assert same_bits(engine.fetch(handle), expected)
    engine.wait_idle()
    assert manager.residency(key("big#0")) is Residency.DEVICE
    assert (manager.peer_bytes(), manager.device_bytes(), manager.bytes_moved_out, manager.bytes_moved_in) == (
        0, nbytes, nbytes, nbytes)
    assert store.table.entries() == []
    assert pools.pool_usage()[1]["in_use_bytes"] == pools.pool_usage()[2]["in_use_bytes"] == 0


def test_table_states_through_a_round_trip(make_d2d):
    gate = threading.Event()
    seen: list[tuple[str, StripeState]] = []
    holder: list[PeerStore] = []

    def fault(k: TensorKey, direction: str) -> None:
        seen.append((direction, find(holder[0], str(k)).state))
        gate.wait(5)

    engine, store, _, _ = make_d2d(fault=fault)
    holder.append(store)
    handle = engine.swap_out(key("s#0"), torch.ones(4096))
    assert find(store, str(key("s#0"))).state is StripeState.RESERVED
    gate.set()
    engine.wait_idle()
    assert find(store, str(key("s#0"))).state is StripeState.ON_PEERS
    engine.fetch(handle)
    engine.wait_idle()
    assert seen == [("out", StripeState.RESERVED), ("in", StripeState.ON_PEERS)]
    assert store.table.entries() == []


def test_small_tensors_go_whole_and_fill_the_peers_in_proportion(make_d2d):
    engine, store, pools, manager = make_d2d(min_stripe_bytes=MiB)
    size = 16 * KiB
    handles = [engine.swap_out(key(f"small#{i}"), torch.full((size // 4,), float(i))) for i in range(40)]
    engine.wait_idle()
    entries = store.table.entries()
    assert all(len(e.stripes) == 1 for e in entries)
    per_peer = {p: manager.peer_bytes(p) for p in (1, 2)}
    assert per_peer[1] + per_peer[2] == 40 * size
    assert abs(per_peer[1] - 0.75 * 40 * size) <= size and abs(per_peer[2] - 0.25 * 40 * size) <= size
    usage = pools.pool_usage()
    assert (usage[1]["in_use_bytes"], usage[2]["in_use_bytes"]) == (per_peer[1], per_peer[2])
    for i, handle in enumerate(handles):
        assert torch.equal(engine.fetch(handle), torch.full((size // 4,), float(i)))


def test_a_swap_may_name_other_weights(make_d2d):
    engine, store, _, manager = make_d2d(min_stripe_bytes=KiB)
    handle = engine.swap_out(key("w#0"), torch.ones(8 * KiB), weights=((2, 1.0),))
    engine.wait_idle()
    assert [s.peer for s in find(store, str(key("w#0"))).stripes] == [2]
    assert (manager.peer_bytes(1), manager.peer_bytes(2)) == (0, 32 * KiB)
    assert torch.equal(engine.fetch(handle), torch.ones(8 * KiB))


def test_quota_exhaustion_names_the_tensor_and_rolls_back(make_d2d):
    # device 2's quota is too small for the 1 MiB stripe; device 1's 3 MiB stripe was
    # already reserved and must be given back
    engine, store, pools, manager = make_d2d(three_stage_d2d_plan(pool1=4 * MiB, pool2=512 * KiB), min_stripe_bytes=MiB)
    with pytest.raises(SwapError) as info:
        engine.swap_out(key("big#0", 1), torch.empty(1 << 20))
    assert str(info.value).startswith(
        "swap-out failed: rank 0 stage 0 microbatch 1 tensor big#0: peer pool quota of stage 0 on device 2 "
        "exhausted: rank 0 stage 0 microbatch 1 tensor big#0 needs 1048576 bytes")
    assert not manager.is_tracked(key("big#0", 1))
    assert store.table.entries() == []
    assert pools.pool_usage()[1]["in_use_bytes"] == pools.pool_usage()[2]["in_use_bytes"] == 0
    small = torch.randn(1000)
    assert torch.equal(engine.fetch(engine.swap_out(key("small#0"), small)), small)  # not sticky


def test_a_dead_peer_stops_swap_out_and_check_with_its_name(make_d2d):
    engine, store, pools, manager = make_d2d(check_interval_s=3600)
    handle = engine.swap_out(key("a#0"), torch.ones(1000))
    engine.wait_idle()
    dead = kill_rank(pools, 0)
    message = rf"peer rank 0 \(device [12], pid {dead.pid}\), which holds a D2D peer pool, has died"
    # every reservation checks its peers, whenever the last periodic check was
    with pytest.raises(SwapError, match=rf"^swap-out failed: rank 0 stage 0 microbatch 0 tensor b#0: {message}$"):
        engine.swap_out(key("b#0"), torch.ones(10))
    assert not manager.is_tracked(key("b#0"))
    store.check_interval_s = 0.0  # the periodic check is due at once
    with pytest.raises(SwapError, match=f"^{message}$"):
        engine.check()
    with pytest.raises(SwapError, match=message):
        engine.fetch(handle)


def test_a_swap_in_checks_its_peers_even_right_after_a_check(make_d2d):
    engine, _, pools, _ = make_d2d(check_interval_s=3600)
    handle = engine.swap_out(key("a#0"), torch.ones(1000))
    engine.wait_idle()
    kill_rank(pools, 0)
    with pytest.raises(SwapError, match="peer rank 0 .* has died"):
        engine.fetch(handle)


def test_a_key_discarded_during_its_copy_can_be_swapped_again(make_d2d):
    gate = threading.Event()
    engine, _, pools, _ = make_d2d(fault=lambda k, d: gate.wait(5))
    try:
        handle = engine.swap_out(key("c#0"), torch.ones(100))
        wait_until(lambda: handle.state is SwapState.OUT_COPYING)
        engine.discard(handle)
        newer = engine.swap_out(key("c#0"), torch.full((100,), 2.0))
    finally:
        gate.set()
    engine.wait_idle()
    assert handle.state is SwapState.CANCELLED
    assert torch.equal(engine.fetch(newer), torch.full((100,), 2.0))
    engine.discard(newer)
    engine.wait_idle()  # its in copy's completer frees the blocks once it saw the copy done
    assert sum(u["in_use_bytes"] for u in pools.pool_usage().values()) == 0


class _FakeStream:
    """Stands in for torch.cuda.Stream on a CPU machine: records where and at which priority."""

    made: list[tuple[str, int]] = []

    def __init__(self, device=None, priority: int = 0) -> None:
        _FakeStream.made.append((str(device), priority))


def test_copy_streams_come_from_the_pool_nccl_does_not_draw_from(make_pools, monkeypatch):
    """torch.cuda.Stream() draws round-robin from 32 streams per device and priority, and
    ProcessGroupNCCL from the default priority's: every swap copy stream (host and D2D,
    on the rank's device and on each peer's) is a high-priority one."""
    from mpress.runtime.memory.host_pool import PinnedHostPool
    from mpress.runtime.swap.store import HostStore

    _FakeStream.made = []
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    plan = three_stage_d2d_plan()
    weights = tuple((s.device, s.fraction) for s in plan.stages[0].rules[0].stripes)
    PeerStore(make_pools(plan), 0, torch.device("cuda", 0), weights)
    HostStore(PinnedHostPool(4096, pin_memory=False), torch.device("cuda", 0))
    peers = {d for d, _ in weights}
    assert len(_FakeStream.made) == 4 * len(peers) + 2
    assert {d for d, _ in _FakeStream.made} == {"cuda:0"} | {f"cuda:{d}" for d in peers}
    assert {p for _, p in _FakeStream.made} == {-1}


def test_waiting_for_room_shares_one_deadline_and_asks_only_the_reservations_peers():
    """`await_room` waits for a slot on each peer the reservation stripes over, within one
    deadline (before: the full timeout per peer in turn, and on every peer the store had
    used, whatever the reservation's weights)."""
    weights = ((1, 0.5), (2, 0.25), (3, 0.25))
    store = PeerStore(Quotas(0, {1: 64 * KiB, 2: 64 * KiB, 3: 64 * KiB, 4: 64 * KiB}, {"u": 1}), 0, CPU, weights)
    store.reserve("u#0", 4 * KiB, weights, "u")  # the one slot of u on each of peers 1, 2 and 3
    timeout = 0.4
    start = time.monotonic()
    store.await_room("u", 4 * KiB, weights, timeout)  # no slot comes free
    waited = time.monotonic() - start
    assert timeout <= waited < 2 * timeout  # before: 3 x timeout
    start = time.monotonic()
    store.await_room("u", 4 * KiB, ((4, 1.0),), timeout)  # peer 4's slots are all free
    assert time.monotonic() - start < timeout / 2  # before: waited on peers 1 to 3
    store.reserve("u#1", 4 * KiB, ((4, 1.0),), "u")
