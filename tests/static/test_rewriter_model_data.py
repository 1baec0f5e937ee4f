"""mpress.static.rewriter on model data rather than activations: optimizer states
streamed to and from the host one layer's chunk at a time, and PipeDream's stashed
weight versions swapped to the host; where the actions land and what they do to memory.

Expected strings and figures are derived as test_rewriter.py's docstring says, from the
toy profile in tests.support.rewriter.
"""

from __future__ import annotations

import pytest

from mpress.actions import Kind
from mpress.static.lowering import TensorInfo
from mpress.static.memory import optimizer_step_s
from mpress.static.rewriter import offloaded_optim_bytes, stash_offloaded
from tests.support.plans import rule
from tests.support.rewriter import (
    DGX1,
    FAST,
    MB,
    NUM_PARAMS,
    PARAM,
    Case,
    bytes_at,
    expand,
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
    # stage 0 (layers 0-2): parameters 3 + gradients 3 + Adam 6 + master 3 MB, plus comm
    # buffers 2 x 0.3 MB (its output and that output's gradient): 15.6 MB static. With the
    # states on the host only 6.6 MB stay. Activations: 6 + 7 + 8 = 21 MB per microbatch,
    # 2 in flight; the first two chunks (2 x 3 MB) come in at F1's end, before B0.
    case = Case("1f1b", [(0, 3), (3, 4)], 2, {0: [rule("optim:*")]}, hardware=FAST)
    assert case.program(rewritten=False).static_bytes[0] == 15_600_000
    assert case.program().static_bytes[0] == 6_600_000
    base, res = case.emulate(rewritten=False), case.emulate()
    assert base.peak_bytes[0] == 15_600_000 + 2 * 21 * MB
    assert res.peak_bytes[0] == 6_600_000 + 2 * 21 * MB + 2 * 3 * MB
    # while the step streams, at most three chunks are on the device: the one going out,
    # and the two ahead of it
    opt_start = min(s for s, t in zip(res.task_start_s[0], case.program().ranks[0])
                    if t.action.kind is Kind.OPT)
    assert max(b for ts, b in res.timeline[0] if ts >= opt_start) == 6_600_000 + 3 * 3 * MB
    assert res.timeline[0][-1][1] == 6_600_000  # the states end the iteration on the host
    assert res.peak_bytes[1] == base.peak_bytes[1]


# -- PipeDream stashed weights --------------------------------------------------------------------

def test_pipedream_stash_offload() -> None:
    # same placement as activations: the version each F stashes goes out after the F and
    # comes back for the B that needs it; the unit is the stage's parameters (2 x 1 MB)
    case = Case("pipedream", [(0, 2), (2, 4)], 4, {0: [rule("stash:*")]})
    assert case.rank(0) == expand("""
        0F0 0SO0:{T} 0SI0:{T} 0F1 0SO1:{T} 0B0 0SI1:{T} 0F2 0SO2:{T} 0B1 0SI2:{T} 0F3 0SO3:{T}
        0SI3:{T} 0B2 0B3 0OPT""", T="0:stash@r0")
    assert case.rw.tensors == {"0:stash@r0": TensorInfo(bytes=2 * PARAM)}
    assert stash_offloaded(case.plan, case.costs) == [True, False]
    # a rule for some microbatches only (none of them microbatch 0) moves versions out too
    some = Case("pipedream", [(0, 2), (2, 4)], 4, {1: [rule("stash:*", microbatches="2-3")]})
    assert stash_offloaded(some.plan, some.costs) == [False, True]
    assert some.rank(1) == expand("1F0 1B0 1F1 1B1 1F2 1SO2:{T} 1SI2:{T} 1B2 1F3 1SO3:{T} 1SI3:{T} 1B3 1OPT",
                                  T="1:stash@r0")
    # without weight stashing a stash rule has nothing to move
    sync = Case("1f1b", [(0, 2), (2, 4)], 4, {0: [rule("stash:*")]})
    assert sync.rw.schedule == sync.schedule and sync.rw.tensors == {}


def test_pipedream_stash_offload_memory() -> None:
    # 4 stages of one layer, 8 microbatches; stage 0: S = 6 MB activations and P = 1 MB of
    # weights per version, 4 in flight. Static with the versions off the device: model
    # states 5 MB (live weights included) + comm 2 x 0.1 MB. Peak at F3's start: mb 0's
    # version is back, mb 1's on the host, mb 2's SO in flight, mb 3's being made:
    # 4 S + 3 P.
    case = Case("pipedream", [(0, 1), (1, 2), (2, 3), (3, 4)], 8, {0: [rule("stash:*")]}, hardware=FAST)
    static = case.program().static_bytes[0]
    assert static == 5 * MB + 200_000
    res = case.emulate()
    assert res.peak_bytes[0] == static + 4 * 6 * MB + 3 * PARAM
    # in the steady state two versions are on the host: right after F4 starts, the
    # device holds the live weights (static), mbs 1-4's activations, and the versions of
    # mb 1 (back for B1) and mb 4 (just made)
    f4 = [str(t.action) for t in case.program().ranks[0]].index("0F4")
    t = res.task_start_s[0][f4]
    assert bytes_at(res, 0, t) == static + 4 * 6 * MB + 2 * PARAM
    assert res.timeline[0][-1][1] == static
