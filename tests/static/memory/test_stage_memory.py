"""A stage's memory layer by layer (`stage_memory.py`): hand-computed steps on literal
layers, and the composed walk against what `LiveBytes` counts when a probed model really
runs its forward and backward on CPU."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpress.contract.actions import Action
from mpress.contract.live_bytes import LiveBytes
from mpress.static.profile.memory_probe import probe_layers
from mpress.static.profile.profile import LayerMemory, LayerProfile, SavedTensor
from mpress.static.emulate.program import Task, walk_peaks
from mpress.static.memory.stage_memory import WHOLE, StepMemory, backward_steps, forward_steps, freeable_bytes


def layer(name: str, grad_bytes: int = 0, recompute: LayerMemory | None = None, **memory) -> LayerProfile:
    return LayerProfile(name=name, forward_flops=0, backward_flops=0, forward_time_s=0, backward_time_s=0,
                        grad_bytes=grad_bytes, memory=LayerMemory(**memory),
                        recompute_memory=recompute or LayerMemory())


# Four layers (bytes):
#   A: saves its input (the stage's input) and 100 new bytes, output 10: kept 110;
#   B: saves nothing (so A's output dies in B's forward), output 20: kept 20;
#   C: saves its input (B's output) and its own output 30: kept 30;
#   D: saves 36 new bytes but not its input (C keeps that anyway), output 4: kept 40.
#   C recomputed: the checkpoint keeps its input and its output (30), not saved.
A = layer("a", grad_bytes=7, kept_bytes=110, forward_peak_bytes=130, saves_input=True, backward_peak_bytes=60,
          input_grad_bytes=5, output_bytes=10)
B = layer("b", kept_bytes=20, forward_peak_bytes=25, backward_peak_bytes=30, input_grad_bytes=10, output_bytes=20)
C = layer("c", grad_bytes=3, kept_bytes=30, forward_peak_bytes=30, saves_input=True, saves_output=True,
          backward_peak_bytes=50, input_grad_bytes=20, output_bytes=30,
          recompute=LayerMemory(kept_bytes=30, forward_peak_bytes=45, saves_input=True, backward_peak_bytes=70,
                                input_grad_bytes=20, output_bytes=30))
D = layer("d", grad_bytes=2, kept_bytes=40, forward_peak_bytes=50, backward_peak_bytes=45, input_grad_bytes=30,
          output_bytes=4)
LAYERS = [A, B, C, D]
PLAIN = [None] * 4
C_RECOMPUTED = [None, None, WHOLE, None]


def test_forward_takes_what_each_layer_keeps_and_frees_inputs_nothing_holds():
    assert forward_steps(LAYERS, PLAIN) == [
        StepMemory(alloc_bytes=110, transient_bytes=20, free_bytes=0),   # peak 130 - kept 110
        StepMemory(alloc_bytes=20, transient_bytes=5, free_bytes=10),    # A's output: neither A nor B saves it
        StepMemory(alloc_bytes=30, transient_bytes=0, free_bytes=0),     # C saves its input
        StepMemory(alloc_bytes=40, transient_bytes=10, free_bytes=0),    # C saves its output, D's input
    ]


def test_forward_of_a_recomputed_layer_uses_its_checkpointed_memory():
    steps = forward_steps(LAYERS, C_RECOMPUTED)
    assert steps[2] == StepMemory(alloc_bytes=30, transient_bytes=15, free_bytes=0)  # 45 - 30
    # the checkpoint does not save C's output, and D does not save its input: it dies in D
    assert steps[3] == StepMemory(alloc_bytes=40, transient_bytes=10, free_bytes=30)


def test_backward_last_layer_first():
    assert backward_steps(LAYERS, PLAIN, first_backward=True) == [
        # D: takes C's gradient 30 + its parameters' 2; gives back what it kept but its
        # output (40 - 4); its incoming gradient is the receive buffer's
        StepMemory(alloc_bytes=32, transient_bytes=13, free_bytes=36),
        # C: 20 + 3; gives back what it kept (30, its output among them), its saved input
        # (B's output 20) and D's gradient it consumed (30)
        StepMemory(alloc_bytes=23, transient_bytes=27, free_bytes=80),
        # B: 10; kept only its output, which C held and gave back; C's gradient 20
        StepMemory(alloc_bytes=10, transient_bytes=20, free_bytes=20),
        # A: 5 + 7; kept 110 less its output 10 (B's forward freed it); B's gradient 10;
        # the stage's output (D's, 4), held until the backward ends
        StepMemory(alloc_bytes=12, transient_bytes=48, free_bytes=114),
    ]


def test_later_backwards_make_no_parameter_gradients():
    steps = backward_steps(LAYERS, PLAIN, first_backward=False)
    assert [(s.alloc_bytes, s.transient_bytes) for s in steps] == [(30, 15), (20, 30), (10, 20), (5, 55)]
    assert [s.free_bytes for s in steps] == [36, 80, 20, 114]


def test_backward_of_a_recomputed_layer():
    steps = backward_steps(LAYERS, C_RECOMPUTED, first_backward=True)
    # C: 20 + 3, peak 70; kept 30 is its output, which D's forward freed; B's output 20
    # (its saved input) and D's gradient 30
    assert steps[1] == StepMemory(alloc_bytes=23, transient_bytes=47, free_bytes=50)
    assert [steps[0], steps[2], steps[3]] == [backward_steps(LAYERS, PLAIN, first_backward=True)[k] for k in (0, 2, 3)]


@pytest.mark.parametrize("recomputed", [PLAIN, C_RECOMPUTED])
@pytest.mark.parametrize("first", [True, False])
def test_a_microbatch_leaves_only_the_input_gradient_and_parameter_gradients(recomputed, first):
    steps = forward_steps(LAYERS, recomputed) + backward_steps(LAYERS, recomputed, first_backward=first)
    left = sum(s.alloc_bytes - s.free_bytes for s in steps)
    # A's input gradient 5 stays (the send carrying it holds it: the lowering gives it back
    # when the schedule lets the send go); parameters' gradients 7 + 3 + 2
    assert left == 5 + (12 if first else 0)


# D with a loss of 6 bytes (part of what it keeps: 36 saved + its output 4 + the loss)
D_LOSS = layer("d", grad_bytes=2, kept_bytes=46, forward_peak_bytes=56, backward_peak_bytes=45, input_grad_bytes=30,
               output_bytes=4, loss_bytes=6)


def test_a_stage_that_ends_the_model_keeps_its_loss_and_the_seed_lives_through_the_backward():
    steps = backward_steps([A, B, C, D_LOSS], PLAIN, first_backward=True)
    assert steps == [
        # D: C's gradient 30, its parameters' 2 and the loss's seed gradient 6 (peak 45 -
        # 38); gives back what it kept but its output and the loss (46 - 4 - 6)
        StepMemory(alloc_bytes=38, transient_bytes=7, free_bytes=36),
        *backward_steps(LAYERS, PLAIN, first_backward=True)[1:3],  # C and B as without a loss
        # A: as without a loss (114), and the seed (6) when the whole backward ends
        StepMemory(alloc_bytes=12, transient_bytes=48, free_bytes=114 + 6),
    ]
    left = sum(s.alloc_bytes - s.free_bytes for s in forward_steps([A, B, C, D_LOSS], PLAIN) + steps)
    assert left == 5 + 12 + 6  # A's input gradient, the parameters' gradients, the loss
    # one layer: the seed comes and goes in the same step; the stage's output goes too
    (only,) = backward_steps([D_LOSS], [None], first_backward=False)
    assert only == StepMemory(alloc_bytes=30 + 6, transient_bytes=9, free_bytes=46 - 4 - 6 + 6 + 4)


def test_an_output_a_send_holds_is_not_given_back_by_its_backward():
    held = backward_steps(LAYERS, PLAIN, first_backward=True, output_held=True)
    assert held[:3] == backward_steps(LAYERS, PLAIN, first_backward=True)[:3]
    assert held[3] == StepMemory(alloc_bytes=12, transient_bytes=48, free_bytes=114 - 4)  # D's output 4 stays
    left = sum(s.alloc_bytes - s.free_bytes for s in forward_steps(LAYERS, PLAIN) + held)
    assert left == 5 + 12 + 4  # and the held output, which the lowering gives back later


def test_the_stage_output_goes_when_the_backward_ends_even_when_its_layer_saves_it():
    # A, B, C: C (the last) saves its own output (30). The pipeline holds the stage's
    # output until the microbatch's whole backward is over (and a send may hold it longer):
    # C's step gives back only its saved input (B's output, 20); A's gives the output back
    # at the end, or, with output_held, leaves it to the lowering.
    three = [A, B, C]
    steps = backward_steps(three, [None] * 3, first_backward=True)
    assert steps == [StepMemory(alloc_bytes=23, transient_bytes=27, free_bytes=20),
                     StepMemory(alloc_bytes=10, transient_bytes=20, free_bytes=20),
                     StepMemory(alloc_bytes=12, transient_bytes=48, free_bytes=100 + 10 + 30)]
    held = backward_steps(three, [None] * 3, first_backward=True, output_held=True)
    assert [s.free_bytes for s in held] == [20, 20, 100 + 10]
    left = sum(s.alloc_bytes - s.free_bytes for s in forward_steps(three, [None] * 3) + held)
    assert left == 5 + 10 + 30  # A's input gradient, A's and C's parameters' gradients, the held output


def test_freeable_bytes_leave_out_inputs_something_else_holds():
    saved = [SavedTensor(module="m", index=0, bytes=10, input=True), SavedTensor(module="m", index=1, bytes=50)]
    # layer 0's input is the stage's (the receive buffer keeps it)
    assert freeable_bytes(LAYERS, 0, saved, PLAIN) == 50
    # C's input is B's output, which B does not keep: swapping it frees it
    assert freeable_bytes(LAYERS, 2, saved, PLAIN) == 60
    # D's input is C's output, which C saves (unless C is recomputed)
    assert freeable_bytes(LAYERS, 3, saved, PLAIN) == 50
    assert freeable_bytes(LAYERS, 3, saved, C_RECOMPUTED) == 60


# ---- the walk against a real run on CPU -------------------------------------------------------

def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _probed(model: nn.Sequential, x: torch.Tensor, loss_fn=None) -> list[LayerProfile]:
    paths = [name for name, _ in model.named_children()]
    return [LayerProfile(name=p, forward_flops=0, backward_flops=0, forward_time_s=0, backward_time_s=0,
                         grad_bytes=found.param_grad_bytes, memory=found.plain, recompute_memory=found.recomputed)
            for p, found in zip(paths, probe_layers(model, (x,), paths, loss_fn=loss_fn))]


def _walk(layers: list[LayerProfile], recomputed: list, num_microbatches: int) -> tuple[int, int]:
    """Peak and end of the walk of all forwards, then all backwards (GPipe order)."""
    steps = forward_steps(layers, recomputed) * num_microbatches
    for m in range(num_microbatches):
        steps += backward_steps(layers, recomputed, first_backward=m == 0)
    tasks = [Task(Action.parse("0F0"), alloc_bytes=s.alloc_bytes, transient_bytes=s.transient_bytes,
                  free_bytes=s.free_bytes) for s in steps]
    return max(walk_peaks(tasks, 0)), sum(t.alloc_bytes - t.free_bytes for t in tasks)


def _forward(model: nn.Sequential, x: torch.Tensor, recomputed: list) -> torch.Tensor:
    """The stage's forward as the runtime runs it: a recomputed layer under a non-reentrant
    checkpoint with its random state preserved."""
    h = x
    for module, r in zip(model, recomputed):
        h = checkpoint(module, h, use_reentrant=False, preserve_rng_state=True) if r is not None else module(h)
    return h


def _run_middle_stage(model: nn.Sequential, recomputed: list, out_width: int) -> None:
    """A stage between two others: its inputs and the gradients of its outputs are receive
    buffers made before the step (not counted); two microbatches, all forwards then all
    backwards; the pipeline holds each output until its backward is over."""
    xs = [torch.randn(5, 8, requires_grad=True) for _ in range(2)]
    grads = [torch.ones(5, out_width) for _ in xs]
    peak, end = _walk(_probed(model, xs[0]), recomputed, len(xs))
    tracker = LiveBytes(rank=0)
    for t in [*model.parameters(), *xs, *grads]:
        tracker.adopt(t, "before the step")
    with tracker.watch():
        start = tracker.live_bytes
        tracker.reset_peak()
        outs = [_forward(model, x, recomputed) for x in xs]
        for m, g in enumerate(grads):
            torch.autograd.backward([outs[m]], [g])
            outs[m] = None
    assert (tracker.peak_bytes - start, tracker.live_bytes - start) == (peak, end)


@pytest.mark.parametrize("recomputed", [list(r) for r in itertools.product([None, WHOLE], repeat=5)],
                         ids=lambda r: "".join("R" if x else "-" for x in r))
def test_walk_of_a_middle_stage_equals_a_cpu_run(recomputed):
    _run_middle_stage(_model(), recomputed, out_width=4)


@pytest.mark.parametrize("recomputed", [list(r) for r in itertools.product([None, WHOLE], repeat=4)],
                         ids=lambda r: "".join("R" if x else "-" for x in r))
def test_walk_of_a_stage_whose_last_layer_saves_its_output_equals_a_cpu_run(recomputed):
    # the stage ends in a ReLU, which saves its own output (the stage's output) for its
    # backward; the pipeline still holds that output until the whole backward is over
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU())
    assert _probed(model, torch.randn(5, 8, requires_grad=True))[-1].memory.saves_output
    _run_middle_stage(model, recomputed, out_width=32)


@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("recomputed", [[None] * 5, [None, WHOLE, None, WHOLE, WHOLE]],
                         ids=lambda r: "".join("R" if x else "-" for x in r))
def test_walk_of_a_last_stage_with_its_loss_equals_a_cpu_run(recomputed, num_microbatches):
    # The last stage as torch's pipelining runs it: the loss is part of the last layer; the
    # schedule keeps each loss (`_internal_losses`) until the step ends, and
    # `torch.autograd.backward(loss)` makes the loss's seed gradient itself and holds it
    # until the whole backward returns. All forwards, then all backwards.
    model = _model()
    xs, target = [torch.randn(5, 8) for _ in range(num_microbatches)], torch.randn(5, 4)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    layers = _probed(model, xs[0], loss_fn)
    loss_bytes = 4  # a float32 scalar
    assert layers[-1].memory.loss_bytes == loss_bytes and layers[0].memory.loss_bytes == 0
    peak, end = _walk(layers, recomputed, num_microbatches)
    tracker = LiveBytes(rank=0)
    for t in [*model.parameters(), *xs, target]:
        tracker.adopt(t, "before the step")
    with tracker.watch():
        start = tracker.live_bytes
        tracker.reset_peak()
        outs: list[torch.Tensor | None] = [_forward(model, x, recomputed) for x in xs]
        losses = [loss_fn(out) for out in outs]
        for m in range(num_microbatches):
            torch.autograd.backward(losses[m])
            outs[m] = None
        seen = (tracker.peak_bytes - start, tracker.live_bytes - start)  # the iteration's end: the losses are kept
        losses.clear()  # the step is over
        after_step = tracker.live_bytes - start
    assert seen == (peak, end)
    # the losses were the only thing the walk kept past the backwards
    assert after_step == end - num_microbatches * loss_bytes
