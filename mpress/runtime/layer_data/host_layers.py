"""A stage's layers whose working parameters and gradients live in host memory (`param:`
and `grad:` host rules), carried out as the rank's program lists them (the scheme:
`mpress/static/plan/layer_data.py`; the program: `RankProgram.layer_data`).

Parameters of a `param:` layer live in their home copies on the host (`MasterWeights`
homes: views of a pinned slab on a GPU, host tensors on a CPU stand-in), which the host
optimizer step writes. Their device storages are emptied at start-up (`storage.resize_(0)`,
as FSDP frees a flat parameter: the parameter, and every view autograd saved of it,
keep their identity) and refilled for each use:

- `{s}SI{m}:{s}:params:LAYER` (fetch): the storage gets its bytes back and the home copy
  is copied in, on a GPU on the stage's copy stream after the compute stream's work so
  far, an event recorded; the compute stream waits for that event before the layer
  runs. A fetch listed between compute actions is issued by the program's handler, one
  listed inside a forward or backward when the layer before it in that pass ends.
- `{s}SO{m}:{s}:params:LAYER` (drop): the home copy is still good, so nothing is copied:
  the storage is emptied when the layer ends in that pass.
- `{s}SO{m}:{s}:grads:LAYER` (drain): when the layer's backward ends, each parameter's
  gradient of the microbatch goes to its host buffer (the host step's staging buffer),
  the first microbatch copied, the later ones added in microbatch order -- the additions
  torch's own accumulation makes, so the sum is the same bits -- and the device gradient
  is dropped (on a GPU its storage goes back once the copy ended). The host step reads
  the sum there (`MasterWeights` `grad_on_host`); torch's scaling of the gradients by
  the microbatch count (`scale_grads`) divides it there too.

When a layer's pass ends: a layer's forward ends with its forward hook; its backward ends
when the gradients of the layer before it are wanted (a multi-grad hook on that layer's
outputs, which fires once every gradient with respect to them is made, before the node
that made them runs: the later layer's nodes have all run by then, its gradient
accumulations included, which the engine runs first of the ready nodes; the hook adds no
node, so the layer's outputs stay what they were, views and in-place use included) or,
for the stage's first layer, when the backward returns. Anything the list puts inside a compute action that no
such moment reached runs when the action ends, in the list's order; each is recorded, so
the program checks that what ran is what it lists. A forward outside the program (an
evaluation) fetches what it needs and drops it again.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from mpress.config.vocabulary import Technique
from mpress.contract.actions import Action, Kind, UnitId, UnitKind
from mpress.errors import PlanError
from mpress.runtime.swap.store import copy_stream


def host_layers(runtime: Any, kind: str) -> list[str]:
    """The stage's layers whose `kind` ("param" or "grad") data its rules keep on the host
    (the rules as `StageRules`, the reading both halves share, resolves them)."""
    rules = runtime.router.rules
    return [layer for layer in runtime.router.layers if rules.model_data_rule(kind, layer) is not None]


def refuse_unrun(plan: Any, *, clipping: bool, replicas: bool, tied: bool, source: str = "plan") -> None:
    """Refuse, in one line naming the rule, a `grad:` host rule in a job that reads the
    gradients on the device between the backwards and the step, which the host sums are
    not (yet) part of: gradient clipping, replicas' averaging, tied weights' sums."""
    what = "clip_grad_norm" if clipping else "replicas of the pipeline" if replicas else \
        "tied weights across stages" if tied else None
    if what is None:
        return
    for sp in plan.stages:
        for r, rule in enumerate(sp.rules):
            if rule.tensor.startswith("grad:") and rule.technique is Technique.HOST:
                raise PlanError(f"{source}: stages[{sp.stage}].rules[{r}].tensor: {rule.tensor} sums gradients on the "
                                f"host, which this job's {what} does not read; drop the rule or the {what}")


def _divide_as_on(device: torch.device, buffer: torch.Tensor, factor: int) -> None:
    """`buffer /= factor` on the host with the rounding `grad.div_(factor)` has on `device`:
    CUDA's division by a scalar multiplies by its fp32 reciprocal (`div_true_kernel_cuda`,
    which may lose one bit), the CPU's divides."""
    if device.type == "cuda":  # the reciprocal in the kernel's accumulate type (fp32; fp64 for fp64)
        acc = torch.float64 if buffer.dtype == torch.float64 else torch.float32
        buffer.mul_(float(torch.tensor(1.0, dtype=acc) / factor))
    else:
        buffer.div_(factor)


def _grad_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors among a layer's outputs (a tensor, or tuples, lists and dicts of
    them) whose gradients the backward computes."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _grad_tensors(x)]
    return []


