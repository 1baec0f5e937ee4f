"""mpress.static.plan.rewriter on model data rather than activations: optimizer states
streamed to and from the host one layer's chunk at a time, and PipeDream's stashed
weight versions swapped to the host; where the actions land and what they do to memory.

Expected strings and figures are derived as test_rewriter.py's docstring says (memory:
the walk of the rank's lowered list), from the toy profile in tests.support.rewriter.
"""

from __future__ import annotations

import pytest

from mpress.static.emulate.lowering import TensorInfo
from mpress.static.memory.model import optimizer_step_s
from mpress.static.plan.rewriter import offloaded_optim_bytes, stash_offloaded
from tests.support.plans import rule
from tests.support.rewriter import (
    DGX1,
    FAST,
    MB,
    NUM_PARAMS,
    PARAM,
    Case,
    expand,
    rise,
)

# -- optimizer states --------------------------------------------------------------------------------


def opt_chunk(s: int, layer: int) -> str:
    return f"{s}:optim:layers.{layer}"


def test_optimizer_offload_streams_chunks() -> None:
    # stage 0 holds layers 0-2; rank 0 runs 0F0 0F1 0B0 0B1 0OPT. The OPT becomes one OPT
    # per layer; the first two chunks come in before the compute action one ahead of the
    # last B (B0), each chunk goes out after its step, followed by the OI two chunks ahead.
    case = Case("1f1b", [(0, 3), (3, 4)], 2, {0: [rule("optim:*")]})
    assert case.rank(0) == expand("""
        0F0 0F1 0OI:{c0} 0OI:{c1} 0B0 0B1 0OPT:{c0} 0OO:{c0} 0OI:{c2} 0OPT:{c1} 0OO:{c1} 0OPT:{c2} 0OO:{c2}""",
                                  c0=opt_chunk(0, 0), c1=opt_chunk(0, 1), c2=opt_chunk(0, 2))
    assert case.rank(1) == "1F0 1B0 1F1 1B1 1OPT"
    step_s = NUM_PARAMS * 16 / (15.7e12 * 0.4)  # Adam: 16 FLOP per parameter at 40% of fp32 peak
    assert optimizer_step_s(NUM_PARAMS, DGX1) == pytest.approx(step_s)
    # a chunk is one layer's Adam states + master weights: 2 + 1 MB
    assert set(case.rw.tensors) == {opt_chunk(0, j) for j in range(3)}
    for info in case.rw.tensors.values():
        assert info.bytes == 3 * MB and info.compute_s == pytest.approx(step_s) and info.stripes == ()
    assert offloaded_optim_bytes(case.plan, case.costs) == [9 * MB, 0]


def test_optimizer_offload_of_four_chunks_and_lead() -> None:
    # one stage, GPipe, 1 microbatch: 0F0 0B0 0OPT; lead 1 puts the prefetch before F0
    case = Case("gpipe", [(0, 4)], 1, {0: [rule("optim:*")]})
    assert case.rank(0) == expand("""
        0OI:{c0} 0OI:{c1} 0F0 0B0 0OPT:{c0} 0OO:{c0} 0OI:{c2} 0OPT:{c1} 0OO:{c1} 0OI:{c3} 0OPT:{c2} 0OO:{c2}
        0OPT:{c3} 0OO:{c3}""", **{f"c{j}": opt_chunk(0, j) for j in range(4)})
    # lead 2 on a longer list: 1F1B rank 0 of 2 stages, 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3:
    # two compute actions ahead of the last B (B3) is F3
    case = Case("1f1b", [(0, 2), (2, 4)], 4, {0: [rule("optim:*", prefetch_lead=2)]})
    assert case.rank(0) == expand("""
        0F0 0F1 0B0 0F2 0B1 0OI:{c0} 0OI:{c1} 0F3 0B2 0B3 0OPT:{c0} 0OO:{c0} 0OPT:{c1} 0OO:{c1}""",
                                  c0=opt_chunk(0, 0), c1=opt_chunk(0, 1))


