"""A failure on one rank of a job without D2D ends every rank, each with one line naming
the failed rank, through torchrun: none blocks in a pipeline recv or a collective until
the collective timeout (under NCCL: until the watchdog kills it with a stack dump)."""

from __future__ import annotations

import re

import pytest

from mpress.contract.plan import TensorRule
from tests.launcher.test_train_launcher import base_config, launch
from tests.support.plans import pipeline_plan


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_swap_failure_on_rank_0_stops_every_other_rank_naming_it(tmp_path, world):
    # rank 0 host-swaps its first layer into a pinned pool far too small ($MPRESS_HOST_POOL_BYTES):
    # its first swap-out fails mid-step while the others wait on the pipeline; no D2D, no peer pools
    plan = pipeline_plan("1f1b", world, 4, {0: [TensorRule(tensor="layers.0.**", technique="host")]})
    assert not plan.uses_peer_pools
    plan.save(tmp_path / "plan.yaml")
    config = base_config(tmp_path / "plan.yaml", num_stages=world)
    res = launch(config, tmp_path, nproc=world, env={"MPRESS_HOST_POOL_BYTES": "4096"}, timeout=120)
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if x.startswith("mpress.train: rank")]
    by_rank = {r: [x for x in lines if x.startswith(f"mpress.train: rank {r}:")] for r in range(world)}
    assert len(by_rank[0]) == 1, res.stderr[-3000:]
    assert re.match(r"mpress\.train: rank 0: SwapError: swap-out failed: rank 0 stage 0 microbatch \d+ "
                    r"tensor \S*layers\.0\.\S*: pinned host pool exhausted", by_rank[0][0]), by_rank[0]
    for r in range(1, world):
        assert by_rank[r] == [f"mpress.train: rank {r}: stopping: rank 0 failed (SwapError)"], res.stderr[-3000:]
