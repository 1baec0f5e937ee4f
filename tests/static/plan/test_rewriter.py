"""mpress.static.plan.rewriter: where a plan's memory actions on activations land in per-rank
action lists, and what they do to memory once lowered.

Expected action strings are derived by hand from the rewriter's placement rules (its
module docstring), counting compute actions (F, B, OPT) of the rank's list from 0:

- SO/DO/DR right after F(s, m); the copy-out's bytes leave at the next compute action
  (its release point), so a swap-in goes before compute action
  max(k - prefetch_lead, p + 2), B(s, m) being action k and F(s, m) action p;
- nothing is swapped when B(s, m) is the compute action right after F(s, m);
- RC right after B(s, m), last layer first.

Memory figures are the walk of the rank's lowered list (`walk_peaks`: per task, the most
bytes while it runs, less the static bytes here), from the toy profile's sizes in
tests.support.rewriter: layer i keeps ACT[i] + OUT[i] = 6.1, 7.2, 8.3, 9.4 MB; its
backward takes the gradient of its input (IN[i]; none for layer 0) and, in the stage's
first backward, 1 MB of parameter gradients, and holds 1 MB more while it runs in later
backwards (the toy's backward peak always counts the gradients). The walk also counts
what torch's schedule holds past a backward (test_schedule_holds.py): 1F1B keeps stage
s's output of forward min(M, S - s) - 2 until the backward after the stage's last
forward ends, and a stage's input gradient until its next backward ends.

Optimizer states and PipeDream's stashed weights are in test_rewriter_model_data.py;
invariants over every schedule in test_rewriter_invariants.py.
"""

from __future__ import annotations

import pytest

from mpress.errors import PlanError
from mpress.contract.plan import Stripe, TensorRule
from mpress.static.emulate.lowering import TensorInfo
from mpress.static.memory.stage_costs import stage_costs
from mpress.static.plan.rewriter import offloaded_optim_bytes, rewrite, stash_offloaded
from mpress.static.schedules import build_schedule
from mpress.static.memory.stage_memory import WHOLE
from tests.support.plans import rule
from tests.support.rewriter import (
    DGX1,
    FAST,
    FWD,
    MB,
    Case,
    expand,
    make_plan,
    rise,
    toy_profile,
)

L0_POOL = 4_000_256 + 1_000_448 + 1_000_448
"""Pool blocks of layer 0's swapped tensors (`TensorInfo.pool_bytes`: each tensor rounded
up to the pools' 512-byte alignment): fc#0 4 MB, fc#1 1 MB, act#0 1 MB."""
L1_POOL = 100_352 + 4_000_256 + 1_000_448 + 2_000_384
"""Layer 1's, with its saved input: ln#0 0.1 MB, fc#0 4 MB, fc#1 1 MB, act#0 2 MB."""
D2D_STRIPES = [Stripe(device=2, fraction=1 / 3), Stripe(device=3, fraction=2 / 3)]
"""GPU 0 of a DGX-1 has 1 NVLink to GPU 2 and 2 to GPU 3: stripes in proportion."""


# -- host swap: placement ------------------------------------------------------------------------


def test_host_swap_of_one_layer_in_every_microbatch() -> None:
    # 1F1B, 2 stages x 4 microbatches; rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3 OPT (actions
    # 0-8). SO right after each F; SI before action max(k - 1, p + 2): B0 (k 2, p 0) -> 2
    # (B0), B1 (4, 1) -> 3 (F2), B2 (6, 3) -> 5 (F3), B3 (7, 5) -> 7 (B3).
    case = Case("1f1b", [(0, 2), (2, 4)], 4, {0: [rule("layers.0.**")]})
    assert case.rank(0) == expand("""
        0F0 0SO0:{T} 0F1 0SO1:{T} 0SI0:{T} 0B0 0SI1:{T} 0F2 0SO2:{T} 0B1 0SI2:{T} 0F3 0SO3:{T}
        0B2 0SI3:{T} 0B3 0OPT""", T="0:layers.0.**@r0")
    assert case.rank(1) == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1OPT"
    # fc#0 + fc#1 + act#0 = 4 + 1 + 1 MB; its saved input (ln#0, the token ids) is the
    # input batch's, which swapping would not free
    assert case.rw.tensors == {"0:layers.0.**@r0": TensorInfo(bytes=6 * MB, pool_bytes=L0_POOL,
                                                                 largest_block_bytes=4_000_256)}  # fc#0
    assert case.rw.schedule.name == "1f1b" and case.rw.schedule.stage_to_rank == (0, 1)


