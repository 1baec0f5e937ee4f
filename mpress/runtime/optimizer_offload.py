"""Where a stage's optimizer data lives between steps: the device, the pinned pool, or the host.

Optimizer data of a parameter: Adam's states `exp_avg` and `exp_avg_sq` and, under mixed
precision, its fp32 master weight (see `master_weights.py`). Per stage, by the plan:

- `optimizer_step: device` (default): the data of each layer an `optim:LAYER` host, d2d
  or nvme rule names lives off the device (host, striped over the rule's peers, or in a
  file on a local drive: `swap/nvme.py`) from the
  start of training, and streams through the device one layer's chunk at a time as the
  rank's program says (`OptimizerOffload`): `OI` of a chunk brings it in (its copies
  start), the chunk's optimizer step (`OPT:{s}:optim:LAYER`) waits for them, and `OO`
  sends it out again. Keys `optim:<param>:exp_avg`, `optim:<param>:exp_avg_sq`
  (category OPTIMIZER) and `optim:<param>:master` (category MASTER). Other layers' data
  stays on the device.
- `optimizer_step: host`: all the stage's data lives on the host for good (the
  `MasterWeights` host copies and the CPU optimizer's states); `HostOptimizerStep` only
  reports it to the stage's memory manager (residency HOST), so the per-rank report
  shows it. `optim:` rules of such a stage are subsumed: nothing is swapped.

Values are untouched by any of this, so training is bit-identical to keeping everything.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mpress.contract.actions import Action, UnitId, UnitKind
from mpress.contract.actions import Kind as ActionKind
from mpress.errors import PlanError
from mpress.contract.identity import TensorKey
from mpress.runtime.job_state import Chunk
from mpress.runtime.layer_data.host_layers import HostLayerData, host_layers
from mpress.runtime.master_weights import Kind, MasterWeights
from mpress.runtime.memory.manager import Category, Residency
from mpress.runtime.swap.engine import SwapEngine, SwapHandle
from mpress.config.vocabulary import OptimizerStep, Technique

OFFLOADED_STATES = ("exp_avg", "exp_avg_sq")
MASTER = "master"
"""The last part of a master weight's key (`optim:<param>:master`, a host-step stage's) and
of a chunk's master group (`optim:LAYER:master`)."""
STATES = "states"
"""The last part of a chunk's Adam-state group key (`optim:LAYER:states`)."""


def layer_params(module: nn.Module, layers: list[str]) -> dict[str, list[str]]:
    """Names of `module`'s parameters per layer (module order); a parameter under no
    layer goes with the last one, so every parameter is in exactly one chunk."""
    out: dict[str, list[str]] = {layer: [] for layer in layers}
    for name, _p in module.named_parameters():
        owner = next((layer for layer in layers if layer == "" or name.startswith(layer + ".")), layers[-1])
        out[owner].append(name)
    return out


def steps_on_host(runtime) -> bool:
    """Whether the plan runs this stage's optimizer step on the host."""
    return runtime.stage_plan.optimizer_step is OptimizerStep.HOST


def _key(runtime, name: str, part: str) -> TensorKey:
    return TensorKey(rank=runtime.rank, stage=runtime.stage_plan.stage, microbatch=None,
                     tensor=f"optim:{name}:{part}")


def planned_routes(runtime) -> dict[str, tuple[SwapEngine, Any]]:
    """layer -> (swap engine, D2D stripe weights or None) of each layer of the stage whose
    optimizer data the plan offloads; none for a stage whose step runs on the host (its
    data never comes to the device)."""
    sp = runtime.stage_plan
    if steps_on_host(runtime):
        return {}
    routes: dict[str, tuple[SwapEngine, Any]] = {}
    for layer in runtime.router.layers:
        found = runtime.router.rules.model_data_rule("optim", layer)
        if found is None:
            continue
        _index, rule = found
        engine = {Technique.HOST: runtime.engine, Technique.D2D: runtime.d2d_engine,
                  Technique.NVME: runtime.nvme_engine}.get(rule.technique)
        if engine is None:
            raise PlanError(f"stage {sp.stage}: the plan sends optimizer states ({rule.tensor}) to "
                            f"{rule.technique} but no {rule.technique} swap engine runs")
        routes[layer] = (engine, tuple((st.device, st.fraction) for st in rule.stripes) or None)
    return routes


