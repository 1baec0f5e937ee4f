"""Which parameters take weight decay: the optimizer's two parameter groups.

Weight decay pulls weights towards zero. For biases, the gains and shifts of
normalisation layers and embedding tables that is not wanted (GPT-2/3, nanoGPT and
torchtitan leave them undecayed), so the optimizer runs two groups: `decay` (the job's
`weight_decay`) and `no_decay` (0). What goes into `no_decay` is a list of entries, each
either a built-in category or a glob over the whole model's parameter names
(`fnmatch`: `*` matches across dots, e.g. `head.*`, `*.pos.weight`):

    bias       a parameter whose own name is `bias` (`layers.0.attn.qkv.bias`)
    norm       a parameter of a normalisation module (its class name ends in `Norm`:
               LayerNorm, RMSNorm, GroupNorm, BatchNorm1d, ... checked as `*Norm*`)
    embedding  a parameter of an embedding module (class name containing `Embedding`),
               and every copy of a weight tied across stages (a tied embedding and
               output projection decay alike, so the copies stay equal)

Names are the whole model's module paths (every stage keeps them), so the selection is
the same whatever the stage split; both groups exist on every rank (one may be empty),
so every rank's optimizer, and every checkpoint, has the same groups. Without weight
decay there is one group: the split would change nothing.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Sequence

import torch
from torch import nn

NO_DECAY_CATEGORIES: tuple[str, ...] = ("bias", "norm", "embedding")
"""Built-in entries of `no_decay` (see the module docstring)."""
DEFAULT_NO_DECAY: tuple[str, ...] = NO_DECAY_CATEGORIES


def _is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__


def _is_embedding(module: nn.Module) -> bool:
    return "Embedding" in type(module).__name__


def no_decay_names(modules: Sequence[nn.Module], patterns: Sequence[str], *,
                   tied: Collection[str] = ()) -> set[str]:
    """Names of the parameters of `modules` that `patterns` exempt from weight decay.

    patterns: `no_decay` entries (categories or globs, see the module docstring).
    tied: names of parameters tied across stages (the `embedding` category takes them).
    """
    wanted = set(patterns)
    globs = [p for p in patterns if p not in NO_DECAY_CATEGORIES]
    out: set[str] = set()
    for module in modules:
        for mod_name, mod in module.named_modules():
            category = ("norm" in wanted and _is_norm(mod)) or ("embedding" in wanted and _is_embedding(mod))
            for own, _p in mod.named_parameters(recurse=False):
                name = f"{mod_name}.{own}" if mod_name else own
                if (category or ("bias" in wanted and own == "bias")
                        or ("embedding" in wanted and name in tied)
                        or any(fnmatch.fnmatchcase(name, g) for g in globs)):
                    out.add(name)
    return out


def param_groups(names: Sequence[str], tensors: Sequence[torch.Tensor], *, weight_decay: float,
                 no_decay: Collection[str]) -> list[dict]:
    """torch optimizer parameter groups over `tensors` (the tensors stepped for parameters
    `names`, in the same order): with `weight_decay` > 0, `[decay, no_decay]` (the latter
    with weight_decay 0, possibly empty); else one group. Each tensor keeps its order."""
    if len(names) != len(tensors):
        raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
    if weight_decay <= 0:
        return [{"params": list(tensors), "weight_decay": 0.0}]
    decay = [t for n, t in zip(names, tensors) if n not in no_decay]
    exempt = [t for n, t in zip(names, tensors) if n in no_decay]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]


def build_optimizer(kind: str, names: Sequence[str], tensors: Sequence[torch.Tensor], *, lr: float,
                    betas: tuple[float, float], eps: float, weight_decay: float,
                    no_decay: Collection[str]) -> torch.optim.Optimizer:
    """torch's `Adam` (`kind` "adam": weight decay as an L2 term added to the gradient) or
    `AdamW` ("adamw": decoupled decay, `p -= lr * weight_decay * p` before the Adam
    update) over `param_groups(...)`, with torch's defaults otherwise (one tensor at a
    time on the CPU: the bit-for-bit tests compare against it)."""
    groups = param_groups(names, tensors, weight_decay=weight_decay, no_decay=no_decay)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=betas, eps=eps)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    raise ValueError(f"optimizer must be adam or adamw, got {kind!r}")


__all__ = ["DEFAULT_NO_DECAY", "NO_DECAY_CATEGORIES", "build_optimizer", "no_decay_names", "param_groups"]
