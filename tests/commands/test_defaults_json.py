"""Defaults derived from the inputs (stages from the device count, one microbatch size
default everywhere), said in the output; `--json` for plan, emulate, maxsize and topo
with the tables' figures; `plan` without `--out` says so; one unit (GB) in every table."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mpress.cli import main
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.contract.plan import Plan
from mpress.runtime.train_config import TrainConfig
from mpress.static.plan.evaluate import evaluate, setup_pipeline
from mpress.static.profile.profile import Profile
from mpress.config.units import fmt_bytes
from mpress.config.vocabulary import Strategy

TINY = ["--model", "gpt-tiny", "--hardware", "cpu-local"]


def _json(argv: list[str], capsys) -> dict:
    assert main(argv) == 0
    out, err = capsys.readouterr()
    return json.loads(out)  # the whole of stdout is the JSON document


def _train_default(key: str) -> object:
    return next(f.default for f in dataclasses.fields(TrainConfig) if f.name == key)


@pytest.mark.parametrize("devices", [2, 3])
def test_stages_default_to_the_device_count(devices, capsys):
    settings = _json(["emulate", *TINY, "--num-devices", str(devices), "--json"], capsys)["settings"]
    assert settings["num_stages"] == devices and settings["num_devices"] == devices
    assert settings["num_microbatches"] == 2 * devices
    assert "num_stages" in settings["defaults"] and "num_microbatches" in settings["defaults"]


def test_interleaved_defaults_to_one_rank_per_device_two_stages_each(capsys):
    settings = _json(["emulate", *TINY, "--num-devices", "2", "--schedule", "interleaved", "--json"],
                     capsys)["settings"]
    assert (settings["num_ranks"], settings["num_stages"]) == (2, 4)


def test_one_microbatch_size_default_for_profile_plan_and_training(tmp_path, capsys):
    assert main(["profile", "--model", "gpt-tiny", "--analytic", "--hardware", "cpu-local",
                 "--out", str(tmp_path / "p.yaml")]) == 0
    capsys.readouterr()
    profiled = Profile.load(tmp_path / "p.yaml").microbatch_size
    planned = _json(["plan", *TINY, "--device-memory", "3MB", "--json"], capsys)["settings"]["microbatch_size"]
    emulated = _json(["emulate", *TINY, "--json"], capsys)["settings"]["microbatch_size"]
    assert profiled == planned == emulated == _train_default("microbatch_size")


def test_the_resolved_values_are_said(capsys):
    assert main(["emulate", *TINY, "--num-devices", "2"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("settings: "))
    assert "num_stages 2 (one per device" in line and "num_microbatches 4 (2 per rank)" in line
    assert f"microbatch_size {_train_default('microbatch_size')} (default)" in line


def test_emulate_json_has_the_tables_figures(capsys):
    doc = _json(["emulate", *TINY, "--num-stages", "2", "--num-microbatches", "4", "--json"], capsys)
    hw = load_hardware("cpu-local")
    ev = evaluate(setup_pipeline(load_model_config("gpt-tiny"), hw, schedule="1f1b", num_stages=2,
                                 microbatch_size=1, num_microbatches=4))
    assert [s["need_bytes"] for s in doc["stages"]] == [m.total_bytes for m in ev.setup.memory]
    assert [s["emulated_peak_bytes"] for s in doc["stages"]] == [ev.result.peak_bytes[m.device]
                                                                 for m in ev.setup.memory]
    assert doc["iteration_s"] == ev.result.iteration_s and doc["fits"] is True
    assert all(isinstance(s["need_bytes"], int) and isinstance(s["busy_s"], float) for s in doc["stages"])


def test_plan_json_matches_the_plan_it_writes(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    doc = _json(["plan", *TINY, "--device-memory", "3MB", "--num-stages", "2", "--json", "--out", str(out)], capsys)
    plan = Plan.load(out)
    assert doc["plan_file"] == str(out)
    assert [s["need_bytes"] for s in doc["stages"]] == [sp.need_bytes for sp in plan.stages]
    assert [s["strategy"] for s in doc["strategies"]] == list(Strategy.words())
    mpress = next(s for s in doc["strategies"] if s["strategy"] == "mpress")
    assert mpress["iteration_s"] == plan.predicted_iteration_s and mpress["time_over_mpress"] == 1.0
    assert all(isinstance(s["pinned_host_bytes"], int) for s in doc["strategies"])


def test_plan_without_out_says_no_plan_file_was_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", *TINY, "--device-memory", "3MB", "--num-stages", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("no plan file written") and "--out" in last
    assert list(tmp_path.iterdir()) == []


def test_maxsize_json(capsys):
    doc = _json(["maxsize", "--model", "gpt", "--hardware", "dgx-a100", "--strategy", "none,recompute", "--json"],
                capsys)
    assert doc["settings"]["num_stages"] == load_hardware("dgx-a100").num_devices
    rows = {r["strategy"]: r for r in doc["strategies"]}
    assert list(rows) == ["none", "recompute"]
    for r in rows.values():
        assert r["largest_model"] is None or (isinstance(r["num_parameters"], int) and r["iteration_s"] > 0)
    assert rows["recompute"]["largest_model"] is not None


def test_topo_json_is_the_hardware(capsys):
    doc = _json(["topo", "--hardware", "dgx1-v100", "--json"], capsys)
    hw = load_hardware("dgx1-v100")
    assert doc["hardware"]["device"]["memory_bytes"] == hw.device.memory_bytes
    n = hw.num_devices
    assert doc["nvlink_links"] == [[0 if i == j else hw.links(i, j) for j in range(n)] for i in range(n)]
    assert doc["pair_gbps"][0][3] == hw.nvlink_gbps(0, 3) and doc["pair_gbps"][0][0] is None


@pytest.mark.parametrize("argv", [
    ["topo", "--hardware", "dgx1-v100"],
    ["emulate", *TINY, "--num-stages", "2"],
    ["tile", "--model", "vgg16", "--image-size", "256"],
])
def test_tables_are_in_gb(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "GiB" not in out and "MiB" not in out


def test_topo_sizes_are_in_gb(capsys):
    assert main(["topo", "--hardware", "dgx1-v100"]) == 0
    hw = load_hardware("dgx1-v100")
    out = capsys.readouterr().out
    assert f"{fmt_bytes(hw.device.memory_bytes)} each" in out and f"host memory {fmt_bytes(hw.host_memory_bytes)}" in out
