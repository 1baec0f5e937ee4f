"""Identity: how every part of mpress names layers and saved tensors, and reads a plan's
rules about them. Both halves call this one module, so a rule means at run time what it
meant when it was planned.

Layers (`layer_paths`): the units a model is split into stages by, as paths of
`named_modules()`:

* a module with a `layer_names()` method (the reference models: `embed`, `layers.i`,
  `head`; any user module that wants to mark its split points) lists them itself;
* `nn.Sequential`: its children;
* any other module whose forward *chains* its top-level children (each child called once,
  in registration order, child i+1 called on child i's output, the module returning the
  last child's output; checked on an example input): its children;
* otherwise the whole module is one layer, named "" (the root's path).

Saved tensors (`SavedTensorNamer`): a tensor autograd saves for backward is named
`module#index` by the innermost module running when it was saved (module forward pre/post
hooks keep a stack) and its index among that module's saved tensors in this forward.
Parameters, and tensors sharing a parameter's storage, are not named (they never move)
and do not count in the index. A tensor saved outside every module (the loss, computed
after the forward) belongs to the last layer and is named under its path.

Run-time keys (`TensorKey`): `(rank, stage, microbatch, tensor)`, the tensor part as above
or `optim:<param>:<state>` for model data, so a failure reads "rank 1 stage 1 microbatch
3 tensor layers.2.mlp.fc1#0" and can be matched against the plan.

Rules (`StageRules`, in `mpress.contract.stage_rules`, which needs no torch): the first rule of a stage whose pattern names a tensor and whose
microbatch selector holds the microbatch decides it; no rule = keep. A layer whose rules
recompute all its saved tensors in a microbatch is checkpointed whole; one whose rules
recompute some of them is checkpointed with the operators producing the rest cached
(`mpress.contract.selective`), so the rest is kept: no other rule may move them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from mpress.contract.selective import LayerOps, OpTrace
from mpress.contract.stage_rules import MODEL_DATA_KINDS, LayerTensors, StageRules  # noqa: F401  (re-exported)
from mpress.errors import PlanError


@dataclass(frozen=True)
class TensorKey:
    """Immutable, hashable name of one tensor at run time."""

    rank: int
    """Global rank of the process that owns the tensor."""
    stage: int
    """Pipeline stage index the tensor belongs to (a rank may hold several stages)."""
    microbatch: int | None
    """Microbatch index for activations; None for model data (params, optimizer states)."""
    tensor: str
    """`module#index` for saved activations, `optim:<param>:<state>` etc. for model data."""

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else f" microbatch {self.microbatch}"
        return f"rank {self.rank} stage {self.stage}{mb} tensor {self.tensor}"


# ---- layers ----------------------------------------------------------------------------------

@contextlib.contextmanager
def side_effect_free(module: nn.Module) -> Iterator[None]:
    """Run something on `module` without a trace: random streams forked (dropout draws the
    same afterwards as if nothing ran) and buffers (BatchNorm statistics) put back."""
    devices = sorted({p.device.index for p in module.parameters() if p.device.type == "cuda"})
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


def _chained_children(module: nn.Module, args: tuple[Any, ...]) -> list[str] | None:
    """Names of the top-level children if `module`'s forward chains them on `args`."""
    children = list(module.named_children())
    if not children:
        return None
    calls: list[tuple[str, Any, Any]] = []
    handles = [child.register_forward_hook(lambda m, a, o, n=name: calls.append((n, a, o)))
               for name, child in children]
    try:
        with torch.no_grad(), side_effect_free(module):
            result = module(*args)
    finally:
        for h in handles:
            h.remove()
    if [c[0] for c in calls] != [name for name, _ in children]:
        return None
    previous: Any = args[0] if len(args) == 1 else None
    for _name, child_args, child_out in calls:
        if len(child_args) != 1 or child_args[0] is not previous:
            return None
        previous = child_out
    return [name for name, _ in children] if result is previous else None


def layer_paths(module: nn.Module, args: tuple[Any, ...]) -> list[str]:
    """The layer list of `module` (see the module docstring); `args` is an example input
    (one microbatch, positional), used only to see whether the forward is a chain."""
    names = getattr(module, "layer_names", None)
    if callable(names):
        paths = list(names())
        found = dict(module.named_modules())
        missing = [p for p in paths if p not in found]
        if missing:
            raise PlanError(f"{type(module).__name__}.layer_names() names {missing[0]!r}, which the module does not have")
        return paths
    if isinstance(module, nn.Sequential) and len(module) > 0:
        return [name for name, _ in module.named_children()]
    return _chained_children(module, args) or [""]


# ---- saved tensors -------------------------------------------------------------------------------

def storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    """What identifies a tensor's storage: its device and address (called for every
    saved tensor, so kept to two cheap attribute reads)."""
    return (t.device, t.untyped_storage().data_ptr())


