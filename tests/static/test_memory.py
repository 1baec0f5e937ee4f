"""The memory model: per-stage bytes by category, imbalance, stashing, and lowering."""

import pytest

from mpress.actions import Action, Kind
from mpress.errors import ScheduleError, UserError
from mpress.hardware import load_hardware
from mpress.static.lowering import TensorInfo, build_channels, build_program, lower_action, peer_transfers
from mpress.static.memory import memory_model, stage_costs
from mpress.static.profile import LayerProfile, Profile, SavedTensor
from mpress.static.schedules import build_schedule

MB = 10**6


def toy_profile(num_layers=8, saved_mb=10, param_mb=4, out_mb=2):
    layers = [
        LayerProfile(
            name=f"layers.{i}", forward_flops=1e9, backward_flops=2e9, forward_time_s=1e-3, backward_time_s=2e-3,
            saved=[SavedTensor(module=f"layers.{i}.fc", index=0, bytes=saved_mb * MB)],
            param_bytes=param_mb * MB, grad_bytes=param_mb * MB, optim_bytes=2 * param_mb * MB,
            output_bytes=out_mb * MB,
        )
        for i in range(num_layers)
    ]
    return Profile(model="toy", model_fingerprint="x", source="analytic", device="t", dtype="fp32",
                   microbatch_size=1, layers=layers)


def test_stage_costs_sum_layers():
    costs = stage_costs(toy_profile(), [(0, 3), (3, 8)])
    assert costs[0].saved_bytes == 30 * MB and costs[1].saved_bytes == 50 * MB
    assert costs[0].input_bytes == 0 and costs[0].output_bytes == 2 * MB
    assert costs[1].input_bytes == 2 * MB and costs[1].output_bytes == 0
    assert costs[1].forward_s == pytest.approx(5e-3)
    with pytest.raises(ScheduleError):
        stage_costs(toy_profile(), [(0, 3), (4, 8)])
    with pytest.raises(ScheduleError):
        stage_costs(toy_profile(), [(0, 3)])


def test_1f1b_imbalance_and_pipedream_stash():
    hw = load_hardware("dgx1-v100")
    ranges = [(2 * s, 2 * s + 2) for s in range(4)]
    costs = stage_costs(toy_profile(), ranges)
    sync = memory_model(costs, build_schedule("1f1b", 4, 8), hw)
    # stage s of 1F1B holds (4 - s) microbatches of 20 MB activations
    assert [m.max_in_flight for m in sync] == [4, 3, 2, 1]
    assert [m.activation_bytes for m in sync] == [80 * MB, 60 * MB, 40 * MB, 20 * MB]
    assert all(m.stash_bytes == 0 for m in sync)
    # model states: 8 MB params + 8 grads + 16 Adam per stage
    assert all(m.model_state_bytes == 32 * MB for m in sync)
    totals = [m.total_bytes for m in sync]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]
    async_ = memory_model(costs, build_schedule("pipedream", 4, 8), hw)
    # PipeDream keeps one parameter version per microbatch in flight: (in_flight - 1) extra
    assert [m.stash_bytes for m in async_] == [24 * MB, 16 * MB, 8 * MB, 0]
    assert all(a.total_bytes >= s.total_bytes for a, s in zip(async_, sync))
    assert async_[0].total_bytes > sync[0].total_bytes


def test_gpipe_holds_every_microbatch():
    hw = load_hardware("dgx1-v100")
    costs = stage_costs(toy_profile(), [(0, 4), (4, 8)])
    mem = memory_model(costs, build_schedule("gpipe", 2, 6), hw)
    assert [m.max_in_flight for m in mem] == [6, 6]


def test_channels_and_peer_paths_follow_topology():
    hw = load_hardware("dgx1-v100")
    ch = build_channels(hw)
    # GPU 0 and 3 share 2 NVLink2 links, 0 and 5 none: 0->5 goes through host over PCIe
    assert ch["nvlink:0->3"].gbps == pytest.approx(2 * ch["nvlink:0->1"].gbps)
    assert "nvlink:0->5" not in ch
    assert [t.channel for t in peer_transfers(hw, 0, 5, 100)] == ["pcie-up:0", "pcie-down:2"]
    # GPUs 0 and 1 share a PCIe switch: one uplink
    assert ch["pcie-up:0"] is ch.get(f"pcie-up:{hw.pcie_group(1)}")
    a100 = load_hardware("dgx-a100")
    assert [t.channel for t in peer_transfers(a100, 0, 5, 100)] == ["nvswitch-out:0"]