class HostLayerData:
    """One stage's `param:`/`grad:` host layers at run time (see the module docstring).

    runtime: the stage's `StageRuntime` (program, router's layers and rules, device,
    live-bytes tracker); masters: the rank's `MasterWeights`, which hold the home copies
    and the gradient buffers; params: the stage's parameter names per layer.
    """

    def __init__(self, runtime: Any, module: nn.Module, masters: Any, params: dict[str, list[str]]) -> None:
        self.runtime = runtime
        self.program = runtime.program
        self.stage = runtime.stage_index
        self.masters = masters
        self.live = runtime.live
        self.device = torch.device(runtime.device)
        self.layers = list(runtime.router.layers)
        named = dict(module.named_parameters())
        self.params = {layer: [(n, named[n]) for n in params[layer]] for layer in self.layers}
        self.param_layers = host_layers(runtime, "param")
        self.grad_layers = host_layers(runtime, "grad")
        for layer in self.param_layers:
            for name, p in self.params[layer]:
                if p.storage_offset() or not p.is_contiguous() or \
                        p.untyped_storage().nbytes() != p.numel() * p.element_size():
                    raise PlanError(f"stage {self.stage}: rule param:{layer} keeps parameter {name} on the host, but "
                                    "it shares its storage with other tensors (e.g. a tied weight); keep that layer's "
                                    "parameters on the device")
        self.copy_stream = copy_stream(self.device) if self.device.type == "cuda" else None
        self._ready: dict[str, Any] = {}
        """Layers whose parameters are on the device -> the fetch's event (None: done)."""
        self._holders: dict[str, list[int | None]] = {}
        """Per layer on the device, the microbatches whose fetch holds it (the program
        fetches a layer for each microbatch's pass and drops it after; two passes'
        fetches may overlap, and one device copy serves both): it goes with the last."""
        self._current: Action | None = None
        self._todo: dict[tuple[Kind, UnitKind, str], Action] = {}
        """What the list puts inside the compute action running now and has not run yet."""
        self._transient: set[str] = set()
        """Layers an evaluation forward fetched outside the program."""
        self._hooks = []
        for j, name in enumerate(self.layers):
            layer = runtime.router.layers[name]
            self._hooks.append(layer.register_forward_pre_hook(lambda _m, _a, j=j: self._forward_begins(j)))
            self._hooks.append(layer.register_forward_hook(lambda _m, _a, out, j=j: self._forward_ends(j, out)))
        for layer in self.param_layers:  # the plan keeps them on the host from the start
            self._free(layer)
        runtime.manager.released_before(sum(p.numel() * p.element_size() for layer in self.param_layers
                                            for _n, p in self.params[layer]))

    # ---- the program's compute actions ----------------------------------------------------

    def begin(self, action: Action) -> None:
        """Compute action `action` (F or B of this stage) starts: what the list runs inside it."""
        self._current = action
        self._todo = {}
        for a in self.program.layer_data(action):
            unit = UnitId.parse(a.tensor or "")
            self._todo[(a.kind, unit.kind, unit.layer or "")] = a

    def end(self) -> None:
        """The compute action is over: the first layer's backward ended; whatever it lists
        that no layer's end reached runs now, in the list's order."""
        current = self._current
        if current is not None and current.kind is Kind.B:
            self._backward_ended(0)
        for key in list(self._todo):
            self._run(*key)
        self._current = None

    def fetch_listed(self, action: Action) -> None:
        """A fetch the program issues between compute actions (its handler)."""
        self._fetch(UnitId.parse(action.tensor or "").layer or "", action.microbatch)

    def settle(self) -> None:
        """Wait for every copy on the copy stream so far: the gradients' to the host (before
        the host reads the sums) and the fetches' from the home copies (before the host
        step writes them). The stream runs them in order, so one event covers them all."""
        if self.copy_stream is not None:
            done = torch.cuda.Event(blocking=True)  # the host sleeps on it rather than spins
            done.record(self.copy_stream)
            done.synchronize()

    def scale(self, factor: int) -> None:
        """Divide the host sums of this step's gradients by `factor`, as torch's `scale_grads`
        divides the gradients on the device."""
        self.settle()
        with torch.no_grad():
            for layer in self.grad_layers:
                for name, _p in self.params[layer]:
                    buffer, ready = self.masters.host_grad(name)
                    if ready:
                        _divide_as_on(self.device, buffer, factor)

    def close(self) -> None:
        self.settle()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    # ---- the moments inside a pass -----------------------------------------------------------

    def _in(self, kind: Kind) -> bool:
        return self._current is not None and self._current.kind is kind

    def _forward_begins(self, j: int) -> None:
        layer = self.layers[j]
        if layer not in self.param_layers:
            return
        if not self._in(Kind.F) and layer not in self._ready:  # a forward outside the program
            self._fetch(layer, None)
            self._transient.add(layer)
        self._use(layer)

    def _forward_ends(self, j: int, out: Any) -> Any:
        layer = self.layers[j]
        if not self._in(Kind.F):
            if layer in self._transient:
                self._transient.discard(layer)
                self._drop(layer, None)
            return None
        self._run(Kind.SO, UnitKind.PARAMS, layer)
        if j + 1 < len(self.layers):
            self._run(Kind.SI, UnitKind.PARAMS, self.layers[j + 1])
        tensors = _grad_tensors(out) if torch.is_grad_enabled() else []
        if tensors:  # no gradient flows back through the layer: its copies run when the backward ends
            microbatch = self._current.microbatch  # type: ignore[union-attr]
            begins = functools.partial(self._backward_begins, j, microbatch)
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _grads: begins(), mode="all")
        return None

    def _backward_begins(self, j: int, microbatch: int | None) -> None:
        current = self._current
        if current is None or current.kind is not Kind.B or current.microbatch != microbatch:
            return
        if j + 1 < len(self.layers):
            self._backward_ended(j + 1)
        if self.layers[j] in self.param_layers:
            self._use(self.layers[j])

    def _backward_ended(self, j: int) -> None:
        """Layer j's backward ended: its gradients drained, its parameters dropped, the
        parameters of the layer before it fetched (as far as the list says)."""
        layer = self.layers[j]
        self._run(Kind.SO, UnitKind.GRADS, layer)
        self._run(Kind.SO, UnitKind.PARAMS, layer)
        if j > 0:
            self._run(Kind.SI, UnitKind.PARAMS, self.layers[j - 1])

    def _run(self, kind: Kind, unit: UnitKind, layer: str) -> None:
        action = self._todo.pop((kind, unit, layer), None)
        if action is None:
            return
        if unit is UnitKind.GRADS:
            self._drain(layer)
        elif kind is Kind.SI:
            self._fetch(layer, action.microbatch)
        else:
            self._drop(layer, action.microbatch)
        self.program.record(action)

    # ---- the copies ------------------------------------------------------------------------

    def _fetch(self, layer: str, microbatch: int | None) -> None:
        """The layer's parameters back in their storages from their home copies, held
        for `microbatch`'s pass (already there: held for it too)."""
        self._holders.setdefault(layer, []).append(microbatch)
        if layer in self._ready:
            return
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the storages' memory is free there
        with torch.no_grad():
            for name, p in self.params[layer]:
                storage = p.untyped_storage()
                storage.resize_(p.numel() * p.element_size())  # on the compute stream's allocator
                if stream is not None:
                    with torch.cuda.stream(stream):
                        p.data.copy_(self.masters.home(name), non_blocking=True)
                else:
                    p.data.copy_(self.masters.home(name))
                    if self.live is not None:
                        self.live.resized(p, f"parameter {name} (fetched)")
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        self._ready[layer] = event
        namer = self.runtime.router.namer
        if namer is not None:
            namer.parameters_moved()

    def _use(self, layer: str) -> None:
        """The layer is about to run: its parameters must be fetched; the compute stream
        waits for their copy."""
        if layer not in self._ready:
            raise PlanError(f"rank {self.program.rank} stage {self.stage}: layer {layer} runs in "
                            f"{self._current or 'a forward'} with its parameters on the host: the program fetches "
                            "them nowhere before (the plan's program does not belong to this schedule)")
        event = self._ready[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            self._ready[layer] = None

    def _drop(self, layer: str, microbatch: int | None) -> None:
        """`microbatch`'s pass lets the layer's device parameters go (their home copies are
        still good): they go when no other pass holds them."""
        holders = self._holders.get(layer, [])
        if microbatch not in holders:
            raise PlanError(f"rank {self.program.rank} stage {self.stage}: the program drops layer {layer}'s "
                            f"parameters for microbatch {microbatch}, which never fetched them")
        holders.remove(microbatch)
        if not holders:
            self._free(layer)

    def _free(self, layer: str) -> None:
        """The layer's device parameters go."""
        self._holders.pop(layer, None)
        if layer in self._ready:
            self._use(layer)  # a copy into them may still run
            del self._ready[layer]
        for name, p in self.params[layer]:
            p.untyped_storage().resize_(0)
            if self.live is not None:
                self.live.resized(p, f"parameter {name}")

    def _drain(self, layer: str) -> None:
        """The layer's gradients of this microbatch summed into their host buffers."""
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradients are made
        with torch.no_grad():
            for name, p in self.params[layer]:
                grad = p.grad
                if grad is None:
                    continue
                buffer, ready = self.masters.host_grad(name)
                if stream is None:
                    buffer.add_(grad) if ready else buffer.copy_(grad)
                else:
                    with torch.cuda.stream(stream):
                        if ready:  # through pageable memory (synchronous), added on the host
                            buffer.add_(grad.to("cpu"))
                        else:
                            buffer.copy_(grad, non_blocking=True)
                    grad.record_stream(stream)  # its storage goes back when the copy ended
                self.masters.mark_host_grad(name)
                p.grad = None
