"""A plan file is bound to the job that trains under it (issue 34): the plan's hardware
must be the job's (the config's `hardware`, with its `device_memory`), its model name the
model's (a fingerprint leaves the name out), and the figures it states must follow from
its content: each stage's `predicted_peak_bytes` is what the planner's own emulation
(`complete_plan`, the code `mpress plan` ran) gives for its rules, and its program what
those rules make. Each edit is one line naming the plan's key, exit 2; the plans `mpress
plan` writes, for every strategy, pass unchanged (no false refusal)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mpress.errors import UserError
from mpress.launcher.startup import load_checked_plan, plan_for
from mpress.runtime.train_config import load_train_config, model_config
from tests.support.documented import one_line_error, run_documented
from tests.support.plans import one_line

JOB = {"model": "gpt-tiny", "schedule": "1f1b", "num_stages": 2, "microbatch_size": 4, "num_microbatches": 4,
       "steps": 1, "hardware": "cpu-local", "seed": 0}
PLAN = ["--model", "gpt-tiny", "--stages", "2", "--microbatch-size", "4", "--microbatches", "4"]


def make_plan(directory: Path, name: str, *flags: str) -> Path:
    """A plan for JOB's pipeline, written by `mpress plan` with `flags`."""
    path = directory / f"{name}.yaml"
    code, _out, err = run_documented(["plan", *PLAN, *flags, "--out", str(path)], in_process=True)
    assert code == 0, err
    return path


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("plans")
    return {"cpu": make_plan(d, "cpu", "--hardware", "cpu-local", "--devices", "2", "--device-memory", "4MB"),
            "dgx": make_plan(d, "dgx", "--hardware", "dgx1-v100")}


def config(directory: Path, plan: Path, **values: object) -> Path:
    path = directory / "train.yaml"
    path.write_text(yaml.safe_dump({**JOB, "device_memory": "4MB", "plan": str(plan), **values}))
    return path


def edited(directory: Path, plan: Path, edit) -> Path:
    data = yaml.safe_load(plan.read_text())
    edit(data)
    path = directory / "edited.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def start_up(path: Path) -> None:
    """What rank 0 of the two-rank job does with the plan before any rank builds a stage."""
    cfg = load_train_config(path)
    plan_for(cfg, model_config(cfg), 2, 2)


def test_a_plan_for_other_hardware_is_refused_through_mpress_train(plans, tmp_path):
    """A gpt-tiny plan made for dgx1-v100, trained on cpu-local: one line, exit 2."""
    train = config(tmp_path, plans["dgx"], device_memory=None)
    code, out, err = run_documented(["train", "--config", str(train), "--nproc-per-node", "2"], cwd=tmp_path)
    one_line_error(code, err, f"{plans['dgx']}: hardware_fingerprint: made for hardware 'dgx1-v100' (8 devices of "
                              "34.4 GB), not this 'cpu-local' (8 devices of 34.4 GB")
    assert "step 0" not in out


def test_a_plan_for_more_device_memory_than_the_jobs_is_refused(plans, tmp_path):
    with pytest.raises(UserError) as info:
        start_up(config(tmp_path, plans["cpu"], device_memory="3MB"))
    assert one_line(info.value) == (f"{plans['cpu']}: device_memory_bytes: made for 4 MB per device; this job's devices "
                                    "have 3 MB (the config's device_memory): give at least the plan's, or plan again "
                                    "for them")


def test_a_plan_for_less_device_memory_than_the_jobs_is_taken(plans, tmp_path):
    """Room beyond the plan's memory (what examples/own_model gives for what the memory
    model leaves out) is no mismatch."""
    cfg = load_train_config(config(tmp_path, plans["cpu"], device_memory="5MB"))
    plan, _setup = load_checked_plan(cfg, model_config(cfg), 2, 2)
    assert plan.device_memory_bytes == 4 * 10**6


def test_a_hardware_fingerprint_of_other_hardware_is_refused(plans, tmp_path):
    """The name kept, the fingerprint the dgx plan's: the figures behind the name differ."""
    dgx = yaml.safe_load(plans["dgx"].read_text())["hardware_fingerprint"]
    bad = edited(tmp_path, plans["cpu"], lambda d: d.update(hardware_fingerprint=dgx))
    with pytest.raises(UserError) as info:
        start_up(config(tmp_path, bad))
    assert one_line(info.value).startswith(f"{bad}: hardware_fingerprint: made for hardware 'cpu-local'")


