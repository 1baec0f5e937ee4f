"""Typed config loading: YAML is only storage, dataclasses are the truth.

`from_dict(cls, data, source)` builds a (possibly nested) dataclass from plain data and
rejects unknown keys, missing keys, wrong types and out-of-range values with a
`ConfigError` that names the source file, the dotted key and what is allowed.

Range checks come from field metadata, e.g.::

    num_layers: int = field(metadata={"min": 1, "doc": "transformer blocks"})

Supported annotations: bool, int, float, str, Literal[...], `str` enums (stored by
value), Optional[X], list[X], dict[str, X], tuple[X, ...] and nested dataclasses.

Every number is checked whatever the metadata says: floats must be finite (no NaN, no
infinity), integers must fit in 64 bits (`INT_MAX`); metadata adds `min`, `gt` and `max`,
applied to every number inside a field (list items, dict values, nested lists).

`load_yaml` is the one reader of config files (train, model, hardware, plan, profile):
it refuses duplicate keys and alias expansion beyond `ALIAS_EXPANSION_LIMIT` nodes.
Output paths are checked before any work by `check_output_path` (config keys) and
`output_path_arg` (argparse flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import os
import stat
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from mpress.config.limits import MAX_FILE_BYTES, MAX_YAML_NODES
from mpress.errors import ConfigError, UserError

T = TypeVar("T")

_MISSING = dataclasses.MISSING

INT_MAX = 2**63 - 1
"""Largest magnitude of an integer in any config: what torch and numpy hold in int64."""

ALIAS_EXPANSION_LIMIT = 10_000
"""Most nodes that YAML aliases may add to a document when it is expanded (a config
read with aliases is used as if every alias were written out). A "billion laughs"
document, nine levels of nine aliases, would add 10**9."""


class _Refused(yaml.YAMLError):
    """A YAML document `_StrictLoader` refuses; the message is the whole reason."""


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (YAML's spec forbids
    it; PyYAML keeps the last silently), documents of more than `MAX_YAML_NODES` nodes
    (counted while composing) and documents whose aliases expand past
    `ALIAS_EXPANSION_LIMIT` nodes (checked on the composed node graph, before anything is
    constructed)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.nodes = 0
        """Nodes composed so far: at most `MAX_YAML_NODES`, refused as they come."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self.nodes += 1
        if self.nodes > MAX_YAML_NODES:
            mark = self.peek_event().start_mark
            raise _Refused(f"line {mark.line + 1}: more than {MAX_YAML_NODES} values in one document; a config, "
                           "plan or profile holds far fewer")
        return super().compose_node(parent, index)

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` may be overridden by design
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # unhashable key: SafeConstructor reports it
            line = key_node.start_mark.line + 1
            if first is not None:
                raise _Refused(f"line {line}: duplicate key {key!r} (first given at line {first}); "
                               "give each key once")
            seen[key] = line
        return super().construct_mapping(node, deep)


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a node graph whose aliases would add more than ALIAS_EXPANSION_LIMIT nodes
    when expanded, or that contains itself (a recursive alias). Iterative: no recursion
    limit on deep documents."""
    size: dict[int, int] = {}  # id(node) -> nodes in its expansion
    distinct = 0
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    open_ids: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            open_ids.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            distinct += 1
            if size[key] - distinct > ALIAS_EXPANSION_LIMIT:
                raise _Refused(f"line {node.start_mark.line + 1}: aliases expand to more than "
                               f"{ALIAS_EXPANSION_LIMIT} extra nodes; write the values out")
            continue
        if key in size:
            continue
        if key in open_ids:
            raise _Refused(f"line {node.start_mark.line + 1}: a recursive alias (a node that contains itself)")
        open_ids.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _json_object(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"duplicate key {key!r}; give each key once")
        out[key] = value
    return out


def load_yaml(path: str | Path) -> Any:
    """Read a YAML (or, for `.json`, JSON) file with `_StrictLoader`'s checks.

    A missing, unreadable or unparsable file, a duplicate key or an alias bomb is a
    one-line `UserError` naming the file (and the line where YAML gives one).
    """
    p = Path(path)
    problem = input_file_problem(p)
    if problem is not None:
        raise UserError(f"{p}: {problem}")
    fmt = "JSON" if p.suffix == ".json" else "YAML"
    try:
        text = p.read_text()
        if p.suffix == ".json":
            return json.loads(text, object_pairs_hook=_json_object)
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass
    except _Refused as exc:
        raise UserError(f"{p}: {exc}") from None
    except OSError as exc:
        raise UserError(f"{p}: cannot read: {exc.strerror or exc}") from None
    except RecursionError:
        raise UserError(f"{p}: not valid {fmt}: nested too deeply") from None
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{p}: not valid {fmt}: {first}") from None


_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def input_file_problem(path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> str | None:
    """Why `path` cannot be read as an input file (None when it can), from its `stat`
    alone, so nothing is opened: missing, not a regular file (a directory, a FIFO, whose
    open would wait for a writer, ...: named as such), or larger than `max_bytes`."""
    try:
        st = Path(path).stat()
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot read: {exc.strerror or exc}"
    for test, kind in _NOT_FILES:
        if test(st.st_mode):
            return f"is {kind}, not a file"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_size > max_bytes:
        return f"is {st.st_size} bytes, more than the {max_bytes} ({max_bytes // 2**20} MiB) an input file may have"
    return None


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
        if isinstance(value, bool):
            raise bad
        if not isinstance(value, int):
            # allow 1e9-style floats that are whole numbers (YAML reads 80e9 as float)
            number = _as_float(value)
            if number is None or not number.is_integer():
                raise bad
            value = number
        if abs(value) > INT_MAX:
            raise ConfigError(source, key, f"must be an integer of at most {INT_MAX:.3g} in magnitude, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, bool):
            raise bad
        number = _as_float(value)
        if number is None:
            raise bad
        if not math.isfinite(number):
            raise ConfigError(source, key, f"must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise ConfigError(source, key, f"unsupported field type {tp!r}")


def _as_float(value: Any) -> float | None:
    """A number or a numeric string (YAML 1.1 reads "1e9" as a string) as a float; None
    when it is neither. An int too large for a float is infinity."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    if isinstance(value, float):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _numbers(value: Any, key: str) -> list[tuple[str, int | float]]:
    """Every number inside `value` with its dotted/indexed key (items of lists, values of
    dicts, at any depth)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [(key, value)]
    if isinstance(value, dict):
        return [n for k, v in value.items() for n in _numbers(v, f"{key}.{k}")]
    if isinstance(value, (list, tuple)):
        return [n for i, v in enumerate(value) for n in _numbers(v, f"{key}[{i}]")]
    return []


def _check_range(meta: Any, value: Any, source: str, key: str) -> None:
    for where, v in _numbers(value, key):
        if "min" in meta and v < meta["min"]:
            raise ConfigError(source, where, f"must be >= {meta['min']}, got {v}")
        if "gt" in meta and v <= meta["gt"]:
            raise ConfigError(source, where, f"must be > {meta['gt']}, got {v}")
        if "max" in meta and v > meta["max"]:
            raise ConfigError(source, where, f"must be <= {meta['max']}, got {v}")


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


OutputKind = Literal["file", "dir", "prefix"]


def output_path_problem(path: str | Path, kind: OutputKind = "file", suffixes: tuple[str, ...] = ()) -> str | None:
    """Why `path` cannot be written (None when it can), checked before any work.

    kind: "file" (written as one file; may exist, must not be a directory), "dir" (a
    directory made if missing; must not be a file), "prefix" (files named `<path>.<x>` are
    written beside it). The writers make missing parent directories, so the nearest
    existing ancestor must be a directory this process can make a file in (tried).
    suffixes: the names the writer's formats take (".yaml", ...); another is refused.
    """
    text = str(path)
    if not text.strip():
        return "an empty path (give a file name)"
    p = Path(text).expanduser()
    if suffixes and p.suffix not in suffixes:
        return f"{p}: unknown format {p.suffix or '(no suffix)'!r}; give a name ending in {', '.join(suffixes)}"
    if kind != "prefix" and p.exists():
        if kind == "file" and p.is_dir():
            return f"{p} is a directory; give a file name"
        if kind == "file" and not p.is_file():
            return f"{p} {input_file_problem(p)}; give a regular file's name"
        if kind == "dir" and not p.is_dir():
            return f"{p} is an existing file, not a directory"
        if not os.access(p, os.W_OK):
            return f"{p} is not writable"
        return None if kind == "file" else _probe(p)
    ancestor = p.parent if kind == "prefix" or not p.exists() else p
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot write under {ancestor}: it is a file, not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot write under {ancestor}: permission denied"
    return _probe(ancestor)


def _probe(directory: Path) -> str | None:
    """Whether a file can be made in `directory`: made and gone at once (an unnamed
    temporary file). `os.access` says yes to root everywhere, /proc included."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as exc:
        return f"cannot write under {directory}: making a file there failed ({exc.strerror or exc})"


def check_output_path(path: str | Path, source: str, key: str, kind: OutputKind = "file") -> None:
    """Raise `ConfigError(source, key, ...)` when `path` cannot be written (see
    `output_path_problem`); for config keys, called before training starts."""
    problem = output_path_problem(path, kind)
    if problem is not None:
        raise ConfigError(source, key, problem)


def output_path_arg(kind: OutputKind = "file", suffixes: tuple[str, ...] = ()) -> "typing.Callable[[str], str]":
    """argparse `type=` for an output flag: the path as given, or argparse's one-line
    error (exit status 2) when `output_path_problem` finds a reason it cannot be written."""
    def check(text: str) -> str:
        problem = output_path_problem(text, kind, suffixes)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return text
    check.__name__ = "output path"  # argparse names the type in some messages
    return check


def int_arg(low: int, high: int) -> "typing.Callable[[str], int]":
    """argparse `type=` for an integer flag in [low, high] (a whole `1e3` is accepted)."""
    def check(text: str) -> int:
        number = _as_float(text.strip())
        try:
            value = int(text)
        except ValueError:
            if number is None or not math.isfinite(number) or not number.is_integer():
                raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
            value = int(number)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {text}")
        return value
    check.__name__ = "integer"
    return check
