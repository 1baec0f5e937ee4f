"""mpress.d2d.runtime.peer_pool and liveness: peer pools in one process (quotas as views
of the importer's pool, the usage ledger, start-up refusals) and process liveness (pid
reuse, zombies, a dead pool holder named). The pools come from `make_pools` (conftest)."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from mpress.d2d.runtime.liveness import ProcessId
from mpress.d2d.runtime.peer_pool import setup_peer_pools
from mpress.d2d.runtime.pool_layout import plan_quotas
from mpress.errors import PlanError, SwapError
from mpress.config.units import ALIGNMENT_BYTES
from tests.support.peers import KiB, MiB, exited_process, kill_rank, round_up
from tests.support.plans import d2d_plan, three_stage_d2d_plan
from tests.support.tensors import CPU


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


def test_a_dead_pool_holder_is_named(make_pools):
    pools = make_pools(three_stage_d2d_plan())
    pools.check_peer(1)
    dead = kill_rank(pools, 0)
    with pytest.raises(SwapError, match=rf"^peer rank 0 \(device 2, pid {dead.pid}\), which holds a D2D peer pool, "
                                        r"has died$"):
        pools.check_peer(2)
    assert pools.dead_ranks() == []  # this rank itself is never listed
