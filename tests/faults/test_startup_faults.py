"""Faults during start-up, on 4 gloo ranks through `mpress train` (issue 34): a rank killed
(-9) or stopped (SIGSTOP) as soon as it is spawned (executed, it is still importing torch:
no line of its own has run; forked by the rank starter, it may have just begun), or while
it is held at a start-up phase (the other ranks wait for it in the plan's broadcast, or in
the stages' set-up) by the fault hook $MPRESS_START_PAUSE=RANK:PHASE
(mpress/launcher/control.start_phase). As mid-run (test_rank_faults.py): every survivor
names the right rank in its one line, the launcher's stderr is one line with status 1,
the launcher ends within 30 s of a fault at a phase (those of a rank faulted at spawn wait
for the survivors' imports of torch first), nothing
of the run is left, and no step ran."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from mpress.launcher.control import COLLECTIVE_TIMEOUT_S
from tests.faults.run import (
    GONE_S,
    START_S,
    WORLD,
    TrainRun,
    tiny_config,
    wait_until_gone,
)

VICTIM = 2


def _one_line(run: TrainRun) -> str:
    lines = run.stderr().splitlines()
    assert len(lines) == 1, run.stderr()
    return lines[0]


def _wait_for_file(path: Path, pattern: str = "") -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text(errors="replace")):
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} never showed {pattern!r}")


def _fault(run: TrainRun, sig: signal.Signals) -> tuple[dict, int, float]:
    info = run.info()
    pid = info["ranks"][VICTIM]
    os.kill(pid, sig)
    t0 = time.monotonic()
    try:
        assert run.finish(timeout_s=START_S) == 1
    finally:
        if sig == signal.SIGSTOP:
            try:
                os.kill(pid, signal.SIGKILL)  # should be gone already; never leave a stopped process behind
            except ProcessLookupError:
                pass
    return info, pid, time.monotonic() - t0


def _check(run: TrainRun, info: dict, pid: int, sig: signal.Signals, took_s: float, *, stalled: str,
           bound_s: float) -> None:
    line = _one_line(run)
    tail = rf" \[3 of the other 3 ranks named it; logs in {re.escape(str(run.run_dir))}\]"
    if sig == signal.SIGKILL:
        assert re.fullmatch(rf"mpress train: rank {VICTIM} \(pid {pid}\) was killed by SIGKILL" + tail, line), line
        named = rf"rank {VICTIM} \(pid {pid}\) has died"
    else:
        assert re.fullmatch(rf"mpress train: rank {VICTIM} \(pid {pid}\) has stalled \({stalled}\); the launcher "
                            r"killed it" + tail, line), line
        named = rf"rank {VICTIM} \(pid {pid}\) has stalled \({stalled}\)"
    for r in range(WORLD):
        if r != VICTIM:
            said = [x for x in run.log(r).splitlines() if x.startswith(f"mpress.train: rank {r}: ")]
            assert len(said) == 1 and re.fullmatch(rf"mpress\.train: rank {r}: stopping: {named}", said[0]), \
                (r, run.log(r)[-2000:])
    assert took_s < bound_s, f"the launcher ended {took_s:.0f} s after the fault"
    assert not wait_until_gone(info["run_id"], time.monotonic()), "processes of the run left"
    assert not any(line.startswith("step ") for line in run.stdout), run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sig, start", [(signal.SIGKILL, "fork"), (signal.SIGSTOP, "fork"), (signal.SIGSTOP, "exec")])
def test_a_rank_faulted_as_it_is_spawned_is_named_by_every_survivor(tmp_path, sig, start):
    run = TrainRun.start(tiny_config(tmp_path), tmp_path, env={"MPRESS_RANK_START": start})
    _wait_for_file(run.run_dir / "run.json")  # written once every rank is spawned: they are importing torch
    info, pid, took = _fault(run, sig)
    # the survivors name it once their watch runs, after importing torch (a loaded machine's
    # 4 imports: tens of seconds); the bound is the collective timeout's that held them before.
    # An executed rank is still importing; one forked from the rank starter has no imports
    # to make: it may have beaten once before the signal, and is then named as mid-run
    before = r"held stopped for \d+ s before its first heartbeat"
    _check(run, info, pid, sig, took, stalled=before if start == "exec" else rf"(?:{before}|no heartbeat for \d+ s)",
           bound_s=COLLECTIVE_TIMEOUT_S / 2)


@pytest.mark.slow
@pytest.mark.parametrize("phase, sig", [("plan", signal.SIGSTOP), ("build", signal.SIGKILL)])
def test_a_rank_faulted_at_a_start_up_phase_is_named_by_every_survivor(tmp_path, phase, sig):
    run = TrainRun.start(tiny_config(tmp_path), tmp_path, env={"MPRESS_START_PAUSE": f"{VICTIM}:{phase}"})
    _wait_for_file(run.run_dir / f"rank{VICTIM}.log", rf"mpress start-up: rank {VICTIM} held at {phase}")
    time.sleep(1.0)  # the others reach the collective that waits for it
    info, pid, took = _fault(run, sig)
    _check(run, info, pid, sig, took, stalled=r"no heartbeat for \d+ s", bound_s=GONE_S)  # as mid-run