def test_partial_optimizer_offload() -> None:
    # only layer 1's states move; the others are stepped in place, in layer order
    case = Case("1f1b", [(0, 3), (3, 4)], 2, {0: [rule("optim:layers.1")]})
    assert case.rank(0) == expand("0F0 0F1 0OI:{c1} 0B0 0B1 0OPT:{c0} 0OPT:{c1} 0OO:{c1} 0OPT:{c2}",
                                  c0=opt_chunk(0, 0), c1=opt_chunk(0, 1), c2=opt_chunk(0, 2))
    assert offloaded_optim_bytes(case.plan, case.costs) == [3 * MB, 0]


def test_optimizer_offload_memory() -> None:
    # stage 0 (layers 0-2): parameters 3 + Adam 6 + master weights 3 MB, plus 2 x (its
    # output's gradient buffer 0.3 + ids 0.05 MB): 12.7 MB static. With the states on the
    # host only 3.7 MB stay. Rank 0: F0 F1 OI(c0) OI(c1) B0 B1, then the streamed step;
    # each forward keeps 6.1 + 7.2 + 8.3 = 21.6 MB; a chunk is 3 MB.
    case = Case("1f1b", [(0, 3), (3, 4)], 2, {0: [rule("optim:*")]}, hardware=FAST)
    assert case.program(rewritten=False).static_bytes[0] == 12_700_000
    program = case.program()
    assert program.static_bytes[0] == 3_700_000
    walk = rise(program, 0)
    c0, c1, c2 = (opt_chunk(0, j) for j in range(3))
    assert walk[f"0OI:{c1}"] == 2 * 21_600_000 + 2 * 3 * MB
    # the peak: B0's layer 2 takes its input's gradient 0.2 + G 1 MB
    assert walk["0B0 L2"] == 2 * 21_600_000 + 2 * 3 * MB + 1_200_000 == 50_400_000 == max(walk.values())
    # the streamed step: after the backwards, c0 and c1 (6 MB) and G (3 x 1 MB) are on the
    # device. Each layer's step holds Adam's temporaries (2 x 4 bytes per parameter, 250k)
    # and the fp32 gradient of its master weights (4 bytes per parameter): 3 MB, and gives
    # back its 1 MB of gradients; each chunk's copy-out gives its 3 MB back at the next
    # step, the last one when it ends.
    assert [(label, b) for label, b in walk.items() if label.startswith(("0OPT", "0OO", "0OI:" + c2))] == [
        (f"0OPT:{c0}", 9 * MB + 3 * MB),
        (f"0OO:{c0}", 8 * MB),
        (f"0OI:{c2}", 11 * MB),  # the most chunks on the device: c0 (still going out), c1, c2
        (f"0OPT:{c1}", 11 * MB - 3 * MB + 3 * MB),
        (f"0OO:{c1}", 7 * MB),
        (f"0OPT:{c2}", 7 * MB - 3 * MB + 3 * MB),
        (f"0OO:{c2}", 3 * MB),
    ]
    base, res = case.emulate(rewritten=False), case.emulate()
    assert base.peak_bytes[0] == 12_700_000 + 2 * 21_600_000 + 1_200_000
    assert res.peak_bytes[0] == 3_700_000 + 50_400_000
    assert res.timeline[0][-1][1] == 3_700_000  # the states end the iteration on the host
    assert res.peak_bytes[1] == base.peak_bytes[1]


# -- PipeDream stashed weights --------------------------------------------------------------------

