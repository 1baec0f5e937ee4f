"""A run whose loss turns non-finite, through `mpress train` on 2 CPU ranks: a learning
rate of 1e30 takes every weight to about 1e30 in the first step, so from step 1 on the
loss is nan. Without clipping each such step is skipped and counted like a non-finite
gradient, the third in a row stops the run with one line naming the step and the stage,
exit status 2 -- never 0. The counts are in each checkpoint: resumed from the one after
the first skip, the run stops at the same step with the same line."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from mpress.launcher.checkpoints.checkpoint import read_step
from tests.launcher.test_train_launcher import ROOT

pytestmark = pytest.mark.slow

STOP = ("error: step 3: the loss is not finite on stage 1, non-finite gradients on stages 0, 1, 3 steps in a row "
        "(steps 1, 2, 3 skipped); stopping")
"""What every rank stops with; the line names the rank the launcher heard from first."""


def _stopped(line: str) -> bool:
    return re.match(r"mpress train: rank [01]: ", line) is not None and line.split(": ", 2)[2].startswith(STOP)


def config(tmp, clip: float | None = None, **checkpoint: object) -> str:
    path = tmp / "train.yaml"
    path.write_text(yaml.safe_dump({
        "model": "gpt-tiny", "schedule": "1f1b", "num_stages": 2, "microbatch_size": 2, "num_microbatches": 4,
        "steps": 8, "plan": "none", "seed": 1, "log_every": 1,
        "optimizer": {"lr": 1e30, "max_skipped_steps": 3, "clip_grad_norm": clip},
        "checkpoint": {"dir": str(tmp / "ckpt"), "every_steps": 1, "keep_last": 8, **checkpoint}}))
    return str(path)


def mpress_train(tmp, clip: float | None = None, **checkpoint: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpress", "train", "--config", config(tmp, clip, **checkpoint),
                           "--nproc-per-node", "2", "--run-dir", str(tmp / "run")],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_non_finite_loss_is_skipped_counted_and_stops_the_run_with_exit_2(tmp_path):
    whole = tmp_path / "whole"
    whole.mkdir()
    res = mpress_train(whole)
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and _stopped(errors[0]), res.stderr[-3000:]
    lines = re.findall(r"^step (\d+): loss (\S+)  (.*)$", res.stdout, re.MULTILINE)
    assert [int(step) for step, _, _ in lines] == [0, 1, 2], res.stdout
    assert math.isfinite(float(lines[0][1])) and "skipped" not in lines[0][2]
    for step, loss, rest in lines[1:]:  # the loss nan, the step skipped and counted
        assert loss == "nan" and f"  step skipped  {step} skipped  (" in rest, rest
    records = [json.loads(line) for line in (whole / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("skipped", False)) for r in records] == [(0, False), (1, True), (2, True)]
    assert read_step(whole / "ckpt" / "step000002")["skips"] == \
        {"skipped_total": 2, "consecutive": 2, "skipped_steps": [1, 2]}

    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "ckpt" / "step000001", resumed / "ckpt" / "step000001")  # one skip so far
    again = mpress_train(resumed, resume=True)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "resuming from" in again.stdout
    errors = [line for line in again.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and _stopped(errors[0]), again.stderr[-3000:]


def test_under_clipping_a_non_finite_loss_is_skipped_and_stops_alike(tmp_path):
    """With clipping the loss rides on the norm's one reduction: the steps read gnorm nan,
    are skipped and counted, and the same line stops the run."""
    res = mpress_train(tmp_path, clip=1.0)
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and _stopped(errors[0]), res.stderr[-3000:]
    lines = re.findall(r"^step (\d+): loss (\S+)  (.*)$", res.stdout, re.MULTILINE)
    assert [int(step) for step, _, _ in lines] == [0, 1, 2], res.stdout
    for step, loss, rest in lines[1:]:
        assert loss == "nan" and f"  gnorm nan (step skipped)  {step} skipped  (" in rest, rest
