"""A pipeline job's state for checkpoints: built on the host, loaded in place.

A checkpoint must not need device memory the plan has not planned. So:

- **save** (`save_state`): every tensor is copied device -> host on its own into a new
  host tensor. Nothing is deep-copied (a deep copy of a state dict copies each tensor on
  its own device: on a GPU, a second model and optimizer beside the first). Optimizer
  data the plan keeps off the device comes back one layer's chunk at a time, as for its
  optimizer step, and goes out again, its device storage released, before the next.
- **load** (`load_state`): from a state whose tensors are on the host (checkpoints are
  read into host tensors), each value is copied into the tensor that
  already holds it on the device: parameters and buffers, masters, optimizer states. An
  optimizer state that does not exist yet (a job that has not stepped: Adam makes its
  states at its first step) is made where torch's `Optimizer.load_state_dict` would put
  it, one tensor at a time. Offloaded chunks again one at a time.

The layout is keyed by parameter name, as torch's `get_state_dict` lays a model and
optimizer out (the stages keep the whole model's module paths, so names are global and
the states of several ranks merge into one): `{"model": name -> tensor, "optimizer":
{"state": name -> {key -> value}, "param_groups": [{hyperparameters..., "params":
[name, ...]}]}, "masters": name -> fp32 tensor}` (`masters` only under mixed precision).
It does not depend on where the plan keeps anything, nor on which rank holds which
parameter, so a checkpoint resumes on another world size or stage split
(`mpress.launcher.checkpoints.checkpoint`). torch's own `get_state_dict`/`set_state_dict` do not fit
here: the optimizer steps fp32 masters and host copies (not the module's parameters), and
the offloaded states are not in `optimizer.state` between steps.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mpress.errors import UserError
from mpress.runtime.master_weights import MasterWeights


@dataclass(frozen=True)
class Chunk:
    """Parameters whose optimizer data comes to the device together (one layer's)."""

    names: list[str]
    """Parameter names, in the parameters' order."""
    home: Callable[[], contextlib.AbstractContextManager]
    """Holds the chunk's offloaded data on the device for a `with` block (a kept layer:
    nothing to do)."""


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A new host tensor with `t`'s values: one tensor's bytes on the host, none on the
    device (a GPU tensor is copied device -> host into pageable memory; the copy waits
    for the current stream)."""
    return t.detach().to("cpu", copy=True)


def _copied(value: Any) -> Any:
    return host_copy(value) if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def save_state(modules: Iterable[nn.Module], masters: MasterWeights, chunks: Iterable[Chunk]) -> dict[str, Any]:
    """The job's state on the host, keyed by parameter name (see the module docstring).
    `chunks` must cover every parameter of `masters` exactly once."""
    model: dict[str, torch.Tensor] = {}
    homes = masters.homes()  # parameters kept on the host: their device storage is empty between uses
    for m in modules:
        for name, t in m.state_dict().items():  # views of the live tensors, no copies
            model[name] = host_copy(homes.get(name, t))
    optimizer = masters.optimizer
    states: dict[str, dict[str, Any]] = {}
    master_copies: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        with chunk.home():
            for name in chunk.names:
                per_param = optimizer.state.get(masters.target(name))
                if per_param:
                    states[name] = {key: _copied(v) for key, v in per_param.items()}
            master_copies.update(masters.state_dict(chunk.names))
    state: dict[str, Any] = {"model": model, "optimizer": {"state": dict(sorted(states.items())),
                                                           "param_groups": _named_groups(masters)}}
    if master_copies:
        state["masters"] = master_copies
    return state


def load_state(modules: Iterable[nn.Module], masters: MasterWeights, chunks: Iterable[Chunk],
               state: dict[str, Any]) -> None:
    """Copy `state` (host tensors, keyed by parameter name) into the job's tensors (see
    the module docstring). `state` may hold more parameters than the job (a checkpoint of
    the whole model): only the job's own are read."""
    saved_model = state["model"]
    for m in modules:
        own = m.state_dict()
        missing = [k for k in own if k not in saved_model]
        if missing:
            raise UserError(f"checkpoint has no model tensor {', '.join(missing[:3])}")
        homes = masters.homes()  # parameters kept on the host: into their home copies
        m.load_state_dict({k: saved_model[k] for k in own if k not in homes}, strict=not homes)  # copy_ into each
        with torch.no_grad():
            for k in own:
                if k in homes:
                    homes[k].copy_(saved_model[k])
    saved = state["optimizer"]
    _check_param_groups(masters.optimizer, saved["param_groups"])
    existing = {id(p): st for p, st in masters.optimizer.state.items()}
    names = set(masters.names())  # masters of parameters this rank does not hold are left out
    saved_masters = {k: v for k, v in state.get("masters", {}).items() if k in names}
    for chunk in chunks:
        with chunk.home():
            # masters first: without a saved one (an fp32 run's) a master comes from its parameter
            masters.load_state_dict({k: saved_masters[k] for k in chunk.names if k in saved_masters},
                                    names=chunk.names)
            for name in chunk.names:
                _load_optimizer_state(masters, name, saved["state"].get(name), existing)


