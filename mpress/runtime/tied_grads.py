"""Tied weights across pipeline stages: every copy's gradient becomes the sum of all of them.

A weight two stages use (a language model's token embedding on the first stage and its
output projection on the last) is held as one copy per stage, equal at the start
(`mpress.models.hf_model`). As Megatron-LM does for its word embeddings, after the
backward passes of a step and before the optimizer step, each copy's gradient is
replaced by the sum of the gradients of all copies, so every copy takes the same
optimizer step and they stay equal, as the single tied tensor of the unsplit model would.

The sum is made in stage order on every rank holding a copy (the copies' gradients are
exchanged point to point over the pipeline's process group), so every copy gets the same
bits. Copies on one rank (interleaved stages) are summed there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

TiedGroup = Sequence[tuple[int, str]]
"""The copies of one tied parameter: (stage, parameter name in that stage's module)."""


@dataclass
class _Group:
    stages: list[int]
    """Every stage holding a copy, in order."""
    local: dict[int, nn.Parameter]
    """This rank's copies by stage."""


class TiedGrads:
    """The tied parameters of this rank's stages and where their other copies live."""

    def __init__(self, groups: Sequence[TiedGroup], *, stage_ids: Sequence[int], modules: Sequence[nn.Module],
                 world: int, group: dist.ProcessGroup | None = None,
                 stage_ranks: Sequence[int] | None = None) -> None:
        """groups: every tied parameter of the model (`HFModel.tied_groups`); stage_ids and
        modules: this rank's stages and their modules; stage s runs on rank
        `stage_ranks[s]` (default s % world) of `group` (the pipeline's process group,
        None = the default one)."""
        self.world = world
        self.stage_ranks = stage_ranks
        self.group = group
        self.groups: list[_Group] = []
        for g in groups:
            local = {s: modules[stage_ids.index(s)].get_parameter(name) for s, name in g if s in stage_ids}
            if local:
                self.groups.append(_Group(stages=sorted({s for s, _ in g}), local=local))

    def __bool__(self) -> bool:
        return bool(self.groups)

    def repeated(self) -> set[int]:
        """Ids of this rank's copies that are not their group's first: after
        `sum_gradients` they hold the same gradient as the first copy, so a global
        gradient norm counts only the first (the unsplit model's one tensor)."""
        return {id(p) for g in self.groups for s, p in g.local.items() if s != g.stages[0]}

    def _peer(self, stage: int) -> int:
        rank = self.stage_ranks[stage] if self.stage_ranks is not None else stage % self.world
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def sum_gradients(self) -> None:
        """Set every local copy's gradient to the sum over all copies (see the module
        docstring). A copy that took no gradient counts as zeros."""
        for g in self.groups:
            some = next(iter(g.local.values()))
            grads: dict[int, torch.Tensor] = {
                s: p.grad if p.grad is not None else torch.zeros_like(p) for s, p in g.local.items()}
            me = dist.get_rank()
            remote = [s for s in g.stages if s not in g.local]
            ops = []
            for s in remote:
                peer = self._peer(s)
                if peer == me:
                    continue
                grads[s] = torch.empty_like(some)
                ops.append(dist.P2POp(dist.irecv, grads[s], peer, group=self.group))
            for peer in sorted({self._peer(s) for s in remote} - {me}):
                for s, p in g.local.items():
                    ops.append(dist.P2POp(dist.isend, grads[s].contiguous(), peer, group=self.group))
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            total = grads[g.stages[0]].clone()
            for s in g.stages[1:]:
                total += grads[s]
            for p in g.local.values():  # in place: whoever holds the gradient tensor sees the sum
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.copy_(total)
