"""The saved-tensor router: applies the plan's technique to every tensor autograd saves.

Around each microbatch's forward the router installs
`torch.autograd.graph.saved_tensors_hooks`; a `SavedTensorNamer` (`mpress.identity`, the
naming the profilers use) gives each saved tensor its identity `(module path, saved
index, microbatch)`, and the stage's `StageRules` (the same reading of the plan the
rewriter uses) decides it:

- keep: the tensor stays (the pack hook returns it);
- host: the pack hook hands it to the host swap engine (swap-out on its worker thread)
  and returns a handle; the unpack hook (in backward) fetches it back;
- d2d: the same through the D2D swap engine, which stripes it over the rule's peers;
- recompute: the layer's forward runs under non-reentrant `torch.utils.checkpoint`
  (RNG state preserved, so dropout masks repeat): its tensors are never saved, only the
  layer's input, and the backward recomputes them.

The stage's layers and the ids each saves come from one inspected forward of the example
input when the router is built (`inspect_stage`), so rules about layers (recompute) are
read over the same ids at run time as at plan time. Parameters, and tensors sharing a
parameter's storage, are never moved.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpress.errors import PlanError
from mpress.identity import SavedTensorNamer, StageRules, TensorKey, inspect_stage, layer_paths
from mpress.plan import StagePlan, TensorRule
from mpress.runtime.memory.manager import Category, MemoryManager
from mpress.runtime.swap.engine import SwapEngine, SwapHandle
from mpress.vocabulary import Technique


@dataclass(frozen=True)
class _Swapped:
    """What the autograd graph holds instead of a swapped-out tensor."""

    engine: SwapEngine
    handle: SwapHandle


class SavedTensorRouter:
    """Routes one stage's saved tensors to keep / host swap / D2D swap / recompute.

    module: the stage module (module paths as in the whole model).
    plan: this stage's part of the plan.
    example_args: one microbatch's input (positional), as the pipeline passes it; the
        router inspects one forward of it (nothing of it remains) when the plan has rules
        about activations.
    layers: the stage's layer list when the caller has it (default: `layer_paths`).
    engine: the host swap engine (needed when the plan host-swaps anything).
    d2d_engine: the D2D swap engine (needed when the plan D2D-swaps anything).
    num_microbatches: when given, the rules' microbatch selectors are checked against it.
    """

    def __init__(self, module: nn.Module, plan: StagePlan, engine: SwapEngine | None, *, rank: int,
                 example_args: tuple[Any, ...], layers: list[str] | None = None,
                 manager: MemoryManager | None = None,
                 d2d_engine: SwapEngine | None = None, num_microbatches: int | None = None) -> None:
        self.module = module
        self.plan = plan
        self.engine = engine
        self.d2d_engine = d2d_engine
        self.manager = manager
        """When given, kept saved bytes are accounted there per microbatch (swapped ones
        per tensor, by the engine)."""
        self.rank = rank
        self.stage = plan.stage
        self._active = False
        self._microbatch = -1
        self._handles: dict[int, list[_Swapped]] = {}
        self._prefetched: set[int] = set()
        self._kept_bytes = 0
        self._kept_storages: set[int] = set()
        self._kept_keys: dict[int, TensorKey] = {}
        self._check_plan()
        # No rule about activations (a keep-all plan, or model data only): no hooks at
        # all, so such a plan costs nothing over plain pipelining. An explicit `keep`
        # rule still routes (and accounts) every saved tensor.
        self.routing = any(not r.tensor.startswith(("optim:", "stash:")) for r in plan.rules)
        self._originals: dict[str, Callable[..., Any]] = {}
        self.namer: SavedTensorNamer | None = None
        paths = layers if layers is not None else layer_paths(module, example_args)
        if not self.routing:
            self.layers = {name: module.get_submodule(name) for name in paths}
            self.rules = StageRules(plan, [], num_microbatches)
            return
        tensors = inspect_stage(module, example_args, paths)
        self.layers = {layer.name: module.get_submodule(layer.name) for layer in tensors}
        self.rules = StageRules(plan, tensors, num_microbatches)
        self.namer = SavedTensorNamer(module, list(self.layers))
        for name, layer in self.layers.items():
            self._originals[name] = layer.forward
            layer.forward = functools.partial(self._layer_forward, name)  # instance override keeps paths

    def _check_plan(self) -> None:
        for rule in self.plan.rules:
            if rule.technique is Technique.HOST and self.engine is None:
                raise PlanError(f"stage {self.stage}: the plan host-swaps {rule.tensor!r} but no swap engine runs")
            if rule.technique is Technique.D2D and self.d2d_engine is None:
                raise PlanError(f"stage {self.stage}: the plan D2D-swaps {rule.tensor!r} but no peer pools were "
                                "set up (call mpress.d2d.runtime.peer_pool.setup_peer_pools on every rank and pass them "
                                "to wrap_stage as peers)")

    # -- decisions ---------------------------------------------------------------------------
    def rule(self, tensor: str, microbatch: int) -> TensorRule | None:
        """The plan's rule for `tensor` in `microbatch` (None: keep)."""
        return self.rules.rule(tensor, microbatch)

    def recomputes(self, layer: str, microbatch: int) -> bool:
        """Whether the plan recomputes layer `layer` in `microbatch`."""
        return self.routing and self.rules.recomputed(self.rules.layer_index(layer), microbatch)

    # -- hooks --------------------------------------------------------------------------------
    def _layer_forward(self, name: str, *args: Any, **kwargs: Any) -> Any:
        forward = self._originals[name]
        if self._active and self.recomputes(name, self._microbatch):
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        return forward(*args, **kwargs)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self._active or self.namer is None:
            return tensor
        name = self.namer.name(tensor)
        if name is None:  # a parameter's storage: never moved
            return tensor
        rule = self.rules.rule(name.id, self._microbatch)
        engine = None
        if rule is not None and rule.technique is Technique.HOST:
            engine = self.engine
        elif rule is not None and rule.technique is Technique.D2D:
            engine = self.d2d_engine
        if engine is None:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._kept_storages:  # autograd may save one storage twice
                self._kept_storages.add(storage.data_ptr())
                self._kept_bytes += storage.nbytes()
            return tensor
        key = TensorKey(rank=self.rank, stage=self.stage, microbatch=self._microbatch, tensor=name.id)
        weights = tuple((s.device, s.fraction) for s in rule.stripes) or None
        swapped = _Swapped(engine, engine.swap_out(key, tensor, weights=weights))
        self._handles.setdefault(self._microbatch, []).append(swapped)
        return swapped

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Swapped):
            return packed.engine.fetch(packed.handle)
        return packed

    # -- per microbatch ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def microbatch(self, microbatch: int) -> Iterator[None]:
        """Route the saved tensors of `microbatch`'s forward (use around the forward)."""
        if not self.routing:
            yield
            return
        self._active, self._microbatch = True, microbatch
        self.namer.begin()
        self._kept_bytes = 0
        self._kept_storages.clear()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._active = False
            self.namer.end()
            if self.manager is not None and self._kept_bytes:
                key = TensorKey(rank=self.rank, stage=self.stage, microbatch=microbatch, tensor="kept")
                self.manager.track(key, self._kept_bytes, Category.ACTIVATION)
                self._kept_keys[microbatch] = key

    def prefetch(self, microbatch: int) -> None:
        """Start bringing `microbatch`'s swapped tensors back (idempotent)."""
        # a microbatch whose forward has not swapped anything yet is not marked: its
        # swap-outs may still come
        if microbatch not in self._prefetched and microbatch in self._handles:
            self._prefetched.add(microbatch)
            # the backward needs the last-saved tensor first, and each engine's in worker
            # copies in the order it is asked: ask in reverse forward order
            for swapped in reversed(self._handles[microbatch]):
                swapped.engine.prefetch(swapped.handle)

    def pending_bytes(self, microbatch: int) -> int:
        """Bytes of `microbatch` on host whose swap-in has not been issued."""
        if microbatch in self._prefetched:
            return 0
        return sum(s.handle.nbytes for s in self._handles.get(microbatch, ()))

    def swapped(self, microbatch: int) -> int:
        """Number of tensors of `microbatch` that went to host or peers."""
        return len(self._handles.get(microbatch, ()))

    def finish(self, microbatch: int) -> None:
        """After `microbatch`'s backward: forget its handles and its kept bytes."""
        for swapped in self._handles.pop(microbatch, ()):  # the swapped-in copies die with the backward
            swapped.engine.discard(swapped.handle)
        self._prefetched.discard(microbatch)
        key = self._kept_keys.pop(microbatch, None)
        if key is not None and self.manager is not None:
            self.manager.forget(key)

    def close(self) -> None:
        """Remove the hooks and restore the layers' forwards."""
        if self.namer is not None:
            self.namer.close()
        for name in self._originals:
            del self.layers[name].forward  # the class's forward shows through again
        self._originals.clear()