def _named_groups(masters: MasterWeights) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: hyperparameters as they are, `params` as
    parameter names (torch's `get_state_dict` layout)."""
    name_of = {id(masters.target(n)): n for n in masters.names()}
    return [{**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
             "params": [name_of[id(p)] for p in g["params"]]} for g in masters.optimizer.param_groups]


def _check_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    """Check the saved parameter groups against the job's. The hyperparameters (learning
    rate, betas, ...) stay the job's: the config is what runs, so a resume with
    `--optimizer.lr 1e-4` trains at 1e-4 (torch's `Optimizer.load_state_dict` would
    silently put the checkpoint's back); the checkpoint keeps its own for the record."""
    if len(saved) != len(optimizer.param_groups):
        raise UserError(f"checkpoint has {len(saved)} optimizer parameter groups, the job "
                        f"{len(optimizer.param_groups)}")


def _load_optimizer_state(masters: MasterWeights, name: str, values: dict[str, Any] | None,
                          existing: dict[int, dict[str, Any]]) -> None:
    """Parameter `name`'s saved optimizer state into its stepped tensor's state. (A
    function of its own: no reference to the chunk's device tensors outlives the chunk.)"""
    optimizer = masters.optimizer
    target = masters.target(name)
    before = existing.pop(id(target), {})
    if values is None:
        optimizer.state.pop(target, None)
        return
    # what is on the device now: kept states, or an offloaded chunk's just brought home
    held = {**before, **optimizer.state.get(target, {})}
    where = _Where(target, _group_flags(optimizer, target), name)
    optimizer.state[target] = {key: _into(held.get(key), v, key, where) for key, v in values.items()}


def _group_flags(optimizer: torch.optim.Optimizer, target: torch.Tensor) -> list[dict[str, Any]]:
    """The group of `target`, in the form torch's placement policy reads (`params` holding
    index 0, `fused` and `capturable` flags)."""
    group = next(g for g in optimizer.param_groups if any(p is target for p in g["params"]))
    return [{"params": [0], "fused": group.get("fused", False), "capturable": group.get("capturable", False)}]


@dataclass(frozen=True)
class _Where:
    """The tensor a loaded optimizer state belongs to, and its place in the saved groups."""

    target: torch.Tensor
    groups: list[dict[str, Any]]
    """The target's group flags, as `_group_flags` gives them."""
    name: str


def _into(held: Any, value: Any, key: str, where: _Where) -> Any:
    """`value` in the tensor that holds it now (copied in place), or in a new one placed
    as torch's `Optimizer.load_state_dict` places loaded states (on the stepped tensor's
    device and dtype; Adam's step counter stays a host scalar unless capturable/fused)."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if isinstance(held, torch.Tensor):
        if held.shape != value.shape:
            raise UserError(f"checkpoint's optimizer state {key} of {where.name} is {tuple(value.shape)}, "
                            f"the job's is {tuple(held.shape)}")
        with torch.no_grad():
            held.copy_(value)
        return held
    placed = torch.optim.Optimizer._process_value_according_to_param_policy(where.target, value, 0, where.groups, key)
    # never the caller's tensor itself (a host state stays the job's own)
    return placed.clone() if placed is value else placed
