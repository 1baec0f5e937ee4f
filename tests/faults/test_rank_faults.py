"""Faults on 4 gloo ranks through `mpress train` (issue 17): a rank killed (-9, SIGTERM)
or stopped (SIGSTOP), the launcher killed, a host pool too small. Each run checks that
every surviving rank named the failed one in its one line (in its log, where the launcher's line points),
that every process of the run is gone within 30 s of the fault, that /dev/shm holds
nothing of the run, and that the launcher's stderr is one line with the right status.

The runs use a D2D plan (peer pools in shared memory on ranks 2 and 3), so a run has
segments to leak; each test first checks they exist."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from mpress.contract.plan import TensorRule
from tests.faults.run import WORLD, TrainRun, d2d_plan, run_processes, run_segments, tiny_config, wait_until_gone
from tests.support.plans import d2d_rule, pipeline_plan

VICTIM = 2  # holds a peer pool


def _started(tmp_path, **kw) -> tuple[TrainRun, dict]:
    run = TrainRun.start(tiny_config(tmp_path, d2d_plan()), tmp_path, **kw)
    run.wait_for(r"^step 0: loss")  # the fault comes after the first step
    info = run.info()
    assert run_segments(info["run_id"]), "the run has no shared-memory segment: the /dev/shm check would be idle"
    assert set(info["ranks"]) <= set(run_processes(info["run_id"])), "ranks without the run id: the check would be idle"
    return run, info


def _one_line(run: TrainRun) -> str:
    lines = run.stderr().splitlines()
    assert len(lines) == 1, run.stderr()
    return lines[0]


def _assert_survivors_named(run: TrainRun, failed: int, phrase: str) -> None:
    for r in range(WORLD):
        if r == failed:
            continue
        said = [x for x in run.log(r).splitlines() if x.startswith(f"mpress.train: rank {r}: ")]
        assert len(said) == 1 and re.search(phrase, said[0]), (r, run.log(r)[-2000:])


def _assert_all_gone(info: dict, since: float) -> None:
    assert not wait_until_gone(info["run_id"], since), "processes of the run left after 30 s"
    assert run_segments(info["run_id"]) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_rank_is_named_by_every_survivor_and_the_launcher(tmp_path, sig):
    run, info = _started(tmp_path)
    pid = info["ranks"][VICTIM]
    os.kill(pid, sig)
    t0 = time.monotonic()
    assert run.finish() == 1
    line = _one_line(run)
    assert line == (f"mpress train: rank {VICTIM} (pid {pid}) was killed by {sig.name} "
                    f"[3 of the other 3 ranks named it; logs in {run.run_dir}]"), line
    # "stopping: rank 2 (pid P) has died", or a D2D swap's own error naming its dead peer
    _assert_survivors_named(run, VICTIM, rf"rank {VICTIM} \(pid {pid}\b.*has died")
    _assert_all_gone(info, t0)


@pytest.mark.slow
def test_a_stopped_rank_counts_as_stalled_and_is_named_then_killed(tmp_path):
    run, info = _started(tmp_path)
    pid = info["ranks"][VICTIM]
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        assert run.finish() == 1
    finally:
        try:
            os.kill(pid, signal.SIGKILL)  # should be gone already; never leave a stopped process behind
        except ProcessLookupError:
            pass
    line = _one_line(run)
    assert re.fullmatch(rf"mpress train: rank {VICTIM} \(pid {pid}\) has stalled \(no heartbeat for \d+ s\); the "
                        rf"launcher killed it \[3 of the other 3 ranks named it; logs in .*\]", line), line
    _assert_survivors_named(run, VICTIM, rf"rank {VICTIM} \(pid {pid}\) has stalled")
    _assert_all_gone(info, t0)


@pytest.mark.slow
def test_killing_the_launcher_leaves_no_rank_and_no_segment(tmp_path):
    run, info = _started(tmp_path)
    os.kill(run.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    run.finish()
    _assert_all_gone(info, t0)


@pytest.mark.slow
def test_a_host_pool_too_small_is_one_line_naming_rank_stage_microbatch_and_tensor(tmp_path):
    # rank 0 host-swaps its first block into a pinned pool far too small: its first
    # swap-out fails mid-step; stage 1 D2D-swaps into the peer pools of ranks 2 and 3
    plan = pipeline_plan("1f1b", WORLD, 4, {0: [TensorRule(tensor="layers.0.**", technique="host")],
                                            1: [d2d_rule("layers.1.**", {2: 0.5, 3: 0.5})]},
                         peer_pools={2: 8 << 20, 3: 8 << 20})
    run = TrainRun.start(tiny_config(tmp_path, plan), tmp_path, env={"MPRESS_HOST_POOL_BYTES": "4096"})
    t0 = time.monotonic()
    assert run.finish(timeout_s=300) == 1
    info = run.info()
    line = _one_line(run)
    assert re.fullmatch(r"mpress train: rank 0: SwapError: swap-out failed: rank 0 stage 0 microbatch \d+ tensor "
                        r"\S*layers\.0\.\S*: pinned host pool exhausted.* \[3 of the other 3 ranks named "
                        r"it; logs in .*\]", line), line
    _assert_survivors_named(run, 0, r"rank 0 failed \(SwapError\)")
    _assert_all_gone(info, t0)
    assert "step 0:" not in "".join(run.stdout)
