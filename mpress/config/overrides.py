"""Dotted overrides of a YAML config's keys from the command line.

`mpress train --config CFG --steps 10 --optimizer.lr 1e-3` sets `steps` and
`optimizer.lr` in the loaded YAML mapping before it is typed (`mpress.config.loader.from_dict`),
so an override is checked exactly as the same value written in the file would be.

- A key is the YAML key's name; in a flag `-` and `_` are the same (`--num-microbatches`
  is `num_microbatches`); nested keys are joined by `.` (`--checkpoint.dir`).
- A value is read as YAML (`10` is an integer, `1e-3` a string that the typed loader reads
  as a number, `null` is None, `[0.9, 0.95]` a list): what it would be in the file.
- A key the config's dataclass does not have is a `ConfigError` naming `--key`, the
  config file and the keys allowed at that level; so is a value that is not valid YAML,
  and a flag without a value.

`parse_override_args` reads the flags (`--key VALUE` or `--key=VALUE`) and
`apply_overrides` applies them; both `mpress train` and the ranks it launches
(`mpress.train --config CFG --key VALUE ...`) use them, so the ranks run what the
launcher checked.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Any

import yaml

from mpress.errors import ConfigError

Override = tuple[str, str]
"""(dotted key, raw value) as given on the command line."""

_MAX_VALUE_CHARS = 4096
"""Longest raw value accepted: a flag value is a scalar or a short list, not a document."""


def parse_override_args(args: list[str], source: str) -> list[Override]:
    """`["--steps", "10", "--optimizer.lr=1e-3"]` -> `[("steps", "10"), ("optimizer.lr", "1e-3")]`.

    Keys are normalised (`-` -> `_`). Raises `ConfigError` (naming `source`, the config
    file) for an argument that is not a `--key`, or a `--key` without a value.
    """
    out: list[Override] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(source, arg, "unexpected argument: overrides are --KEY VALUE (a YAML key of the config, "
                                           "dotted for nested keys, e.g. --optimizer.lr 1e-3)")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and len(args[i + 1]) > 2):
                raise ConfigError(source, f"--{key}", "needs a value (--KEY VALUE)")
            value = args[i + 1]
            i += 1
        out.append((_normalise(key), value))
        i += 1
    return out


def override_argv(overrides: list[Override]) -> list[str]:
    """The flags that `parse_override_args` reads back as `overrides` (for the ranks)."""
    return [f"--{key}={value}" for key, value in overrides]


def apply_overrides(data: Any, overrides: list[Override], schema: type, source: str) -> Any:
    """A copy of `data` (the YAML mapping of a config file) with every override set.

    schema: the config's dataclass (its fields, and nested dataclass fields, are the keys
    that exist). Missing intermediate mappings are created. Raises `ConfigError` naming
    `--key`, `source` and the allowed keys for a key the schema does not have, or a value
    that is not valid YAML; types and ranges are left to the typed loader.
    """
    if not overrides:
        return data
    out = copy.deepcopy(data) if data is not None else {}
    if not isinstance(out, dict):
        raise ConfigError(source, "<top level>", f"expected a mapping, got {type(out).__name__}")
    for key, raw in overrides:
        parts = key.split(".")
        node, cls = out, schema
        for depth, part in enumerate(parts):
            fields = _fields(cls)
            if part not in fields:
                where = ".".join(parts[:depth])
                raise ConfigError(source, f"--{key}", f"no such key{f' under {where}' if where else ''} "
                                                      f"(allowed: {', '.join(sorted(fields))})")
            if depth == len(parts) - 1:
                node[part] = _value(raw, key, source)
                break
            cls = fields[part]
            if cls is None:
                raise ConfigError(source, f"--{key}", f"{'.'.join(parts[:depth + 1])} has no keys below it "
                                                      f"(set it as --{'.'.join(parts[:depth + 1])} VALUE)")
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(source, f"--{key}", f"{'.'.join(parts[:depth + 1])} in the file is not a mapping")
            node = child
    return out


def _fields(cls: type) -> dict[str, type | None]:
    """Init fields of dataclass `cls`: name -> the dataclass type below it, or None for a leaf."""
    hints = typing.get_type_hints(cls)
    out: dict[str, type | None] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        nested = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        out[f.name] = nested[0] if nested else None  # type: ignore[assignment]
    return out


def _value(raw: str, key: str, source: str) -> Any:
    if len(raw) > _MAX_VALUE_CHARS:
        raise ConfigError(source, f"--{key}", f"value longer than {_MAX_VALUE_CHARS} characters")
    try:
        return yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(source, f"--{key}", f"not a YAML value ({first}): {raw!r}") from None


def _normalise(key: str) -> str:
    return key.replace("-", "_")


__all__ = ["Override", "apply_overrides", "override_argv", "parse_override_args"]