def test_prefetch_lead_moves_swap_ins_earlier() -> None:
    # GPipe, one stage: F0 F1 F2 F3 B0 B1 B2 B3 OPT; B(m) is action 4 + m, F(m) action m.
    # Lead 2: max(2 + m, m + 2): SIs before F2, F3, B0, B1 (lead 1 would give F3, B0, B1, B2).
    case = Case("gpipe", [(0, 4)], 4, {0: [rule("layers.1.**", prefetch_lead=2)]})
    assert case.rank(0) == expand("""
        0F0 0SO0:{T} 0F1 0SO1:{T} 0SI0:{T} 0F2 0SO2:{T} 0SI1:{T} 0F3 0SO3:{T} 0SI2:{T} 0B0 0SI3:{T} 0B1
        0B2 0B3 0OPT""", T="0:layers.1.**@r0")
    # 7 MB of its own, and its input (layer 0's 0.1 MB output), which layer 0 does not keep
    assert case.rw.tensors == {"0:layers.1.**@r0": TensorInfo(bytes=7_100_000, pool_bytes=L1_POOL,
                                                                 largest_block_bytes=4_000_256)}


def test_swap_in_waits_for_its_swap_outs_release_point() -> None:
    # 1F1B, 4 stages x 8 microbatches, lead 3; rank 0 runs F0 F1 F2 F3 B0 F4 B1 F5 B2 F6
    # B3 F7 B4 B5 B6 B7 (actions 0-15). max(k - 3, p + 2) per B: B0 (4, 0) -> 2 (F2: lead
    # alone gives F1, SO0's release point), B1 (6, 1) -> 3 (F3), B2 (8, 2) -> 5 (F4), B3
    # (10, 3) -> 7 (F5), B4 (12, 5) -> 9 (F6), B5 (13, 7) -> 10 (B3), B6 (14, 9) -> 11
    # (F7), B7 (15, 11) -> 13 (B5: lead alone gives B4, SO7's release point).
    case = Case("1f1b", [(0, 1), (1, 2), (2, 3), (3, 4)], 8, {0: [rule("layers.0.**", prefetch_lead=3)]})
    assert case.rank(0) == expand("""
        0F0 0SO0:{T} 0F1 0SO1:{T} 0SI0:{T} 0F2 0SO2:{T} 0SI1:{T} 0F3 0SO3:{T} 0B0 0SI2:{T} 0F4 0SO4:{T}
        0B1 0SI3:{T} 0F5 0SO5:{T} 0B2 0SI4:{T} 0F6 0SO6:{T} 0SI5:{T} 0B3 0SI6:{T} 0F7 0SO7:{T} 0B4
        0SI7:{T} 0B5 0B6 0B7 0OPT""", T="0:layers.0.**@r0")


def test_rule_on_one_tensor_moves_only_that_tensor() -> None:
    # a unit is what one rule decides in one layer: two rules on layer 1 make two units.
    # 1F1B rank 0 of 2 microbatches: F0 F1 B0 B1 OPT; SIs before B0 (max(1, 2)) and B1 (max(2, 3))
    case = Case("1f1b", [(0, 2), (2, 4)], 2, {0: [rule("layers.1.fc#0"), rule("layers.1.*#*", "host")]})
    assert case.rank(0) == expand("""
        0F0 0SO0:{A} 0SO0:{B} 0F1 0SO1:{A} 0SO1:{B} 0SI0:{A} 0SI0:{B} 0B0 0SI1:{A} 0SI1:{B} 0B1 0OPT""",
                                  A="0:layers.1.**@r0", B="0:layers.1.**@r1")
    # B: ln#0 (its input, 0.1 MB) + fc#1 1 MB + act#0 2 MB
    assert case.rw.tensors == {"0:layers.1.**@r0": TensorInfo(bytes=4 * MB, pool_bytes=4_000_256,
                                                                 largest_block_bytes=4_000_256),
                               "0:layers.1.**@r1": TensorInfo(bytes=3_100_000, pool_bytes=100_352 + 1_000_448 + 2_000_384,
                                                                 largest_block_bytes=2_000_384)}


