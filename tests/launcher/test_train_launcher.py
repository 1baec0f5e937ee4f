"""The torchrun launcher end to end: training under a plan, checkpoint and resume, bad
input and failures (one line, never a hang)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from mpress.launcher.checkpoints.checkpoint import read_step
from mpress.contract.plan import TensorRule
from tests.support.compare import assert_states_equal
from tests.support.plans import pipeline_plan

ROOT = Path(__file__).resolve().parents[2]


def launch(config: dict, tmp: Path, nproc: int = 2, timeout: int = 240, env: dict | None = None,
           torchrun: bool = True):
    """`config` run on `nproc` CPU ranks through the documented torchrun command, or with
    `torchrun=False` through `mpress train` (its ranks forked from one process that
    imported torch once: far less CPU, for tests of what the ranks do rather than of how
    torchrun starts them; rank 0's output is the command's, as under torchrun, and the
    others' is in their logs in a run directory under `tmp`)."""
    path = tmp / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "mpress.train", "--config", str(path)]
    else:
        run_dir = tempfile.mkdtemp(prefix="run-", dir=tmp)
        cmd = [sys.executable, "-m", "mpress", "train", "--config", str(path), "--nproc-per-node", str(nproc),
               "--run-dir", run_dir]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def losses(stdout: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+): loss (\S+)", stdout, re.M)}


@pytest.fixture
def plan_file(tmp_path):
    plan = pipeline_plan("1f1b", 2, 4, {0: [TensorRule(tensor="optim:*", technique="host"),
                                            TensorRule(tensor="layers.0.**", technique="recompute"),
                                            TensorRule(tensor="layers.1.**", technique="host")],
                                        1: [TensorRule(tensor="layers.2.**", technique="host")]})
    path = tmp_path / "plan.yaml"
    plan.save(path)
    return path


def base_config(plan_path, **kw):
    return {"model": "gpt-tiny", "schedule": "1f1b", "num_stages": 2, "microbatch_size": 2, "num_microbatches": 4,
            "steps": 6, "plan": str(plan_path), "seed": 1, "log_every": 1, **kw}


@pytest.mark.slow
def test_train_with_plan_then_resume_matches_uninterrupted(plan_file, tmp_path):
    full = launch(base_config(plan_file, checkpoint={"dir": str(tmp_path / "a"), "every_steps": 3}), tmp_path)
    assert full.returncode == 0, full.stderr[-2000:]
    assert "per rank" in full.stdout and "tensors swapped" in full.stdout
    first = launch(base_config(plan_file, steps=3, checkpoint={"dir": str(tmp_path / "b"), "every_steps": 3}),
                   tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = launch(base_config(plan_file, checkpoint={"dir": str(tmp_path / "b"), "every_steps": 3,
                                                        "resume": True}), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming at step 3" in resumed.stdout
    a, r = losses(full.stdout), losses(resumed.stdout)
    assert [a[s] for s in (3, 4, 5)] == [r[s] for s in (3, 4, 5)]
    assert_states_equal(read_step(tmp_path / "a" / "step000005"), read_step(tmp_path / "b" / "step000005"))


@pytest.mark.slow
def test_bad_config_is_one_line_exit_2(tmp_path):
    res = launch({"model": "gpt-tiny", "stepz": 3}, tmp_path)
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if x.startswith("mpress.train:")]
    assert lines and "stepz: unknown key" in lines[0]
    assert "[rank0]: Traceback" not in res.stderr  # torchrun itself prints a traceback for a failed child


@pytest.mark.slow
def test_swap_failure_stops_every_rank_with_its_name(plan_file, tmp_path):
    # a pool far too small for the plan: rank 0's swap-out fails; every rank ends, none hangs
    res = launch(base_config(plan_file), tmp_path, env={"MPRESS_HOST_POOL_BYTES": "4096"}, timeout=120)
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if x.startswith("mpress.train: rank")]
    assert any(re.match(r"mpress\.train: rank 0: SwapError: swap-out failed: rank 0 stage 0 microbatch \d+ "
                        r"tensor \S*layers\.\S+: pinned host pool exhausted", x) for x in lines), res.stderr[-3000:]
    assert any(x.startswith("mpress.train: rank 1:") for x in lines)


def test_plan_auto_with_d2d_trains_and_reports_the_peer_traffic(tmp_path):
    """The shipped D2D example, shortened: rank 0 plans with the d2d strategy, the ranks
    set up shared-memory peer pools and train; the report shows bytes sent to peers and
    the pools the importers held."""
    config = yaml.safe_load((ROOT / "configs/train/gpt-tiny-d2d.yaml").read_text())
    config.update(steps=3, log_every=1)
    res = launch(config, tmp_path, nproc=4)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "plan d2d (auto)" in res.stdout
    traffic = res.stdout[res.stdout.index("per rank: swaps and recompute"):]
    rows = [line for line in traffic.splitlines() if line.startswith("│")]
    assert len(rows) == 4
    sent = [row.split("│")[4].strip() for row in rows]
    pools = [row.split("│")[5].strip() for row in rows]
    assert any(s != "-" for s in sent) and any(p != "-" for p in pools), traffic


def test_a_peer_pool_too_small_stops_every_rank_at_start_up(tmp_path):
    config = yaml.safe_load((ROOT / "configs/train/gpt-tiny-d2d.yaml").read_text())
    config.update(steps=3)
    res = launch(config, tmp_path, nproc=4, env={"MPRESS_PEER_POOL_BYTES": "4096"}, timeout=120)
    assert res.returncode != 0  # torchrun's own status for failed workers
    lines = [x for x in res.stderr.splitlines() if x.startswith("mpress.train: rank")]
    # torchrun stops the other workers once one has failed, so not every rank may get to
    # print (tests/runtime/test_d2d_runs.py checks every rank's error without torchrun)
    assert lines, res.stderr[-3000:]
    assert all(": error: peer pools: rank " in x and "is too small: 4096 bytes" in x for x in lines), lines
    assert "step 0:" not in res.stdout  # nothing trained