def test_lowering_memory_actions():
    hw = load_hardware("dgx1-v100")
    costs = stage_costs(toy_profile(), [(0, 8)])[0]
    tensors = {"t": TensorInfo(bytes=30 * MB, compute_s=0.5e-3, stripes=((1, 1 / 3), (3, 2 / 3)))}
    kw = dict(costs=costs, device=0, hardware=hw, tensors=tensors)
    so = lower_action(Action(0, Kind.SO, 0, "t"), **kw)
    assert so.free_bytes == 30 * MB and so.transfers[0].channel == "pcie-up:0" and so.cost == "host"
    si = lower_action(Action(0, Kind.SI, 0, "t"), **kw)
    assert si.alloc_bytes == 30 * MB and si.transfers[0].channel == "pcie-down:0"
    do = lower_action(Action(0, Kind.DO, 0, "t"), **kw)
    assert [(t.channel, t.bytes) for t in do.transfers] == [("nvlink:0->1", 10 * MB), ("nvlink:0->3", 20 * MB)]
    di = lower_action(Action(0, Kind.DI, 0, "t"), **kw)
    assert [t.channel for t in di.transfers] == ["nvlink:1->0", "nvlink:3->0"]
    rc = lower_action(Action(0, Kind.RC, 0, "t"), **kw)
    assert rc.compute_s == 0.5e-3 and rc.alloc_bytes == 0  # restored bytes are the backward's transient
    b = lower_action(Action(0, Kind.B, 0), **kw, dropped_bytes=30 * MB, recomputed_peak_bytes=10 * MB)
    assert b.free_bytes == costs.saved_bytes - 30 * MB and b.transient_bytes == 10 * MB
    # a checkpointed forward never holds what it drops: F takes less, DR frees nothing
    assert lower_action(Action(0, Kind.DR, 0, "t"), **kw).free_bytes == 0
    f = lower_action(Action(0, Kind.F, 0), **kw, dropped_bytes=30 * MB)
    assert f.alloc_bytes == costs.saved_bytes - 30 * MB
    with pytest.raises(UserError, match="does not describe"):
        lower_action(Action(0, Kind.SO, 0, "nope"), **kw)
    bad = {"t": TensorInfo(bytes=1, stripes=((5, 1.0),))}  # GPU 0 has no NVLink to GPU 5
    with pytest.raises(UserError, match="no NVLink"):
        lower_action(Action(0, Kind.DO, 0, "t"), costs=costs, device=0, hardware=hw, tensors=bad)


def test_build_program_shapes():
    hw = load_hardware("dgx1-v100")
    sched = build_schedule("1f1b", 4, 8)
    prog = build_program(toy_profile(), [(2 * s, 2 * s + 2) for s in range(4)], sched, hw, microbatch_size=2)
    assert len(prog.ranks) == 4 and prog.rank_device == (0, 1, 2, 3)
    assert prog.samples_per_iteration == 16
    assert prog.model_flops_per_iteration == pytest.approx(8 * 3e9 * 8)
    assert set(prog.sends) == {(0, 1), (1, 2), (2, 3)} and set(prog.grad_sends) == {(1, 0), (2, 1), (3, 2)}
    f = next(t for t in prog.ranks[0] if t.action.kind is Kind.F)
    assert f.alloc_bytes == 20 * MB and f.compute_s == pytest.approx(2e-3)
    with pytest.raises(UserError):
        build_program(toy_profile(), [(0, 8)], sched, hw, microbatch_size=2)


def test_optimizer_states_striped_over_peers_travel_nvlink():
    hw = load_hardware("dgx1-v100")
    costs = stage_costs(toy_profile(), [(0, 8)])[0]
    tensors = {"o": TensorInfo(bytes=30 * MB, stripes=((1, 1 / 3), (3, 2 / 3)))}
    kw = dict(costs=costs, device=0, hardware=hw, tensors=tensors)
    oo = lower_action(Action(0, Kind.OO, None, "o"), **kw)
    assert [(t.channel, t.bytes) for t in oo.transfers] == [("nvlink:0->1", 10 * MB), ("nvlink:0->3", 20 * MB)]
    assert oo.free_bytes == 30 * MB
    oi = lower_action(Action(0, Kind.OI, None, "o"), **kw)
    assert [t.channel for t in oi.transfers] == ["nvlink:1->0", "nvlink:3->0"] and oi.alloc_bytes == 30 * MB
    host = lower_action(Action(0, Kind.OO, None, "t"), costs=costs, device=0, hardware=hw,
                        tensors={"t": TensorInfo(bytes=5)})
    assert [t.channel for t in host.transfers] == ["pcie-up:0"]
