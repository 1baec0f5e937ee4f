"""The out-of-core model on one device (`mpress.static.ooc_*`): what its sweeps must show by
construction. Small models (gpt-tiny analytic on cpu-local) so that every case is quick."""

from dataclasses import replace

import pytest

from mpress.errors import UserError
from mpress.hardware.server import load_hardware
from mpress.static.studies.ooc_model import (
    host_link_gbps,
    load_ooc_model,
    num_microbatches_for,
    ooc_setup,
    single_device,
    with_host_link,
)
from mpress.contract.plan_check import host_bytes
from mpress.static.plan.rewriter import host_step_bytes
from mpress.static.studies.ooc_point import POLICIES, evaluate_point, reemulate
from mpress.static.studies.ooc_sweeps import (
    DEFAULT_OVER,
    bandwidth_sweep,
    batch_sweep,
    batch_sweep_json,
    default_batch_sizes,
    footprint_bytes,
    knee_batch,
)
from mpress.config.vocabulary import SwapInPolicy

MB = 2  # microbatch size: the swap unit


@pytest.fixture(scope="module")
def tiny():
    """gpt-tiny, microbatch 2, on one cpu-local device whose capacity sits between the
    footprints of 2 and 4 microbatches (so 4 microbatches and more need host swap)."""
    hw = single_device(load_hardware("cpu-local"))
    model = load_ooc_model(model="gpt-tiny", module=None, hardware=hw, microbatch_size=MB)
    two, four = footprint_bytes(model, hw, 2 * MB), footprint_bytes(model, hw, 4 * MB)
    return model, single_device(load_hardware("cpu-local"), (two + four) // 2)


def test_single_device_has_one_device_and_the_capacity_asked_for():
    hw = single_device(load_hardware("dgx1-v100"), 5_000_000_000)  # a mesh preset, cut to one GPU
    assert hw.num_devices == 1 and hw.pcie_switches == []
    assert hw.usable_memory_bytes == 5_000_000_000
    assert single_device(load_hardware("hgx-h100")).usable_memory_bytes == load_hardware("hgx-h100").usable_memory_bytes
    assert host_link_gbps(with_host_link(hw, 450.0)) == 450.0


def test_a_batch_runs_as_microbatches_on_one_stage(tiny):
    model, hw = tiny
    setup = ooc_setup(model, hw, 5 * MB)
    assert setup.schedule.num_stages == 1 and setup.schedule.num_microbatches == 5
    assert setup.schedule.name == "gpipe"
    with pytest.raises(UserError, match="not a multiple of"):
        num_microbatches_for(model, 3)
    with pytest.raises(UserError, match="one device"):
        ooc_setup(model, load_hardware("cpu-local"), MB)


def test_batch_sweep_is_the_in_memory_run_below_the_knee_and_fits_above(tiny):
    model, hw = tiny
    points = batch_sweep(model, hw, [MB, 2 * MB, 4 * MB, 8 * MB, 16 * MB])
    knee = knee_batch(points)
    assert knee == 4 * MB  # the capacity lies between the footprints of 2 and 4 microbatches
    for p in points:
        for policy in POLICIES:
            run = p.runs[policy]
            if p.batch_size < knee:
                # flat: nothing is swapped, the policy's run is the in-memory one
                assert not run.swapped and run.normalised == 1.0
                assert run.samples_per_s == pytest.approx(p.in_memory_samples_per_s)
            else:
                assert p.over_capacity and run.swapped and run.fits
                assert run.peak_bytes <= p.capacity_bytes < p.footprint_bytes
                assert run.normalised >= 1.0 - 1e-12  # copies only add waits
    # footprints grow with the batch; the in-memory time is the reference of every row
    assert [p.footprint_bytes for p in points] == sorted(p.footprint_bytes for p in points)
    data = batch_sweep_json(points)
    assert data["knee_batch_size"] == knee and len(data["points"]) == 5


def test_default_batch_sizes_run_past_the_memory(tiny):
    model, hw = tiny
    sizes = default_batch_sizes(model, hw)
    assert sizes[0] == MB and all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert footprint_bytes(model, hw, sizes[-1]) >= DEFAULT_OVER * hw.usable_memory_bytes
    assert footprint_bytes(model, hw, sizes[-2]) < DEFAULT_OVER * hw.usable_memory_bytes


def test_stalls_are_blamed_on_swapped_tensors_of_the_plan(tiny):
    model, hw = tiny
    point = evaluate_point(model, with_host_link(hw, 0.5), 16 * MB)  # a slow link: swaps cannot hide
    for policy in POLICIES:
        run = point.runs[policy]
        assert run.plan is not None and run.plan.swap_in_policy is policy
        assert run.stall_s > 0 and run.stall_s_by_cost.get("host", 0) > 0
        assert run.top_stalls and run.top_stalls[0][1] > 0
        patterns = [r.tensor.removesuffix(".**") for r in run.plan.stages[0].rules]
        layer = run.top_stalls[0][0].split(":", 1)[1].split("@")[0].removesuffix(".**")
        assert layer in patterns  # blamed on a tensor the plan swaps
        # one action ahead: the out-of-core model's lead for both policies
        assert {r.prefetch_lead for r in run.plan.stages[0].rules if not r.tensor.startswith("optim")} == {1}


def test_capacity_policy_brings_tensors_back_no_later_than_layer_ahead(tiny):
    model, hw = tiny
    point = evaluate_point(model, with_host_link(hw, 0.5), 16 * MB)
    ahead, capacity = point.runs[SwapInPolicy.LAYER_AHEAD], point.runs[SwapInPolicy.CAPACITY]
    # the same tensors go to the host; capacity placement only moves swap-ins earlier, so
    # its device holds at least as much at its peak
    assert [r.tensor for r in ahead.plan.stages[0].rules] == [r.tensor for r in capacity.plan.stages[0].rules]
    assert capacity.peak_bytes >= ahead.peak_bytes


def test_bandwidth_sweep_falls_to_the_in_memory_time(tiny):
    model, hw = tiny
    # without latency, and without cpu-local's host DRAM bound on every copy, an
    # infinitely fast link costs nothing
    hw = replace(hw, pcie_latency_s=0.0, host_memory_gbps=None)
    gbps = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 450.0, 1e4, 1e7]
    rows = bandwidth_sweep(model, hw, 16 * MB, gbps)
    assert [r.gbps for r in rows] == gbps
    for policy in POLICIES:
        times = [r.point.runs[policy].normalised for r in rows]
        assert all(t >= 1.0 - 1e-12 for t in times)
        assert all(b <= a + 1e-12 for a, b in zip(times, times[1:])), times  # non-increasing
        assert times[0] > 1.05  # a slow link shows
        assert times[-1] == pytest.approx(1.0, abs=1e-6)
        # one plan, emulated at every bandwidth
        assert len({id(r.point.runs[policy].plan) for r in rows}) == 1
    with pytest.raises(UserError, match="> 0 GB/s"):
        bandwidth_sweep(model, hw, 16 * MB, [0.0])