def test_no_swap_when_backward_directly_follows_forward() -> None:
    # 1F1B's last stage runs each B right after its F: a swap-in could only come before the
    # swap-out's release point, so the unit stays; recompute still applies
    case = Case("1f1b", [(0, 2), (2, 4)], 2, {1: [rule("layers.2.**", "recompute"), rule("layers.3.**")]})
    assert case.rank(1) == expand("1F0 1DR0:{R} 1B0 1RC0:{R} 1F1 1DR1:{R} 1B1 1RC1:{R} 1OPT", R="1:layers.2.**@r0")
    assert case.rw.tensors == {"1:layers.2.**@r0": TensorInfo(bytes=0, compute_s=FWD[2], recompute=WHOLE)}
    # the same on the first stage of a one-microbatch pipeline (rank 0: F0 B0 OPT)
    one = Case("1f1b", [(0, 2), (2, 4)], 1, {0: [rule("layers.0.**"), rule("layers.1.**", "d2d",
                                                 stripes=D2D_STRIPES)]})
    assert one.rw.schedule == one.schedule and one.rw.tensors == {}


def test_swapped_bytes_leave_out_inputs_held_elsewhere() -> None:
    # GPipe, 2 stages x 2 microbatches, every layer to host. A unit frees its layer's own
    # tensors and its saved input, except the stage's input (the input batch on stage 0,
    # torch's receive buffer on stage 1), which stays on the device anyway.
    case = Case("gpipe", [(0, 2), (2, 4)], 2, {0: [rule("layers.0.**"), rule("layers.1.**")],
                                               1: [rule("layers.2.**"), rule("layers.3.**")]})
    assert {k: v.bytes for k, v in case.rw.tensors.items()} == {
        "0:layers.0.**@r0": 6 * MB, "0:layers.1.**@r1": 7 * MB + 100_000,
        "1:layers.2.**@r0": 8 * MB, "1:layers.3.**@r1": 9 * MB + 300_000}


# -- host swap: memory -----------------------------------------------------------------------------

def test_host_swap_peak_gpipe() -> None:
    # GPipe, one stage of 4 layers, 6 microbatches: each forward keeps A = 31 MB; layer 1
    # (U = 7.1 MB) to host, lead 1: SI(m) before action 5 + m (F5, B0, ..., B4).
    # Static: parameters 4 + Adam 8 + master weights 4 MB + 6 x (ids + targets 0.1 MB).
    case = Case("gpipe", [(0, 4)], 6, {0: [rule("layers.1.**")]}, hardware=FAST)
    program = case.program()
    assert program.static_bytes[0] == case.program(rewritten=False).static_bytes[0] == 16_600_000
    walk = rise(program, 0)
    t = "0:layers.1.**@r0"
    # F4 ends holding 5 A less the 4 units released by F1-F4 (SO4's is still on the device)
    assert walk["0F4 L3"] == 5 * 31 * MB - 4 * 7_100_000 == 126_600_000
    assert walk[f"0SI0:{t}"] == 133_700_000  # + U
    assert walk["0F5 L3"] == 6 * 31 * MB - 4 * 7_100_000 == 157_600_000  # SO4's U released, + A
    # the peak: SI1 is issued before B0, SO5's release point: 3 units away (mbs 2-4)
    assert walk[f"0SI1:{t}"] == 6 * 31 * MB - 3 * 7_100_000 == 164_700_000
    # B0 gives SO5's U back, then its last layer takes its input's gradient 0.3 + 1 MB
    assert walk["0B0 L3"] == 164_700_000 - 7_100_000 + 1_300_000 == 158_900_000
    assert max(walk.values()) == 164_700_000
    base, res = case.emulate(rewritten=False), case.emulate()
    assert base.peak_bytes[0] == 16_600_000 + 6 * 31 * MB + 1_300_000  # all kept, then B0's last layer
    assert res.peak_bytes[0] == 16_600_000 + 164_700_000  # the emulated memory is the walk
    assert res.timeline[0][-1][1] == 16_600_000  # everything came back and was freed