def test_a_plan_whose_hardware_name_was_edited_is_refused(plans, tmp_path):
    bad = edited(tmp_path, plans["cpu"], lambda d: d.update(hardware="dgx1-v100"))
    with pytest.raises(UserError) as info:
        start_up(config(tmp_path, bad))
    assert one_line(info.value).startswith(f"{bad}: hardware: made for 'dgx1-v100', not 'cpu-local'")


def test_a_plan_whose_model_name_was_edited_is_refused(plans, tmp_path):
    bad = edited(tmp_path, plans["cpu"], lambda d: d.update(model="gpt-small"))
    with pytest.raises(UserError) as info:
        start_up(config(tmp_path, bad))
    fp = yaml.safe_load(bad.read_text())["model_fingerprint"]
    assert one_line(info.value) == (f"{bad}: model: made for 'gpt-small', but this model is 'gpt-tiny' (a fingerprint "
                                    f"leaves out the name: the plan's {fp} is that of 'gpt-tiny'); plan again for "
                                    "'gpt-tiny'")


@pytest.mark.parametrize("stage", [0, 1])
def test_an_edited_stage_peak_is_refused_naming_the_stage(plans, tmp_path, stage):
    planned = yaml.safe_load(plans["cpu"].read_text())["stages"][stage]["predicted_peak_bytes"]
    assert planned > 1
    bad = edited(tmp_path, plans["cpu"], lambda d: d["stages"][stage].update(predicted_peak_bytes=planned - 1))
    with pytest.raises(UserError) as info:
        start_up(config(tmp_path, bad))
    assert one_line(info.value).startswith(f"{bad}: stages[{stage}].predicted_peak_bytes: {planned - 1} in the plan, "
                                           f"but its program peaks at {planned} bytes on device {stage}")


@pytest.mark.parametrize("key, value, words", [
    ("predicted_iteration_s", 1e-9, "predicted_iteration_s: 1e-09 s in the plan, but its program takes"),
    ("fits", False, "fits: false in the plan, but its program fits the devices' memory"),
])
def test_an_edited_plan_figure_is_refused_naming_it(plans, tmp_path, key, value, words):
    bad = edited(tmp_path, plans["cpu"], lambda d: d.update({key: value}))
    with pytest.raises(UserError) as info:
        start_up(config(tmp_path, bad))
    assert one_line(info.value).startswith(f"{bad}: {words}")


def test_an_edited_program_is_refused_naming_the_rank(plans, tmp_path):
    def swap_first_two(data: dict) -> None:
        actions = data["actions"][1].split()
        actions[0], actions[1] = actions[1], actions[0]
        data["actions"][1] = " ".join(actions)

    bad = edited(tmp_path, plans["cpu"], swap_first_two)
    with pytest.raises(UserError) as info:
        start_up(config(tmp_path, bad))
    assert one_line(info.value).startswith(f"{bad}: plan: rank 1's program differs from what its rules make")


@pytest.mark.parametrize("strategy, memory", [("mpress", "4.3MB"), ("recompute", "4.3MB"), ("host-swap", "4.6MB"),
                                              ("d2d", "5.1MB")])  # D2D rules: at 5 MB the slots find no room, at 5.2 MB none are needed
def test_every_strategys_plan_trains_with_its_figures_unchanged(tmp_path, strategy, memory):
    """One source of truth: the start-up check recomputes each stage's peak with the
    planner's own emulation, so a plan `mpress plan` wrote is accepted as written."""
    path = make_plan(tmp_path, strategy, "--hardware", "cpu-local", "--devices", "2", "--device-memory", memory,
                     "--strategy", strategy)
    cfg = load_train_config(config(tmp_path, path, device_memory=memory))
    plan, _setup = load_checked_plan(cfg, model_config(cfg), 2, 2)
    start = plan_for(cfg, model_config(cfg), 2, 2)
    assert start.plan == plan
    assert any(sp.rules for sp in plan.stages) and all(sp.predicted_peak_bytes > 0 for sp in plan.stages)
    assert start.predicted_peak_bytes == [sp.predicted_peak_bytes for sp in plan.stages]
    assert plan.fits and plan.predicted_iteration_s > 0
