"""Ctrl-C (SIGINT) to `mpress train` (issue 34), on 4 gloo ranks: at any moment the job
ends with one line on stderr and status 130, no traceback anywhere the user looks, and
nothing of the run left. During start-up (the launcher still importing torch, or the ranks
waiting for rank 0 held at planning) the ranks are ended at once; mid-run they stop after
the same step, save a checkpoint first, and the line says which step was saved -- and a
run resumed from it ends with parameters, optimizer state and RNG streams equal to those
of a run never interrupted."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mpress.launcher.checkpoints.manifest import step_folder
from tests.faults.run import START_S, WORLD, TrainRun, tiny_config, wait_until_gone

STEPS = 12
"""Steps of the interrupted run, of its resumption and of the run never interrupted."""


def _one_line(run: TrainRun) -> str:
    text = run.stderr()
    lines = text.splitlines()
    assert len(lines) == 1, text
    return lines[0]


def _no_traceback(run: TrainRun) -> None:
    for r in range(WORLD):
        log = run.run_dir / f"rank{r}.log"
        if log.exists():
            assert "Traceback" not in log.read_text(errors="replace"), (r, log.read_text()[-2000:])
    assert "Traceback" not in "".join(run.stdout)


def _interrupt(run: TrainRun) -> int:
    run.proc.send_signal(signal.SIGINT)
    return run.finish(timeout_s=START_S)


def _importing_torch(run: TrainRun) -> None:
    """Waits until the launcher has begun importing torch (its shared library is mapped):
    a fixed sleep could land in the interpreter's own start-up on a slow machine, before any
    code of mpress runs."""
    maps = Path(f"/proc/{run.proc.pid}/maps")
    deadline = time.monotonic() + START_S
    while "libtorch" not in maps.read_text(errors="replace"):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.stderr()
        time.sleep(0.005)


@pytest.mark.slow
def test_ctrl_c_while_the_launcher_imports_is_one_line_and_130(tmp_path):
    run = TrainRun.start(tiny_config(tmp_path), tmp_path)
    _importing_torch(run)  # the import takes about a second more: no rank exists yet
    assert _interrupt(run) == 130
    assert _one_line(run) == "mpress: interrupted"
    assert not (run.run_dir / "run.json").exists()


@pytest.mark.slow
def test_ctrl_c_during_start_up_stops_every_rank_with_one_line_and_130(tmp_path):
    run = TrainRun.start(tiny_config(tmp_path), tmp_path, env={"MPRESS_START_PAUSE": "0:plan"})
    log = run.run_dir / "rank0.log"
    deadline = time.monotonic() + START_S
    while not (log.exists() and "mpress start-up: rank 0 held at plan" in log.read_text()):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.stderr()
        time.sleep(0.05)
    info = run.info()
    t0 = time.monotonic()
    assert _interrupt(run) == 130
    assert _one_line(run) == f"mpress train: interrupted (SIGINT): stopped {WORLD} ranks; logs in {run.run_dir}"
    assert not wait_until_gone(info["run_id"], t0), "processes of the run left"
    _no_traceback(run)


def _state(folder: Path, tmp: Path) -> dict:
    """Every key a checkpoint step holds (parameters, optimizer state, RNG streams)."""
    out = tmp / f"{folder.name}-{folder.parent.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


@pytest.mark.slow
def test_ctrl_c_mid_run_saves_the_step_and_resuming_equals_an_uninterrupted_run(tmp_path):
    ckpt, (a, b, c) = tmp_path / "ckpt", [tmp_path / n for n in ("a", "b", "c")]
    for d in (a, b, c):
        d.mkdir()
    run = TrainRun.start(tiny_config(a, steps=STEPS, checkpoint={"dir": str(ckpt)}), a)
    run.wait_for(r"^step 1: loss")
    info = run.info()
    t0 = time.monotonic()
    assert _interrupt(run) == 130
    line = _one_line(run)
    m = re.fullmatch(rf"mpress train: interrupted \(SIGINT\) after step (\d+), checkpoint of step (\d+) saved to "
                     rf"(\S+); stopped {WORLD} ranks; logs in {re.escape(str(run.run_dir))}", line)
    assert m and m.group(1) == m.group(2), line
    step = int(m.group(1))
    assert 1 <= step < STEPS - 1, line  # stopped mid-run, not at the end
    assert Path(m.group(3)) == step_folder(ckpt, step) and (step_folder(ckpt, step) / "manifest.json").exists()
    assert not wait_until_gone(info["run_id"], t0), "processes of the run left"
    _no_traceback(run)
    assert any(f"checkpoint of step {step} saved" in x for x in run.stdout), run.stdout

    resumed = TrainRun.start(tiny_config(b, steps=STEPS, checkpoint={"dir": str(ckpt), "resume": True}), b)
    assert resumed.finish(timeout_s=START_S) == 0, resumed.stderr()
    assert any(f"resuming at step {step + 1}" in x for x in resumed.stdout), resumed.stdout
    straight = TrainRun.start(tiny_config(c, steps=STEPS, checkpoint={"dir": str(tmp_path / "ckpt-straight")}), c)
    assert straight.finish(timeout_s=START_S) == 0, straight.stderr()
    last = STEPS - 1
    got, want = _state(step_folder(ckpt, last), tmp_path), _state(step_folder(tmp_path / "ckpt-straight", last), tmp_path)
    assert any(isinstance(v, torch.Tensor) and v.numel() > 1000 for v in want.values())  # parameters are there
    assert got.keys() == want.keys()
    assert [k for k in want if not _equal(got[k], want[k])] == []
