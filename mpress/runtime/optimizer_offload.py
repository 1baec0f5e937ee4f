"""Where a stage's optimizer data lives between steps: the device, the pinned pool, or the host.

Optimizer data of a parameter: Adam's states `exp_avg` and `exp_avg_sq` and, under mixed
precision, its fp32 master weight (see `master_weights.py`). Per stage, by the plan:

- `optimizer_step: device` (default): data of layers an `optim:LAYER` host or d2d rule
  names goes out through the host or D2D swap engine (striped over the rule's peers)
  after each optimizer step (`OptimizerOffload`) and comes
  back for the next: the swap-ins are issued when the stage starts its last backward, so
  the copies overlap it, and waited on just before the step. Keys
  `optim:<param>:exp_avg`, `optim:<param>:exp_avg_sq` (category OPTIMIZER) and
  `optim:<param>:master` (category MASTER). Other layers' data stays on the device.
- `optimizer_step: host`: all the stage's data lives on the host for good (the
  `MasterWeights` host copies and the CPU optimizer's states); `HostOptimizerStep` only
  reports it to the stage's memory manager (residency HOST), so the per-rank report
  shows it. `optim:` rules of such a stage are subsumed: nothing is swapped.

Values are untouched by any of this, so training is bit-identical to keeping everything.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mpress.errors import PlanError
from mpress.identity import TensorKey
from mpress.runtime.master_weights import Kind, MasterWeights
from mpress.runtime.memory.manager import Category, Residency
from mpress.runtime.swap.engine import SwapEngine, SwapHandle
from mpress.vocabulary import OptimizerStep, Technique

OFFLOADED_STATES = ("exp_avg", "exp_avg_sq")
MASTER = "master"
"""The last part of a master weight's key (`optim:<param>:master`)."""


def stage_param_names(module: nn.Module, layers: list[str]) -> list[str]:
    """Names of `module`'s parameters that belong to one of `layers`, in module order."""
    return [name for name, _p in module.named_parameters()
            if any(name.startswith(layer + ".") for layer in layers)]


def steps_on_host(runtime) -> bool:
    """Whether the plan runs this stage's optimizer step on the host."""
    return runtime.stage_plan.optimizer_step is OptimizerStep.HOST


def _key(runtime, name: str, part: str) -> TensorKey:
    return TensorKey(rank=runtime.rank, stage=runtime.stage_plan.stage, microbatch=None,
                     tensor=f"optim:{name}:{part}")


class OptimizerOffload:
    """Moves the optimizer states (and device masters) of planned parameters off the
    device (host or peers) and back.

    routes: parameter name -> (swap engine, D2D stripe weights or None).
    """

    def __init__(self, masters: MasterWeights, routes: dict[str, tuple[SwapEngine, Any]], runtime) -> None:
        self.masters = masters
        self.optimizer = masters.optimizer
        self.names = list(routes)
        self.routes = routes
        self.runtime = runtime
        self.handles: dict[tuple[str, str], tuple[SwapEngine, SwapHandle]] = {}
        """(parameter name, state name or MASTER) -> the engine and swap holding it while away."""
        runtime.on_last_backward.append(self.prefetch)

    @classmethod
    def from_plan(cls, masters: MasterWeights, module: nn.Module, runtime) -> "OptimizerOffload | None":
        """The offloader for the parameters whose layer the plan offloads, or None (also
        for a stage whose step runs on the host: its data never comes to the device)."""
        sp = runtime.stage_plan
        if steps_on_host(runtime):
            return None
        routes: dict[str, tuple[SwapEngine, Any]] = {}
        for layer in runtime.router.layers:
            found = runtime.router.rules.model_data_rule("optim", layer)
            if found is None:
                continue
            _index, rule = found
            engine = runtime.engine if rule.technique is Technique.HOST else runtime.d2d_engine
            if engine is None:
                raise PlanError(f"stage {sp.stage}: the plan sends optimizer states ({rule.tensor}) to "
                                f"{rule.technique} but no {rule.technique} swap engine runs")
            weights = tuple((st.device, st.fraction) for st in rule.stripes) or None
            for name in stage_param_names(module, [layer]):
                routes[name] = (engine, weights)
        return cls(masters, routes, runtime) if routes else None

    def prefetch(self) -> None:
        """Start bringing every offloaded tensor back (during the last backward)."""
        for engine, handle in self.handles.values():
            engine.prefetch(handle)

    def before_step(self) -> None:
        """Put the states and masters back (waits for the swap-ins)."""
        for (name, part), (engine, handle) in self.handles.items():
            tensor = engine.fetch(handle)
            if part == MASTER:
                self.masters.restore(name, tensor)
            else:
                self.optimizer.state[self.masters.target(name)][part] = tensor
        self.handles.clear()

    def after_step(self) -> None:
        """Send the states and masters out; no device copy is kept until `before_step`."""
        for name in self.names:
            engine, weights = self.routes[name]
            target = self.masters.target(name)
            st = self.optimizer.state.get(target)
            for part in OFFLOADED_STATES if st else ():
                tensor = st.get(part)
                if tensor is None:
                    continue
                self.handles[(name, part)] = (engine, engine.swap_out(
                    _key(self.runtime, name, part), tensor, category=Category.OPTIMIZER, weights=weights))
                del st[part]
            if self.masters.kind(name) is Kind.DEVICE_MASTER:
                self.handles[(name, MASTER)] = (engine, engine.swap_out(
                    _key(self.runtime, name, MASTER), self.masters.release(name), category=Category.MASTER,
                    weights=weights))


class HostOptimizerStep:
    """Accounting of a stage whose step runs on the host: its masters and optimizer states
    are reported to the stage's memory manager as host-resident (they never move)."""

    def __init__(self, masters: MasterWeights, names: list[str], runtime) -> None:
        self.masters = masters
        self.optimizer = masters.optimizer
        self.names = names
        self.runtime = runtime
        manager = runtime.manager
        for name in names:
            manager.track(_key(runtime, name, MASTER), masters.nbytes(name), Category.MASTER, Residency.HOST)

    @classmethod
    def from_plan(cls, masters: MasterWeights, module: nn.Module, runtime) -> "HostOptimizerStep | None":
        """The accounting for a stage the plan steps on the host, or None."""
        if not steps_on_host(runtime):
            return None
        return cls(masters, [name for name, _p in module.named_parameters()], runtime)

    def before_step(self) -> None:
        """Nothing to bring back: the data is where the step runs."""

    def after_step(self) -> None:
        """Report the optimizer states created since the last call (Adam makes them at its
        first step or when a checkpoint is loaded)."""
        manager = self.runtime.manager
        for name in self.names:
            st = self.optimizer.state.get(self.masters.target(name)) or {}
            for part in OFFLOADED_STATES:
                tensor = st.get(part)
                key = _key(self.runtime, name, part)
                if tensor is not None and not manager.is_tracked(key):
                    manager.track(key, tensor.numel() * tensor.element_size(), Category.OPTIMIZER,
                                  Residency.HOST)