def test_host_swap_peak_1f1b_first_stage() -> None:
    # 1F1B, 4 stages of one layer, 8 microbatches; stage 0 (layer 0: A = 6.1 MB kept, U = 6
    # MB swapped, the 0.1 MB output stays) to host; G = 1 MB of gradients. Rank 0 (see
    # test_swap_in_waits_for_its_swap_outs_release_point), lead 1: SI0 before F3, SI(m)
    # before F(m + 3) for m = 1-4, SI5-7 before B4-B6.
    # Static: parameters 1 + Adam 2 + master 1 MB + 8 x (output's gradient buffer 0.1 +
    # ids 0.05 MB).
    case = Case("1f1b", [(0, 1), (1, 2), (2, 3), (3, 4)], 8, {0: [rule("layers.0.**")]}, hardware=FAST)
    program = case.program()
    assert program.static_bytes[0] == 5_200_000
    walk = rise(program, 0)
    t = "0:layers.0.**@r0"
    assert walk["0F2 L0"] == 3 * 6_100_000 - 2 * 6 * MB == 6_300_000  # SO0, SO1 released
    assert walk[f"0SI0:{t}"] == 12_300_000
    assert walk["0F3 L0"] == 4 * 6_100_000 - 2 * 6 * MB == 12_400_000  # SO2 released, mb 0 back
    assert walk["0B0 L0"] == 4 * 6_100_000 - 3 * 6 * MB + 1 * MB == 7_400_000  # SO3 released, + G
    # steady state (F4-F7): 4 microbatches in flight, 2 of them on the host, and G; from
    # F6 on, also mb 2's 0.1 MB output: 1F1B's send of forward min(8, 4) - 2 = 2 holds it
    # until B4 (the backward after the stage's last forward) ends
    for m in range(4, 6):
        assert walk[f"0F{m} L0"] == 4 * 6_100_000 - 2 * 6 * MB + 1 * MB == 13_400_000
    for m in range(6, 8):
        assert walk[f"0F{m} L0"] == 13_400_000 + 100_000
    held_by_b4 = next(t for t in program.ranks[0] if t.label() == "0B4 L0")
    assert held_by_b4.free_bytes == 6_100_000 + 100_000  # its own microbatch's and mb 2's output
    # the peak: SI5 is issued before B4, SO7's release point: only mb 6 is away
    assert walk[f"0SI5:{t}"] == 4 * 6_100_000 - 6 * MB + 1 * MB + 100_000 == 19_500_000 == max(walk.values())
    base, res = case.emulate(rewritten=False), case.emulate()
    # without the swap: 4 microbatches, G, B3's 1 MB while it runs and mb 2's held output
    assert base.peak_bytes[0] == 5_200_000 + 4 * 6_100_000 + 2 * MB + 100_000
    assert res.peak_bytes[0] == 5_200_000 + 19_500_000
    assert res.peak_bytes[1:4] == base.peak_bytes[1:4]  # the other stages are untouched
    assert res.timeline[0][-1][1] == 5_200_000


# -- D2D swap -----------------------------------------------------------------------------------

def test_d2d_swap_with_stripes() -> None:
    # rank 0: F0 F1 B0 B1 OPT; DIs before B0 and B1 (see test_rule_on_one_tensor_moves_only_that_tensor)
    case = Case("1f1b", [(0, 2), (2, 4)], 2, {0: [rule("layers.1.**", "d2d", stripes=D2D_STRIPES)]})
    assert case.rank(0) == expand("0F0 0DO0:{T} 0F1 0DO1:{T} 0DI0:{T} 0B0 0DI1:{T} 0B1 0OPT",
                                  T="0:layers.1.**@r0")
    assert case.rw.tensors == {"0:layers.1.**@r0": TensorInfo(bytes=7_100_000, pool_bytes=L1_POOL,
                                                                  largest_block_bytes=4_000_256,
                                                                  stripes=((2, 1 / 3), (3, 2 / 3)))}
    lowered = {str(t.action): t for t in case.program().ranks[0]}
    assert [(x.channel, x.bytes) for x in lowered["0DO0:0:layers.1.**@r0"].transfers] == [
        ("nvlink:0->2", 2_366_667), ("nvlink:0->3", 4_733_333)]  # 7.1 MB / 3, x 2 / 3
    assert [x.channel for x in lowered["0DI1:0:layers.1.**@r0"].transfers] == ["nvlink:2->0", "nvlink:3->0"]


