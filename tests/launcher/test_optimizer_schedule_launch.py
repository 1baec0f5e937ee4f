"""AdamW, a warmup + cosine schedule and gradient clipping through `mpress train`
on 2 CPU ranks: the progress lines report the rate and the global gradient norm, and a
run resumed from a checkpoint taken mid-warmup continues the schedule exactly (the rate
follows from the step index alone): its losses and final state `==` the uninterrupted
run's."""

from __future__ import annotations

import re
import shutil

import pytest

from mpress.launcher.checkpoints.checkpoint import read_step
from tests.launcher.test_train_launcher import base_config, launch, losses, plan_file  # noqa: F401 (fixture)
from tests.support.compare import assert_states_equal

STEPS = 4
OPTIMIZER = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "schedule": "cosine", "warmup_steps": 3,
             "min_lr": 1e-3, "clip_grad_norm": 0.5}


def run(cfg: dict, tmp) -> str:
    res = launch(cfg, tmp, nproc=2, timeout=300, torchrun=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.mark.slow
def test_a_resume_mid_warmup_continues_the_schedule_exactly(tmp_path, plan_file):  # noqa: F811
    whole = tmp_path / "whole"
    whole.mkdir()
    ckpt = {"dir": str(whole / "ckpt"), "every_steps": 1, "keep_last": STEPS}
    out = run(base_config(plan_file, steps=STEPS, optimizer=OPTIMIZER, checkpoint=ckpt), whole)
    lines = [line for line in out.splitlines() if re.match(r"step \d+: loss", line)]
    assert len(lines) == STEPS, out
    rates = [float(re.search(r"  lr (\S+)", line).group(1)) for line in lines]
    assert rates == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-3], rel=1e-2)  # warmup 3, then the last step at min_lr
    assert all(re.search(r"  gnorm \d", line) for line in lines), lines

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(whole / "ckpt" / "step000001", resumed / "ckpt" / "step000001")  # after step 1: mid-warmup
    ckpt = {"dir": str(resumed / "ckpt"), "every_steps": 1, "keep_last": STEPS, "resume": True}
    again = run(base_config(plan_file, steps=STEPS, optimizer=OPTIMIZER, checkpoint=ckpt), resumed)
    assert "resuming from" in again
    assert losses(again) == {s: v for s, v in losses(out).items() if s >= 2}
    assert_states_equal(read_step(whole / "ckpt" / "step000003"), read_step(resumed / "ckpt" / "step000003"))
