"""Your own loop's optimizer under a plan: `wrap_optimizer(optimizer, stages)`.

    optimizer = torch.optim.AdamW(groups, lr=3e-4, weight_decay=0.1)    # the user's own
    optimizer = wrap_optimizer(optimizer, [stage])                      # + this line
    scheduler = LambdaLR(optimizer, warmup_cosine)                      # unchanged
    ...
    optimizer.zero_grad(); schedule.step(...); optimizer.step(); scheduler.step()

The wrapped optimizer is a `torch.optim.Optimizer` (LR schedulers take it) over the
user's own parameter groups -- the same group dicts, so a scheduler's rate reaches the
step -- and carries out the plan's model-data decisions around each step with the
runtime's one implementation (`mpress.runtime.optimizer_offload.RankOptimizer`, which
`mpress train` runs too): the user's optimizer is retargeted to the tensors the plan
steps (host copies for a stage stepped on the host, masters of half-precision
parameters), the offloaded layers' optimizer data streams through the device one
layer's chunk at a time as the rank's program says, and each step runs the program's
optimizer actions. Values are those of the unwrapped optimizer, bit for bit.

Checkpoints (`state_dict`/`load_state_dict`) are keyed by parameter name, flat per
parameter so that every rank's keys are its own (`torch.distributed.checkpoint` saves
and loads them with the model's state dict):

    {"state": {name: {"step", "exp_avg", "exp_avg_sq"}},       # offloaded ones included
     "param_groups": {name: {"lr", "betas", "weight_decay", ...}},  # the parameter's group
     "masters": {name: fp32 tensor}}                          # under mixed precision only

Every parameter has a state, zeros (Adam's own start) before the first step, so a fresh
loop's `state_dict()` is the template `torch.distributed.checkpoint.load` fills in
place. `load_state_dict` puts hyperparameters back as torch's does (the saved rate, so
a resumed LR scheduler continues); load the model's state before the optimizer's (a
master the checkpoint does not hold comes from its parameter).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from mpress.errors import PlanError, UserError
from mpress.runtime.job_state import load_state, save_state
from mpress.runtime.master_weights import MASTER_DTYPE
from mpress.runtime.optimizer_offload import RankOptimizer, layer_params
from mpress.runtime.stage import MpressStage

ADAMS = (torch.optim.Adam, torch.optim.AdamW)
"""The optimizers the plan's memory model counts (two states per parameter)."""


def _refuse(optimizer: torch.optim.Optimizer, stages: Sequence[MpressStage]) -> None:
    """What a plan's optimizer side cannot carry out, in one line naming what is missing."""
    what = type(optimizer).__name__
    if not stages or not all(isinstance(s, MpressStage) for s in stages):
        raise UserError("wrap_optimizer: pass the rank's stages as apply_mpress returned them")
    if not isinstance(optimizer, ADAMS):
        raise UserError(f"wrap_optimizer: {what} is not Adam or AdamW: a plan counts and moves Adam's two states "
                        "per parameter (exp_avg, exp_avg_sq); use torch.optim.Adam or torch.optim.AdamW")
    for i, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad"):
            raise UserError(f"wrap_optimizer: parameter group {i} has amsgrad=True, a third state per parameter "
                            "that no plan counts; use amsgrad=False")
    if optimizer.state:
        raise UserError(f"wrap_optimizer: the {what} has stepped already; wrap it before its first step (load a "
                        "checkpoint through the wrapped optimizer)")
    programs = {id(s.runtime.program) for s in stages}
    if len(programs) > 1:
        raise PlanError("wrap_optimizer: the stages walk different programs; a rank's stages share one "
                        "(apply_mpress(..., program=rank_program(plan)))")
    stepped = {a.stage for a in stages[0].runtime.program.optimizer_actions()}
    missing = sorted(stepped - {s.stage_index for s in stages})
    if missing:
        raise PlanError(f"wrap_optimizer: the rank's program steps the optimizer of stage {missing[0]}, which was "
                        "not passed to wrap_optimizer")


