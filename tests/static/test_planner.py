"""The planner on hand-checked toy pipelines, its baselines, and the preset targets."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpress.errors import UserError
from mpress.hardware import DeviceSpec, Hardware, load_hardware
from mpress.model_config import load_model_config
from mpress.static.evaluate import PipelineSetup, setup_pipeline
from mpress.static.memory import memory_model, stage_costs
from mpress.static.plan_eval import check_plan_for_setup, evaluate_plan
from mpress.static.plan_draft import peer_quota_bytes
from mpress.identity import StageRules
from mpress.vocabulary import Strategy
from mpress.static.planner import (
    check_fits_at_all,
    plan_strategy,
)
from mpress.static.profile import LayerProfile, Profile, SavedTensor
from mpress.static.schedules import build_schedule


def technique(plan, stage: int, tensor: str, microbatch: int) -> str:
    """What the plan does with `tensor` of `stage` in `microbatch`, read as both halves read it."""
    return StageRules(plan.stage(stage), []).technique(tensor, microbatch)


GB = 10**9
MB = 10**6
TINY = load_model_config("gpt-tiny")  # only its fingerprint ties the toy profile to a model


def layer(name, *, saved=0, fwd=0.5, bwd=1.0, params=1 * MB, out=1 * MB):
    return LayerProfile(name=name, forward_flops=1e9, backward_flops=2e9, forward_time_s=fwd, backward_time_s=bwd,
                        saved=[SavedTensor(module=f"{name}.op", index=0, bytes=saved)] if saved else [],
                        param_bytes=params, grad_bytes=params, output_bytes=out)


def toy_hardware(memory_bytes, *, pcie_gbps=100.0, nvlink_gbps=100.0):
    return Hardware(name="toy", num_devices=2, compute_efficiency=1.0,
                    device=DeviceSpec(name="toy", memory_bytes=memory_bytes, peak_flops={"fp32": 1e12}),
                    host_memory_bytes=10**12, pcie_h2d_gbps=pcie_gbps, pcie_d2h_gbps=pcie_gbps, pcie_efficiency=1.0,
                    nvlink_links=[[0, 1], [1, 0]], nvlink_gbps_per_link=nvlink_gbps, nvlink_efficiency=1.0,
                    pcie_latency_s=0.0, nvlink_latency_s=0.0)


def toy_setup(stage0, stage1, hw, num_microbatches=4, schedule="1f1b") -> PipelineSetup:
    """Two stages with the given layers, no partitioning (the ranges are the test's)."""
    layers = stage0 + stage1
    profile = Profile(model="gpt-tiny", model_fingerprint=TINY.fingerprint(), source="analytic", device="toy",
                      dtype="fp32", microbatch_size=1, layers=layers)
    ranges = [(0, len(stage0)), (len(stage0), len(layers))]
    sched = build_schedule(schedule, 2, num_microbatches)
    costs = stage_costs(profile, ranges)
    return PipelineSetup(model=TINY, hardware=hw, profile=profile, microbatch_size=1, ranges=ranges, schedule=sched,
                         stage_to_device=[0, 1], costs=costs, memory=memory_model(costs, sched, hw, [0, 1]))


def test_long_lived_tensor_gets_host_swap():
    # Stage 0 holds 2 microbatches x 4 GB of layer a on a 6 GB device: it must shed a.
    # a lives >= 1.5 s (stage 1's F + B run in between); its round trip over a 100 GB/s
    # PCIe is 0.08 s, so the swap hides and costs nothing; recompute would cost 1 ms.
    setup = toy_setup([layer("a", saved=4 * GB, fwd=1e-3, bwd=2e-3)], [layer("b", saved=1 * MB)],
                      toy_hardware(6 * GB))
    r = plan_strategy(setup, "mpress")
    assert r.fits
    assert [technique(r.plan, 0, "a.op#0", m) for m in range(4)] == ["host"] * 4
    assert technique(r.plan, 1, "b.op#0", 0) == "keep"
    none = plan_strategy(setup, "none")
    assert not none.fits
    assert r.evaluation.result.iteration_s == pytest.approx(none.evaluation.result.iteration_s, rel=1e-3)


def test_cheap_short_lived_tensors_get_recompute():
    # The last stage's layers c1, c2 are needed right after they are made (c2's live
    # interval is 0, c1's is c2's 2 ms backward): a host swap would expose most of its
    # 40 ms round trip, recompute costs a 1 ms forward each. 2 + 2 GB of model states +
    # 2 x 2 GB of activations exceed the 7 GB device; recomputing both layers leaves one
    # layer's 2 GB alive at a time during the backward: 6 GB.
    setup = toy_setup([layer("p", saved=1 * MB)],
                      [layer("c1", saved=2 * GB, fwd=1e-3, bwd=2e-3, params=2 * GB),
                       layer("c2", saved=2 * GB, fwd=1e-3, bwd=2e-3, params=1 * MB)], toy_hardware(7 * GB))
    r = plan_strategy(setup, "mpress")
    assert r.fits
    for name in ("c1.op#0", "c2.op#0"):
        assert [technique(r.plan, 1, name, m) for m in range(4)] == ["recompute"] * 4
    assert r.evaluation.result.peak_bytes[r.plan.stage_to_device[1]] == pytest.approx(6 * GB, rel=1e-3)
    assert r.peers == [[], []]  # D2D would be slower than 1 ms of recompute: not used


def test_short_lived_expensive_tensor_gets_d2d():
    # Stage 0 holds 2 microbatches x 1.5 GB of layer x next to 1.5 GB of model states on a
    # 4 GB device. Recomputing x costs its 1 s forward per microbatch; host swap over a
    # 1 GB/s PCIe takes 3 s each way, longer than x lives; NVLink at 100 GB/s takes 15 ms,
    # and stage 1's device has 3 GB to lend: the D2D round moves x there.
    setup = toy_setup([layer("x", saved=int(1.5 * GB), fwd=1.0, bwd=2.0, params=int(0.75 * GB))],
                      [layer("y", saved=1 * MB, fwd=1.0, bwd=2.0)],
                      toy_hardware(4 * GB, pcie_gbps=1.0))
    r = plan_strategy(setup, "mpress")
    assert r.fits, r.reason
    assert [technique(r.plan, 0, "x.op#0", m) for m in range(4)] == ["d2d"] * 4
    lender = r.plan.stage_to_device[1]
    assert r.peers[0] == [lender]
    # 2 in flight x 1.5 GB, plus the quota's slack for the runtime's stripe alignment
    assert r.plan.stages[1].peer_pool_bytes == peer_quota_bytes(3 * GB)
    assert [(q.device, q.quota_bytes) for q in r.plan.stages[0].peer_quotas] == [(lender, peer_quota_bytes(3 * GB))]
    rec = plan_strategy(setup, "recompute")
    assert rec.fits and r.evaluation.result.iteration_s < rec.evaluation.result.iteration_s


def test_plans_differ_per_microbatch_where_that_pays():
    # GPipe, 2 stages x 4 microbatches of 1 s F / 2 s B. Stage 0's layer a (1 GB per
    # microbatch, 4 in flight on a 3 GB device) lives 6, 7, 8, 9 s in microbatches 0..3.
    # Over a 0.4 GB/s PCIe a round trip takes 5 s: it hides in every interval, but the
    # stage's PCIe time over the iteration (4 slots x 3 s = 12 s) carries only two. The
    # two that live longest (2, 3) are swapped, the others recomputed (1 s each, after
    # their gradient arrives): faster than recomputing all four or swapping all four.
    hw = replace(toy_hardware(3 * GB, pcie_gbps=0.4), nvlink_links=[[0, 0], [0, 0]])
    setup = toy_setup([layer("a", saved=1 * GB, fwd=1.0, bwd=2.0)], [layer("b", saved=1 * MB, fwd=1.0, bwd=2.0)],
                      hw, schedule="gpipe")
    r = plan_strategy(setup, "mpress")
    assert r.fits
    assert [technique(r.plan, 0, "a.op#0", m) for m in range(4)] == ["recompute", "recompute", "host", "host"]
    for other in ("recompute", "host-swap"):
        base = plan_strategy(setup, other)
        assert base.fits and r.evaluation.result.iteration_s < base.evaluation.result.iteration_s, other


def test_strategies_that_cannot_fit_say_so():
    # model states alone (2 + 2 GB) exceed what recompute can reach on a 3 GB device
    setup = toy_setup([layer("p", saved=1 * MB)], [layer("c", saved=1 * GB, params=2 * GB)], toy_hardware(3 * GB))
    for name in Strategy.words():
        r = plan_strategy(setup, name)
        assert not r.fits and "peaks at" in r.reason or "find no spare" in r.reason, (name, r.reason)
    with pytest.raises(UserError, match="does not fit even with every tensor swapped: stage 1"):
        check_fits_at_all(setup)


def test_unknown_strategy():
    setup = toy_setup([layer("p")], [layer("q")], toy_hardware(6 * GB))
    with pytest.raises(UserError, match="unknown strategy"):
        plan_strategy(setup, "magic")


def _preset(model, hardware, schedule, mbsize):
    return setup_pipeline(load_model_config(model), load_hardware(hardware), schedule=schedule, num_stages=8,
                          microbatch_size=mbsize, num_microbatches=16)


@pytest.mark.parametrize("model, hardware, schedule, mbsize", [
    ("gpt-20.4b", "dgx1-v100", "1f1b", 2),
    ("gpt-25.5b", "dgx-a100", "1f1b", 2),
    ("bert-6.2b", "dgx1-v100", "pipedream", 12),
])
def test_mpress_fits_the_paper_targets_and_beats_every_fitting_baseline(model, hardware, schedule, mbsize):
    setup = _preset(model, hardware, schedule, mbsize)
    results = {name: plan_strategy(setup, name) for name in Strategy.words()}
    mp = results["mpress"]
    assert mp.fits, mp.reason
    assert mp.host_bytes <= setup.hardware.host_memory_bytes
    assert all(p <= setup.hardware.device.memory_bytes for p in mp.evaluation.result.peak_bytes)
    assert not results["none"].fits
    for name, r in results.items():
        if r.fits:
            assert mp.evaluation.result.iteration_s <= r.evaluation.result.iteration_s * (1 + 1e-9), name
    # the written plan belongs to the setup and re-evaluates to the same iteration
    check_plan_for_setup(mp.plan, setup)
    again = evaluate_plan(setup, mp.plan)
    assert again.result.iteration_s == pytest.approx(mp.evaluation.result.iteration_s)


def test_recompute_only_stops_fitting_before_mpress():
    setup = _preset("gpt-20.4b", "dgx1-v100", "1f1b", 2)
    assert not plan_strategy(setup, "recompute").fits
    assert plan_strategy(setup, "mpress").fits
