"""Pinned host memory a stage's program needs: its most pool bytes at once (swapped units
until their backward, host-offloaded optimizer chunks from the start), plus the
fragmentation headroom and one largest block."""

from __future__ import annotations

import pytest

from mpress.contract.actions import Schedule, parse_actions
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.emulate.host_memory import FRAGMENTATION_HEADROOM, pinned_bytes
from mpress.static.plan.plan_eval import evaluate_plan
from mpress.static.plan.planner import PlannerOptions, plan_strategy
from mpress.static.emulate.lowering import TensorInfo
from mpress.config.units import ALIGNMENT_BYTES, round_up
from mpress.config.vocabulary import ScheduleName

A, B = "0:a.**@r0", "0:b.**@r0"
OA, OB = "0:optim:a", "0:optim:b"
TENSORS = {
    A: TensorInfo(bytes=1000, pool_bytes=1024, largest_block_bytes=512),
    B: TensorInfo(bytes=3000, pool_bytes=3072, largest_block_bytes=2048),
    OA: TensorInfo(bytes=4000, pool_bytes=5120, largest_block_bytes=1536),
    OB: TensorInfo(bytes=2000, pool_bytes=2560, largest_block_bytes=1024, stripes=((1, 1.0),)),  # to a peer
}


def schedule(*ranks: str) -> Schedule:
    return Schedule(ScheduleName.GPIPE, num_stages=len(ranks), num_microbatches=2,
                    stage_to_rank=tuple(range(len(ranks))), ranks=tuple(tuple(parse_actions(r)) for r in ranks))


def with_headroom(peak: int, largest: int) -> int:
    return peak + round_up(int(peak * FRAGMENTATION_HEADROOM), ALIGNMENT_BYTES) + largest


def test_swapped_units_hold_their_blocks_until_their_backward():
    # F0 swaps a and b out (4096 B), F1 again (8192 B at once), B0 gives back microbatch 0's
    sched = schedule(f"0F0 0SO0:{A} 0SO0:{B} 0F1 0SO1:{A} 0SO1:{B} 0SI0:{A} 0SI0:{B} 0B0 0SI1:{A} 0SI1:{B} 0B1 0OPT")
    assert pinned_bytes(sched, TENSORS) == [with_headroom(8192, 2048)]


def test_host_offloaded_optimizer_chunks_are_in_the_pool_from_the_start():
    # OA (host) is out from the start: 5120; OB goes to a peer, not this pool. During F1 a
    # swapped unit adds 1024; OA's OI gives its blocks back by the end of its step, OO takes them again
    sched = schedule(f"0F0 0SO0:{A} 0F1 0SI0:{A} 0B0 0OI:{OA} 0B1 0OPT:{OA} 0OO:{OA} 0OPT:{OB} 0OO:{OB}")
    assert pinned_bytes(sched, TENSORS) == [with_headroom(5120 + 1024, 1536)]


def test_a_stage_that_moves_nothing_to_the_host_needs_no_pool():
    sched = schedule("0F0 0F1 0B0 0B1 0OPT", f"1F0 1B0 1F1 1B1 1OPT:{OB} 1OO:{OB}")
    assert pinned_bytes(sched, {**TENSORS, OB: TENSORS[OB]}) == [0, 0]


@pytest.mark.slow
def test_the_gpt_20b_dgx1_plan_pins_what_the_runtime_pins_and_the_host_holds_it():
    """The README's real-size plan: each stage's pinned figure is what its program needs
    (this walk), the runtime pins exactly that figure (`PinnedHostPool` page-locks its
    capacity rounded up to the block alignment, tested with a fake cudart beside it), and
    all of it fits the preset's host memory."""
    hardware = load_hardware("dgx1-v100")
    setup = setup_pipeline(load_model_config("gpt-20.4b"), hardware, schedule="1f1b", num_stages=8,
                           microbatch_size=2, num_microbatches=16)
    result = plan_strategy(setup, "mpress", PlannerOptions())
    assert result.fits
    plan = result.plan
    ev = evaluate_plan(setup, plan)
    walked = pinned_bytes(ev.schedule, ev.tensors)
    assert [sp.pinned_host_bytes for sp in plan.stages] == walked
    pinned = sum(round_up(b, ALIGNMENT_BYTES) for b in walked)  # what the stages' pools page-lock
    assert 0 < pinned <= hardware.host_memory_bytes
