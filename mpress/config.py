"""Typed config loading: YAML is only storage, dataclasses are the truth.

`from_dict(cls, data, source)` builds a (possibly nested) dataclass from plain data and
rejects unknown keys, missing keys, wrong types and out-of-range values with a
`ConfigError` that names the source file, the dotted key and what is allowed.

Range checks come from field metadata, e.g.::

    num_layers: int = field(metadata={"min": 1, "doc": "transformer blocks"})

Supported annotations: bool, int, float, str, Literal[...], `str` enums (stored by
value), Optional[X], list[X], dict[str, X], tuple[X, ...] and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from mpress.errors import ConfigError, UserError

T = TypeVar("T")

_MISSING = dataclasses.MISSING


def load_yaml(path: str | Path) -> Any:
    """Read a YAML (or JSON) file; a missing or unparsable file is a `UserError`."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such file")
    try:
        text = p.read_text()
        if p.suffix == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {first}") from None


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file so nothing half-written remains."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(text)
    tmp.replace(p)


def to_dict(obj: Any) -> Any:
    """Plain-data form of a dataclass (tuples become lists) for YAML/JSON dumping."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {_type_name(get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def _convert(tp: Any, value: Any, source: str, key: str) -> Any:
    origin = get_origin(tp)
    bad = ConfigError(source, key, f"expected {_type_name(tp)}, got {value!r}")
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        real = [a for a in args if a is not type(None)]
        if len(real) == 1:  # Optional[X]: keep X's precise error (e.g. the bad cell of a matrix)
            return _convert(real[0], value, source, key)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, source, key)
            except ConfigError:
                continue
        raise bad
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise bad
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise bad from None
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        (inner, *_rest) = get_args(tp)
        items = [_convert(inner, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        kt, vt = get_args(tp)
        return {_convert(kt, k, source, f"{key}"): _convert(vt, v, source, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return from_dict(tp, value, source, prefix=key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            # allow 1e9-style floats that are whole numbers (YAML reads 80e9 as float)
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, str):
                try:
                    f = float(value)
                except ValueError:
                    raise bad from None
                if f.is_integer():
                    return int(f)
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e9" as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise ConfigError(source, key, f"unsupported field type {tp!r}")


def _check_range(meta: Any, value: Any, source: str, key: str) -> None:
    if value is None or isinstance(value, (str, bool)):
        return
    values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if isinstance(v, (list, tuple, dict)) or not isinstance(v, (int, float)):
            continue
        if "min" in meta and v < meta["min"]:
            raise ConfigError(source, key, f"must be >= {meta['min']}, got {v}")
        if "gt" in meta and v <= meta["gt"]:
            raise ConfigError(source, key, f"must be > {meta['gt']}, got {v}")
        if "max" in meta and v > meta["max"]:
            raise ConfigError(source, key, f"must be <= {meta['max']}, got {v}")


def from_dict(cls: type[T], data: Any, source: str = "", prefix: str = "") -> T:
    """Build dataclass `cls` from `data`, validating keys, types and ranges.

    `source` names the file for error messages; `prefix` is the dotted key path of `data`.
    """
    if not isinstance(data, dict):
        raise ConfigError(source, prefix or "<top level>", f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        allowed = ", ".join(sorted(fields))
        raise ConfigError(source, _join(prefix, str(unknown[0])), f"unknown key (allowed: {allowed})")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name not in data:
            if f.default is _MISSING and f.default_factory is _MISSING:
                raise ConfigError(source, key, f"missing required key ({_type_name(hints[name])})")
            continue
        value = _convert(hints[name], data[name], source, key)
        _check_range(f.metadata, value, source, key)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # __post_init__ checks raise ConfigError("", key, ...): add the file and prefix here.
        if exc.source:
            raise
        raise ConfigError(source, _join(prefix, exc.key), exc.problem) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(source, prefix or cls.__name__, str(exc)) from None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
