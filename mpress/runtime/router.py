"""The saved-tensor router: applies the plan's technique to every tensor autograd saves.

Around each microbatch's forward the router installs
`torch.autograd.graph.saved_tensors_hooks`; module pre/post hooks keep a stack of the
running modules, so each saved tensor gets the identity the profilers and plans use:
`(module path, saved index, microbatch)`, the module being the innermost one running
and the index counting that module's saved tensors in this forward. Then, per the plan:

- keep: the tensor stays (the pack hook returns it);
- host: the pack hook hands it to the host swap engine (swap-out on its worker thread)
  and returns a handle; the unpack hook (in backward) fetches it back;
- d2d: the same through the D2D swap engine, which stripes it over the rule's peers;
- recompute: the layer's forward runs under non-reentrant `torch.utils.checkpoint`
  (RNG state preserved, so dropout masks repeat): its tensors are never saved, only the
  layer's input, and the backward recomputes them.

Parameters, and tensors sharing a parameter's storage, are never moved.
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
from mpress.plan import StagePlan, TensorRule
from mpress.identity import TensorKey
from mpress.runtime.memory.manager import Category, MemoryManager
from mpress.runtime.swap.engine import SwapEngine, SwapHandle


@dataclass(frozen=True)
class _Swapped:
    """What the autograd graph holds instead of a swapped-out tensor."""

    engine: SwapEngine
    handle: SwapHandle


def layer_modules(module: nn.Module) -> dict[str, nn.Module]:
    """The stage's layers by profile name: the module's `layer_names()` when it has them
    (reference models: embed, layers.N, head), else its top-level children."""
    names = module.layer_names() if hasattr(module, "layer_names") else [n for n, _ in module.named_children()]
    found = dict(module.named_modules())
    missing = [n for n in names if n not in found]
    if missing:
        raise PlanError(f"stage module has no layer {missing[0]!r}")
    return {n: found[n] for n in names}


class SavedTensorRouter:
    """Routes one stage's saved tensors to keep / host swap / D2D swap / recompute.

    module: the stage module (module paths as in the whole model).
    plan: this stage's part of the plan.
    engine: the host swap engine (needed when the plan host-swaps anything).
    d2d_engine: the D2D swap engine (needed when the plan D2D-swaps anything).
    """

    def __init__(self, module: nn.Module, plan: StagePlan, engine: SwapEngine | None, *, rank: int,
                 manager: MemoryManager | None = None, d2d_engine: SwapEngine | None = None) -> None:
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
        self._stack: list[str] = []
        self._counts: dict[str, int] = {}
        self._ids: dict[tuple[str, int], str] = {}
        self._handles: dict[int, list[_Swapped]] = {}
        self._prefetched: set[int] = set()
        self._decisions: dict[tuple[str, int], TensorRule | None] = {}
        self._kept_bytes = 0
        self._kept_storages: set[int] = set()
        self._kept_keys: dict[int, TensorKey] = {}
        self._param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._paths = {m: name for name, m in module.named_modules()}
        self.layers = layer_modules(module)
        self._check_plan()
        # No rule about activations (a keep-all plan, or model data only): no hooks at
        # all, so such a plan costs nothing over plain pipelining. An explicit `keep`
        # rule still routes (and accounts) every saved tensor.
        self.routing = any(not r.tensor.startswith(("optim:", "stash:")) for r in plan.rules)
        self._hooks = []
        self._originals: dict[str, Callable[..., Any]] = {}
        if not self.routing:
            return
        for sub in module.modules():
            self._hooks.append(sub.register_forward_pre_hook(self._enter))
            self._hooks.append(sub.register_forward_hook(self._leave))
        for name, layer in self.layers.items():
            self._originals[name] = layer.forward
            layer.forward = functools.partial(self._layer_forward, name)  # instance override keeps paths

    def _check_plan(self) -> None:
        for rule in self.plan.rules:
            if rule.technique == "host" and self.engine is None:
                raise PlanError(f"stage {self.stage}: the plan host-swaps {rule.tensor!r} but no swap engine runs")
            if rule.technique == "d2d" and self.d2d_engine is None:
                raise PlanError(f"stage {self.stage}: the plan D2D-swaps {rule.tensor!r} but no peer pools were "
                                "set up (call mpress.d2d.runtime.peer_pool.setup_peer_pools on every rank and pass them "
                                "to wrap_stage as peers)")

    # -- decisions ---------------------------------------------------------------------------
    def rule(self, tensor: str, microbatch: int) -> TensorRule | None:
        """The plan's rule for `tensor` in `microbatch` (None: keep), cached."""
        key = (tensor, microbatch)
        if key not in self._decisions:
            self._decisions[key] = self.plan.technique(tensor, microbatch)
        return self._decisions[key]

    def technique(self, tensor: str, microbatch: int) -> str:
        rule = self.rule(tensor, microbatch)
        return rule.technique if rule else "keep"

    def recomputes(self, layer: str, microbatch: int) -> bool:
        """Whether the plan recomputes layer `layer` in `microbatch` (recompute rules
        cover whole layers, `LAYER.**`, so the layer's own first tensor decides)."""
        return self.technique(f"{layer}#0", microbatch) == "recompute"

    # -- hooks --------------------------------------------------------------------------------
    def _enter(self, module: nn.Module, _args: Any) -> None:
        if self._active:
            self._stack.append(self._paths.get(module, ""))

    def _leave(self, module: nn.Module, _args: Any, _out: Any) -> None:
        if self._active and self._stack:
            self._stack.pop()

    def _layer_forward(self, name: str, *args: Any, **kwargs: Any) -> Any:
        forward = self._originals[name]
        if self._active and self.recomputes(name, self._microbatch):
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        return forward(*args, **kwargs)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self._active:
            return tensor
        storage = tensor.untyped_storage().data_ptr()
        if storage in self._param_storages:
            return tensor
        module = self._stack[-1] if self._stack else ""
        index = self._counts.get(module, 0)
        self._counts[module] = index + 1
        tensor_id = self._ids.get((module, index))
        if tensor_id is None:
            tensor_id = self._ids[(module, index)] = f"{module}#{index}"
        rule = self.rule(tensor_id, self._microbatch)
        engine = None
        if rule is not None and rule.technique == "host":
            engine = self.engine
        elif rule is not None and rule.technique == "d2d":
            engine = self.d2d_engine
        if engine is None:
            if storage not in self._kept_storages:  # autograd may save one storage twice
                self._kept_storages.add(storage)
                self._kept_bytes += tensor.untyped_storage().nbytes()
            return tensor
        key = TensorKey(rank=self.rank, stage=self.stage, microbatch=self._microbatch, tensor=tensor_id)
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
        self._stack.clear()
        self._counts.clear()
        self._kept_bytes = 0
        self._kept_storages.clear()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._active = False
            if self.manager is not None and self._kept_bytes:
                key = TensorKey(rank=self.rank, stage=self.stage, microbatch=microbatch, tensor="kept")
                self.manager.track(key, self._kept_bytes, Category.ACTIVATION)
                self._kept_keys[microbatch] = key

    def identities(self) -> list[str]:
        """Every saved-tensor identity (`module#index`) routed so far, first-seen order."""
        return list(self._ids.values())

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
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for name in self._originals:
            del self.layers[name].forward  # the class's forward shows through again
        self._originals.clear()