class SavedName(NamedTuple):
    """The name of one saved tensor, and the layer that was running (a named tuple: one
    is made per saved tensor)."""

    module: str
    index: int
    layer: int
    """Index of the layer in the namer's layer list."""

    @property
    def id(self) -> str:
        return f"{self.module}#{self.index}"


class SavedTensorNamer:
    """Names the tensors autograd saves in `module`'s forwards (see the module docstring).

    Hooks on every submodule stay installed until `close`; they only act between `begin`
    and `end` (one forward, and the loss after it). `layer` is the index of the layer
    running now (it changes when a layer's forward starts; after the forward, the last).
    """

    def __init__(self, module: nn.Module, layers: Sequence[str]) -> None:
        if not layers:
            raise PlanError("a module needs at least one layer")
        self._paths = {m: name for name, m in module.named_modules()}
        self._layer_of = {module.get_submodule(p): i for i, p in enumerate(layers)}
        self.layers = list(layers)
        self._parameters = list(module.parameters())
        self._params = {storage_key(p) for p in self._parameters}
        self._stack: list[str] = []
        self._counts: dict[str, int] = {}
        self.layer = 0
        self.active = False
        self._hooks = []
        for sub in module.modules():
            self._hooks.append(sub.register_forward_pre_hook(self._enter))
            self._hooks.append(sub.register_forward_hook(self._leave, always_call=True))

    def begin(self) -> None:
        """Start naming one forward: indices count from 0 again."""
        self._stack.clear()
        self._counts.clear()
        self.layer = 0
        self.active = True

    def end(self) -> None:
        self.active = False

    def _enter(self, module: nn.Module, _args: Any) -> None:
        if self.active:
            self._stack.append(self._paths.get(module, ""))
            index = self._layer_of.get(module)
            if index is not None:
                self.layer = index

    def _leave(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        if self.active and self._stack:
            self._stack.pop()
            if not self._stack:
                self.layer = len(self.layers) - 1  # what follows the forward belongs to the last layer

    def parameters_moved(self) -> None:
        """Parameters' storages were refilled at new addresses (a layer's host parameters
        fetched again): know them by their addresses now (an empty one has none)."""
        self._params = {storage_key(p) for p in self._parameters if p.untyped_storage().nbytes()}

    def is_parameter(self, t: torch.Tensor) -> bool:
        """Whether `t` is a parameter or shares a parameter's storage."""
        return storage_key(t) in self._params

    def name(self, t: torch.Tensor, storage: tuple[torch.device, int] | None = None) -> SavedName | None:
        """The name of `t`, which autograd is saving now; None for parameters.
        `storage`: `storage_key(t)` when the caller has it."""
        if (storage_key(t) if storage is None else storage) in self._params:
            return None
        module = self._stack[-1] if self._stack else self.layers[-1]
        index = self._counts.get(module, 0)
        self._counts[module] = index + 1
        return SavedName(module, index, self.layer)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _never_unpacked(_saved: None) -> torch.Tensor:
    raise RuntimeError("inspect_stage runs no backward")


def inspect_stage(module: nn.Module, args: tuple[Any, ...], layers: Sequence[str] | None = None) -> list[LayerTensors]:
    """The layers of `module` and what each saves, from one forward on the example input
    `args` (random streams and buffers are left as they were; the forward's results are
    dropped). `layers`: the layer list when known (default `layer_paths`).

    No backward follows, so a saved tensor is named and let go at once (autograd keeps
    a placeholder): the forward holds what a forward holds while it runs, never one
    microbatch's saved activations all at once, which is what the plan exists to avoid
    (at a rank's start-up, before any plan has compacted anything)."""
    layers = list(layers) if layers is not None else layer_paths(module, args)
    namer = SavedTensorNamer(module, layers)
    saved: list[list[str]] = [[] for _ in layers]
    producers: list[list[int | None]] = [[] for _ in layers]
    traces: list[tuple[Any, ...]] = [((), -1)] * len(layers)
    trace = OpTrace()

    def pack(t: torch.Tensor) -> None:
        name = namer.name(t)
        if name is not None:
            saved[name.layer].append(name.id)
            producers[name.layer].append(trace.producer(t))
        return None  # nothing unpacks it: the storage goes as soon as the forward is done with it

    def enter(_m: nn.Module, _a: Any) -> None:
        trace.begin()

    def leave(index: int) -> Any:
        def hook(_m: nn.Module, _a: Any, _o: Any) -> None:
            trace.end()
            traces[index] = (tuple(trace.ops), trace.last_saved_op)
        return hook

    handles = []
    for i, path in enumerate(layers):
        sub = module.get_submodule(path)
        handles += [sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave(i))]
    try:
        with torch.enable_grad(), side_effect_free(module), \
                torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked), trace:
            namer.begin()
            module(*args)
    finally:
        namer.end()
        namer.close()
        for h in handles:
            h.remove()
    return [LayerTensors(name=n, saved=tuple(ids), ops=LayerOps(ops=ops, producers=tuple(p), last_op=last))
            for n, ids, p, (ops, last) in zip(layers, saved, producers, traces)]
