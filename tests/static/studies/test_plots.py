"""The pictures: each device's peak by category (summing to the emulated peak), a plan's
stage x layer technique map (equal to its rules), `maxsize` as bars; the commands write
them as PNGs."""

from __future__ import annotations

import pytest

from mpress.cli import main
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.contract.plan import Plan, TensorRule
from mpress.static.plan.evaluate import evaluate, setup_pipeline
from mpress.static.studies.maxsize import MaxSize
from mpress.static.emulate.breakdown import peak_breakdown
from mpress.static.plan.plan_eval import evaluate_plan
from mpress.static.studies.plots import maxsize_bars
from mpress.static.studies.technique_map import Cell, technique_map
from mpress.config.vocabulary import Technique
from tests.support.plans import pipeline_plan
from tests.support.tiny_pipeline import MODEL, RANGES

PNG = b"\x89PNG\r\n\x1a\n"
RULES = {0: [TensorRule(tensor="optim:*", technique="host"),
             TensorRule(tensor="layers.0.**", technique="recompute"),
             TensorRule(tensor="layers.1.**", technique="host")],
         1: [TensorRule(tensor="layers.2.**", technique="host", microbatches="0-2"),
             TensorRule(tensor="optim:layers.3", technique="host")]}


def _plan_setup():
    plan = pipeline_plan("1f1b", 2, 4, RULES)
    setup = setup_pipeline(load_model_config(MODEL), load_hardware(plan.hardware, num_devices=2,
                                                                   memory_bytes=plan.device_memory_bytes),
                           schedule="1f1b", num_stages=2, microbatch_size=plan.microbatch_size,
                           num_microbatches=4, ranges=RANGES[2])
    return plan, setup


def test_peak_by_category_sums_to_the_emulated_peak_under_a_plan():
    plan, setup = _plan_setup()
    res = evaluate_plan(setup, plan).result
    parts = peak_breakdown(res, setup.costs, weight_stashing=False)
    for d, c in enumerate(setup.costs):
        assert sum(parts[d].values()) == res.peak_bytes[d] and min(parts[d].values()) >= 0
        assert parts[d]["parameters"] == c.param_bytes
    # stage 0 offloads every layer's optimizer state: at its peak at most one layer's
    # units are in (the step streams them); stage 1 keeps all but layers.3's
    assert parts[0]["optimizer state"] < setup.costs[0].optim_bytes + setup.costs[0].master_bytes
    held = [x for x in setup.costs[1].layers if x.name != "layers.3"]
    assert parts[1]["optimizer state"] >= sum(x.optim_bytes + x.master_bytes for x in held)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "pipedream"])
def test_peak_by_category_sums_to_the_emulated_peak_without_a_plan(schedule):
    setup = setup_pipeline(load_model_config("gpt-5.3b"), load_hardware("dgx1-v100"), schedule=schedule,
                           num_stages=8, microbatch_size=2, num_microbatches=16)
    res = evaluate(setup).result
    stash = setup.schedule.weight_stashing
    parts = peak_breakdown(res, setup.costs, weight_stashing=stash)
    for d, m in enumerate(setup.memory):
        assert sum(parts[d].values()) == res.peak_bytes[d] and min(parts[d].values()) >= 0
        assert parts[d]["optimizer state"] == m.optim_bytes + m.master_bytes  # nothing offloaded
        assert parts[d]["activations"] > 0
        # with weight stashing the live weights are one of the versions the forwards hold
        assert parts[d]["parameters"] == m.param_bytes + (m.stash_bytes if stash else 0) or stash


def test_technique_map_is_the_plans_rules():
    plan, setup = _plan_setup()
    tmap = technique_map(plan, setup)
    assert tmap.layer_names == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    host, keep, rc = Technique.HOST, Technique.KEEP, Technique.RECOMPUTE
    assert tmap.cells == [
        {0: Cell(keep, False, host), 1: Cell(rc, False, host), 2: Cell(host, False, host)},
        {3: Cell(host, True, keep), 4: Cell(keep, False, host), 5: Cell(keep, False, keep)},
    ]


def test_maxsize_bars_are_the_rows():
    model = load_model_config("gpt-5.3b")
    rows = [MaxSize(strategy="none", model=None, num_parameters=0, result=None, evaluations=3),
            MaxSize(strategy="mpress", model=model, num_parameters=5_300_000_000, result=None, evaluations=9)]
    assert maxsize_bars(rows) == [("none", 0.0, "nothing fits"), ("mpress", 5.3, "gpt-5.3b")]


def test_emulate_writes_the_memory_plot_and_the_map(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "gpt-tiny", "--hardware", "cpu-local", "--stages", "2", "--microbatches", "4",
                 "--microbatch-size", "2", "--device-memory", "3MB", "--strategy", "mpress", "--out", str(path)]) == 0
    assert any(r.technique is not Technique.KEEP for sp in Plan.load(path).stages for r in sp.rules)
    mem, tmap = tmp_path / "mem.png", tmp_path / "map.png"
    assert main(["emulate", str(path), "--plot", str(mem), "--map", str(tmap)]) == 0
    assert mem.read_bytes()[:8] == PNG and tmap.read_bytes()[:8] == PNG
    assert "memory plot written" in capsys.readouterr().out
    assert main(["emulate", "--model", "gpt-tiny", "--hardware", "cpu-local", "--stages", "2",
                 "--map", str(tmp_path / "m2.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--map: needs a plan" in err


@pytest.mark.slow
def test_maxsize_writes_a_bar_chart(tmp_path):
    bars = tmp_path / "bars.png"
    assert main(["maxsize", "--strategies", "none", "--plot", str(bars)]) == 0
    assert bars.read_bytes()[:8] == PNG