class OptimizerOffload:
    """Streams the optimizer states (and device masters) of planned layers through the
    device, one layer's chunk at a time, as the rank's program says (see the module
    docstring). Everything planned is sent out when it is made.

    routes: layer -> (swap engine, D2D stripe weights or None); params: layer -> its
    parameter names.
    """

    def __init__(self, masters: MasterWeights, routes: dict[str, tuple[SwapEngine, Any]],
                 params: dict[str, list[str]], runtime) -> None:
        self.masters = masters
        self.optimizer = masters.optimizer
        self.routes = routes
        self.params = params
        self.runtime = runtime
        self.handles: dict[str, list[tuple[SwapHandle, list[tuple[str, str]]]]] = {layer: [] for layer in routes}
        """layer -> each swap group holding its data while away, with the (parameter name,
        state name or MASTER) of each of the group's tensors, in order."""
        program = runtime.program
        program.on(ActionKind.OI, runtime.stage_index, lambda a: self.bring_in(unit_layer(a)))
        program.on(ActionKind.OO, runtime.stage_index, lambda a: self.send_out(unit_layer(a)))
        for layer in routes:  # the plan has them off the device from the start
            self.send_out(layer)
            routes[layer][0].wait_outs()  # one layer's masters on the device at a time

    @classmethod
    def from_plan(cls, masters: MasterWeights, module: nn.Module, runtime) -> "OptimizerOffload | None":
        """The offloader for the layers whose optimizer data the plan offloads, or None
        (also for a stage whose step runs on the host: its data never comes to the device)."""
        routes = planned_routes(runtime)
        return cls(masters, routes, layer_params(module, list(runtime.router.layers)), runtime) if routes else None

    def bring_in(self, layer: str) -> None:
        """Start the copies of `layer`'s chunk back to the device (an `OI`)."""
        engine, _weights = self.routes[layer]
        for handle, _parts in self.handles[layer]:
            engine.prefetch(handle)

    def home(self, layer: str) -> None:
        """Put `layer`'s states and masters back (waits for their copies); a layer the plan
        keeps on the device has nothing to do."""
        if layer not in self.routes:
            return
        engine, _weights = self.routes[layer]
        for handle, parts in self.handles[layer]:
            for (name, part), tensor in zip(parts, engine.fetch_group(handle)):
                if part == MASTER:
                    self.masters.restore(name, tensor)
                else:
                    self.optimizer.state[self.masters.target(name)][part] = tensor
        self.handles[layer].clear()

    def send_out(self, layer: str) -> None:
        """Send `layer`'s states and masters out (an `OO`) as two swap groups (see the
        module docstring); no device copy is kept."""
        engine, weights = self.routes[layer]
        states: list[tuple[tuple[str, str], Any]] = []
        masters: list[tuple[tuple[str, str], Any]] = []
        for name in self.params[layer]:
            st = self.optimizer.state.get(self.masters.target(name))
            for part in OFFLOADED_STATES if st else ():
                tensor = st.pop(part, None)
                if tensor is not None:
                    states.append(((name, part), tensor))
            if self.masters.kind(name) is Kind.DEVICE_MASTER:
                master = self.masters.make_away(name) if self.masters.unmade(name) else self.masters.release(name)
                masters.append(((name, MASTER), master))
        for group, category, parts in ((STATES, Category.OPTIMIZER, states), (MASTER, Category.MASTER, masters)):
            if not parts:
                continue
            named = [(name if part == MASTER else f"{name}:{part}", tensor) for (name, part), tensor in parts]
            handle = engine.swap_out_group(_key(self.runtime, layer, group), named, category=category,
                                           weights=weights)
            self.handles[layer].append((handle, [where for where, _t in parts]))

    @contextlib.contextmanager
    def chunk_home(self, layer: str) -> Iterator[None]:
        """`layer`'s chunk on the device for the block, alone: brought home (its copies
        waited for), then sent out again and its device storage released (a release point
        of the stage) when the block ends. Checkpoints read and write the offloaded data
        this way, one chunk at a time, so they hold on the device what the chunk's
        optimizer step holds. A layer the plan keeps on the device: nothing to do."""
        if layer not in self.routes:
            yield
            return
        self.bring_in(layer)
        self.home(layer)
        try:
            yield
        finally:
            self.send_out(layer)
            self.runtime.release()


def unit_layer(action: Action) -> str:
    """The layer of the optimizer chunk an OI, OO or OPT action names."""
    unit = UnitId.parse(action.tensor or "")
    if unit.kind is not UnitKind.OPTIM:
        raise PlanError(f"action {action} names {action.tensor!r}, not a layer's optimizer chunk")
    return unit.layer  # type: ignore[return-value]


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


