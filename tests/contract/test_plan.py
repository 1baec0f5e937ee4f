"""mpress.contract.plan: the plan contract (selectors, patterns, validation, storage).

Pure: no torch, no emulator. Every error a user can get from a plan must be one line,
name the file (or source) and say what is wrong, so the tests assert on message content.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from mpress.config.loader import to_dict
from mpress.errors import ConfigError, PlanError, UserError
from mpress.contract.identity import StageRules
from mpress.contract.plan import (
    Plan,
    Stripe,
    TensorRule,
    format_microbatches,
    parse_microbatches,
    pattern_matches,
)
from tests.support.plans import contract_plan as make_plan
from tests.support.plans import one_line, rule

GB = 10**9


# -- helpers -------------------------------------------------------------------------------

def plan_dict(**overrides: object) -> dict:
    """Plain-data form of a valid two-stage plan (what a YAML file holds)."""
    data = to_dict(make_plan({0: [rule("layers.0.**", microbatches="0-1")]}))
    data.update(overrides)
    return data


# -- microbatch selectors ----------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("all", None),
    (" all ", None),
    ("0,2,5", {0, 2, 5}),
    ("0-3", {0, 1, 2, 3}),
    ("0-3,7", {0, 1, 2, 3, 7}),
    ("7", {7}),
    (" 1 , 3-4 ", {1, 3, 4}),
    ("2-2", {2}),
    ("0-1,1-2", {0, 1, 2}),
])
def test_parse_microbatches(text: str, expected: set[int] | None) -> None:
    got = parse_microbatches(text)
    assert got == (None if expected is None else frozenset(expected))


@pytest.mark.parametrize("text, words", [
    ("x", ["cannot read", "'x'"]),
    ("", ["cannot read"]),
    ("0,,1", ["cannot read"]),
    ("-1", ["cannot read"]),
    ("1-x", ["cannot read"]),
    ("3-1", ["bad range", "'3-1'"]),
])
def test_parse_microbatches_rejects_malformed(text: str, words: list[str]) -> None:
    with pytest.raises(PlanError) as info:
        parse_microbatches(text)
    msg = one_line(info.value)
    assert all(w in msg for w in words), msg


def test_parse_microbatches_range_check() -> None:
    assert parse_microbatches("0-3", 4) == frozenset(range(4))
    assert parse_microbatches("all", 1) is None
    with pytest.raises(PlanError, match=r"4 is out of range \(the plan has 4 microbatches\)"):
        parse_microbatches("0-4", 4)
    with pytest.raises(PlanError, match="9 is out of range"):
        parse_microbatches("1,9", 4)


@pytest.mark.parametrize("mbs, text", [
    (None, "all"),
    ([5], "5"),
    ([0, 1, 2, 3, 7], "0-3,7"),
    (frozenset({5, 0, 2}), "0,2,5"),
    ([3, 2, 1, 0], "0-3"),
    ([0, 1, 3, 4, 6], "0-1,3-4,6"),
])
def test_format_microbatches(mbs, text: str) -> None:
    assert format_microbatches(mbs) == text


@given(st.frozensets(st.integers(min_value=0, max_value=40), min_size=1))
def test_format_then_parse_round_trips(mbs: frozenset[int]) -> None:
    assert parse_microbatches(format_microbatches(mbs)) == mbs


# -- tensor patterns ---------------------------------------------------------------------------

@pytest.mark.parametrize("pattern, tensor, expected", [
    # exact identity
    ("layers.3.mlp.fc1#0", "layers.3.mlp.fc1#0", True),
    ("layers.3.mlp.fc1#0", "layers.3.mlp.fc1#1", False),
    # shell globs
    ("layers.*.attn.*#*", "layers.3.attn.qkv#2", True),
    ("layers.*.attn.*#*", "layers.3.mlp.fc1#0", False),
    ("layers.3.mlp.fc?#0", "layers.3.mlp.fc2#0", True),
    ("layers.[0-2].fc#0", "layers.1.fc#0", True),
    ("layers.[0-2].fc#0", "layers.3.fc#0", False),
    # PREFIX.**: every tensor saved inside module PREFIX, the module itself included
    ("layers.3.**", "layers.3.mlp.fc1#0", True),
    ("layers.3.**", "layers.3#0", True),
    ("layers.3.**", "layers.30.mlp.fc1#0", False),
    ("layers.3.**", "layers.2.mlp.fc1#0", False),
    ("layers.3.**", "optim:layers.3", False),
    ("layers.3.**", "stash:layers.3", False),
    # PREFIX may be a glob
    ("layers.*.mlp.**", "layers.3.mlp.fc1#0", True),
    ("layers.*.mlp.**", "layers.3.mlp#1", True),
    ("layers.*.mlp.**", "layers.3.attn.qkv#0", False),
    ("layers.1?.**", "layers.12.fc#0", True),
    ("layers.1?.**", "layers.1.fc#0", False),
    # activation patterns never name model data: `*` is every saved activation
    ("*", "layers.0.fc#0", True),
    ("*", "optim:layers.0", False),
    ("*", "stash:layers.0", False),
    ("*0", "optim:layers.0", False),
    ("*.**", "optim:layers.0", False),
    # model data
    ("optim:layers.3", "optim:layers.3", True),
    ("optim:*", "optim:layers.3", True),
    ("optim:*", "stash:layers.3", False),
    ("stash:layers.*", "stash:layers.0", True),
    ("stash:layers.*", "layers.0.fc#0", False),
    ("layers.*", "optim:layers.0", False),
])
def test_pattern_matches(pattern: str, tensor: str, expected: bool) -> None:
    assert pattern_matches(pattern, tensor) is expected


def test_first_matching_rule_decides_per_microbatch() -> None:
    plan = make_plan({0: [
        rule("layers.0.fc#0", "d2d", stripes=[Stripe(device=3, fraction=1.0)]),
        rule("layers.0.**", "host", microbatches="0-1"),
        rule("layers.0.**", "recompute"),
        rule("optim:*", "host"),
    ]})
    sp = plan.stage(0)
    rules, other = StageRules(sp, []), StageRules(plan.stage(1), [])
    assert rules.technique("layers.0.fc#0", 2) == "d2d"           # rule 0 wins everywhere
    assert rules.technique("layers.0.act#0", 0) == "host"         # rule 1 selects mb 0-1
    assert rules.technique("layers.0.act#0", 1) == "host"
    assert rules.technique("layers.0.act#0", 2) == "recompute"    # falls through to rule 2
    assert rules.technique("layers.1.act#0", 0) == "keep"         # no rule matches
    assert rules.technique("optim:layers.1", None) == "host"
    assert other.technique("layers.0.act#0", 0) == "keep"         # rules are per stage
    assert rules.rule("layers.0.act#0", 3) is sp.rules[2]
    assert rules.rule("layers.1.act#0", 3) is None
    with pytest.raises(PlanError, match="plan has stages 0..1, not 2"):
        plan.stage(2)


# -- validation at construction -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, key, words", [
    ({"technique": "d2d"}, "stripes", ["needs at least one stripe", "layers.0.**"]),
    ({"technique": "d2d", "stripes": [Stripe(device=1, fraction=0.5), Stripe(device=2, fraction=0.25)]},
     "stripes", ["sum to 0.750000, not 1"]),
    ({"technique": "d2d", "stripes": [Stripe(device=1, fraction=0.5), Stripe(device=1, fraction=0.5)]},
     "stripes", ["two stripes on one device"]),
    ({"technique": "host", "stripes": [Stripe(device=1, fraction=1.0)]}, "stripes", ["only d2d rules", "is host"]),
    ({"technique": "recompute", "stripes": [Stripe(device=1, fraction=1.0)]}, "stripes", ["only d2d rules"]),
    ({"technique": "host", "microbatches": "0-x"}, "microbatches", ["cannot read", "0-x"]),
])
def test_rule_validation(kwargs: dict, key: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        TensorRule(tensor="layers.0.**", **kwargs)
    assert info.value.key == key
    msg = one_line(info.value)
    assert all(w in msg for w in words), msg


@pytest.mark.parametrize("tensor", ["optim:*", "optim:layers.0", "stash:layers.*"])
def test_model_data_cannot_be_recomputed(tensor: str) -> None:
    with pytest.raises(ConfigError, match="is model data and cannot be recomputed") as info:
        TensorRule(tensor=tensor, technique="recompute")
    assert info.value.key == "technique"
    # the same tensors may be swapped
    TensorRule(tensor=tensor, technique="host")
    TensorRule(tensor=tensor, technique="d2d", stripes=[Stripe(device=1, fraction=0.25),
                                                        Stripe(device=2, fraction=0.75)])


def test_stripe_fractions_are_range_checked_when_loaded(tmp_path: Path) -> None:
    data = plan_dict()
    data["stages"][0]["rules"][0].update(technique="d2d", stripes=[{"device": 1, "fraction": 1.5}])
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        Plan.load(path)
    msg = one_line(info.value)
    assert str(path) in msg and "stages[0].rules[0].stripes[0].fraction" in msg and "<= 1" in msg


def test_plan_validation_messages() -> None:
    def err(**kw: object) -> ConfigError:
        with pytest.raises(ConfigError) as info:
            make_plan(**kw)  # type: ignore[arg-type]
        one_line(info.value)
        return info.value

    e = err(ranges=((0, 2), (3, 4)))
    assert e.key == "stages[1].first_layer" and "contiguous" in e.problem
    e = err(ranges=((0, 2), (2, 2)))
    assert e.key == "stages[1].end_layer" and "must be > first_layer (2)" in e.problem
    e = err(ranges=((0, 3), (3, 1)))
    assert e.key == "stages[1].end_layer"
    e = err(rules={0: [rule("layers.0.**", microbatches="2-4")]})
    assert e.key == "stages[0].rules[0].microbatches" and "4 is out of range" in e.problem
    assert "4 microbatches" in e.problem
    e = err(rules={1: [rule("layers.2.**", "d2d", stripes=[Stripe(device=0, fraction=0.5),
                                                             Stripe(device=1, fraction=0.5)])]})
    assert e.key == "stages[1].rules[0].stripes" and "exporter's own device" in e.problem


def test_plan_stage_list_must_match_num_stages_and_order() -> None:
    good = make_plan()
    with pytest.raises(ConfigError, match="one entry per stage") as info:
        replace(good, num_stages=3)
    assert info.value.key == "stages"
    with pytest.raises(ConfigError, match="one entry per stage"):
        replace(good, stage_to_device=[0])
    swapped = [replace(good.stages[1], first_layer=0, end_layer=2), replace(good.stages[0], first_layer=2, end_layer=4)]
    with pytest.raises(ConfigError) as info:
        replace(good, stages=swapped, stage_to_device=[1, 0])
    assert info.value.key == "stages[0].stage" and "must be 0 (stages are listed in order)" in info.value.problem
    with pytest.raises(ConfigError) as info:
        replace(good, stage_to_device=[0, 5])
    assert info.value.key == "stages[1].device" and "differs from stage_to_device" in info.value.problem
    with pytest.raises(ConfigError, match="plan version 2 is not supported") as info:
        replace(good, version=2)
    assert info.value.key == "version"


# -- storage ------------------------------------------------------------------------------------

def rich_plan() -> Plan:
    return make_plan({
        0: [rule("layers.0.**", "host", microbatches="0-1,3", prefetch_lead=3),
            rule("layers.1.**", "recompute", microbatches="5"),
            rule("optim:*", "host")],
        1: [rule("layers.2.mlp.*#*", "d2d", stripes=[Stripe(device=2, fraction=1 / 3), Stripe(device=3, fraction=2 / 3)]),
            rule("stash:*", "host")],
    }, num_microbatches=8, s0={"pinned_host_bytes": 3 * GB, "need_bytes": 40 * GB, "predicted_peak_bytes": 31 * GB},
        s1={"peer_pool_bytes": 2 * GB})


@pytest.mark.parametrize("name", ["plan.yaml", "plan.json"])
def test_save_load_round_trip(tmp_path: Path, name: str) -> None:
    plan = rich_plan()
    path = tmp_path / "sub" / name
    plan.save(path)
    assert Plan.load(path) == plan
    text = path.read_text()
    data = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    assert data["stages"][0]["rules"][0]["microbatches"] == "0-1,3"
    # a single index must stay a string in YAML, not become the integer 5
    assert data["stages"][0]["rules"][1]["microbatches"] == "5"
    assert data["stages"][1]["rules"][0]["stripes"] == [{"device": 2, "fraction": 1 / 3},
                                                         {"device": 3, "fraction": 2 / 3}]
    assert not list(path.parent.glob(".*.tmp"))  # the atomic write left nothing behind


def test_to_yaml_is_what_save_writes(tmp_path: Path) -> None:
    plan = rich_plan()
    plan.save(tmp_path / "p.yaml")
    assert (tmp_path / "p.yaml").read_text() == plan.to_yaml()
    assert plan.to_yaml().startswith("version: 1\n")


def write_plan(tmp_path: Path, data: dict, name: str = "bad.yaml") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data, sort_keys=False))
    return path


def load_error(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        Plan.load(path)
    one_line(info.value)
    assert str(path) in str(info.value), str(info.value)
    return info.value


def test_load_unknown_keys_name_file_and_key(tmp_path: Path) -> None:
    e = load_error(write_plan(tmp_path, plan_dict(colour="red")))
    assert e.key == "colour" and "unknown key" in e.problem and "num_microbatches" in e.problem
    data = plan_dict()
    data["stages"][0]["rules"][0]["lead"] = 2
    e = load_error(write_plan(tmp_path, data, "nested.json"))
    assert e.key == "stages[0].rules[0].lead" and "unknown key" in e.problem and "prefetch_lead" in e.problem


@pytest.mark.parametrize("edit, key, words", [
    (lambda d: d["stages"][0].update(end_layer="two"), "stages[0].end_layer", ["expected an integer", "'two'"]),
    (lambda d: d.update(fits="yes"), "fits", ["expected true/false"]),
    (lambda d: d.update(schedule="zigzag"), "schedule", ["expected one of", "'1f1b'"]),
    (lambda d: d["stages"][0]["rules"][0].update(technique="zip"), "stages[0].rules[0].technique", ["'recompute'"]),
    (lambda d: d["stages"][0]["rules"][0].update(prefetch_lead=0), "stages[0].rules[0].prefetch_lead", [">= 1"]),
    (lambda d: d["stages"].pop(), "stages", ["one entry per stage (2)"]),
    (lambda d: d.pop("num_microbatches"), "num_microbatches", ["missing required key"]),
    (lambda d: d["stages"][0]["rules"][0].update(microbatches="0-9"), "stages[0].rules[0].microbatches",
     ["9 is out of range", "4 microbatches"]),
    (lambda d: d["stages"][0]["rules"][0].update(microbatches="1..3"), "stages[0].rules[0].microbatches",
     ["cannot read", "1..3"]),
    (lambda d: d["stages"][0].update(first_layer=3), "stages[0].end_layer", ["must be > first_layer (3)"]),
    (lambda d: d["stages"][1].update(first_layer=3), "stages[1].first_layer", ["contiguous"]),
    (lambda d: d["stages"][0]["rules"][0].update(technique="d2d", stripes=[{"device": 0, "fraction": 1.0}]),
     "stages[0].rules[0].stripes", ["exporter's own device"]),
    (lambda d: d["stages"][0]["rules"][0].update(tensor="optim:*", technique="recompute"),
     "stages[0].rules[0].technique", ["cannot be recomputed"]),
])
def test_load_bad_values_name_file_and_key(tmp_path: Path, edit, key: str, words: list[str]) -> None:
    data = plan_dict()
    edit(data)
    e = load_error(write_plan(tmp_path, data))
    assert e.key == key, str(e)
    assert all(w in e.problem for w in words), str(e)


def test_load_missing_or_unparsable_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file"):
        Plan.load(tmp_path / "nope.yaml")
    bad = tmp_path / "broken.yaml"
    bad.write_text("stages: [\n")
    with pytest.raises(UserError, match="not valid YAML") as info:
        Plan.load(bad)
    assert str(bad) in one_line(info.value)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    e = load_error(top)
    assert "expected a mapping" in e.problem


# -- numbers in plan files: finite, whole where they count, bounded ---------------------------------

@pytest.mark.parametrize("edit, key, words", [
    (lambda d: d.update(num_microbatches=10**9), "num_microbatches", ["<= 4096"]),
    (lambda d: d.update(num_microbatches=2.5), "num_microbatches", ["expected an integer", "2.5"]),
    (lambda d: d.update(microbatch_size=10**9), "microbatch_size", ["<= 65536"]),
    (lambda d: d.update(num_devices=10**6), "num_devices", ["<= 1024"]),
    (lambda d: d.update(device_memory_bytes=2e18), "device_memory_bytes", ["<= 1152921504606846976"]),
    (lambda d: d.update(predicted_iteration_s=float("nan")), "predicted_iteration_s", ["finite"]),
    (lambda d: d.update(predicted_iteration_s=float("inf")), "predicted_iteration_s", ["finite"]),
    (lambda d: d.update(stage_to_device=[0, 10**6]), "stage_to_device[1]", ["<= 1023"]),
    (lambda d: d["stages"][1].update(peer_pool_bytes=2e18), "stages[1].peer_pool_bytes", ["<= 1152921504606846976"]),
    (lambda d: d["stages"][1].update(pinned_host_bytes="1e400"), "stages[1].pinned_host_bytes", ["1e400"]),
    (lambda d: d["stages"][0].update(need_bytes=-1), "stages[0].need_bytes", [">= 0"]),
    (lambda d: d["stages"][0]["rules"][0].update(prefetch_lead=10**12), "stages[0].rules[0].prefetch_lead",
     ["<= 8388608"]),
    (lambda d: d["stages"][0].update(peer_quotas=[{"device": 1, "quota_bytes": 2e18}]),
     "stages[0].peer_quotas[0].quota_bytes", ["<= 1152921504606846976"]),
    (lambda d: d["stages"][0]["rules"][0].update(technique="d2d", stripes=[{"device": 1, "fraction": float("nan")}]),
     "stages[0].rules[0].stripes[0].fraction", ["finite"]),
    (lambda d: d["stages"][0]["rules"][0].update(technique="d2d", stripes=[{"device": 5000, "fraction": 1.0}]),
     "stages[0].rules[0].stripes[0].device", ["<= 1023"]),
    # ranks: one stage each, or (interleaved) a whole number of stages each
    (lambda d: d.update(num_ranks=1), "num_ranks", ["1f1b runs one stage per rank", "must equal num_stages (2)"]),
    (lambda d: d.update(schedule="interleaved", num_ranks=3), "num_ranks", ["must divide num_stages (2)"]),
])
def test_load_range_checks_numbers(tmp_path: Path, edit, key: str, words: list[str]) -> None:
    data = plan_dict()
    edit(data)
    e = load_error(write_plan(tmp_path, data))
    assert e.key == key, str(e)
    assert all(w in e.problem for w in words), str(e)
