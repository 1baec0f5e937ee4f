"""`mpress plan --layer-data` to `mpress train`, end to end: gpt-tiny on 2 CPU ranks whose
devices (1.2 MB) hold it only when the planner also keeps layers' parameters or
gradients on the host; the plan it writes has such rules, and `mpress train` runs it,
measuring each rank's device peak within [90%, 100%] of the plan's prediction; a job
that clips gradients refuses `grad:` host rules in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from mpress.contract.plan import LAYER_DATA_PREFIXES, Plan, TensorRule
from tests.faults.run import ROOT, WORLD, tiny_config
from tests.support.plans import pipeline_plan

DEVICE_MEMORY = "1200KB"


def _mpress(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpress", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.slow
def test_a_plan_keeping_layer_data_on_the_host_trains(tmp_path):
    shape = ["--num-stages", "2", "--num-microbatches", "4", "--microbatch-size", "2"]
    planned = _mpress("plan", "--model", "gpt-tiny", "--hardware", "cpu-local", *shape, "--device-memory",
                      DEVICE_MEMORY, "--layer-data", "--out", str(tmp_path / "plan.yaml"))
    assert planned.returncode == 0, planned.stderr
    plan = Plan.load(tmp_path / "plan.yaml")
    assert plan.fits and any(r.tensor.startswith(LAYER_DATA_PREFIXES) for sp in plan.stages for r in sp.rules)
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({"model": "gpt-tiny", "schedule": "1f1b", "num_stages": 2, "microbatch_size": 2,
                                      "num_microbatches": 4, "steps": 2, "plan": str(tmp_path / "plan.yaml"),
                                      "hardware": "cpu-local", "device_memory": DEVICE_MEMORY, "seed": 0}))
    trained = _mpress("train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--json")
    assert trained.returncode == 0, trained.stderr
    rows = json.loads(trained.stdout)
    for row in rows:
        predicted = plan.stages[row["rank"]].predicted_peak_bytes
        assert 0.9 * predicted <= row["measured"] <= predicted, (row, predicted)


def test_clipping_with_host_gradient_sums_is_one_line_exit_2(tmp_path):
    """Clipping reads the gradients on the devices, where a `grad:` host rule no longer
    keeps them: `mpress train` refuses the pair before any rank starts."""
    rules = {s: [TensorRule(tensor="grad:*", technique="host")] for s in range(WORLD)}
    plan = pipeline_plan("1f1b", WORLD, 4, rules, host_step=tuple(range(WORLD)))
    config = tiny_config(tmp_path, plan, optimizer={"clip_grad_norm": 1.0})
    res = _mpress("train", "--config", str(config), "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 2, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and "stages[0].rules[0].tensor" in lines[0] and "clip_grad_norm" in lines[0], lines
    assert "step 0" not in res.stdout  # refused before any step, as every plan refusal is
