"""An idle lender: a device with a peer pool and no stage (issue 12, item 1).

Its pool is allocated by the lowest rank among its exporters (`pool_layout.pool_holders`),
which is then an exporter to its own allocation. CUDA IPC cannot open a handle in the
process that made it (`cudaIpcOpenMemHandle` maps memory exported by *another* process,
and torch's cache of the producer's storage is keyed differently from its lookup), so the
holder must write through its own buffer. The shared-memory transport keeps the same rule
(it refuses a payload its own process created), so these CPU tests fail where a GPU job
would crash at start-up. The `cuda` tests run the one-GPU case where a GPU is present.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist

from mpress.d2d.runtime.peer_pool import PeerPools, setup_peer_pools
from mpress.d2d.runtime.pool_layout import plan_quotas, pool_holders
from mpress.d2d.runtime.transport import CudaIpcTransport, SharedMemoryTransport
from mpress.errors import SwapError
from mpress.contract.plan import Plan
from mpress.runtime.memory.manager import MemoryManager
from mpress.runtime.swap.engine import SwapEngine
from tests.support.keys import key
from tests.support.peers import KiB, MiB
from tests.support.plans import d2d_plan
from tests.support.spawn import spawn
from tests.support.tensors import CPU, random_tensor, same_bits

IDLE = 1
"""The idle lender of `idle_lender_plan`: stages run on devices 0 and 2."""


def idle_lender_plan(quota_bytes: int = 64 * KiB, num_ranks: int = 2) -> Plan:
    """Stage 0 on device 0 (rank 0) and stage 1 on device 2 (rank 1 of 2) both stripe
    everything to device 1, which runs no stage: its pool is the sum of their quotas."""
    return d2d_plan([0, 2], stripes={0: {IDLE: 1.0}, 1: {IDLE: 1.0}},
                    quotas={0: {IDLE: quota_bytes}, 1: {IDLE: quota_bytes}}, num_ranks=num_ranks)


def _fill(rank: int) -> int:
    return 0xA0 + rank


def _round_trip(pools: PeerPools, stage: int, device: torch.device) -> bool:
    """Swap a tensor out to the stage's quota on the idle pool and back; bit-identical?"""
    manager = MemoryManager(device, rank=stage)
    with SwapEngine(pools.store_for(stage), manager, device, rank=stage, stage=stage, timeout_s=30) as engine:
        tensor = random_tensor(torch.float32, (4096,), device=device)
        expected = tensor.clone()
        handle = engine.swap_out(key(f"x{stage}#0", stage=stage), tensor)
        engine.wait_idle()
        tensor.zero_()  # the copy on the peer is what comes back
        back = engine.fetch(handle)
        identical = same_bits(back, expected)
        del back, handle
    return identical


def _idle_lender_worker(rank: int, world: int, plan_paths: list[str | None]):
    plan = idle_lender_plan()
    pools = setup_peer_pools(plan, [rank], CPU)
    result: dict = {"pid": os.getpid(), "round_trip": _round_trip(pools, rank, CPU)}
    quota = pools.quota(rank, IDLE)
    quota.buffer.fill_(_fill(rank))  # this exporter's whole quota, as the holder will see it
    result["quota"] = (quota.quota.offset_bytes, quota.quota.nbytes)
    dist.barrier()  # every exporter has written
    home = pools.pool_on(IDLE)
    if home is not None:
        result["holder_quota_ptr"] = quota.buffer.data_ptr() - home.data_ptr()
        result["home"] = home.clone()
    dist.barrier()  # the holder has looked
    gc.collect()
    pools.close(barrier=True)
    yield result