def test_d2d_swap_peak_gpipe() -> None:
    # GPipe, 2 stages x 4 microbatches; stage 0 holds layers 0-1 (A = 6.1 + 7.2 MB kept),
    # layer 1 (U = 7.1 MB) goes to GPUs 2 and 3. Rank 0: F0-F3 B0-B3 OPT; DI(m) before
    # action 3 + m (F3, B0, B1, B2). Static: parameters 2 + Adam 4 + master 2 MB + 4 x
    # (output's gradient buffer 0.2 + ids 0.05 MB).
    case = Case("gpipe", [(0, 2), (2, 4)], 4, {0: [rule("layers.1.**", "d2d", stripes=D2D_STRIPES)]},
                hardware=FAST)
    program = case.program()
    assert program.static_bytes[0] == 9 * MB
    walk = rise(program, 0)
    t = "0:layers.1.**@r0"
    assert walk["0F3 L1"] == 4 * 13_300_000 - 2 * 7_100_000 == 39 * MB  # DO0-DO2 released, DI0 back
    # the peak: DI1 before B0, DO3's release point: mbs 2 and 3 away
    assert walk[f"0DI1:{t}"] == 4 * 13_300_000 - 7_100_000 == 46_100_000 == max(walk.values())
    base, res = case.emulate(rewritten=False), case.emulate()
    assert base.peak_bytes[0] == 9 * MB + 4 * 13_300_000 + 1_100_000  # B0's layer 1: its input's gradient + G
    assert res.peak_bytes[0] == 9 * MB + 46_100_000
    assert res.peak_bytes[2:4] == base.peak_bytes[2:4]  # no peer pool was planned: the peers hold nothing
    assert res.timeline[0][-1][1] == 9 * MB


# -- recompute ------------------------------------------------------------------------------------

def test_recompute_drops_after_forward_and_restores_after_backward() -> None:
    case = Case("1f1b", [(0, 2), (2, 4)], 4, {0: [rule("layers.1.**", "recompute")]})
    assert case.rank(0) == expand("""
        0F0 0DR0:{T} 0F1 0DR1:{T} 0B0 0RC0:{T} 0F2 0DR2:{T} 0B1 0RC1:{T} 0F3 0DR3:{T} 0B2 0RC2:{T}
        0B3 0RC3:{T} 0OPT""", T="0:layers.1.**@r0")
    # no bytes move (the layer's recompute memory says what it keeps); it re-runs its
    # 1.1 ms forward
    assert case.rw.tensors == {"0:layers.1.**@r0": TensorInfo(bytes=0, compute_s=1.1e-3, recompute=WHOLE)}


@pytest.mark.parametrize("layers", [[1], [1, 3], [1, 2, 3]])
def test_recompute_units_drop_in_layer_order_and_recompute_last_layer_first(layers: list[int]) -> None:
    rules = [rule(f"layers.{j}.**", "recompute") for j in layers]
    case = Case("1f1b", [(0, 1), (1, 4)], 1, {1: rules})
    names = {j: f"1:layers.{j}.**@r{r}" for r, j in enumerate(layers)}
    assert case.rw.tensors == {names[j]: TensorInfo(bytes=0, compute_s=FWD[j], recompute=WHOLE) for j in layers}
    drops = " ".join(f"1DR0:{names[j]}" for j in layers)
    recomputes = " ".join(f"1RC0:{names[j]}" for j in reversed(layers))
    assert case.rank(1) == f"1F0 {drops} 1B0 {recomputes} 1OPT"


