"""Fixtures of the D2D runtime tests: `make_pools` sets up peer pools in one process (a
world-1 gloo group whose rank runs every stage, shared-memory pools).

The CPU tiers drive the same protocol as a GPU job: the pools are created and exported
through `all_gather_object`. Here one process holds every pool, so its stages write into
the buffers it allocated, as a GPU job's holder must (a process cannot open its own CUDA
IPC handle, and the shared-memory transport refuses its own export likewise); opening
another process's export is what the multi-process tests (`spawn`) exercise.
"""

from __future__ import annotations

import gc

import pytest

from mpress.d2d.runtime.peer_pool import PeerPools, setup_peer_pools
from mpress.contract.plan import Plan
from tests.support.tensors import CPU


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
