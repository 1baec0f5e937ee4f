"""The memory model (per-stage bytes by category, imbalance, stashing) and the lowering of
action lists into layer tasks with their memory, copies and release points."""

from dataclasses import replace

import pytest

from mpress.contract.actions import parse_actions
from mpress.errors import ScheduleError, UserError
from mpress.hardware.server import load_hardware
from mpress.static.emulate.lowering import (
    TensorInfo,
    build_channels,
    build_program,
    lower_rank,
    lower_rank_traced,
    optimizer_transient_bytes,
    peer_transfers,
)
from mpress.static.memory.model import memory_model
from mpress.static.memory.stage_costs import stage_costs
from mpress.static.profile.profile import LayerMemory, LayerProfile, Profile, SavedTensor
from mpress.static.emulate.program import walk_peaks
from mpress.static.schedules import build_schedule

MB = 10**6
DGX1 = load_hardware("dgx1-v100")


def toy_profile(num_layers=8, saved_mb=10, param_mb=4, out_mb=2):
    """Each layer saves `saved_mb` new bytes and not its input, keeps its output: kept
    saved + out; its forward holds 2 MB more for a moment, its backward 8 MB."""
    memory = LayerMemory(kept_bytes=(saved_mb + out_mb) * MB, forward_peak_bytes=(saved_mb + out_mb + 2) * MB,
                         backward_peak_bytes=8 * MB, input_grad_bytes=out_mb * MB, output_bytes=out_mb * MB)
    layers = [
        LayerProfile(
            name=f"layers.{i}", forward_flops=1e9, backward_flops=2e9, forward_time_s=1e-3, backward_time_s=2e-3,
            saved=[SavedTensor(module=f"layers.{i}.fc", index=0, bytes=saved_mb * MB)],
            param_bytes=param_mb * MB, grad_bytes=param_mb * MB, optim_bytes=2 * param_mb * MB,
            output_bytes=out_mb * MB, memory=memory,
        )
        for i in range(num_layers)
    ]
    return Profile(model="toy", model_fingerprint="x", source="analytic", device="t", dtype="fp32",
                   microbatch_size=1, layers=layers, input_bytes=1 * MB, target_bytes=MB // 2)


def test_stage_costs_sum_layers():
    costs = stage_costs(toy_profile(), [(0, 3), (3, 8)])
    assert costs[0].saved_bytes == 30 * MB and costs[1].saved_bytes == 50 * MB
    assert costs[0].input_bytes == 0 and costs[0].output_bytes == 2 * MB
    assert costs[1].input_bytes == 2 * MB and costs[1].output_bytes == 0
    # the input batch on the first stage, the targets on the last
    assert costs[0].batch_bytes == 1 * MB and costs[1].batch_bytes == MB // 2
    assert stage_costs(toy_profile(), [(0, 8)])[0].batch_bytes == 1 * MB + MB // 2
    assert costs[1].forward_s == pytest.approx(5e-3)
    with pytest.raises(ScheduleError):
        stage_costs(toy_profile(), [(0, 3), (4, 8)])
    with pytest.raises(ScheduleError):
        stage_costs(toy_profile(), [(0, 3)])


def test_1f1b_imbalance_and_pipedream_stash():
    ranges = [(2 * s, 2 * s + 2) for s in range(4)]
    costs = stage_costs(toy_profile(), ranges)
    sync = memory_model(costs, build_schedule("1f1b", 4, 8), DGX1)
    # stage s of 1F1B holds (4 - s) microbatches; a 2-layer stage's forward keeps
    # 12 + 12 MB less the first layer's output (the second does not save it): 22 MB
    assert [m.max_in_flight for m in sync] == [4, 3, 2, 1]
    assert [m.activation_bytes_per_microbatch for m in sync] == [22 * MB] * 4
    assert [m.activation_bytes for m in sync] == [88 * MB, 66 * MB, 44 * MB, 22 * MB]
    assert all(m.stash_bytes == 0 for m in sync)
    # model states: 8 MB params + 8 grads + 16 Adam per stage
    assert all(m.model_state_bytes == 32 * MB for m in sync)
    # receive buffers per microbatch: input activation (2 MB, not on stage 0) and output
    # gradient (2 MB, not on stage 3); the batch (1 MB) on stage 0, the targets (0.5 MB) on 3
    assert [m.buffer_bytes for m in sync] == [24 * MB, 32 * MB, 32 * MB, 20 * MB]
    # transient: the larger of a forward's 2 MB beyond what its layer keeps (14 - 12) and
    # a backward's 8 MB
    assert all(m.transient_bytes == 8 * MB and m.capacity_bytes == DGX1.usable_memory_bytes for m in sync)
    assert [m.total_bytes for m in sync] == [152 * MB, 138 * MB, 116 * MB, 82 * MB]
    async_ = memory_model(costs, build_schedule("pipedream", 4, 8), DGX1)
    # PipeDream keeps one parameter version per microbatch in flight: (in_flight - 1) extra
    assert [m.stash_bytes for m in async_] == [24 * MB, 16 * MB, 8 * MB, 0]
    assert all(a.total_bytes >= s.total_bytes for a, s in zip(async_, sync))
    assert async_[0].total_bytes > sync[0].total_bytes


def test_gpipe_holds_every_microbatch():
    costs = stage_costs(toy_profile(), [(0, 4), (4, 8)])
    mem = memory_model(costs, build_schedule("gpipe", 2, 6), DGX1)
    assert [m.max_in_flight for m in mem] == [6, 6]


def test_channels_and_peer_paths_follow_topology():
    ch = build_channels(DGX1)
    # GPU 0 and 3 share 2 NVLink2 links, 0 and 5 none: 0->5 goes through host over PCIe
    assert ch["nvlink:0->3"].gbps == pytest.approx(2 * ch["nvlink:0->1"].gbps)
    assert "nvlink:0->5" not in ch
    # through host DRAM: written by 0's uplink, read by 5's
    assert [t.channel for t in peer_transfers(DGX1, 0, 5, 100)] == ["pcie-up:0", "host-mem", "pcie-down:2", "host-mem"]
    # GPUs 0 and 1 share a PCIe switch: one uplink
    assert ch["pcie-up:0"] is ch.get(f"pcie-up:{DGX1.pcie_group(1)}")
    a100 = load_hardware("dgx-a100")
    assert [t.channel for t in peer_transfers(a100, 0, 5, 100)] == ["nvswitch-out:0", "nvswitch-in:5"]


# ---- lowering -----------------------------------------------------------------------------------

def small_stage():
    """One stage of two layers (bytes): each keeps 12 (10 saved + its output 2), saves
    neither its input nor its output, holds 2 more in forward and 9 in backward, hands on
    an input gradient of 2; recomputed it keeps its input and its output only (2) and holds
    14 in forward and 20 in backward; parameters 4, gradients 4, Adam 8 (1 parameter each)."""
    plain = LayerMemory(kept_bytes=12, forward_peak_bytes=14, backward_peak_bytes=9, input_grad_bytes=2,
                        output_bytes=2)
    recomputed = LayerMemory(kept_bytes=2, forward_peak_bytes=14, saves_input=True, backward_peak_bytes=20,
                             input_grad_bytes=2, output_bytes=2)
    layers = [LayerProfile(name=f"layers.{i}", forward_flops=1e9, backward_flops=2e9, forward_time_s=1e-3,
                           backward_time_s=2e-3, param_bytes=4, grad_bytes=4, optim_bytes=8, largest_param_bytes=4,
                           output_bytes=2, memory=plain, recompute_memory=recomputed) for i in range(2)]
    profile = Profile(model="toy", model_fingerprint="x", source="analytic", device="t", dtype="fp32",
                      microbatch_size=1, layers=layers)
    return stage_costs(profile, [(0, 2)])


U0, U1 = "0:layers.0.**@r0", "0:layers.1.**@r1"
TENSORS = {U0: TensorInfo(bytes=10), U1: TensorInfo(bytes=10)}


def lower(text: str, tensors=None, **kw):
    return lower_rank(parse_actions(text), costs=small_stage(), devices=[0], hardware=DGX1,
                      tensors=TENSORS if tensors is None else tensors, **kw)


def test_lowering_layer_tasks_copies_and_release_points():
    # mb 0: layer 0's unit swapped to host, layer 1's dropped and recomputed; mb 1 kept.
    text = f"0F0 0SO0:{U0} 0DR0:{U1} 0F1 0SI0:{U0} 0B0 0RC0:{U1} 0B1 0OPT"
    tasks, origins = lower_rank_traced(parse_actions(text), costs=small_stage(), devices=[0], hardware=DGX1,
                                       tensors=TENSORS)
    rows = [(t.label(), t.alloc_bytes, t.transient_bytes, t.free_bytes, t.starts_action, t.release_bytes, t.consumes)
            for t in tasks]
    assert rows == [
        ("0F0 L0", 12, 2, 0, True, 0, ()),
        (f"0SO0:{U0}", 0, 0, 0, False, 0, ()),       # its copy-out, right after its layer
        ("0F0 L1", 2, 12, 0, False, 0, ()),          # checkpointed: keeps its input (saved) and output
        (f"0DR0:{U1}", 0, 0, 0, False, 0, ()),       # a marker
        ("0F1 L0", 12, 2, 0, True, 10, ()),          # the release point of the swap-out
        ("0F1 L1", 12, 2, 2, False, 0, ()),          # layer 0's output dies here
        (f"0SI0:{U0}", 10, 0, 0, False, 0, ()),
        (f"0RC0:{U1} L1", 0, 0, 0, True, 0, ()),     # the recompute starts the backward
        # first backward: input gradient 2 + parameters' 4; recomputed layer 1 gives back
        # its saved input (layer 0's output, 2); what it kept is the stage's output
        ("0B0 L1", 6, 14, 2, False, 0, ()),
        # 10 saved, layer 1's gradient 2, the stage's output 2; waits for its unit
        ("0B0 L0", 6, 3, 14, False, 0, (U0,)),
        ("0B1 L1", 2, 7, 10, True, 0, ()),
        ("0B1 L0", 2, 7, 14, False, 0, ()),
        # the gradients (4 + 4) go; Adam's temporaries over a layer's fused group: 2 x 4 x 1
        ("0OPT", 0, 8, 8, True, 0, ()),
    ]
    # a recompute takes its layer's forward time
    assert [t.compute_s for t in tasks if t.action.is_compute][:-1] == [1e-3] * 5 + [2e-3] * 4
    assert origins == [0, 0, 0, 0, 3, 3, 4, 5, 5, 5, 7, 7, 8]
    assert [(x.channel, x.bytes) for x in tasks[1].transfers] == [("pcie-up:0", 10), ("host-mem", 10)]
    assert [(x.channel, x.bytes) for x in tasks[6].transfers] == [("pcie-down:0", 10), ("host-mem", 10)]
    assert (tasks[1].cost, tasks[3].cost, tasks[7].cost) == ("host", "drop", "recompute")
    assert walk_peaks(tasks, 0) == [14, 12, 26, 14, 18, 30, 36, 36, 56, 49, 41, 33, 20]
    # what is left: the input gradients of the stage (2 per microbatch): lowered without
    # `late`, nothing gives them back (test_schedule_holds.py has the schedule's late frees)
    assert sum(t.alloc_bytes - t.free_bytes - t.release_bytes for t in tasks) == 4


def test_a_copy_out_with_no_release_point_after_it_gives_back_when_it_ends():
    tasks = lower(f"0F0 0SO0:{U0}")
    assert tasks[1].free_bytes == 10 and tasks[1].alloc_bytes == 0


def test_weight_stashing_takes_a_weight_version_per_forward():
    f0, _, _, b0 = lower("0F0 0B0", weight_stashing=True)
    assert f0.alloc_bytes == 12 + 8 and b0.free_bytes == 14 + 8


def test_optimizer_temporaries_fused_or_one_tensor_at_a_time():
    layer = small_stage()[0].layers[0]  # 1 parameter: 4 bytes, Adam 8, largest tensor 4
    # fused multi-tensor Adam: 2 x 4 bytes per parameter of the group
    assert optimizer_transient_bytes(layer, DGX1) == 8
    # torch's one-tensor loop: the square root and the denominator of a tensor while the
    # previous tensor's denominator is still referenced: 3 x its largest tensor
    one_tensor = replace(DGX1, optimizer_foreach=False)
    assert optimizer_transient_bytes(layer, one_tensor) == 3 * 4
    # mixed precision adds the fp32 gradients of the master weights (4 bytes per parameter)
    assert optimizer_transient_bytes(replace(layer, master_bytes=4), one_tensor) == 3 * 4 + 4
    opt = lower_rank(parse_actions("0F0 0B0 0OPT"), costs=small_stage(), devices=[0], hardware=one_tensor,
                     tensors={})[-1]
    assert (opt.label(), opt.transient_bytes, opt.free_bytes) == ("0OPT", 12, 8)


def test_d2d_copies_follow_their_stripes():
    tensors = {U0: TensorInfo(bytes=30, stripes=((1, 1 / 3), (3, 2 / 3)))}
    tasks = lower(f"0F0 0DO0:{U0} 0F1 0DI0:{U0} 0B0 0B1", tensors)
    do, di = tasks[1], tasks[5]
    assert [(t.channel, t.bytes) for t in do.transfers] == [("nvlink:0->1", 10), ("nvlink:0->3", 20)]
    assert [t.channel for t in di.transfers] == ["nvlink:1->0", "nvlink:3->0"]
    assert do.cost == "d2d" and di.alloc_bytes == 30 and tasks[3].release_bytes == 30


def test_optimizer_states_striped_over_peers_travel_nvlink():
    o = "0:optim:layers.0"
    tensors = {o: TensorInfo(bytes=30, compute_s=1e-4, stripes=((1, 1 / 3), (3, 2 / 3)))}
    tasks = lower(f"0F0 0B0 0OI:{o} 0OPT:{o} 0OO:{o} 0OPT", tensors)
    oi, step, oo, rest = tasks[4:]
    assert [t.channel for t in oi.transfers] == ["nvlink:1->0", "nvlink:3->0"] and oi.alloc_bytes == 30
    # the chunk's step gives back its layer's gradients and waits for its states
    assert (step.compute_s, step.free_bytes, step.consumes) == (1e-4, 4, (o,))
    assert [(t.channel, t.bytes) for t in oo.transfers] == [("nvlink:0->1", 10), ("nvlink:0->3", 20)]
    # the step of the rest of the stage is its release point and frees the other gradients
    assert (rest.release_bytes, rest.free_bytes) == (30, 4)
    host = lower(f"0F0 0B0 0OO:{o}", {o: TensorInfo(bytes=5)})[-1]
    assert [t.channel for t in host.transfers] == ["pcie-up:0", "host-mem"] and host.free_bytes == 5


def test_lowering_errors_say_what_is_wrong():
    with pytest.raises(UserError, match="does not describe"):
        lower(f"0F0 0SO0:{U0}", {})
    with pytest.raises(UserError, match="no NVLink"):  # GPU 0 has no NVLink to GPU 5
        lower(f"0F0 0DO0:{U0}", {U0: TensorInfo(bytes=1, stripes=((5, 1.0),))})
    with pytest.raises(ScheduleError, match="which stage 0 does not hold"):
        lower("0F0 0SO0:0:layers.9.**@r0", {"0:layers.9.**@r0": TensorInfo(bytes=1)})
    with pytest.raises(ScheduleError, match="not inside the F or B it belongs to"):
        lower(f"0F0 0RC0:{U1} 0B0")


def test_build_program_shapes():
    sched = build_schedule("1f1b", 4, 8)
    prog = build_program(toy_profile(), [(2 * s, 2 * s + 2) for s in range(4)], sched, DGX1, microbatch_size=2)
    assert len(prog.ranks) == 4 and prog.rank_device == (0, 1, 2, 3)
    assert prog.samples_per_iteration == 16
    assert prog.model_flops_per_iteration == pytest.approx(8 * 3e9 * 8)
    assert set(prog.sends) == {(0, 1), (1, 2), (2, 3)} and set(prog.grad_sends) == {(1, 0), (2, 1), (3, 2)}
    # 8 forwards and 8 backwards of 2 layer tasks each, and the optimizer step
    assert [len(r) for r in prog.ranks] == [33] * 4
    f = prog.ranks[0][0]
    assert (f.label(), f.alloc_bytes, f.compute_s) == ("0F0 L0", 12 * MB, 1e-3)
    # parameters 8 + Adam 16 + the receive buffers and batch (see the 1F1B test)
    assert prog.static_bytes == (48 * MB, 56 * MB, 56 * MB, 44 * MB)
    assert prog.device_capacity_bytes == (DGX1.usable_memory_bytes,) * DGX1.num_devices
    with pytest.raises(UserError):
        build_program(toy_profile(), [(0, 8)], sched, DGX1, microbatch_size=2)