class MpressOptimizer(torch.optim.Optimizer):
    """The user's optimizer with the plan's model-data decisions carried out around its
    step (see the module docstring). Its `param_groups` and `state` are the user's
    optimizer's; `step` takes no closure."""

    def __init__(self, optimizer: torch.optim.Optimizer, stages: Sequence[MpressStage]) -> None:
        _refuse(optimizer, stages)
        # torch's Optimizer.__init__ would make new groups: this one shares the user's
        self._inner = optimizer
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict[int, Any] = OrderedDict()
        modules = [s.submod for s in stages]
        self._named = {name: p for m in modules for name, p in m.named_parameters()}
        name_of = {id(p): name for name, p in self._named.items()}
        grouped = [name_of.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
        if None in grouped:
            raise UserError("wrap_optimizer: the optimizer steps a tensor that is no parameter of the stages passed")
        left_out = [name for name in self._named if name not in grouped]
        if left_out or len(set(grouped)) != len(grouped):
            raise UserError(f"wrap_optimizer: parameter {(left_out or grouped)[0]} is in "
                            f"{'no' if left_out else 'two'} parameter groups of the optimizer; every parameter of "
                            "the stages must be in exactly one")
        params = {s.stage_index: layer_params(s.submod, list(s.runtime.router.layers)) for s in stages}
        self._rank = RankOptimizer(modules, [s.stage_index for s in stages], [s.runtime for s in stages],
                                   stages[0].runtime.program, params, self._retarget)
        self._rank.start()

    def _retarget(self, names: list[str], tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The user's optimizer over the tensors the plan steps, group by group, in place."""
        by_param = {id(self._named[n]): t for n, t in zip(names, tensors)}
        for group in self._inner.param_groups:
            group["params"] = [by_param[id(p)] for p in group["params"]]
        return self._inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._inner.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UserError("wrap_optimizer: a wrapped optimizer takes no new parameter groups (the plan covers the "
                        "stages' parameters); add them before wrapping")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the stages' gradients (set to None, or zeroed in place)."""
        if set_to_none:
            self._rank.masters.discard_grads()
            return
        for p in self._named.values():
            if p.grad is not None:
                p.grad.detach_().zero_()
        self._rank.masters.discard_host_grads()  # sums of gradients drained to the host (`grad:` host rules)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One optimizer step of the rank's stages, as the plan's program lists it."""
        if closure is not None:
            raise UserError("wrap_optimizer: step() takes no closure (a pipeline step is the schedule's)")
        self._rank.step()

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Host copies, keyed by parameter name (see the module docstring); offloaded
        chunks come to the device one at a time."""
        saved = save_state([], self._rank.masters, self._rank.chunks())
        states = saved["optimizer"]["state"]
        for name, p in self._named.items():
            if name not in states:  # Adam's start: step 0, zero moments
                zeros = torch.zeros(p.shape, dtype=MASTER_DTYPE)
                states[name] = {"step": torch.tensor(0.0), "exp_avg": zeros, "exp_avg_sq": zeros.clone()}
        groups = {name: {k: v for k, v in g.items() if k != "params"}
                  for g in saved["optimizer"]["param_groups"] for name in g["params"]}
        out: dict[str, Any] = {"state": {n: states[n] for n in self._named},
                               "param_groups": {n: groups[n] for n in self._named}}
        if "masters" in saved:
            out["masters"] = saved["masters"]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """`state_dict()`'s layout (host tensors, e.g. filled by
        `torch.distributed.checkpoint.load`) into the optimizer's tensors in place,
        offloaded chunks one at a time; hyperparameters as saved."""
        missing = [n for n in self._named if n not in state_dict.get("state", {})
                   or n not in state_dict.get("param_groups", {})]
        if missing:
            raise UserError(f"optimizer checkpoint has no state for parameter {missing[0]}")
        masters = self._rank.masters
        name_of = {id(masters.target(n)): n for n in masters.names()}
        groups = [[name_of[id(p)] for p in g["params"]] for g in self.param_groups]
        load_state([], masters, self._rank.chunks(),
                   {"model": {}, "masters": state_dict.get("masters", {}),
                    "optimizer": {"state": state_dict["state"], "param_groups": [{"params": g} for g in groups]}})
        for group, names in zip(self.param_groups, groups):
            if names:
                group.update({k: copy.deepcopy(v) for k, v in state_dict["param_groups"][names[0]].items()})
        self._rank.after_change()

    def close(self) -> None:
        """Unpin the host step's staging slabs (at the end of training)."""
        self._rank.masters.close()


def wrap_optimizer(optimizer: torch.optim.Optimizer, stages: MpressStage | Sequence[MpressStage]) -> MpressOptimizer:
    """The user's `torch.optim.Adam`/`AdamW` over the rank's stages (`apply_mpress`'s),
    carrying out the plan's optimizer-state offload, master weights and host step around
    its `step()` (see the module docstring). Refused in one line: another optimizer, one
    that has stepped, one whose groups do not hold exactly the stages' parameters, or
    stages the rank's program does not cover."""
    return MpressOptimizer(optimizer, [stages] if isinstance(stages, MpressStage) else list(stages))


__all__ = ["MpressOptimizer", "wrap_optimizer"]
