"""Optimizer-state offload: Adam's states live in the pinned host pool between steps.

For every parameter of a layer the plan offloads (`optim:LAYER` rule, technique host),
the Adam states `exp_avg` and `exp_avg_sq` go out through the swap engine after each
optimizer step and come back for the next one; the swap-ins are issued when the stage
starts its last backward, so the copies overlap it. The states' values are untouched by
the round trip, so training is bit-identical to keeping them. (fp32 master weights of
mixed precision go the same way once the runtime keeps master weights; the reference
models train in one dtype.)
"""

from __future__ import annotations

from torch import nn

from mpress.errors import PlanError
from mpress.runtime.identity import TensorKey
from mpress.runtime.memory_manager import Category
from mpress.runtime.swap_engine import SwapHandle

OFFLOADED_STATES = ("exp_avg", "exp_avg_sq")


class OptimizerOffload:
    """Moves the optimizer states of planned parameters to host and back."""

    def __init__(self, optimizer, params: dict[str, nn.Parameter], runtime) -> None:
        if runtime.engine is None:
            raise PlanError(f"stage {runtime.stage_plan.stage}: optimizer offload needs a swap engine")
        self.optimizer = optimizer
        self.params = params
        self.runtime = runtime
        self.engine = runtime.engine
        self.handles: dict[tuple[str, str], SwapHandle] = {}
        runtime.on_last_backward.append(self.prefetch)

    @classmethod
    def from_plan(cls, optimizer, module: nn.Module, runtime) -> "OptimizerOffload | None":
        """The offloader for the parameters whose layer the plan offloads, or None."""
        sp = runtime.stage_plan
        chosen: dict[str, nn.Parameter] = {}
        for layer in runtime.router.layers:
            rule = sp.technique(f"optim:{layer}", None)
            if rule is None or rule.technique == "keep":
                continue
            if rule.technique != "host":
                raise PlanError(f"stage {sp.stage}: {rule.technique} of optimizer states ({rule.tensor}) is not "
                                "supported by this runtime yet; use host")
            for name, p in module.named_parameters():
                if name.startswith(layer + "."):
                    chosen[name] = p
        return cls(optimizer, chosen, runtime) if chosen else None

    def _key(self, name: str, state: str) -> TensorKey:
        return TensorKey(rank=self.runtime.rank, stage=self.runtime.stage_plan.stage, microbatch=None,
                         tensor=f"optim:{name}:{state}")

    def prefetch(self) -> None:
        """Start bringing every offloaded state back (during the last backward)."""
        for handle in self.handles.values():
            self.engine.prefetch(handle)

    def before_step(self) -> None:
        """Put the states back into the optimizer (waits for the swap-ins)."""
        for (name, state), handle in self.handles.items():
            self.optimizer.state[self.params[name]][state] = self.engine.fetch(handle)
        self.handles.clear()

    def after_step(self) -> None:
        """Send the states out; the optimizer keeps no device copy until `before_step`."""
        for name, p in self.params.items():
            st = self.optimizer.state.get(p)
            if not st:
                continue
            for state in OFFLOADED_STATES:
                tensor = st.get(state)
                if tensor is None:
                    continue
                self.handles[(name, state)] = self.engine.swap_out(self._key(name, state), tensor,
                                                                   category=Category.OPTIMIZER)
                del st[state]