def test_conv_net_is_profiled_layer_by_layer():
    hw = single_device(load_hardware("cpu-local"))
    model = load_ooc_model(model="vgg16", module=None, hardware=hw, microbatch_size=2, image_size=32, width_div=16)
    names = [x.name for x in model.profile.layers]
    assert model.kind == "conv" and model.microbatch_size == 2
    assert names[0] == "features.0" and names[-1] == "head" and len(names) == 32  # 13 conv + 13 ReLU + 5 pool + head
    with pytest.raises(UserError, match="--layers"):
        load_ooc_model(model="vgg16", module=None, hardware=hw, microbatch_size=2, layers=["features"])


def test_a_policys_host_figure_is_what_its_plan_pins(tiny):
    """A policy's host figure is the plan's host sum (`plan_check.host_bytes`, which the
    plan check and the planner read): its pool, and the staging slabs of a stage whose
    optimizer steps on the host (pinned apart from the pool), not the pool alone."""
    model, hw = tiny
    point = evaluate_point(model, hw, 8 * MB)
    costs = ooc_setup(model, hw, 8 * MB).costs
    for run in point.runs.values():
        assert run.host_bytes == host_bytes(run.plan, host_step_bytes(run.plan, costs)).pinned > 0
    # the same swaps with the stage's optimizer stepping on the host, emulated again
    stepped = {policy: replace(run, plan=replace(run.plan, stages=[replace(run.plan.stages[0], optimizer_step="host")]))
               for policy, run in point.runs.items()}
    again = reemulate(replace(point, runs=stepped), model, hw)
    for policy, run in again.runs.items():
        need = host_bytes(run.plan, host_step_bytes(run.plan, costs))
        assert need.slabs > 0 and run.host_bytes == need.pinned == need.pools + need.slabs, policy