def test_recompute_memory_walk() -> None:
    # stage 1 holds layers 1-3 (L0-L2 of the stage), one microbatch, layers 1 and 3
    # recomputed: a recomputed layer keeps only its output (its input stays, saved by the
    # checkpoint) and holds its activations ACT while its forward, and its backward
    # (which recomputes them), runs. Static: parameters 3 + Adam 6 + master 3 MB + the
    # input's receive buffer 0.1 + targets 0.05 MB.
    case = Case("1f1b", [(0, 1), (1, 4)], 1, {1: [rule("layers.1.**", "recompute"), rule("layers.3.**", "recompute")]})
    program = case.program()
    assert program.static_bytes[1] == 12_150_000
    a, b = "1:layers.1.**@r0", "1:layers.3.**@r1"
    assert list(rise(program, 1).items()) == [
        ("1F0 L0", 200_000 + 7 * MB),          # keeps OUT 0.2, holds ACT 7 while it runs
        (f"1DR0:{a}", 200_000),
        ("1F0 L1", 200_000 + 8_300_000),       # layer 2 keeps 8.3
        ("1F0 L2", 8_500_000 + 400_000 + 9 * MB),  # keeps OUT 0.4, holds ACT 9
        (f"1DR0:{b}", 8_900_000),
        (f"1RC0:{b} L2", 8_900_000),
        # layer 3's backward: its input's gradient 0.3 + G 1 MB, and ACT 9 recomputed
        ("1B0 L2", 8_900_000 + 1_300_000 + 9 * MB),
        # layer 3 gave back its saved input (layer 2's output, 0.3): 9.9; layer 2 takes 0.2 + 1
        ("1B0 L1", 9_900_000 + 1_200_000),
        # layer 2 gave back its own 8 MB, its saved input (layer 1's output, 0.2) and the
        # gradient it consumed (layer 3's input's, 0.3)
        (f"1RC0:{a} L0", 11_100_000 - 8_500_000),
        ("1B0 L0", 2_600_000 + 1_100_000 + 7 * MB),  # its input's gradient 0.1 + G 1, ACT 7
        # left: G 3 MB (the stage input's 0.1 MB gradient went when B0 ended: 1F1B lets
        # the send of B(s, m)'s input gradient go at the end of the stage's next backward,
        # and B0 is its last); Adam's temporaries: 2 x 4 bytes and the fp32 gradient 4
        # bytes per parameter (250k)
        ("1OPT", 3 * MB + 3 * MB),
    ]
    base = rise(case.program(rewritten=False), 1)
    assert max(base.values()) == 26_200_000  # 7.2 + 8.3 + 9.4 + B0's first layer 1.3


def test_recomputed_layers_keep_only_their_output() -> None:
    # every layer of stage 0 recomputed: the forward keeps 0.1 + 0.2 MB of outputs; the
    # token ids are the input batch's (one rule on `layers.*` makes a unit per layer)
    case = Case("1f1b", [(0, 2), (2, 4)], 1, {0: [rule("layers.*", "recompute")]})
    a, b = "0:layers.0.**@r0", "0:layers.1.**@r0"
    assert case.rank(0) == f"0F0 0DR0:{a} 0DR0:{b} 0B0 0RC0:{b} 0RC0:{a} 0OPT"
    assert case.rw.tensors == {a: TensorInfo(bytes=0, compute_s=1.0e-3, recompute=WHOLE), b: TensorInfo(bytes=0, compute_s=1.1e-3, recompute=WHOLE)}
    walk = rise(case.program(), 0)
    assert (walk[f"0DR0:{a}"], walk[f"0DR0:{b}"]) == (100_000, 300_000)


def test_catch_all_recompute_rule_leaves_model_data_alone() -> None:
    # `*` names every saved activation of the stage, not its optimizer states or stash
    case = Case("pipedream", [(0, 2), (2, 4)], 1, {0: [rule("*", "recompute")]})
    assert case.rank(0) == expand("0F0 0DR0:{A} 0DR0:{B} 0B0 0RC0:{B} 0RC0:{A} 0OPT",
                                  A="0:layers.0.**@r0", B="0:layers.1.**@r0")
    assert offloaded_optim_bytes(case.plan, case.costs) == [0, 0]
    assert stash_offloaded(case.rw.schedule) == [False, False]


def test_recompute_peak_and_overhead() -> None:
    # GPipe, one stage, 4 microbatches, layers 2 and 3 recomputed: each forward keeps
    # 6.1 + 7.2 + 0.3 + 0.4 = 14 MB instead of 31. Static 16 MB + 4 x 0.1 MB.
    case = Case("gpipe", [(0, 4)], 4, {0: [rule("layers.2.**", "recompute"), rule("layers.3.**", "recompute")]},
                hardware=FAST)
    program = case.program()
    assert program.static_bytes[0] == 16_400_000
    walk = rise(program, 0)
    # F3's layer 3: 3 x 14 + 13.6 kept, its 0.4 output and ACT 9 while it runs
    assert walk["0F3 L3"] == 3 * 14 * MB + 13_600_000 + 400_000 + 9 * MB == 65 * MB
    # the peak: B0's layer 3 takes its input's gradient 0.3 + G 1 MB and recomputes ACT 9
    assert walk["0B0 L3"] == 4 * 14 * MB + 1_300_000 + 9 * MB == 66_300_000 == max(walk.values())
    base, res = case.emulate(rewritten=False), case.emulate()
    assert base.peak_bytes[0] == 16_400_000 + 4 * 31 * MB + 1_300_000
    assert res.peak_bytes[0] == 16_400_000 + 66_300_000
    # each microbatch re-runs the forwards of layers 2 and 3 (1.2 + 1.3 ms)
    assert res.busy_s_by_cost["recompute"] == pytest.approx(4 * (1.2e-3 + 1.3e-3))
    assert res.iteration_s == pytest.approx(base.iteration_s + 4 * 2.5e-3)
    assert res.timeline[0][-1][1] == 16_400_000


