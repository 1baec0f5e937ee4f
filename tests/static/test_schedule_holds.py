"""What torch's schedules hold past a microbatch's backward through their send works
(`schedules.held_outputs`, `schedules.held_input_grads`), and where the lowering gives
those bytes back (`lowering.late_frees`, `lower_rank(late=...)`).

Expected dicts are derived by hand from the rank lists (printed in each test) and the
rules of the two functions' docstrings:
- outputs: GPipe and interleaved hold every output a stage sends until the rank's last
  backward ends; 1F1B (and PipeDream) holds the output of forward min(M, S - s) - 2 of
  stage s until the end of the backward that follows the stage's last forward, when that
  backward comes after the forward's own; the last stage sends nothing;
- input gradients (stages after the first): GPipe and interleaved until the rank's last
  backward ends; 1F1B until the end of the stage's next backward (the last: its own).
"""

from __future__ import annotations

import pytest

from mpress.contract.actions import format_actions
from mpress.hardware.server import load_hardware
from mpress.static.emulate.lowering import LateFrees, late_frees, lower_rank
from mpress.static.memory.stage_costs import stage_costs
from mpress.static.profile.profile import LayerMemory, LayerProfile, Profile
from mpress.static.schedules import build_schedule, held_input_grads, held_outputs

DGX1 = load_hardware("dgx1-v100")


def ranks(schedule) -> list[str]:
    return [format_actions(list(r)) for r in schedule.ranks]


# ---- held_outputs / held_input_grads ------------------------------------------------------------

def test_gpipe_holds_every_send_until_the_ranks_last_backward():
    sched = build_schedule("gpipe", 2, 3)
    assert ranks(sched) == ["0F0 0F1 0F2 0B0 0B1 0B2 0OPT", "1F0 1F1 1F2 1B0 1B1 1B2 1OPT"]
    # rank 0's last backward is B(0, 2): every output of stage 0 goes at its end (that of
    # microbatch 2 at its own backward's end anyway)
    assert held_outputs(sched) == {(0, 0): (0, 2), (0, 1): (0, 2), (0, 2): (0, 2)}
    assert held_input_grads(sched) == {(1, 0): (1, 2), (1, 1): (1, 2), (1, 2): (1, 2)}


