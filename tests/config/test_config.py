"""mpress.config.loader: typed dataclass loading with key/type/range checks (pure, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from mpress.config.loader import (
    from_dict,
    load_yaml,
    to_dict,
    write_text_atomic,
)
from mpress.errors import ConfigError, UserError

SRC = "cfg/test.yaml"


@dataclass(kw_only=True, frozen=True)
class Device:
    name: str
    memory_bytes: int = field(metadata={"gt": 0})
    efficiency: float = field(default=0.5, metadata={"gt": 0, "max": 1})


@dataclass(kw_only=True, frozen=True)
class Machine:
    num_devices: int = field(metadata={"min": 1})
    device: Device
    pinned: bool = False
    mode: Literal["sync", "async"] = "sync"
    sizes: list[int] = field(default_factory=list, metadata={"min": 0})
    peaks: dict[str, float] = field(default_factory=dict, metadata={"gt": 0})
    devices: list[Device] = field(default_factory=list)
    limit_bytes: int | None = None


def machine(**overrides: object) -> dict:
    data: dict = {"num_devices": 2, "device": {"name": "g", "memory_bytes": 1024}}
    data.update(overrides)
    return data


def error(data: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        from_dict(Machine, data, SRC)
    return info.value


def test_valid_mapping_builds_nested_dataclasses() -> None:
    m = from_dict(Machine, machine(pinned=True, mode="async", sizes=[1, 2], peaks={"fp32": 1e12},
                                   devices=[{"name": "a", "memory_bytes": 5}]), SRC)
    assert m.device == Device(name="g", memory_bytes=1024)
    assert m.pinned is True and m.mode == "async" and m.sizes == [1, 2]
    assert m.peaks == {"fp32": 1e12}
    assert m.devices == [Device(name="a", memory_bytes=5)]
    assert m.limit_bytes is None
    # to_dict is the inverse on plain data
    assert from_dict(Machine, to_dict(m), SRC) == m


def test_unknown_key_names_file_key_and_allowed_keys() -> None:
    e = error(machine(num_device=3))
    assert e.source == SRC and e.key == "num_device"
    msg = str(e)
    assert msg.startswith(f"{SRC}: num_device:")
    for allowed in ("num_devices", "device", "pinned", "mode", "sizes"):
        assert allowed in msg


def test_unknown_nested_key_has_dotted_path() -> None:
    data = machine()
    data["device"]["memory"] = 3
    e = error(data)
    assert e.key == "device.memory"
    assert "memory_bytes" in e.problem  # the allowed keys of the nested class


def test_missing_key() -> None:
    data = machine()
    del data["num_devices"]
    e = error(data)
    assert e.key == "num_devices" and "missing" in e.problem


def test_missing_nested_key() -> None:
    e = error(machine(device={"name": "g"}))
    assert e.key == "device.memory_bytes" and "missing" in e.problem


@pytest.mark.parametrize("key, value", [
    ("num_devices", "two"),
    ("num_devices", 2.5),
    ("pinned", "yes"),
    ("pinned", 1),
    ("mode", "fast"),
    ("sizes", 3),
    ("device", [1, 2]),
    ("peaks", [1.0]),
])
def test_wrong_type(key: str, value: object) -> None:
    e = error(machine(**{key: value}))
    assert e.key == key and "expected" in e.problem and repr(value) in e.problem


def test_bool_is_not_an_int_or_a_float() -> None:
    assert error(machine(num_devices=True)).key == "num_devices"
    data = machine()
    data["device"]["efficiency"] = True
    assert error(data).key == "device.efficiency"


@pytest.mark.parametrize("overrides, key, bound", [
    ({"num_devices": 0}, "num_devices", ">= 1"),
    ({"device": {"name": "g", "memory_bytes": 0}}, "device.memory_bytes", "> 0"),
    ({"device": {"name": "g", "memory_bytes": -5}}, "device.memory_bytes", "> 0"),
    ({"device": {"name": "g", "memory_bytes": 1, "efficiency": 1.5}}, "device.efficiency", "<= 1"),
    ({"device": {"name": "g", "memory_bytes": 1, "efficiency": 0.0}}, "device.efficiency", "> 0"),
    ({"sizes": [1, -1]}, "sizes[1]", ">= 0"),
    ({"peaks": {"fp32": 0.0}}, "peaks.fp32", "> 0"),
])
def test_out_of_range(overrides: dict, key: str, bound: str) -> None:
    e = error(machine(**overrides))
    assert e.key == key and bound in e.problem


def test_range_bounds_are_inclusive_where_documented() -> None:
    m = from_dict(Machine, machine(num_devices=1, device={"name": "g", "memory_bytes": 1, "efficiency": 1.0}), SRC)
    assert m.num_devices == 1 and m.device.efficiency == 1.0


def test_list_element_error_names_the_index() -> None:
    assert error(machine(sizes=[1, 2, "x"])).key == "sizes[2]"
    e = error(machine(devices=[{"name": "a", "memory_bytes": 1}, {"name": "b", "memory_bytes": "lots"}]))
    assert e.key == "devices[1].memory_bytes"


def test_dict_value_error_names_the_entry() -> None:
    assert error(machine(peaks={"fp32": 1.0, "fp16": "fast"})).key == "peaks.fp16"


def test_whole_floats_are_accepted_for_ints() -> None:
    # YAML reads 32e9-style literals as floats (or, without a dot, as strings).
    m = from_dict(Machine, machine(device={"name": "g", "memory_bytes": 32e9}), SRC)
    assert m.device.memory_bytes == 32_000_000_000 and isinstance(m.device.memory_bytes, int)
    m = from_dict(Machine, machine(device={"name": "g", "memory_bytes": "32e9"}), SRC)
    assert m.device.memory_bytes == 32_000_000_000
    assert error(machine(device={"name": "g", "memory_bytes": 1.5e0})).key == "device.memory_bytes"


def test_optional_accepts_null_and_value() -> None:
    assert from_dict(Machine, machine(limit_bytes=None), SRC).limit_bytes is None
    assert from_dict(Machine, machine(limit_bytes=7), SRC).limit_bytes == 7
    assert error(machine(limit_bytes="seven")).key == "limit_bytes"


def test_top_level_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError) as info:
        from_dict(Machine, [1, 2], SRC)
    assert info.value.source == SRC and "mapping" in info.value.problem


def test_yaml_round_trip_through_files(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    write_text_atomic(path, "num_devices: 3\ndevice:\n  name: g\n  memory_bytes: 32e9\n")
    m = from_dict(Machine, load_yaml(path), str(path))
    assert m.num_devices == 3 and m.device.memory_bytes == 32_000_000_000
    assert not list(tmp_path.glob(".*.tmp"))  # nothing half-written left behind


def test_yaml_file_errors_name_the_path(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("num_devices: 3\ndevice: {name: g, memory_bytes: 8}\nbogus: 1\n")
    with pytest.raises(ConfigError) as info:
        from_dict(Machine, load_yaml(path), str(path))
    assert str(path) in str(info.value) and "bogus" in str(info.value)


class Colour(str, enum.Enum):
    RED = "red"
    GREEN = "green"


@dataclass(kw_only=True)
class Paint:
    colour: Colour = Colour.RED


def test_str_enums_are_read_and_written_by_value() -> None:
    assert from_dict(Paint, {"colour": "green"}, SRC).colour is Colour.GREEN
    assert to_dict(Paint(colour=Colour.GREEN)) == {"colour": "green"}
    with pytest.raises(ConfigError) as info:
        from_dict(Paint, {"colour": "blue"}, SRC)
    assert info.value.key == "colour" and "one of 'red', 'green'" in info.value.problem


def test_load_yaml_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(UserError) as info:
        load_yaml(path)
    assert str(path) in str(info.value) and "no such file" in str(info.value)


def test_load_yaml_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("a: [1, 2\nb: :\n")
    with pytest.raises(UserError) as info:
        load_yaml(path)
    msg = str(info.value)
    assert str(path) in msg and "not valid YAML" in msg and "\n" not in msg


def test_load_yaml_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(UserError) as info:
        load_yaml(path)
    assert str(path) in str(info.value) and "not valid JSON" in str(info.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "nan", ".inf", "1e400"])
def test_floats_must_be_finite_whatever_the_metadata(value: object) -> None:
    # NaN compares false with every bound: it passed `gt: 0` before
    data = machine()
    data["device"]["efficiency"] = value
    e = error(data)
    assert e.key == "device.efficiency"


def test_nan_in_a_dict_of_floats_names_the_entry() -> None:
    e = error(machine(peaks={"fp32": 1.0, "fp16": float("nan")}))
    assert e.key == "peaks.fp16" and "finite" in e.problem


@pytest.mark.parametrize("value", [2**63, -(2**63), 1e300, "1e300", 10**400],
                         ids=["2**63", "-2**63", "1e300", "str-1e300", "10**400"])
def test_integers_must_fit_in_64_bits(value: object) -> None:
    e = error(machine(limit_bytes=value))
    assert e.key == "limit_bytes" and "at most" in e.problem


@dataclass(kw_only=True, frozen=True)
class Grid:
    cells: list[list[int]] = field(metadata={"min": 0, "max": 9})


def test_range_applies_inside_nested_lists() -> None:
    assert from_dict(Grid, {"cells": [[0, 9], [9, 0]]}, SRC).cells == [[0, 9], [9, 0]]
    with pytest.raises(ConfigError) as info:
        from_dict(Grid, {"cells": [[0, 10], [1, 0]]}, SRC)
    assert info.value.key == "cells[0][1]" and "<= 9" in info.value.problem


def test_duplicate_yaml_key_names_file_key_and_line(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("num_devices: 2\ndevice:\n  name: g\n  name: h\n")
    with pytest.raises(UserError) as info:
        load_yaml(path)
    msg = str(info.value)
    assert msg.startswith(str(path)) and "'name'" in msg and "line 4" in msg and "\n" not in msg


def test_duplicate_json_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"num_devices": 2, "num_devices": 3}')
    with pytest.raises(UserError) as info:
        load_yaml(path)
    assert str(path) in str(info.value) and "'num_devices'" in str(info.value)


def test_merge_keys_may_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nthis:\n  <<: *b\n  x: 3\n")
    assert load_yaml(path)["this"] == {"x": 3, "y": 2}


def _laughs(levels: int) -> str:
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_before_expansion(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_laughs(9))  # 9**9 = 387,420,489 strings when expanded
    with pytest.raises(UserError) as info:
        load_yaml(path)
    assert str(path) in str(info.value) and "aliases expand" in str(info.value)


def test_a_few_aliases_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "few.yaml"
    path.write_text(_laughs(3))  # 729 strings
    assert len(load_yaml(path)["l2"]) == 9


def test_recursive_alias_and_deep_nesting_are_one_line_errors(tmp_path: Path) -> None:
    rec = tmp_path / "rec.yaml"
    rec.write_text("a: &a [1, *a]\n")
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 50_000 + "]" * 50_000)
    for path in (rec, deep):
        with pytest.raises(UserError) as info:
            load_yaml(path)
        assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("kind, make, problem", [
    ("file", lambda d: d, "is a directory"),
    ("file", lambda d: _file(d / "f") / "out.json", "is a file"),
    ("dir", lambda d: _file(d / "ckpt"), "existing file"),
    ("prefix", lambda d: _file(d / "f") / "sub" / "trace", "is a file"),
    ("file", lambda d: "", "empty"),
])
def test_check_output_path_refuses_what_cannot_be_written(tmp_path: Path, kind, make, problem) -> None:
    from mpress.config.loader import check_output_path
    with pytest.raises(ConfigError) as info:
        check_output_path(make(tmp_path), SRC, "trace", kind)
    assert info.value.key == "trace" and problem in info.value.problem


def test_check_output_path_accepts_new_and_existing_paths(tmp_path: Path) -> None:
    from mpress.config.loader import check_output_path
    check_output_path(tmp_path / "new" / "deeper" / "out.json", SRC, "trace")
    check_output_path(_file(tmp_path / "exists.json"), SRC, "trace")
    check_output_path(tmp_path / "ckpt", SRC, "checkpoint.dir", "dir")
    check_output_path(tmp_path, SRC, "checkpoint.dir", "dir")


def _file(path: Path) -> Path:
    path.write_text("x")
    return path
