"""A D2D plan keeps every lender within its usable memory, counting what the runtime
really allocates there: the peer pool as `setup_peer_pools` sizes it (quotas with their
slack), the lender's own stage at its predicted peak, and one CUDA context per exporter
that opens the pool (issue 12, item 6)."""

from __future__ import annotations

import pytest

from mpress.d2d.runtime.pool_layout import plan_quotas
from mpress.d2d.static.mapping import exporter_context_bytes
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.planner import PlannerOptions, plan_strategy
from mpress.config.vocabulary import Technique


@pytest.mark.parametrize("hardware", ["dgx1-v100", "dgx-a100"])
@pytest.mark.parametrize("strategy", ["mpress", "d2d"])
def test_no_lender_is_asked_for_more_than_its_usable_memory(hardware, strategy):
    hw = load_hardware(hardware)
    setup = setup_pipeline(load_model_config("gpt-10.3b"), hw, schedule="1f1b", num_stages=4,
                           microbatch_size=1, num_microbatches=8)
    plan = plan_strategy(setup, strategy, PlannerOptions()).plan
    quotas = plan_quotas(plan)  # device -> its exporters' quotas, as every rank lays them out
    exporters = sum(1 for sp in plan.stages if any(r.technique is Technique.D2D for r in sp.rules))
    if not quotas:
        pytest.skip(f"{strategy} on {hardware} places nothing on peers")
    for device, qs in quotas.items():
        stages = [sp for sp in plan.stages if sp.device == device]
        # a busy lender's predicted peak includes its pool; an idle one holds only the pool
        held = sum(sp.predicted_peak_bytes for sp in stages) if stages else sum(q.nbytes for q in qs)
        contexts = exporter_context_bytes(hw, device, exporters)
        assert held + contexts <= hw.usable_memory_bytes, (device, held, contexts, hw.usable_memory_bytes)
