"""Malformed plan files through `mpress emulate PLAN` (and one through `mpress train`).

Schema and number checks are `from_dict`'s; content checks (rules that match nothing,
devices the hardware lacks, pools beyond the host) are mpress/contract/plan.py and
mpress/contract/plan_check.py's: the cases they do not catch yet are strict xfails."""

from __future__ import annotations

import pytest

from tests.malformed.cases import Case, check, laughs, mutated, params, put

EMULATE = ("emulate", "{d}/plan.yaml")


def plan(case_id: str, change, *words: str, subprocess: bool = False, xfail: str | None = None) -> Case:
    return Case(case_id, EMULATE, {"plan.yaml": lambda d, change=change: mutated(_BASE["plan"], change)},
                ("plan.yaml", *words), subprocess=subprocess, xfail=xfail)


def raw(case_id: str, text: str | bytes, *words: str, subprocess: bool = False) -> Case:
    return Case(case_id, EMULATE, {"plan.yaml": text}, ("plan.yaml", *words), subprocess=subprocess)


def _drop(key: str):
    return lambda data: data.pop(key)


def _first_rule(field: str, value: object):
    def change(data: dict) -> None:
        data["stages"][0]["rules"][0][field] = value
    return change


def _device(stage: int, device: int):
    def change(data: dict) -> None:
        data["stage_to_device"][stage] = device
        data["stages"][stage]["device"] = device
    return change


_BASE: dict[str, str] = {}

CASES = [
    plan("unknown-key", put("strateggy", "mpress"), "strateggy", "unknown key", subprocess=True),
    plan("missing-stages", _drop("stages"), "stages", "missing"),
    plan("version-99", put("version", 99), "version"),
    plan("microbatches-1e9", put("num_microbatches", 1e9), "num_microbatches"),
    plan("microbatches-word", put("num_microbatches", "four"), "num_microbatches"),
    plan("predicted-nan", put("predicted_iteration_s", float("nan")), "predicted_iteration_s", "finite"),
    plan("device-memory-beyond-int64", put("device_memory_bytes", 10**30), "device_memory_bytes"),
    plan("stages-not-a-list", put("stages", "two"), "stages"),
    plan("technique-unknown", _first_rule("technique", "teleport"), "technique"),
    plan("pinned-host-negative", put("stages.0.pinned_host_bytes", -5), "pinned_host_bytes"),
    plan("schedule-unknown", put("schedule", "zigzag"), "schedule"),
    raw("duplicate-key", "version: 1\nversion: 1\n", "duplicate key 'version'", "line 2"),
    raw("alias-bomb", laughs(), "aliases expand", subprocess=True),
    raw("not-a-mapping", "- 0F0\n- 0B0\n", "mapping"),
    raw("empty", "", "mapping"),
    raw("yaml-syntax", "stages: [\n", "not valid YAML"),
    raw("binary", b"\x00\x01\xff\xfe", "not valid YAML"),
    Case("missing-file", ("emulate", "{d}/none.yaml"), {}, ("none.yaml",)),
    plan("rule-for-a-layer-that-does-not-exist", _first_rule("tensor", "no_such_layer.**"), "no_such_layer"),
    plan("stage-on-a-device-the-hardware-lacks", _device(1, 99), "99"),
    plan("peer-pool-1e15", put("stages.1.peer_pool_bytes", 10**15), "peer_pool_bytes"),
    plan("pinned-pool-1e15", put("stages.0.pinned_host_bytes", 10**15), "pinned_host_bytes"),
    Case("train-with-a-bad-plan", ("train", "--config", "{d}/train.yaml", "--nproc-per-node", "2"),
         {"train.yaml": "model: gpt-tiny\nnum_stages: 2\nnum_microbatches: 4\nmicrobatch_size: 2\nsteps: 1\n"
                        "plan: plan.yaml\n",
          "plan.yaml": lambda d: mutated(_BASE["plan"], put("strateggy", "x"))},
         ("plan.yaml", "strateggy"), subprocess=True),
    Case("train-with-a-rule-that-matches-nothing", ("train", "--config", "{d}/train.yaml", "--nproc-per-node", "2"),
         {"train.yaml": "model: gpt-tiny\nnum_stages: 2\nnum_microbatches: 4\nmicrobatch_size: 2\nsteps: 1\n"
                        "plan: plan.yaml\n",
          "plan.yaml": lambda d: mutated(_BASE["plan"], _first_rule("tensor", "no_such_layer.**"))},
         ("no_such_layer",), subprocess=True),
]


@pytest.fixture(autouse=True)
def _base(base_files) -> None:
    _BASE.update(base_files)


@pytest.mark.parametrize("case", params(CASES))
def test_malformed_plan(case: Case, tmp_path) -> None:
    check(case, tmp_path)
