"""The planner's last step (`planner_optim_keep.py`): where a device has room at its
emulated peak, layers' optimizer data stays on it instead of streaming around the step,
and only where that makes the iteration faster."""

from __future__ import annotations

import dataclasses

import pytest

from mpress.config.model_config import load_model_config
from mpress.contract.actions import Kind, UnitId, UnitKind, parse_actions, stage_to_rank
from mpress.contract.plan import TensorRule
from mpress.hardware.server import load_hardware
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.plan_eval import complete_plan
from mpress.static.plan.planner import plan_strategy


@pytest.fixture(scope="module")
def planned():
    # GPT-20.4B on 8 A100s (37.9 GB usable): the fit moves every stage's optimizer data
    # to the host; stage 0 (8 microbatches in flight) peaks within a layer's data of its
    # device, the later stages 2-12 GB below theirs
    setup = setup_pipeline(load_model_config("gpt-20.4b"), load_hardware("dgx-a100"), schedule="1f1b", num_stages=8,
                           microbatch_size=2, num_microbatches=16)
    return setup, plan_strategy(setup, "mpress")


def _streamed_units(plan, stage: int) -> set[str]:
    """Layers whose optimizer data stage's program copies in or out."""
    rank = stage_to_rank(plan.schedule, plan.num_stages, plan.num_ranks)[stage]
    out = set()
    for a in parse_actions(plan.actions[rank]):
        if a.kind in (Kind.OI, Kind.OO) and a.stage == stage:
            unit = UnitId.parse(a.tensor)
            if unit.kind is UnitKind.OPTIM:
                out.add(unit.layer)
    return out


def test_optimizer_data_stays_on_devices_with_room_and_the_program_streams_the_rest(planned):
    setup, result = planned
    usable = setup.hardware.usable_memory_bytes
    assert result.fits and all(p <= usable for p in result.evaluation.result.peak_bytes)
    kept_any = False
    for sp, c in zip(result.plan.stages, setup.costs):
        names = [x.name for x in c.layers]
        optim = [r.tensor for r in sp.rules if r.tensor.startswith("optim:")]
        assert optim and all(r.technique == "host" for r in sp.rules if r.tensor.startswith("optim:"))
        if optim == ["optim:*"]:
            streamed = set(names)
        else:
            kept_any = True
            streamed = {t.removeprefix("optim:") for t in optim}
            assert streamed < set(names)
            # what stays is a whole layer's data, which fit the device's room at the peak
            assert len(set(names) - streamed) >= 1
        assert _streamed_units(result.plan, sp.stage) == streamed, sp.stage
    assert kept_any
    # stage 0's device has no room for a layer's data: it streams all of it
    room0 = usable - result.evaluation.result.peak_bytes[result.plan.stage_to_device[0]]
    assert [r.tensor for r in result.plan.stages[0].rules if r.tensor.startswith("optim:")] == ["optim:*"]
    assert room0 < min(x.optim_bytes + x.master_bytes for x in setup.costs[0].layers)


def test_keeping_the_data_is_faster_than_streaming_it_all(planned):
    setup, result = planned
    # the same plan with every stage's optimizer data streamed again, emulated afresh
    stages = [dataclasses.replace(sp, rules=[r for r in sp.rules if not r.tensor.startswith("optim:")]
                                  + [TensorRule(tensor="optim:*", technique="host")],
                                  predicted_peak_bytes=0, pinned_host_bytes=0, need_bytes=0)
              for sp in result.plan.stages]
    streamed, ev = complete_plan(setup, dataclasses.replace(result.plan, stages=stages, actions=[],
                                                            predicted_iteration_s=0.0))
    assert ev.result.fits
    assert result.evaluation.result.iteration_s < ev.result.iteration_s
    # and it pins less host memory: the kept layers' data has no place in the pools
    assert sum(sp.pinned_host_bytes for sp in result.plan.stages) < sum(sp.pinned_host_bytes
                                                                         for sp in streamed.stages)
