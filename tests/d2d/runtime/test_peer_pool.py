"""Peer pools and the D2D swap store: quota layout (pure), pools, ledger and liveness in
one process (a world-1 gloo group whose rank runs every stage, shared-memory pools),
PeerStore round trips through the swap engine, and CUDA IPC across processes.

The CPU tiers drive the same protocol as a GPU job: the pools are created, exported
through `all_gather_object` and opened again by name, so an exporter writes through a
mapping of its own, as it would through a CUDA IPC handle.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mpress.d2d.runtime.liveness import ProcessId
from mpress.d2d.runtime.peer_pool import PeerPools, setup_peer_pools
from mpress.d2d.runtime.peer_store import PeerStore
from mpress.d2d.runtime.pool_layout import Quota, plan_quotas
from mpress.d2d.runtime.stripe_table import StripeEntry, StripeState
from mpress.errors import PlanError, SwapError
from mpress.plan import Plan
from mpress.identity import TensorKey
from mpress.runtime.memory.manager import MemoryManager, Residency
from mpress.runtime.swap.engine import SwapEngine, SwapState
from mpress.units import ALIGNMENT_BYTES
from tests.support.keys import key
from tests.support.plans import d2d_plan, three_stage_d2d_plan
from tests.support.tensors import CPU, DTYPES, random_tensor, same_bits, wait_until

KiB, MiB = 1 << 10, 1 << 20


def round_up(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


# ---- (a) plan_quotas: pure -------------------------------------------------------------------

def test_explicit_quotas_first_then_equal_share_of_the_rest():
    plan = d2d_plan([0, 1, 2], stripes={0: {2: 1.0}, 1: {2: 1.0}}, pools={2: 10 * KiB},
                    quotas={0: {2: 1000}})
    assert plan_quotas(plan) == {2: [
        Quota(stage=0, device=2, offset_bytes=0, nbytes=1024),        # 1000 rounded up
        Quota(stage=1, device=2, offset_bytes=1024, nbytes=9 * KiB),  # what is left
    ]}


def test_equal_shares_are_aligned_and_fit():
    plan = d2d_plan([0, 1, 2, 3], stripes={0: {3: 1.0}, 1: {3: 1.0}, 2: {3: 1.0}}, pools={3: 10_000})
    quotas = plan_quotas(plan)[3]
    assert [q.stage for q in quotas] == [0, 1, 2]
    share = 10_000 // 3 // ALIGNMENT_BYTES * ALIGNMENT_BYTES
    assert [(q.offset_bytes, q.nbytes) for q in quotas] == [(0, share), (share, share), (2 * share, share)]


def test_quotas_per_device_and_pools_summed_over_the_stages_of_a_device():
    # stage 0 stripes to devices 1 and 2; device 1 runs stages 1 and 3, whose pools add up
    plan = d2d_plan([0, 1, 2, 1], stripes={0: {1: 0.5, 2: 0.5}}, pools={1: 4 * KiB, 2: 2 * KiB, 3: 4 * KiB},
                    quotas={0: {2: 1 * KiB}})
    assert plan_quotas(plan) == {1: [Quota(stage=0, device=1, offset_bytes=0, nbytes=8 * KiB)],
                                 2: [Quota(stage=0, device=2, offset_bytes=0, nbytes=1 * KiB)]}
    # the override replaces every pool's size
    assert plan_quotas(plan, pool_override_bytes=3 * KiB)[1][0].nbytes == 3 * KiB


def test_a_pool_too_small_for_its_quotas_is_refused_with_the_numbers():
    plan = d2d_plan([0, 1, 2], stripes={0: {2: 1.0}, 1: {2: 1.0}}, pools={2: 10_000},
                    quotas={0: {2: 8192}, 1: {2: 4000}})
    with pytest.raises(PlanError) as info:
        plan_quotas(plan)
    message = str(info.value)
    assert message.startswith("peer pool of device 2 is too small: 10000 bytes")
    assert "stage 0 needs 8192 bytes" in message and "stage 1 needs 4096 bytes" in message
    assert "total 12288" in message


def test_a_pool_with_no_room_for_an_equal_share_is_refused():
    plan = d2d_plan([0, 1, 2], stripes={0: {2: 1.0}, 1: {2: 1.0}}, pools={2: 1000})
    with pytest.raises(PlanError, match="peer pool of device 2 is too small: 1000 bytes"):
        plan_quotas(plan)


def test_fixed_quotas_over_the_pool_leave_no_negative_numbers_in_the_message():
    plan = d2d_plan([0, 1, 2], stripes={0: {2: 1.0}, 1: {2: 1.0}}, pools={2: 4096}, quotas={0: {2: 8192}})
    with pytest.raises(PlanError) as info:
        plan_quotas(plan)
    message = str(info.value)
    assert "4096 bytes" in message and "stage 0 needs 8192 bytes" in message
    assert "-" not in message.replace("-byte", "")


def test_striping_to_a_device_without_a_pool_is_refused():
    plan = d2d_plan([0, 1, 2], stripes={0: {1: 0.5, 2: 0.5}, 1: {2: 1.0}}, pools={1: 4 * KiB})
    with pytest.raises(PlanError, match=r"stage\(s\) 0, 1 stripe to device 2, which reserves no peer pool"):
        plan_quotas(plan)


def test_no_d2d_no_quotas():
    assert plan_quotas(d2d_plan([0, 1], pools={1: 4 * KiB})) == {}


# ---- (b) pools in one process ------------------------------------------------------------------

@pytest.fixture
def make_pools(group):
    """setup_peer_pools for a plan whose stages all run on this rank; closed afterwards."""
    made: list[PeerPools] = []

    def make(plan: Plan, **kwargs) -> PeerPools:
        pools = setup_peer_pools(plan, list(range(plan.num_stages)), CPU, **kwargs)
        made.append(pools)
        return pools

    yield make
    gc.collect()  # drop views of the pools held by finished engines before unmapping
    for pools in made:
        pools.close()


def test_quotas_are_aligned_views_of_the_importers_pool(make_pools):
    plan = d2d_plan([0, 1, 2], stripes={0: {2: 1.0}, 1: {2: 1.0}}, pools={2: 64 * KiB},
                    quotas={0: {2: 8000}})
    pools = make_pools(plan)
    layout = {q.stage: q for q in plan_quotas(plan)[2]}
    a, b = pools.quota(0, 2), pools.quota(1, 2)
    assert (a.quota, b.quota) == (layout[0], layout[1])
    assert (a.capacity_bytes, b.capacity_bytes) == (layout[0].nbytes, layout[1].nbytes)
    for quota in (a, b):
        assert quota.buffer.data_ptr() % ALIGNMENT_BYTES == 0
        blocks = [quota.allocate(n, f"t{n}") for n in (1, 511, 512, 513, 3000)]
        assert all(blk.offset_bytes % ALIGNMENT_BYTES == 0 for blk in blocks)
        quota.validate()
    # both quotas are slices of one pool, laid out as the plan says; what the exporters
    # write through their mappings is what the importer's own buffer holds
    # (the importer's buffer is internal: there is no public accessor for it)
    assert b.buffer.data_ptr() - a.buffer.data_ptr() == layout[1].offset_bytes
    home = pools._local_buffers[2]
    a.buffer.fill_(0xA1)
    b.buffer.fill_(0xB2)
    start, end = layout[1].offset_bytes, layout[1].offset_bytes + layout[1].nbytes
    assert bool((home[:start] == 0xA1).all()) and bool((home[start:end] == 0xB2).all())
    with pytest.raises(PlanError, match="stage 2 has no quota on device 2"):
        pools.quota(2, 2)


def test_the_ledger_shows_each_quotas_use_to_the_importer(make_pools):
    plan = d2d_plan([0, 1, 2], stripes={0: {2: 1.0}, 1: {2: 1.0}}, pools={2: 64 * KiB})
    pools = make_pools(plan)
    assert pools.pool_usage()[2]["in_use_bytes"] == 0
    capacity = sum(q.nbytes for q in plan_quotas(plan)[2])
    assert pools.pool_usage()[2]["capacity_bytes"] == capacity
    a, b = pools.quota(0, 2), pools.quota(1, 2)
    x = a.allocate(1000, "x")
    y = b.allocate(3000, "y")
    z = a.allocate(512, "z")
    usage = pools.pool_usage()[2]
    assert usage["in_use_bytes"] == round_up(1000) + round_up(3000) + 512
    assert usage["high_water_bytes"] == usage["in_use_bytes"]
    a.free(x)
    b.free(y)
    usage = pools.pool_usage()[2]
    assert usage["in_use_bytes"] == 512
    assert usage["high_water_bytes"] == round_up(1000) + round_up(3000) + 512  # per exporter, summed
    a.free(z)
    assert pools.pool_usage()[2]["in_use_bytes"] == 0
    assert set(pools.pool_usage()) == {2}  # devices 0 and 1 hold no pool


def test_the_ledger_is_exact_after_concurrent_allocate_and_free(make_pools):
    plan = d2d_plan([0, 1], stripes={0: {1: 1.0}}, pools={1: 1 * MiB})
    pools = make_pools(plan)
    quota = pools.quota(0, 1)

    def churn(name: str) -> None:
        for i in range(300):
            quota.free(quota.allocate(512 * (1 + i % 3), f"{name}{i}"))

    threads = [threading.Thread(target=churn, args=(n,)) for n in "abcd"]
    keep = quota.allocate(2048, "kept")
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pools.pool_usage()[1]["in_use_bytes"] == quota.in_use_bytes == 2048
    quota.free(keep)
    assert pools.pool_usage()[1]["in_use_bytes"] == 0


def test_a_pool_too_small_fails_at_start_up_with_the_numbers(group):
    plan = d2d_plan([0, 1], stripes={0: {1: 1.0}}, pools={1: 4 * KiB}, quotas={0: {1: 8 * KiB}})
    with pytest.raises(PlanError, match=r"^peer pools: rank 0: peer pool of device 1 is too small: 4096 bytes .*"
                                        r"stage 0 needs 8192 bytes"):
        setup_peer_pools(plan, [0, 1], CPU)
    with pytest.raises(PlanError, match="peer pool of device 1 is too small: 100 bytes"):
        setup_peer_pools(d2d_plan([0, 1], stripes={0: {1: 1.0}}, pools={1: 4 * KiB}), [0, 1], CPU,
                         pool_override_bytes=100)


def exited_process() -> ProcessId:
    """The id of a child that ran, exited and was reaped."""
    child = subprocess.Popen(["sleep", "0"])
    child.wait()
    return ProcessId(child.pid, 0)


def test_process_id_liveness():
    me = ProcessId.current()
    assert me.pid == os.getpid() and me.start_ticks > 0 and me.alive()
    assert not ProcessId(me.pid, me.start_ticks + 1).alive()  # same pid, another process (pid reuse)
    assert not exited_process().alive()


def test_a_zombie_is_not_alive():
    child = subprocess.Popen(["sleep", "60"])
    try:
        pid = ProcessId(child.pid, _start_ticks(child.pid))
        assert pid.alive()
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped
        with open(f"/proc/{child.pid}/stat", encoding="ascii") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
        assert not pid.alive()
    finally:
        child.kill()
        child.wait()
    assert not pid.alive()


def _start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def kill_rank(pools: PeerPools, rank: int) -> ProcessId:
    """Make `rank` look dead to `pools`: its published process id becomes an exited one."""
    dead = exited_process()
    pools._infos[rank] = dataclasses.replace(pools._infos[rank], process=dead)
    return dead


def test_a_dead_pool_holder_is_named(make_pools):
    pools = make_pools(three_stage_d2d_plan())
    pools.check_peer(1)
    dead = kill_rank(pools, 0)
    with pytest.raises(SwapError, match=rf"^peer rank 0 \(device 2, pid {dead.pid}\), which holds a D2D peer pool, "
                                        r"has died$"):
        pools.check_peer(2)
    assert pools.dead_ranks() == []  # this rank itself is never listed


# ---- (c) PeerStore + SwapEngine on CPU --------------------------------------------------------

def find(store: PeerStore, owner: str) -> StripeEntry:
    """The newest metadata entry of tensor `owner`."""
    return [e for e in store.table.entries() if e.owner == owner][-1]


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
        assert back.is_contiguous() and same_bits(back, want)
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
    assert sum(u["in_use_bytes"] for u in pools.pool_usage().values()) == 0


# ---- (d) CUDA IPC across processes --------------------------------------------------------------

def _cuda_worker(rank: int, world: int, init: str, out: str, stage_to_device: list[int],
                 weights: dict[int, float], nbytes: int) -> None:
    """Rank 0 runs stage 0, the exporter; ranks 1.. run the importer stages. Plan device d
    runs on GPU d % device_count, so one GPU can host both ends of the IPC path."""
    device = torch.device("cuda", stage_to_device[rank] % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    pool_bytes = 2 * nbytes
    plan = d2d_plan(stage_to_device, stripes={0: weights}, num_ranks=world,
                    pools={s: pool_bytes for s in range(1, world)})
    pools = setup_peer_pools(plan, [rank], device)
    result: dict = {"device": stage_to_device[rank]}
    if rank == 0:
        result.update(_export(pools, device, weights, nbytes))
    else:
        box = [None]
        dist.barrier()  # the exporter's swap-out completed
        dist.broadcast_object_list(box, src=0)
        entry, expected = box[0]
        my_device = stage_to_device[rank]
        result["usage"] = pools.pool_usage()[my_device]
        result["allocated"] = torch.cuda.memory_allocated(device)
        quota = next(q for q in plan_quotas(plan)[my_device] if q.stage == 0)
        home = pools._local_buffers[my_device]  # the importer's own pool (no public accessor)
        result["holds"] = all(
            torch.equal(home[quota.offset_bytes + s.block.offset_bytes:][:s.nbytes].cpu(),
                        expected[s.tensor_offset_bytes:s.tensor_offset_bytes + s.nbytes])
            for s in entry.stripes if s.peer == my_device)
        dist.barrier()  # importers have looked
    gc.collect()
    if rank == 0:
        pools.close()  # the exporter unmaps before the importers free their pools
    dist.barrier()
    if rank != 0:
        pools.close()
    dist.barrier()
    dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"{rank}.pt"))


def _export(pools: PeerPools, device: torch.device, weights: dict[int, float], nbytes: int) -> dict:
    manager = MemoryManager(device, rank=0)
    store = PeerStore(pools, 0, device, tuple(weights.items()))
    with SwapEngine(store, manager, device, rank=0, stage=0, timeout_s=60) as engine:
        tensor = random_tensor(torch.float32, (nbytes // 4,), device=device)
        expected = tensor.cpu().view(torch.uint8)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        handle = engine.swap_out(key("x#0"), tensor)
        del tensor
        engine.wait_idle()
        after_out = torch.cuda.memory_allocated(device)
        entry = find(store, str(key("x#0")))
        peer_bytes = {p: manager.peer_bytes(p) for p in weights}
        dist.barrier()
        dist.broadcast_object_list([(entry, expected)], src=0)
        dist.barrier()  # importers have looked
        back = engine.fetch(handle)
        torch.cuda.synchronize(device)
        after_in = torch.cuda.memory_allocated(device)
        identical = torch.equal(back.cpu().view(torch.uint8), expected)
        del back, handle
    return {"before": before, "after_out": after_out, "after_in": after_in, "identical": identical,
            "stripes": [(s.peer, s.nbytes) for s in entry.stripes], "peer_bytes": peer_bytes,
            "state": entry.state}


def run_cuda_job(tmp_path: Path, stage_to_device: list[int], weights: dict[int, float],
                 nbytes: int) -> list[dict]:
    world = len(stage_to_device)
    mp.start_processes(_cuda_worker, args=(world, str(tmp_path / "init"), str(tmp_path), stage_to_device,
                                           weights, nbytes), nprocs=world, join=True, start_method="spawn")
    return [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(world)]


def check_cuda_job(results: list[dict], weights: dict[int, float], nbytes: int) -> None:
    exporter, importers = results[0], results[1:]
    assert exporter["identical"]
    assert exporter["state"] is StripeState.ON_PEERS
    # the exporter's device memory fell by the tensor while it was on the peers
    assert exporter["after_out"] <= exporter["before"] - nbytes
    assert exporter["after_in"] >= exporter["after_out"] + nbytes
    stripes = dict(exporter["stripes"])
    assert sum(stripes.values()) == nbytes and set(stripes) == set(weights)
    assert exporter["peer_bytes"] == stripes
    for imp in importers:  # each importer's pool held its stripe
        assert imp["usage"]["in_use_bytes"] == round_up(stripes[imp["device"]])
        assert imp["allocated"] >= imp["usage"]["capacity_bytes"]
        assert imp["holds"]


@pytest.mark.cuda
def test_cuda_ipc_two_processes_on_one_gpu(tmp_path):
    # rank 0: stage 0 on plan device 1, the exporter; rank 1: stage 1 on plan device 0,
    # the importer. With one GPU both run on cuda:0 and the pool goes through CUDA IPC.
    nbytes = 16 * MiB
    results = run_cuda_job(tmp_path, [1, 0], {0: 1.0}, nbytes)
    check_cuda_job(results, {0: 1.0}, nbytes)


@pytest.mark.cuda
def test_cuda_stripes_go_over_peer_links(tmp_path):
    # the exporter (plan device 2) stripes 3:1 to devices 0 and 1, each a process of its
    # own; with two GPUs the exporter shares GPU 0 and only the stripe to 1 crosses a link
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("needs two GPUs")
    exporter_gpu = 2 % n
    for peer in (0, 1):
        if peer != exporter_gpu and not torch.cuda.can_device_access_peer(exporter_gpu, peer):
            pytest.skip(f"GPU {exporter_gpu} has no peer access to GPU {peer}")
    nbytes = 64 * MiB
    weights = {0: 0.75, 1: 0.25}
    results = run_cuda_job(tmp_path, [2, 0, 1], weights, nbytes)
    check_cuda_job(results, weights, nbytes)
    assert dict(results[0]["stripes"]) == {0: 48 * MiB, 1: 16 * MiB}
