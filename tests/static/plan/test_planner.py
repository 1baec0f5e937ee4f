"""The planner on hand-checked toy pipelines, its baselines, and the preset targets."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpress.errors import UserError
from mpress.hardware.server import DeviceSpec, Hardware, load_hardware
from mpress.contract.identity import StageRules
from mpress.config.model_config import load_model_config
from mpress.contract.plan import TensorRule
from mpress.static.plan.evaluate import PipelineSetup, setup_pipeline
from mpress.static.memory.model import memory_model
from mpress.static.memory.stage_costs import stage_costs
from mpress.config.units import ALIGNMENT_BYTES, round_up
from mpress.static.plan.plan_eval import check_plan_for_setup, evaluate_plan
from mpress.static.plan.balance_choice import check_fits_at_all
from mpress.static.plan.planner import PlannerOptions, plan_strategy
from mpress.static.profile.profile import LayerMemory, LayerProfile, Profile, SavedTensor
from mpress.static.schedules import build_schedule
from mpress.config.vocabulary import Strategy


def technique(plan, stage: int, tensor: str, microbatch: int) -> str:
    """What the plan does with `tensor` of `stage` in `microbatch`, read as both halves read it."""
    return StageRules(plan.stage(stage), []).technique(tensor, microbatch)


GB = 10**9
MB = 10**6
TINY = load_model_config("gpt-tiny")  # only its fingerprint ties the toy profile to a model


def layer(name, *, saved=0, fwd=0.5, bwd=1.0, params=1 * MB, out=1 * MB, optim=0):
    """A toy layer that saves `saved` bytes of its own for its backward (not its input) and
    hands `out` bytes on, with `optim` bytes of Adam states. Its memory as the probe would
    count it: the forward keeps saved + out; the backward makes its input's gradient (`out`
    bytes: the toy keeps the width). Checkpointed (recomputed), it keeps only its output
    (and its input), and holds `saved` again while its forward runs and while its backward
    recomputes it."""
    plain = LayerMemory(kept_bytes=saved + out, forward_peak_bytes=saved + out, backward_peak_bytes=out,
                        input_grad_bytes=out, output_bytes=out)
    recomputed = LayerMemory(kept_bytes=out, forward_peak_bytes=saved + out, saves_input=True,
                             backward_peak_bytes=saved + out, input_grad_bytes=out, output_bytes=out)
    return LayerProfile(name=name, forward_flops=1e9, backward_flops=2e9, forward_time_s=fwd, backward_time_s=bwd,
                        saved=[SavedTensor(module=f"{name}.op", index=0, bytes=saved)] if saved else [],
                        param_bytes=params, grad_bytes=params, optim_bytes=optim, output_bytes=out, memory=plain,
                        recompute_memory=recomputed)


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


# A swapped-out tensor's bytes leave the device when the rank's next compute action starts,
# and its swap-in is issued before the compute action ahead of its backward: swapping a
# one-layer stage's activations leaves up to three microbatches of them on the device (the
# one just made, the one the next backward needs, the one after). So the swap tests below
# give stage 0 four or more microbatches in flight (GPipe); with 1F1B's two on the first of
# two stages, a swap would take nothing off the peak.


def test_long_lived_tensor_gets_host_swap():
    # GPipe: stage 0 holds 4 microbatches x 4 GB of layer a on a 13 GB device: it must shed
    # a. a lives >= 3 s (stage 1's forwards and backwards run in between); its round trip
    # over a 100 GB/s PCIe is 0.08 s, so the swap hides and costs nothing; recompute would
    # cost its 50 ms forward each time. Swapped, at most three of the four are on the
    # device at once (12 GB).
    setup = toy_setup([layer("a", saved=4 * GB, fwd=0.05, bwd=0.1)], [layer("b", saved=1 * MB)],
                      toy_hardware(13 * GB), schedule="gpipe")
    r = plan_strategy(setup, "mpress")
    assert r.fits, r.reason
    assert [technique(r.plan, 0, "a.op#0", m) for m in range(4)] == ["host"] * 4
    assert technique(r.plan, 1, "b.op#0", 0) == "keep"
    none = plan_strategy(setup, "none")
    assert not none.fits
    assert r.evaluation.result.iteration_s == pytest.approx(none.evaluation.result.iteration_s, rel=1e-3)


def test_cheap_short_lived_tensors_get_recompute():
    # The last stage's layers c1, c2 are needed right after they are made (its backward
    # follows its forward, so a swap could not even start to free them); recompute costs a
    # 1 ms forward each. 2 GB of parameters + 1 microbatch x 2 x 2 GB of activations (+ the
    # gradients from the first backward on) exceed the 7 GB device; recomputing both layers
    # leaves one layer's 2 GB alive at a time.
    setup = toy_setup([layer("p", saved=1 * MB)],
                      [layer("c1", saved=2 * GB, fwd=1e-3, bwd=2e-3, params=2 * GB),
                       layer("c2", saved=2 * GB, fwd=1e-3, bwd=2e-3, params=1 * MB)], toy_hardware(7 * GB))
    r = plan_strategy(setup, "mpress")
    assert r.fits
    for name in ("c1.op#0", "c2.op#0"):
        assert [technique(r.plan, 1, name, m) for m in range(4)] == ["recompute"] * 4
    # the peak is c2's backward in B3: parameters (2 GB + 1 MB), gradients (2 GB + 1 MB),
    # c2's backward (its 2 GB recomputed, the 1 MB gradient it hands to c1), the outputs of
    # c1 and c2 in microbatch 3 (1 + 1 MB), torch's 4 receive buffers (4 x 1 MB) and the
    # gradient of the stage's input of microbatch 2 (1 MB; 1F1B's send of it is let go
    # when B3 has made its own, those of microbatches 0 and 1 are gone)
    assert r.evaluation.result.peak_bytes[r.plan.stage_to_device[1]] == 6 * GB + 10 * MB
    assert r.peers == [[], []]  # D2D would be slower than 1 ms of recompute: not used


def test_short_lived_expensive_tensor_gets_d2d():
    # GPipe: stage 0 holds 4 microbatches x 0.75 GB of layer x next to 1 GB of parameters
    # on a 3.8 GB device. Recomputing x costs its 1 s forward per microbatch; host swap over
    # a 0.1 GB/s PCIe takes 7.5 s each way, longer than x lives (6..9 s); NVLink at
    # 100 GB/s takes 7.5 ms, and stage 1's device has 3 GB to lend once the CUDA context
    # stage 0's process opens on it (PEER_CONTEXT_BYTES) is left free: the D2D round moves
    # x there.
    setup = toy_setup([layer("x", saved=int(0.75 * GB), fwd=1.0, bwd=2.0, params=int(1.0 * GB))],
                      [layer("y", fwd=1.0, bwd=2.0)],
                      toy_hardware(int(3.8 * GB), pcie_gbps=0.1), schedule="gpipe")
    r = plan_strategy(setup, "mpress")
    assert r.fits, r.reason
    assert [technique(r.plan, 0, "x.op#0", m) for m in range(4)] == ["d2d"] * 4
    lender = r.plan.stage_to_device[1]
    assert r.peers[0] == [lender]
    # 4 in flight: four slots of x's 0.75 GB unit (rounded up to the pools' alignment),
    # what the runtime's quota carves for them
    slots = 4 * round_up(int(0.75 * GB), ALIGNMENT_BYTES)
    assert r.plan.stages[1].peer_pool_bytes == slots
    assert [(q.device, q.quota_bytes) for q in r.plan.stages[0].peer_quotas] == [(lender, slots)]
    rec = plan_strategy(setup, "recompute")
    assert rec.fits and r.evaluation.result.iteration_s < rec.evaluation.result.iteration_s


def test_d2d_is_weighed_per_tensor_from_the_first_step():
    # The case above without the D2D rounds: stage 1's device has spare memory by the
    # memory model before anything is compacted, so the first step already weighs x's D2D
    # swap (7.5 ms each way over NVLink, hidden in its 6..9 s live interval) against its
    # host swap (exposed: 7.5 s each way over the 0.1 GB/s PCIe) and its recompute (1 s
    # per microbatch), and takes D2D.
    setup = toy_setup([layer("x", saved=int(0.75 * GB), fwd=1.0, bwd=2.0, params=int(1.0 * GB))],
                      [layer("y", fwd=1.0, bwd=2.0)],
                      toy_hardware(int(3.8 * GB), pcie_gbps=0.1), schedule="gpipe")
    first_step_only = PlannerOptions(max_d2d_rounds=0)
    r = plan_strategy(setup, "mpress", first_step_only)
    assert r.fits, r.reason
    assert [technique(r.plan, 0, "x.op#0", m) for m in range(4)] == ["d2d"] * 4
    assert r.peers[0] == [r.plan.stage_to_device[1]]
    # where the lender has no room for x's four microbatches in flight, the first step
    # cannot give it D2D, and x is recomputed
    small = toy_setup([layer("x", saved=int(0.75 * GB), fwd=1.0, bwd=2.0, params=int(1.0 * GB))],
                      [layer("y", fwd=1.0, bwd=2.0, params=int(1.2 * GB))],
                      toy_hardware(int(3.8 * GB), pcie_gbps=0.1), schedule="gpipe")
    r = plan_strategy(small, "mpress", first_step_only)
    assert r.fits, r.reason
    assert [technique(r.plan, 0, "x.op#0", m) for m in range(4)] == ["recompute"] * 4


def test_first_step_d2d_yields_to_a_host_swap_that_hides():
    # Peer memory is scarce: where a host swap hides as well (x lives for seconds, PCIe at
    # 100 GB/s takes 7.5 ms each way), the tie goes to the host, even though stage 1's
    # device could take x.
    setup = toy_setup([layer("x", saved=int(0.75 * GB), fwd=1.0, bwd=2.0, params=int(1.0 * GB))],
                      [layer("y", fwd=1.0, bwd=2.0)],
                      toy_hardware(int(3.8 * GB), pcie_gbps=100.0), schedule="gpipe")
    r = plan_strategy(setup, "mpress", PlannerOptions(max_d2d_rounds=0))
    assert r.fits, r.reason
    assert [technique(r.plan, 0, "x.op#0", m) for m in range(4)] == ["host"] * 4
    assert r.peers == [[], []]


def test_plans_differ_per_microbatch_where_that_pays():
    # GPipe, 2 stages x 8 microbatches. Stage 0's layer a (1 GB per microbatch, 8 in
    # flight on a 6.5 GB device) runs first in the stage, so its swap-out hides behind
    # layer c's 1 s forward. The backwards (0.4 s a stage) are shorter than the forwards
    # (1.1 s): a lives 10.5 - 0.7 m s in microbatch m. Over a 1 GB/s PCIe a round trip
    # takes 2 s: it hides in every interval, but the stage's PCIe time over the iteration
    # (8 slots x 1.5 s = 12 s) carries only six. The six that live longest (0..5) are
    # swapped, the others recomputed (0.1 s each): faster than recomputing all eight, or
    # swapping all eight, whose swap-ins the device has no room to bring back early.
    hw = replace(toy_hardware(int(6.5 * GB), pcie_gbps=1.0), nvlink_links=[[0, 0], [0, 0]])
    setup = toy_setup([layer("a", saved=1 * GB, fwd=0.1, bwd=0.2), layer("c", fwd=1.0, bwd=0.2)],
                      [layer("b", fwd=1.1, bwd=0.4)], hw, num_microbatches=8, schedule="gpipe")
    r = plan_strategy(setup, "mpress")
    assert r.fits
    assert [technique(r.plan, 0, "a.op#0", m) for m in range(8)] == ["host"] * 6 + ["recompute"] * 2
    for other in ("recompute", "host-swap"):
        base = plan_strategy(setup, other)
        assert base.fits and r.evaluation.result.iteration_s < base.evaluation.result.iteration_s, other


def test_model_data_stays_when_streaming_it_is_slower_than_recomputing():
    # 1F1B, 4 microbatches; stage 0 holds 2 and four layers of 0.25 GB of parameters (as
    # much of gradients) and 0.5 GB of Adam states each: 4 GB of model states, plus 2 x
    # 1 GB saved by layer a, exceed the 5.5 GB device. Two ways to shed it: recompute a
    # (its forward: 1 ms per microbatch), or stream the 2 GB of Adam states to the host and
    # back around the step (40 ms each way over a 50 GB/s PCIe). The cost model counts the
    # stream as hidden behind the stage's 40 ms backward, so any seed that may put model
    # data on the host sheds it first; the emulation sees it exposed (only the first two
    # layers' chunks come in during the last backwards, the others and every copy out
    # follow them in the step). mpress's recompute seed without model data on the host
    # finds the faster plan.
    hw = replace(toy_hardware(int(5.5 * GB), pcie_gbps=50.0), nvlink_links=[[0, 0], [0, 0]])
    model_data = {"params": GB // 4, "optim": GB // 2, "bwd": 0.01}
    setup = toy_setup([layer("a", saved=1 * GB, fwd=1e-3, **model_data)]
                      + [layer(f"p{i}", fwd=5e-3, **model_data) for i in range(1, 4)],
                      [layer("b", fwd=0.02, bwd=0.04)], hw)
    assert setup.memory[0].model_state_bytes == 4 * GB and not setup.memory[0].fits
    r = plan_strategy(setup, "mpress")
    assert r.fits, r.reason
    assert [[(x.tensor, x.technique, x.microbatches) for x in sp.rules] for sp in r.plan.stages] == [
        [("a.**", "recompute", "all")], []]
    assert r.evaluation.result.iteration_s == plan_strategy(setup, "recompute").evaluation.result.iteration_s
    # streaming the states fits as well (the first seeds' plan), but costs 30 ms more
    stream = evaluate_plan(setup, replace(r.plan, actions=[], stages=[
        replace(r.plan.stages[0], rules=[TensorRule(tensor="optim:*", technique="host")]), r.plan.stages[1]]))
    assert stream.result.fits
    assert stream.result.iteration_s > r.evaluation.result.iteration_s + 0.03


def test_a_pipeline_that_fits_is_left_as_it_is():
    # 1F1B: stage 0 holds 2 microbatches x 1 GB of layer a on a 2.5 GB device. Uncompacted it
    # peaks in B2 at 2.012 GB: a2 and a3 (2 x 1.001 GB), 1 MB of parameters and 1 MB of
    # gradients, 4 x 1 MB receive buffers, the 1 MB input gradients of B0, B1 and B2 (the
    # toy's layer a makes one even on the first stage, where no send takes it and nothing
    # gives it back; a probed first layer makes none), and a0's 1 MB output (its send is
    # held until B2 ends). Every strategy has nothing to shed.
    setup = toy_setup([layer("a", saved=1 * GB)], [layer("b", saved=1 * MB)], toy_hardware(int(2.5 * GB)))
    none = plan_strategy(setup, "none")
    assert none.fits and none.evaluation.result.peak_bytes[0] == 2 * GB + 12 * MB
    for name in Strategy.words():
        r = plan_strategy(setup, name)
        assert r.fits, name
        assert [sp.rules for sp in r.plan.stages] == [[], []], name
        assert r.evaluation.result.iteration_s == none.evaluation.result.iteration_s, name


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
    assert all(p <= setup.hardware.usable_memory_bytes for p in mp.evaluation.result.peak_bytes)
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


def test_d2d_on_interleaved_leaves_nothing_on_peers_without_stripes():
    # interleaved puts two stages on each device, which the device mapper (one stage per
    # device) cannot map: the D2D strategy used to keep the D2D decisions it had made
    # before asking the mapper, and wrote an `optim:*` d2d rule with no stripe
    hw = load_hardware("cpu-local", num_devices=2, memory_bytes=3 * MB)
    setup = setup_pipeline(TINY, hw, schedule="interleaved", num_stages=4, num_ranks=2,
                           microbatch_size=2, num_microbatches=4)
    result = plan_strategy(setup, Strategy.D2D)
    assert all(r.technique != "d2d" for sp in result.plan.stages for r in sp.rules)
    assert not result.fits and "interleaved" in result.reason
    check_plan_for_setup(result.plan, setup)
    evaluate_plan(setup, result.plan)
    # mpress (D2D rounds included) plans it, and its plan checks and emulates
    best = plan_strategy(setup, Strategy.MPRESS)
    assert best.fits
    check_plan_for_setup(best.plan, setup)
    evaluate_plan(setup, best.plan)

