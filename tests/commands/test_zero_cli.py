"""`mpress plan` sets the ZeRO baselines beside the planner's strategies (table and --json)."""

import json
import math

import pytest

from mpress.cli import main

ARGS = ["plan", "--model", "gpt-5.3b", "--hardware", "dgx1-v100", "--microbatch-size", "2"]


def test_plan_table_shows_the_zero_rows(capsys):
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    for name in ("mpress", "zero-offload", "zero-infinity", "zero-infinity-nvme"):
        assert name in out
    assert "time / mpress" in out


def test_plan_json_lists_the_baselines_with_their_ratio(capsys):
    assert main([*ARGS, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    mpress = next(r for r in data["strategies"] if r["strategy"] == "mpress")
    rows = {r["strategy"]: r for r in data["baselines"]}
    assert list(rows) == ["zero-offload", "zero-infinity", "zero-infinity-nvme"]
    for name in ("zero-offload", "zero-infinity", "zero-infinity-nvme"):
        r = rows[name]
        assert r["time_over_mpress"] == pytest.approx(r["iteration_s"] / mpress["iteration_s"])
        assert r["peak_bytes"] > 0 and r["host_bytes"] > 0 and not math.isnan(r["iteration_s"])
    assert rows["zero-infinity-nvme"]["nvme_bytes"] > 0
    assert rows["zero-infinity"]["times"]["optimizer_s"] > 0


def test_a_baseline_is_not_a_strategy_to_write(capsys):
    assert main([*ARGS, "--strategy", "zero-offload"]) == 2
    err = capsys.readouterr().err
    assert "zero-offload" in err and "Traceback" not in err