class RankOptimizer:
    """The optimizer side of one rank's stages, as the plan says: the tensors the
    optimizer steps (`MasterWeights`: host copies for stages stepped on the host, masters
    of offloaded layers made away), the offload of the layers the plan streams
    (`OptimizerOffload`), the host step's accounting (`HostOptimizerStep`), and the
    program's optimizer actions around each chunk's step. One implementation for
    `PipelineJob` and for a user's own loop (`mpress.own_loop`).

    modules, stage_ids: the rank's stage modules and their indices; runtimes: each
    stage's `StageRuntime` (None: a stage without a plan); params: per stage, its
    parameter names per layer; make_optimizer(names, tensors): the optimizer over the
    stepped tensors of the parameters `names` (the modules' parameters, in order).
    The offload starts with `start()` (the trainer counts what it makes)."""

    def __init__(self, modules: list[nn.Module], stage_ids: list[int], runtimes: list, program,
                 params: dict[int, dict[str, list[str]]], make_optimizer) -> None:
        named = {name: p for m in modules for name, p in m.named_parameters()}
        planned = [(s, m, rt) for s, m, rt in zip(stage_ids, modules, runtimes) if rt is not None]
        # staging: one pinned slab per stage stepped on the host, as the static half counts them
        slabs = [[name for name, _p in m.named_parameters()] for _s, m, rt in planned if steps_on_host(rt)]
        # masters of the layers whose optimizer data the plan offloads start away: made and
        # sent out one layer at a time (`start`), never all on the device at once
        away = [name for s, _m, rt in planned for layer in planned_routes(rt) for name in params[s][layer]]
        # layers whose working parameters / gradients the plan keeps on the host (`param:` /
        # `grad:` host rules, which need the host step): their home copies, one more slab
        # per stage, and their gradient sums in the staging buffers
        homes = [[name for layer in host_layers(rt, "param") for name in params[s][layer]]
                 for s, _m, rt in planned if steps_on_host(rt)]
        host_grads = [name for s, _m, rt in planned if steps_on_host(rt)
                      for layer in host_layers(rt, "grad") for name in params[s][layer]]
        self.masters = MasterWeights(named, lambda tensors: make_optimizer(list(named), tensors),
                                     host=[name for slab in slabs for name in slab], slabs=slabs, away=away,
                                     homes=[group for group in homes if group], host_grads=host_grads)
        self.optimizer = self.masters.optimizer
        self.modules, self.stage_ids, self.program, self.params = modules, stage_ids, program, params
        self._planned = planned
        self.offloads: dict[int, OptimizerOffload] = {}
        self.host_steps: list[HostOptimizerStep] = []
        self.layer_data: list[HostLayerData] = []

    def start(self) -> None:
        """Send the planned layers' optimizer data away and report the host step's data."""
        for s, module, runtime in self._planned:
            offload = OptimizerOffload.from_plan(self.masters, module, runtime)
            if offload is not None:
                self.offloads[s] = offload
            host_step = HostOptimizerStep.from_plan(self.masters, module, runtime)
            if host_step is not None:
                self.host_steps.append(host_step)
                if host_layers(runtime, "param") or host_layers(runtime, "grad"):
                    # its parameters leave the device now: the start-up peak counts them until here
                    runtime.layer_data = HostLayerData(runtime, module, self.masters, self.params[s])
                    self.layer_data.append(runtime.layer_data)

    def step(self, *, skip: bool = False, on_stage: Any = None) -> None:
        """The optimizer steps of the rank's stages, as the program lists them (one layer
        at a time without a plan; `on_stage(s)` is told each stage first); skip: drop the
        gradients instead (the program's actions still run, so offloaded chunks come and
        go as planned)."""
        if self.program is None:
            for s in self.stage_ids:
                if on_stage is not None:
                    on_stage(s)
                for names in self.params[s].values():
                    self._step_or_discard(names, skip)
            return
        for data in self.layer_data:  # the gradient sums the host step reads are complete
            data.settle()
        for action in self.program.optimizer_actions():
            self.program.begin(action)
            layers = [unit_layer(action)] if action.tensor else list(self.params[action.stage])
            offload = self.offloads.get(action.stage)
            with torch.profiler.record_function(f"mpress:{action}"):
                for layer in layers:
                    if offload is not None:
                        offload.home(layer)
                    self._step_or_discard(self.params[action.stage][layer], skip)
            self.program.end()
        self.program.end_step()
        self.after_change()

    def _step_or_discard(self, names: list[str], skip: bool) -> None:
        if skip:
            self.masters.discard_grads(names)
        else:
            self.masters.step(names)

    def after_change(self) -> None:
        """After a step or a load: report the host step's new optimizer states."""
        for host_step in self.host_steps:
            host_step.after_step()

    def chunks(self) -> list[Chunk]:
        """Each layer's parameters of each stage, with what brings the layer's offloaded
        optimizer data home (checkpoints read and write it one chunk at a time)."""
        chunks = []
        for s in self.stage_ids:
            offload = self.offloads.get(s)
            for layer, names in self.params[s].items():
                home = functools.partial(offload.chunk_home, layer) if offload is not None \
                    else contextlib.nullcontext
                chunks.append(Chunk(names=names, home=home))
        return chunks
