"""A stage's device memory, layer by layer: what each layer's forward and backward of one
microbatch takes and gives back, composed from the layers' probed memory
(`LayerMemory`) and the way torch's pipelining holds a stage's tensors.

The emulator's layer tasks take these figures (`lowering.py`); the runtime does what they
say, so a CPU run's counted bytes follow them. The rules, for layer j of a stage with
layers 0..n-1 (a layer's memory follows its recompute choice, `layer_memory`: a
recomputed layer uses its `recompute_memory`, one recomputed in part the memory of that
`recompute_options` entry; either checkpoint keeps its input):

- forward of j: takes what it keeps (its saved tensors and its output) and, at its peak,
  its transients; at its end the previous layer's output is given back when nothing holds
  it (j does not save its input, j-1 does not save its output, and it is not the stage's
  input, which torch's receive buffer or the input batch holds);
- a swapped-out unit's bytes leave at the next compute action of the rank (its release
  point) and come back when its swap-in is issued; the bytes a swap frees leave out the
  stage's input (swapping it frees nothing) and an input its producer also keeps;
- backward of j (last layer first): takes the gradient of its input (and, in the step's
  first backward, the parameters' gradients) and, at its peak, its transients; at its end
  it gives back what its forward kept (its output excepted when the next layer held it),
  its saved input, and the gradient it consumed; the stage's output (held by the
  pipeline until the microbatch's backward is over) goes when the backward ends; the
  gradient of the stage's input stays: the send that carries it back holds it, and the
  lowering gives it back when torch's schedule lets that send go
  (`schedules.held_input_grads`);
- a split backward (I, then W, `split_backward_steps`): I of j is j's backward without
  the parameters' gradients and keeps what torch's I leaves for W (the layer's measured
  `split_held_bytes`: the retained graph's saves and the output gradients W starts
  from; else what j's weight gradient reads, `SavedTensor.weight_grad`); torch runs a
  stage's I as one pass over the stage's graph, which frees what the forward kept only
  when the whole I ends, so where probed, I of j takes what j's I has made by its end
  and the stage's last I step gives back the rest; W of j takes the parameters'
  gradients (in the step's first W of the stage) and gives back what I left for it.

Units: bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mpress.errors import PlanError
from mpress.static.profile.profile import LayerMemory, LayerProfile, SavedTensor


@dataclass(frozen=True)
class StepMemory:
    """What one layer's forward or backward of one microbatch does to device memory:
    takes `alloc_bytes` when it starts, holds `transient_bytes` more while it runs, gives
    back `free_bytes` when it ends."""

    alloc_bytes: int
    transient_bytes: int
    free_bytes: int


WHOLE = -1
"""A recompute choice: the whole layer is recomputed."""

Choice = int | None
"""What a layer does with its saved tensors in one microbatch: None keeps them (or swaps
some: swaps are units of their own), `WHOLE` recomputes the layer, k >= 0 recomputes the
tensors of its `recompute_options[k]` and keeps the rest."""


def layer_memory(layer: LayerProfile, choice: Choice) -> LayerMemory:
    """What `layer` holds under recompute choice `choice`."""
    if choice is None:
        return layer.memory
    if choice == WHOLE:
        return layer.recompute_memory
    return layer.recompute_options[choice].memory


def recompute_choice(layer: LayerProfile, recomputed: frozenset[int], where: str) -> Choice:
    """The choice a plan's rules make for `layer` by recomputing the saved tensors at
    `recomputed` (positions): None for none, `WHOLE` when they hold every tensor an
    operator of the layer produced (the runtime then checkpoints it whole), else the
    `recompute_options` entry with exactly those tensors; anything else is a `PlanError`
    (in `where`) naming the choices the profile measured."""
    if not recomputed:
        return None
    producible = {p for p, t in enumerate(layer.saved) if t.op_index >= 0}
    if producible <= recomputed and (producible or len(recomputed) == len(layer.saved)):
        return WHOLE
    wanted = sorted(recomputed & producible)
    for k, option in enumerate(layer.recompute_options):
        if option.tensors == wanted:
            return k
    kept = [layer.saved[p].id for p in sorted(producible - recomputed)]
    shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
    what = f"keeping {shown}" if kept else f"in part ({len(recomputed)} of its {len(layer.saved)} saved tensors)"
    sizes = ", ".join(str(len(producible) - len(o.tensors)) for o in layer.recompute_options)
    raise PlanError(
        f"{where}: {layer.name} recomputed {what} is not a choice its profile measured: recompute all of "
        f"{layer.name}.**" + (f", or keep exactly what one of its {len(layer.recompute_options)} recompute_options "
                              f"keeps ({sizes} tensors)" if sizes else ""))


def recompute_time_s(layer: LayerProfile, choice: Choice) -> float:
    """What recomputing under `choice` takes in the backward (0 for None)."""
    if choice is None:
        return 0.0
    return layer.forward_time_s if choice == WHOLE else layer.recompute_options[choice].time_s


def weight_replay_time_s(layer: LayerProfile, choice: Choice) -> float:
    """What a split backward's W spends replaying `layer` recomputed under `choice` (0
    for None): the recompute's time once per replay its probe counted in W
    (`LayerMemory.weight_replays`: torch's W runs one gradient pass per group of
    parameters, and the checkpoint replays the layer in each). Not measured: once when
    the layer has parameters (W then unpacks its saves at least once), else never."""
    if choice is None:
        return 0.0
    replays = layer_memory(layer, choice).weight_replays
    if replays < 0:
        replays = 1 if layer.param_bytes > 0 else 0
    return replays * recompute_time_s(layer, choice)


def forward_steps(layers: Sequence[LayerProfile], recomputed: Sequence[Choice]) -> list[StepMemory]:
    """The forward of one microbatch, one step per layer in order."""
    out = []
    for j, layer in enumerate(layers):
        mem = layer_memory(layer, recomputed[j])
        freed = 0
        if j > 0 and not mem.saves_input:
            prev = layer_memory(layers[j - 1], recomputed[j - 1])
            if not prev.saves_output:
                freed = prev.output_bytes
        out.append(StepMemory(alloc_bytes=mem.kept_bytes, transient_bytes=max(mem.forward_peak_bytes - mem.kept_bytes, 0),
                              free_bytes=freed))
    return out


def backward_steps(layers: Sequence[LayerProfile], recomputed: Sequence[Choice], *,
                   first_backward: bool, output_held: bool = False) -> list[StepMemory]:
    """The backward of one microbatch, one step per layer, last layer first.

    first_backward: the step's first backward of this stage (it makes the parameters'
    gradients). The last layer's incoming gradient (torch's receive buffer) is not given
    back, nor is the gradient of the stage's input (the send carrying it holds it; see
    the module docstring). A stage that ends the model keeps its loss (`loss_bytes` of its last
    layer) until the step ends (torch's schedule and the trainer hold the losses), and
    the loss's seed gradient, which `torch.autograd.backward` makes, lives until the
    whole backward returns.
    output_held: something else (a send) holds the stage's output beyond the backward:
    not given back here (see `lowering.py`).
    """
    n = len(layers)
    out: list[StepMemory] = []
    last = layer_memory(layers[n - 1], recomputed[n - 1])
    loss = last.loss_bytes
    for j in range(n - 1, -1, -1):
        mem = layer_memory(layers[j], recomputed[j])
        alloc = mem.input_grad_bytes + (layers[j].grad_bytes if first_backward else 0)
        # what its forward kept, but the output the next layer's backward gives back (its
        # saved input) or, for the last layer, the stage's output, which goes at the end
        freed = mem.kept_bytes - (0 if mem.saves_output and j < n - 1 else mem.output_bytes)
        if j == n - 1:
            alloc += loss  # the seed
            freed -= loss  # the loss stays
        if j > 0 and mem.saves_input and not layer_memory(layers[j - 1], recomputed[j - 1]).saves_output:
            freed += layer_memory(layers[j - 1], recomputed[j - 1]).output_bytes  # the input it saved
        if j < n - 1:
            freed += layer_memory(layers[j + 1], recomputed[j + 1]).input_grad_bytes  # the gradient it consumed
        if j == 0:
            freed += loss  # the seed
            if not output_held:
                freed += last.output_bytes  # the stage's output, held until the backward ends
        out.append(StepMemory(alloc_bytes=alloc, transient_bytes=max(mem.backward_peak_bytes - alloc, 0),
                              free_bytes=freed))
    return out


def weight_grad_bytes(layer: LayerProfile) -> int:
    """Bytes of the saved tensors `layer`'s weight gradient reads (when the layer is
    recomputed, its replay before I re-makes them): what a split backward keeps from I
    until W."""
    return sum(t.bytes for t in layer.saved if t.weight_grad and not t.held)


def split_backward_steps(layers: Sequence[LayerProfile], recomputed: Sequence[Choice], *, first_weight: bool,
                         output_held: bool = False) -> tuple[list[StepMemory], list[StepMemory]]:
    """(I steps, W steps) of a split backward of one microbatch, last layer first (as
    `backward_steps`, which says what the whole backward takes and gives back; the two
    halves together take and give back the same). first_weight: the step's first W of
    this stage (it makes the parameters' gradients).

    What I leaves for W is the layer's measured `split_held_bytes` (torch's I retains
    the graph's saves and holds the output gradients of the operators with weights), or,
    where not measured, what its weight gradient reads; and a stage that does not end
    the model keeps its output with the I's state until W. I and W peak at the layer's
    measured `input_peak_bytes` and `weight_peak_bytes` (where not measured, I where the
    whole backward does).

    Torch's I of a stage is one pass of the engine over the whole stage's graph, which it
    retains: nothing the forward kept goes while it runs, only when it has handed over
    the stage's input gradient and detaches the outputs. So where measured, I of layer j
    takes what the layer's I has made when its input gradient is out
    (`input_end_bytes`: the output gradients it keeps for W, the saves' gradients of the
    loss, its input gradient) and gives back only the incoming gradient it has used
    (`output_grad_freed_bytes`; the last layer's is torch's receive buffer); the stage's
    last I step (layer 0) then gives back, at its end, what the I's detach frees: the
    rest, so that the I's steps together take and give back what the layers' measured
    I halves do."""
    whole = backward_steps(layers, recomputed, first_backward=False, output_held=output_held)
    n = len(layers)
    last = layer_memory(layers[n - 1], recomputed[n - 1])
    inputs: list[StepMemory] = []
    weights: list[StepMemory] = []
    net = 0  # what the I's steps must leave live in all: the whole backward's net and what W gives back
    for k, step in enumerate(whole):
        j = n - 1 - k
        mem = layer_memory(layers[j], recomputed[j])
        held = mem.split_held_bytes if mem.split_held_bytes >= 0 else min(step.free_bytes, weight_grad_bytes(layers[j]))
        if mem.split_held_bytes >= 0 and j > 0 and mem.saves_input and \
                not layer_memory(layers[j - 1], recomputed[j - 1]).saves_output:
            held += layer_memory(layers[j - 1], recomputed[j - 1]).output_bytes  # its saved input (not probed)
        if j == 0 and not output_held and not last.loss_bytes:
            held += last.output_bytes
        net += step.alloc_bytes - step.free_bytes + held
        peak = mem.input_peak_bytes if mem.input_peak_bytes >= 0 else step.alloc_bytes + step.transient_bytes
        if mem.input_end_bytes >= 0 and mem.input_peak_bytes >= 0:
            inputs.append(StepMemory(alloc_bytes=mem.input_end_bytes,
                                     transient_bytes=max(peak - mem.input_end_bytes, 0),
                                     free_bytes=mem.output_grad_freed_bytes if j < n - 1 else 0))
        else:  # not measured: held beyond what the whole step gives back is taken here
            extra = max(held - step.free_bytes, 0)
            inputs.append(StepMemory(alloc_bytes=step.alloc_bytes + extra,
                                     transient_bytes=max(peak - step.alloc_bytes - extra, 0),
                                     free_bytes=max(step.free_bytes - held, 0)))
        alloc = layers[j].grad_bytes if first_weight else 0
        weights.append(StepMemory(alloc_bytes=alloc, transient_bytes=max(mem.weight_peak_bytes - alloc, 0),
                                  free_bytes=held))
    made = sum(i.alloc_bytes - i.free_bytes for i in inputs)
    end = inputs[-1]  # layer 0's: the I's detach at its end gives back the rest (or, short of it, it takes that)
    inputs[-1] = StepMemory(alloc_bytes=end.alloc_bytes + max(net - made, 0),
                            transient_bytes=max(end.transient_bytes - max(net - made, 0), 0),
                            free_bytes=end.free_bytes + max(made - net, 0))
    return inputs, weights


def freeable_tensors(layers: Sequence[LayerProfile], layer: int, tensors: Sequence[SavedTensor],
                     recomputed: Sequence[Choice]) -> list[SavedTensor]:
    """The tensors among `tensors` (saved by layer `layer` of the stage) whose storage
    swapping them out frees: all but the stage's input (the receive buffer or the input
    batch holds it), an input whose producer keeps it too, storages held elsewhere (the
    loss's targets) and storages counted before (0 bytes)."""
    out = []
    for t in tensors:
        if t.held or t.bytes == 0:
            continue
        if t.input:
            if layer == 0:
                continue
            if layer_memory(layers[layer - 1], recomputed[layer - 1]).saves_output:
                continue
        out.append(t)
    return out


def freeable_bytes(layers: Sequence[LayerProfile], layer: int, tensors: Sequence[SavedTensor],
                   recomputed: Sequence[Choice]) -> int:
    """Bytes swapping `tensors` out frees (`freeable_tensors`)."""
    return sum(t.bytes for t in freeable_tensors(layers, layer, tensors, recomputed))