def test_the_holder_of_an_idle_pool_writes_into_its_own_allocation():
    plan = idle_lender_plan()
    holders = pool_holders(plan, plan_quotas(plan))
    assert holders == {IDLE: 0}, "rank 0 holds the idle pool and exports to it"
    run = spawn(_idle_lender_worker, 2, [None], timeout_s=120, group_timeout_s=60)
    assert run.errors == {}, run.errors
    holder, other = run.results[0]
    assert holder["round_trip"] and other["round_trip"]
    assert "home" in holder and "home" not in other
    # the holder's quota is a view of the pool it allocated, not a second mapping of it
    assert holder["holder_quota_ptr"] == holder["quota"][0]
    home = holder["home"]
    for rank, r in enumerate(run.results[0]):  # both exporters' writes are in the holder's pool
        offset, nbytes = r["quota"]
        assert bool((home[offset:offset + nbytes] == _fill(rank)).all())


def test_one_process_running_every_stage_holds_and_fills_the_idle_pool(make_pools):
    pools = make_pools(idle_lender_plan(num_ranks=1))
    home = pools.pool_on(IDLE)
    assert home is not None
    layout = {q.stage: q for q in plan_quotas(idle_lender_plan(num_ranks=1))[IDLE]}
    for stage in (0, 1):
        quota = pools.quota(stage, IDLE)
        assert quota.buffer.data_ptr() - home.data_ptr() == layout[stage].offset_bytes
        assert _round_trip(pools, stage, CPU)


def test_the_shared_memory_transport_refuses_its_own_export():
    # as cudaIpcOpenMemHandle does: a process opens what *another* process exported
    transport = SharedMemoryTransport()
    try:
        _buffer, payload = transport.create(4 * KiB, CPU)
        with pytest.raises(SwapError, match=r"^the peer pool .* was exported by this process \(pid \d+\): use the "
                                            r"buffer it allocated"):
            transport.open(payload, CPU)
    finally:
        transport.close()


# ---- CUDA (skipped without a GPU) ----------------------------------------------------------

class _CountingIpc(CudaIpcTransport):
    """CUDA IPC that counts the handles it opens."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = 0

    def open(self, payload, device):
        self.opened += 1
        return super().open(payload, device)


@pytest.mark.cuda
def test_cuda_holder_of_an_idle_pool_opens_no_ipc_handle(group):
    # One process runs both exporter stages on GPU 0 and holds the idle lender's pool.
    # With one GPU the idle plan device is GPU 0 itself; with more it is GPU 1, reached
    # over a peer link. Before the fix the holder opened its own IPC handle and failed.
    if torch.cuda.device_count() < 2:
        plan = d2d_plan([1, 2], stripes={0: {0: 1.0}, 1: {0: 1.0}}, quotas={0: {0: MiB}, 1: {0: MiB}})
        idle = 0
    else:
        if not torch.cuda.can_device_access_peer(0, IDLE):
            pytest.skip(f"GPU 0 has no peer access to GPU {IDLE}")
        plan, idle = idle_lender_plan(quota_bytes=MiB, num_ranks=1), IDLE
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    transport = _CountingIpc()
    pools = setup_peer_pools(plan, [0, 1], device, transport=transport)
    try:
        assert transport.opened == 0
        home = pools.pool_on(idle)
        assert home is not None and home.device == torch.device("cuda", idle)
        for stage in (0, 1):
            quota = pools.quota(stage, idle)
            assert quota.buffer.untyped_storage().data_ptr() == home.untyped_storage().data_ptr()
            assert _round_trip(pools, stage, device)
    finally:
        gc.collect()
        pools.close()


@pytest.mark.cuda
def test_cuda_ipc_transport_refuses_its_own_export_before_cuda_does():
    # the one-process case `b = torch.empty(1 << 20, device="cuda"); f, a = reduce_tensor(b);
    # f(*a)` is never taken: the transport names the mistake instead
    transport = CudaIpcTransport()
    try:
        _buffer, payload = transport.create(1 << 20, torch.device("cuda", 0))
        with pytest.raises(SwapError, match=r"^the peer pool .* was exported by this process"):
            transport.open(payload, torch.device("cuda", 0))
    finally:
        transport.close()
