"""Contracts of the D2D runtime found missing in a review (each failed before its fix):
plans for fewer stages than GPUs, setup failures agreed by every rank and cleaned up,
conjugate views through peers, refused reservations leave nothing tracked. All run on
CPU (shared-memory pools, gloo).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from mpress.d2d.runtime.peer_pool import setup_peer_pools
from mpress.d2d.runtime.pool_layout import plan_quotas
from mpress.d2d.runtime.transport import SharedMemoryTransport
from mpress.d2d.runtime.peer_store import PeerStore
from mpress.errors import PlanError, SwapError, TopologyError
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.runtime.memory.manager import MemoryManager
from mpress.runtime.swap.engine import SwapEngine
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.planner import PlannerOptions, plan_strategy
from tests.support.keys import key
from tests.support.plans import d2d_plan, three_stage_d2d_plan
from tests.support.spawn import spawn

CPU = torch.device("cpu")
KiB = 1 << 10


@pytest.fixture
def d2d_engine(group):
    """(engine, manager) swapping stage 0 of `three_stage_d2d_plan` into shared-memory pools."""
    made = []

    def make() -> tuple[SwapEngine, MemoryManager]:
        plan = three_stage_d2d_plan()
        pools = setup_peer_pools(plan, [0, 1, 2], CPU)
        weights = tuple((s.device, s.fraction) for s in plan.stages[0].rules[0].stripes)
        store = PeerStore(pools, 0, CPU, weights, min_stripe_bytes=KiB, check_interval_s=0.0)
        manager = MemoryManager(CPU, rank=0)
        engine = SwapEngine(store, manager, CPU, rank=0, stage=0, timeout_s=10)
        made.append((engine, pools))
        return engine, manager

    yield make
    for engine, pools in made:
        engine.close(timeout_s=5)
        gc.collect()
        pools.close()


# ---- planner -> runtime ----------------------------------------------------------------------

def test_a_d2d_plan_for_fewer_stages_than_gpus_is_accepted_by_the_runtime():
    # 4 pipeline ranks on an 8-GPU machine: what `plan: auto` with `hardware: detect`
    # plans under `torchrun --nproc-per-node 4` there (or `mpress plan` for dgx-a100)
    setup = setup_pipeline(load_model_config("gpt-10.3b"), load_hardware("dgx-a100"), schedule="1f1b",
                           num_stages=4, microbatch_size=1, num_microbatches=8)
    result = plan_strategy(setup, "d2d", PlannerOptions())
    assert result.fits
    stripe_devices = {s.device for sp in result.plan.stages for r in sp.rules for s in r.stripes}
    assert stripe_devices, "the plan uses D2D at all"
    quotas = plan_quotas(result.plan)  # what setup_peer_pools does first on every rank
    assert stripe_devices <= set(quotas)


# ---- setup_peer_pools error paths --------------------------------------------------------------

class _CreateFails(SharedMemoryTransport):
    """Shared-memory pools whose second allocation fails as CUDA IPC export can (reduce_tensor
    raises RuntimeError, e.g. `cudaIpcGetMemHandle` on a platform without IPC)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def create(self, nbytes: int, device: torch.device):
        if self.names:
            raise RuntimeError("CUDA error: operation not supported (cudaIpcGetMemHandle)")
        buffer, payload = super().create(nbytes, device)
        self.names.append(payload[0])
        return buffer, payload


def test_an_allocation_error_of_any_kind_is_reported_as_the_rank_failure(group):
    transport = _CreateFails()
    try:
        with pytest.raises(SwapError, match=r"^peer pools: rank 0: RuntimeError: .*cudaIpcGetMemHandle"):
            setup_peer_pools(three_stage_d2d_plan(), [0, 1, 2], CPU, transport=transport)
    finally:
        transport.close()


def test_an_allocation_error_frees_the_pools_made_before_it(group):
    transport = _CreateFails()
    try:
        with pytest.raises(Exception, match="cudaIpcGetMemHandle"):
            setup_peer_pools(three_stage_d2d_plan(), [0, 1, 2], CPU, transport=transport)
        assert transport.names, "the first pool was created"
        left = [n for n in transport.names if Path("/dev/shm", n.lstrip("/")).exists()]
        assert left == []
    finally:
        transport.close()


class _OpenFails(SharedMemoryTransport):
    """An exporter that cannot reach its peer's pool (what `_check_peer_access` raises on
    CUDA when two GPUs have no peer access)."""

    def open(self, payload, device):
        raise TopologyError("GPU 0 cannot access GPU 1 directly (no peer access)")


def _open_fails_worker(rank: int, world: int, plan_paths: list[str | None]):
    plan = d2d_plan([0, 1], stripes={0: {1: 1.0}}, pools={1: 64 * KiB}, num_ranks=2)
    pools = setup_peer_pools(plan, [rank], CPU, transport=_OpenFails() if rank == 0 else None)
    pools.close()


def test_a_rank_that_cannot_open_its_peers_pools_fails_every_rank():
    # a rank that fails stops at once, as the launcher does; its peers are on their own
    seen = spawn(_open_fails_worker, 2, [], timeout_s=60, group_timeout_s=20, stop_others_on_error=False).errors
    for rank in (0, 1):  # the same error, of the same class, on every rank
        assert seen.get(rank, "").startswith("TopologyError: peer pools: rank 0: GPU 0 cannot access GPU 1"), seen


# ---- PeerStore and the engine ------------------------------------------------------------------

def test_a_conjugate_view_round_trips_through_peers(d2d_engine):
    engine, _ = d2d_engine()
    base = torch.randn(4096, dtype=torch.complex64)
    saved = base.conj()  # what autograd saves for `a * b.conj()`
    handle = engine.swap_out(key("conj#0"), saved)
    back = engine.fetch(handle)
    assert torch.equal(back, saved)


def test_a_refused_reservation_leaves_nothing_tracked(d2d_engine):
    engine, manager = d2d_engine()
    with pytest.raises(PlanError, match="no quota on device 5"):
        engine.swap_out(key("w#0"), torch.ones(256), weights=((5, 1.0),))
    assert not manager.is_tracked(key("w#0"))
    assert manager.device_bytes() == 0