@pytest.mark.parametrize("name", ["1f1b", "pipedream"])
def test_1f1b_two_stages_four_microbatches(name):
    sched = build_schedule(name, 2, 4)
    assert ranks(sched) == ["0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3 0OPT", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1OPT"]
    # stage 0: forward min(4, 2) - 2 = 0; the stage's last forward F3 is followed by B2
    assert held_outputs(sched) == {(0, 0): (0, 2)}
    # B(1, m)'s input gradient goes at the end of B(1, m + 1); B(1, 3)'s at its own
    assert held_input_grads(sched) == {(1, 0): (1, 1), (1, 1): (1, 2), (1, 2): (1, 3), (1, 3): (1, 3)}


def test_1f1b_four_stages_eight_microbatches():
    sched = build_schedule("1f1b", 4, 8)
    assert ranks(sched)[:3] == [
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7 0OPT",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7 1OPT",
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7 2OPT",
    ]
    # forward min(8, 4 - s) - 2: 2, 1, 0 on stages 0-2; after F7 come B4, B5, B6
    assert held_outputs(sched) == {(0, 2): (0, 4), (1, 1): (1, 5), (2, 0): (2, 6)}
    # every stage after the first: (s, m) -> (s, m + 1), and (s, 7) -> (s, 7)
    assert held_input_grads(sched) == {(s, m): (s, min(m + 1, 7)) for s in (1, 2, 3) for m in range(8)}
    assert len(held_input_grads(sched)) == 24


def test_1f1b_with_as_many_microbatches_as_stages():
    sched = build_schedule("1f1b", 3, 3)
    assert ranks(sched)[:2] == ["0F0 0F1 0F2 0B0 0B1 0B2 0OPT", "1F0 1F1 1B0 1F2 1B1 1B2 1OPT"]
    # stage 0: forward 1's send goes at the end of B0 (after F2), before B1, its own
    # backward, ends: nothing held past it. Stage 1: forward 0's goes at the end of B1.
    assert held_outputs(sched) == {(1, 0): (1, 1)}
    assert held_input_grads(sched) == {(1, 0): (1, 1), (1, 1): (1, 2), (1, 2): (1, 2),
                                       (2, 0): (2, 1), (2, 1): (2, 2), (2, 2): (2, 2)}


def test_interleaved_holds_every_send_until_the_ranks_last_backward():
    sched = build_schedule("interleaved", 4, 4, num_ranks=2)
    assert ranks(sched) == ["0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3 2OPT 0OPT",
                            "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 3OPT 1OPT"]
    # rank 0 (stages 0 and 2) ends its backwards with B(0, 3), rank 1 (stages 1 and 3)
    # with B(1, 3); stage 3 is the last and sends no output
    assert held_outputs(sched) == {**{(0, m): (0, 3) for m in range(4)}, **{(1, m): (1, 3) for m in range(4)},
                                   **{(2, m): (0, 3) for m in range(4)}}
    assert held_input_grads(sched) == {**{(1, m): (1, 3) for m in range(4)}, **{(2, m): (0, 3) for m in range(4)},
                                       **{(3, m): (1, 3) for m in range(4)}}


# ---- late_frees and the lowering ----------------------------------------------------------------

def _costs(stage_output_saved: bool = False):
    """Four layers, two per stage. Layer i keeps 5 bytes and its output 10 (i + 1), and
    hands back its input's gradient 10 i (the previous output; none for layer 0). Stage
    0's output (layer 1's) is 20, stage 1's input gradient (layer 2's) 20; the other
    layers' figures differ so a wrong layer would show. stage_output_saved: layer 1 saves
    its own output for its backward (a stage ending in a ReLU)."""
    layers = []
    for i in range(4):
        out = 10 * (i + 1)
        memory = LayerMemory(kept_bytes=5 + out, forward_peak_bytes=5 + out, backward_peak_bytes=0,
                             input_grad_bytes=10 * i, output_bytes=out, saves_output=stage_output_saved and i == 1)
        layers.append(LayerProfile(name=f"layers.{i}", forward_flops=1.0, backward_flops=2.0, forward_time_s=1e-3,
                                   backward_time_s=2e-3, param_bytes=1, grad_bytes=1, output_bytes=out,
                                   memory=memory))
    profile = Profile(model="toy", model_fingerprint="x", source="analytic", device="t", dtype="fp32",
                      microbatch_size=1, layers=layers)
    return stage_costs(profile, [(0, 2), (2, 4)])


def test_late_frees_of_1f1b():
    late = late_frees(build_schedule("1f1b", 2, 4), _costs())
    # stage 0's output of microbatch 0 goes at the end of B(0, 2); stage 1's input
    # gradients: B(1, 0)'s at the end of B(1, 1), ..., B(1, 2)'s and B(1, 3)'s at B(1, 3)'s
    assert late == LateFrees(outputs=frozenset({(0, 0)}),
                             frees={(0, 2): 20, (1, 1): 20, (1, 2): 20, (1, 3): 40})


def test_late_frees_of_gpipe():
    late = late_frees(build_schedule("gpipe", 2, 3), _costs())
    # microbatch 2's output goes at its own backward's end: not a late output
    assert late == LateFrees(outputs=frozenset({(0, 0), (0, 1)}), frees={(0, 2): 2 * 20, (1, 2): 3 * 20})


def _frees(tasks) -> list[tuple[str, int]]:
    return [(t.label(), t.free_bytes) for t in tasks]


@pytest.mark.parametrize("rank", [0, 1])
def test_the_lowering_gives_held_bytes_back_at_the_end_of_their_holders_backward(rank):
    sched, costs = build_schedule("1f1b", 2, 4), _costs()

    def lowered(late):
        return lower_rank(sched.ranks[rank], costs=costs, devices=[0, 1], hardware=DGX1, tensors={}, late=late)

    held, plain = lowered(late_frees(sched, costs)), lowered(None)
    changed = {label: (b - a) for (label, a), (_, b) in zip(_frees(plain), _frees(held)) if a != b}
    if rank == 0:
        # B(0, 0) no longer gives its output back; B(0, 2)'s last task (layer 0) does
        assert changed == {"0B0 L0": -20, "0B2 L0": +20}
    else:
        assert changed == {"1B1 L0": +20, "1B2 L0": +20, "1B3 L0": +40}
    # with the late frees, the iteration gives back all it took; before them, the input
    # gradients of stage 1 (4 x 20) were never given back
    assert sum(t.alloc_bytes - t.free_bytes - t.release_bytes for t in held) == 0
    left = sum(t.alloc_bytes - t.free_bytes - t.release_bytes for t in plain)
    assert left == (0 if rank == 0 else 4 * 20)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_a_held_output_its_layer_saves_is_given_back_once(name):
    # Stage 0's last layer saves its output: the output a send holds must still be given
    # back once, at the end of its holder's backward (not also by its layer's backward)
    sched, costs = build_schedule(name, 2, 4), _costs(stage_output_saved=True)
    tasks = lower_rank(sched.ranks[0], costs=costs, devices=[0, 1], hardware=DGX1, tensors={},
                       late=late_frees(sched, costs))
    assert sum(t.alloc_bytes - t.free_bytes - t.release_bytes for t in tasks) == 0