# -- per-microbatch techniques ---------------------------------------------------------------------

def test_different_techniques_per_microbatch() -> None:
    # microbatches 0-1 of layer 0 go to host (rule 0), the others are recomputed (rule 1).
    # Rank 0: F0 F1 B0 F2 B1 F3 B2 B3 OPT; SI0 before B0 (max(1, 2)), SI1 before F2 (max(3, 3))
    case = Case("1f1b", [(0, 2), (2, 4)], 4,
                {0: [rule("layers.0.**", "host", microbatches="0-1"), rule("layers.0.**", "recompute")]})
    assert case.rank(0) == expand("""
        0F0 0SO0:{H} 0F1 0SO1:{H} 0SI0:{H} 0B0 0SI1:{H} 0F2 0DR2:{R} 0B1 0F3 0DR3:{R} 0B2 0RC2:{R}
        0B3 0RC3:{R} 0OPT""", H="0:layers.0.**@r0", R="0:layers.0.**@r1")
    assert case.rw.tensors == {"0:layers.0.**@r0": TensorInfo(bytes=6 * MB, pool_bytes=L0_POOL,
                                                                 largest_block_bytes=4_000_256),
                               "0:layers.0.**@r1": TensorInfo(bytes=0, compute_s=1.0e-3, recompute=WHOLE)}
    res = case.emulate()
    assert res.busy_s_by_cost["recompute"] == pytest.approx(2 * 1.0e-3)  # mbs 2 and 3 only


def test_keep_rules_and_unmatched_tensors_change_nothing() -> None:
    case = Case("1f1b", [(0, 2), (2, 4)], 4, {0: [rule("layers.0.**", "keep"), rule("optim:*", "keep")],
                                              1: [rule("layers.9.**", "host")]})
    assert case.rw.schedule == case.schedule
    assert case.rw.tensors == {}
    assert offloaded_optim_bytes(case.plan, case.costs) == [0, 0]

# -- refusals -------------------------------------------------------------------------------------


def test_recompute_of_part_of_a_layer_is_refused() -> None:
    with pytest.raises(PlanError) as info:
        Case("1f1b", [(0, 2), (2, 4)], 2, {0: [rule("layers.0.fc#*", "recompute")]})
    msg = str(info.value)
    assert "\n" not in msg
    # layer 0 saves ln#0, fc#0, fc#1, act#0; this profile measured no op-level choice
    assert "stage 0 microbatch 0: layers.0 recomputed in part (2 of its 4 saved tensors)" in msg
    assert msg.endswith("is not a choice its profile measured: recompute all of layers.0.**")


@pytest.mark.parametrize("rules, mb", [
    # first match wins: an earlier rule takes part of the layer the recompute rule names
    ([rule("layers.0.fc#0", "host"), rule("layers.0.**", "recompute")], 0),
    ([rule("layers.0.act#0", "keep"), rule("layers.0.**", "recompute")], 0),
    ([rule("layers.0.fc#1", "host", microbatches="1"), rule("layers.0.**", "recompute")], 1),
])
def test_recompute_shadowed_by_an_earlier_rule_is_refused(rules: list[TensorRule], mb: int) -> None:
    with pytest.raises(PlanError) as info:
        Case("1f1b", [(0, 2), (2, 4)], 2, {0: rules})
    msg = str(info.value)
    assert "\n" not in msg and f"stage 0 microbatch {mb}" in msg and "layers.0.**" in msg
    assert "a layer recomputed in part keeps the rest" in msg or "not a choice its profile measured" in msg


def test_plan_for_another_pipeline_shape_is_refused() -> None:
    profile = toy_profile()
    sched = build_schedule("1f1b", 2, 4)
    plan = make_plan({}, [(0, 2), (2, 4)], build_schedule("1f1b", 2, 8))
    with pytest.raises(PlanError, match="plan is for 2 stages x 8 microbatches, schedule has 2 x 4"):
        rewrite(plan, sched, stage_costs(profile, [(0, 2), (2, 4)]), DGX1)