def test_pipedream_stash_offload() -> None:
    # same placement as activations: the version each F stashes goes out after the F and
    # comes back for the B that needs it; the unit is the stage's parameters (2 x 1 MB)
    case = Case("pipedream", [(0, 2), (2, 4)], 4, {0: [rule("stash:*")]})
    assert case.rank(0) == expand("""
        0F0 0SO0:{T} 0F1 0SO1:{T} 0SI0:{T} 0B0 0SI1:{T} 0F2 0SO2:{T} 0B1 0SI2:{T} 0F3 0SO3:{T}
        0B2 0SI3:{T} 0B3 0OPT""", T="0:stash@r0")
    assert case.rw.tensors == {"0:stash@r0": TensorInfo(bytes=2 * PARAM, pool_bytes=2 * PARAM)}
    assert stash_offloaded(case.rw.schedule) == [True, False]
    # a rule for some microbatches only (not microbatch 0) moves versions out too. Rank 0:
    # F0 F1 B0 F2 B1 F3 B2 B3 (actions 0-7): SI2 before F3 (max(5, 5)), SI3 before B3 (max(6, 7))
    some = Case("pipedream", [(0, 2), (2, 4)], 4, {0: [rule("stash:*", microbatches="2-3")]})
    assert some.rank(0) == expand("0F0 0F1 0B0 0F2 0SO2:{T} 0B1 0SI2:{T} 0F3 0SO3:{T} 0B2 0SI3:{T} 0B3 0OPT",
                                  T="0:stash@r0")
    assert stash_offloaded(some.rw.schedule) == [True, False]
    # the last stage runs each B right after its F: no version leaves, and its static
    # bytes (the live weights are the newest version) are those of the plain pipeline
    last = Case("pipedream", [(0, 2), (2, 4)], 4, {1: [rule("stash:*")]})
    assert last.rw.schedule == last.schedule and last.rw.tensors == {}
    assert stash_offloaded(last.rw.schedule) == [False, False]
    assert last.program().static_bytes == last.program(rewritten=False).static_bytes
    assert last.emulate().peak_bytes == last.emulate(rewritten=False).peak_bytes
    # without weight stashing a stash rule has nothing to move
    sync = Case("1f1b", [(0, 2), (2, 4)], 4, {0: [rule("stash:*")]})
    assert sync.rw.schedule == sync.schedule and sync.rw.tensors == {}


def test_pipedream_stash_offload_memory() -> None:
    # 4 stages of one layer, 8 microbatches; stage 0: each F keeps 6.1 MB of activations
    # and makes a P = 1 MB weight version, which goes to host (placement as in
    # test_rewriter.py's test_host_swap_peak_1f1b_first_stage). Static with the versions
    # off the device: the live weights 1 + Adam 2 + master 1 MB + 8 x (output's gradient
    # buffer 0.1 + ids 0.05 MB); without the plan the live weights are the newest version.
    case = Case("pipedream", [(0, 1), (1, 2), (2, 3), (3, 4)], 8, {0: [rule("stash:*")]}, hardware=FAST)
    program = case.program()
    assert program.static_bytes[0] == 5_200_000
    assert case.program(rewritten=False).static_bytes[0] == 4_200_000
    walk = rise(program, 0)
    t = "0:stash@r0"
    assert walk["0F3 L0"] == 4 * 6_100_000 + 2 * PARAM  # versions of mbs 0 (back) and 3
    # steady state (F4-F7): mbs 4 in flight, G = 1 MB, 2 versions on the device and 2
    # away; from F6 on also mb 2's 0.1 MB output, which the send of PipeDream's (1F1B's)
    # forward min(8, 4) - 2 = 2 holds until B4 ends
    for m in range(4, 6):
        assert walk[f"0F{m} L0"] == 4 * 6_100_000 + 1 * MB + 2 * PARAM == 27_400_000
    for m in range(6, 8):
        assert walk[f"0F{m} L0"] == 27_400_000 + 100_000
    # the peak: SI5 is issued before B4, SO7's release point: only mb 6's version is away
    assert walk[f"0SI5:{t}"] == 4 * 6_100_000 + 1 * MB + 3 * PARAM + 100_000 == 28_500_000 == max(walk.values())
    res, base = case.emulate(), case.emulate(rewritten=False)
    assert res.peak_bytes[0] == 5_200_000 + 28_500_000
    # without the plan: 4 versions, G, B3's 1 MB while it runs and mb 2's held output
    assert base.peak_bytes[0] == 4_200_000 + 4 * (6_100_000 + PARAM) + 2 * MB + 100_000
    assert res.timeline[0][-1][1] == 5_200_000
