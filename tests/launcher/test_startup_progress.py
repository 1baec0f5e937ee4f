"""`mpress train` is never silent before step 0: its first line comes before it loads
torch, and rank 0 says each start-up phase (the ranks meeting, profiling, planning, the
data, building the stages) as it enters it, in order, through the launcher's stdout
when that is a pipe; a saved plan (`plan: FILE`) is checked, not planned again."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HOOK = """
import importlib.abc, sys
class SayTorch(importlib.abc.MetaPathFinder):  # marks the launcher's first import of torch on stdout
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            print("-- torch --", flush=True)
        return None
sys.meta_path.insert(0, SayTorch())
from mpress.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_every_start_up_phase_shows_a_line_in_order(tmp_path):
    argv = ["train", "--config", "gpt-tiny-gpipe", "--steps", "1", "--nproc-per-node", "2", "--num-stages", "2",
            "--num-microbatches", "2", "--run-dir", str(tmp_path / "run")]
    done = subprocess.run([sys.executable, "-c", HOOK, *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, check=False, env={**_env(), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    expected = [
        r"mpress train: gpt-tiny-gpipe: loading torch and checking the job$",
        r"-- torch --$",  # the first line came before torch
        r"mpress train: 2 ranks \(gloo\); rank 0's output follows",
        r"start-up: starting 2 ranks: they load torch and mpress, then they meet \(\d:\d\d:\d\d\)$",
        r"start-up: rendezvous: waiting for the 2 ranks \(gloo\) \(\d:\d\d:\d\d\)$",
        r"start-up: profiling gpt-tiny \(analytic\) for planning on cpu-local \(\d:\d\d:\d\d\)$",
        r"start-up: planning mpress for 2 stages on cpu-local \(plan: auto\) \(\d:\d\d:\d\d\)$",
        r"start-up: data: synthetic \(\d:\d\d:\d\d\)$",
        r"start-up: building 2 stages on 2 ranks \(pools, peers\) \(\d:\d\d:\d\d\)$",
        r"mpress\.train: gpt-tiny, gpipe, 2 stages x 2 microbatches of 4, plan mpress \(auto\)",
        r"step 0: loss ",
    ]
    assert len(lines) >= len(expected), done.stdout
    for pattern, line in zip(expected, lines):
        assert re.match(pattern, line), f"{line!r} is not {pattern!r}:\n{done.stdout}"
    # the times (since the command started) never go back
    stamps = re.findall(r"\((\d):(\d\d):(\d\d)\)$", done.stdout, re.MULTILINE)
    times = [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s in stamps]
    assert len(times) == 6 and times == sorted(times)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "MPRESS_START_TIME"}


def test_a_saved_plan_is_checked_not_planned_again(tmp_path, monkeypatch):
    """`plan: FILE`: rank 0 says it checks the file and runs neither the planner nor
    anything a plan made now would need."""
    from mpress.launcher import startup
    from mpress.runtime.train_config import load_train_config, model_config

    shape = [("num_stages", "2"), ("num_microbatches", "2")]
    cfg = load_train_config("gpt-tiny-gpipe", shape)
    made = startup.plan_for(cfg, model_config(cfg), 2, 2)
    path = tmp_path / "plan.yaml"
    made.plan.save(path)

    def no_planner(*_args, **_kw):
        raise AssertionError("the planner ran for a saved plan")

    monkeypatch.setattr(startup, "plan_strategy", no_planner)
    said: list[str] = []
    cfg = load_train_config("gpt-tiny-gpipe", [*shape, ("plan", str(path))])
    start = startup.plan_for(cfg, model_config(cfg), 2, 2, say=said.append)
    assert said == [f"plan {path}: checking it against the job and emulating its program (no planning)"]
    assert start.ranges == made.ranges and start.predicted_peak_bytes == made.predicted_peak_bytes
    assert start.plan.actions == made.plan.actions
