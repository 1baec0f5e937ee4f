"""A stage's memory layer by layer (`stage_memory.py`): hand-computed steps on literal
layers, and the composed walk against what `LiveBytes` counts when a probed model really
runs its forward and backward on CPU."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpress.actions import Action
from mpress.live_bytes import LiveBytes
from mpress.static.memory_probe import probe_layers
from mpress.static.profile import LayerMemory, LayerProfile, SavedTensor
from mpress.static.program import Task, walk_peaks
from mpress.static.stage_memory import StepMemory, backward_steps, forward_steps, freeable_bytes


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
PLAIN = [False] * 4
C_RECOMPUTED = [False, False, True, False]


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
    # A's input gradient 5 stays (the receive buffer's); parameters' gradients 7 + 3 + 2
    assert left == 5 + (12 if first else 0)


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
                         grad_bytes=grads, memory=plain, recompute_memory=recomputed)
            for p, (plain, recomputed, grads) in zip(paths, probe_layers(model, (x,), paths, loss_fn=loss_fn))]


def _walk(layers: list[LayerProfile], recomputed: list[bool], num_microbatches: int) -> tuple[int, int]:
    """Peak and end of the walk of all forwards, then all backwards (GPipe order)."""
    steps = forward_steps(layers, recomputed) * num_microbatches
    for m in range(num_microbatches):
        steps += backward_steps(layers, recomputed, first_backward=m == 0)
    tasks = [Task(Action.parse("0F0"), alloc_bytes=s.alloc_bytes, transient_bytes=s.transient_bytes,
                  free_bytes=s.free_bytes) for s in steps]
    return max(walk_peaks(tasks, 0)), sum(t.alloc_bytes - t.free_bytes for t in tasks)


def _forward(model: nn.Sequential, x: torch.Tensor, recomputed: list[bool]) -> torch.Tensor:
    """The stage's forward as the runtime runs it: a recomputed layer under a non-reentrant
    checkpoint with its random state preserved."""
    h = x
    for module, r in zip(model, recomputed):
        h = checkpoint(module, h, use_reentrant=False, preserve_rng_state=True) if r else module(h)
    return h


@pytest.mark.parametrize("recomputed", [list(r) for r in itertools.product([False, True], repeat=5)],
                         ids=lambda r: "".join("R" if x else "-" for x in r))
def test_walk_of_a_middle_stage_equals_a_cpu_run(recomputed):
    # A stage between two others: its inputs and the gradients of its outputs are receive
    # buffers made before the step (not counted); two microbatches, all forwards then all
    # backwards; the pipeline holds each output until its backward.
    model = _model()
    xs = [torch.randn(5, 8, requires_grad=True) for _ in range(2)]
    grads = [torch.ones(5, 4) for _ in xs]
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


def test_walk_of_a_last_stage_with_its_loss_equals_a_cpu_run():
    # The last stage as torch's pipelining runs it: the loss is part of the last layer; the
    # schedule keeps each loss (`_internal_losses`) until the step ends, and
    # `torch.autograd.backward(loss)` makes the loss's seed gradient itself and holds it
    # until the whole backward returns.
    model = _model()
    x, target = torch.randn(5, 8), torch.randn(5, 4)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    peak, end = _walk(_probed(model, x, loss_fn), [False] * 5, 1)
    tracker = LiveBytes(rank=0)
    for t in [*model.parameters(), x, target]:
        tracker.adopt(t, "before the step")
    with tracker.watch():
        start = tracker.live_bytes
        tracker.reset_peak()
        out = model(x)
        losses = [loss_fn(out)]
        torch.autograd.backward(losses[0])
        del out
        peak_seen = tracker.peak_bytes - start
        losses.clear()  # the step is over
    assert (peak_seen, tracker.live_bytes - start) == (peak, end)
