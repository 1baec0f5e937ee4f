"""A user's own model for the profilers: `package.module:factory` and the layers it is split by.

A factory takes no arguments and returns `(module, example_input)` or
`(module, example_input, loss_fn)`: `example_input` is one microbatch (a tensor or a tuple
of tensors passed positionally), `loss_fn(output) -> scalar` defaults to `default_loss`.
The factory's module is imported with the current directory importable (first on
`sys.path`), as `python -m` would; the `mpress` console script does not see it otherwise.

Layers (`select_layers`): the split points a user names as module paths of
`named_modules()`, with `*` standing for one name segment (`blocks.*` is `blocks.0`,
`blocks.1`, ..., not `blocks.0.fc1`); without names, `mpress.contract.identity.layer_paths` finds
them (a `layer_names()` method, `nn.Sequential` children, children a forward chains, or
the whole module). A model whose forward is not a plain chain of its children (residual
streams, a `ModuleList` looped over) is split only where it is named.

A profile identifies the model by `module_fingerprint` (its structure: module classes,
parameter and buffer shapes and dtypes), the same on meta, fake and real tensors.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mpress.errors import UserError

LossFn = Callable[[Any], torch.Tensor]
Factory = Callable[[], Any]


@dataclass(kw_only=True)
class UserModule:
    """What a user factory returns: a module, its example input and an optional loss."""

    module: nn.Module
    example_input: Any
    """A tensor or a tuple of tensors passed positionally to `module`."""
    loss_fn: LossFn | None = None
    """output -> scalar tensor; None: the sum of the floating outputs."""

    @property
    def args(self) -> tuple[Any, ...]:
        return as_args(self.example_input)

    @property
    def microbatch_size(self) -> int:
        """The first dimension of the first tensor input (1 for a scalar input)."""
        first = next(t for t in self.args if isinstance(t, torch.Tensor))
        return int(first.shape[0]) if first.ndim > 0 else 1


def as_args(example_input: Any) -> tuple[Any, ...]:
    return tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a (nested) tuple/list/dict output."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v)


def default_loss(output: Any) -> torch.Tensor:
    """Sum of every floating tensor in `output` (in fp32): a stand-in loss so backward runs."""
    parts = [t.float().sum() for t in tensors(output) if t.is_floating_point()]
    if not parts:
        raise UserError("module output has no floating-point tensor to back-propagate from")
    return torch.stack(parts).sum()


def module_fingerprint(module: nn.Module) -> str:
    """Stable short hash of a module's structure: class names and parameter/buffer shapes."""
    parts = [f"{name}:{type(m).__name__}" for name, m in module.named_modules()]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in module.named_parameters()]
    parts += [f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in module.named_buffers()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _make_cwd_importable() -> None:
    """Put the current directory first on sys.path, as `python -m` does for its whole run
    (it stays: a factory may import more of its package when it is called)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def import_factory(spec: str) -> Factory:
    """The callable `package.module:factory` names; any problem is a one-line `UserError`."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise UserError(f"--module {spec!r}: expected 'package.module:factory'")
    try:
        _make_cwd_importable()
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and mod_name.startswith(exc.name):
            raise UserError(f"--module {spec!r}: no module {exc.name!r} in the current directory ({os.getcwd()}) "
                            "or on PYTHONPATH; run mpress where the package lives or add it to "
                            "PYTHONPATH") from None
        raise UserError(f"--module {spec!r}: importing {mod_name} failed: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # any import-time failure is the user's module's problem
        raise UserError(f"--module {spec!r}: cannot import {mod_name}: {type(exc).__name__}: {exc}") from None
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise UserError(f"--module {spec!r}: {mod_name} has no callable {attr!r}")
    return factory


def call_factory(factory: Factory, spec: str) -> UserModule:
    """Call `factory` and check what it returns (one-line `UserError` naming `spec`)."""
    try:
        result = factory()
    except UserError:
        raise
    except Exception as exc:  # report the user's factory failing in one line
        raise UserError(f"--module {spec!r}: factory raised {type(exc).__name__}: {exc}") from None
    if not isinstance(result, tuple) or len(result) not in (2, 3) or not isinstance(result[0], nn.Module):
        raise UserError(f"--module {spec!r}: factory must return (nn.Module, example_input[, loss_fn])")
    loss_fn = result[2] if len(result) == 3 else None
    if loss_fn is not None and not callable(loss_fn):
        raise UserError(f"--module {spec!r}: the third returned item (loss_fn) is not callable")
    if not any(isinstance(t, torch.Tensor) for t in as_args(result[1])):
        raise UserError(f"--module {spec!r}: example_input must be a tensor or a tuple of tensors")
    return UserModule(module=result[0], example_input=result[1], loss_fn=loss_fn)


def load_user_factory(spec: str) -> UserModule:
    """Import `package.module:factory` and call it (see the module docstring)."""
    return call_factory(import_factory(spec), spec)


def parse_layers(text: str | None) -> list[str] | None:
    """`--layers "embed,blocks.*,head"` -> patterns (None when not given)."""
    if text is None:
        return None
    patterns = [p.strip() for p in text.split(",") if p.strip()]
    if not patterns:
        raise UserError("--layers: give module names or patterns, e.g. 'embed,blocks.*,head'")
    return patterns


def _matches(pattern: str, path: str) -> bool:
    parts, names = pattern.split("."), path.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


def select_layers(module: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The module paths `patterns` name (see the module docstring), in `named_modules()`
    order. Every pattern must name a module; no named module may lie inside another."""
    paths = [name for name, _ in module.named_modules() if name]
    chosen: list[str] = []
    for pattern in patterns:
        hits = [p for p in paths if _matches(pattern, p)]
        if not hits:
            raise UserError(f"--layers {pattern!r} names no module of {type(module).__name__} "
                            f"(its children: {', '.join(n for n, _ in module.named_children())})")
        chosen += [p for p in hits if p not in chosen]
    layers = [p for p in paths if p in chosen]
    for outer in layers:
        inner = next((p for p in layers if p.startswith(outer + ".")), None)
        if inner is not None:
            raise UserError(f"--layers: {inner!r} lies inside {outer!r}; name layers that do not nest")
    return layers
