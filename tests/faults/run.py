"""Driving `mpress train` from a test: start it, wait for a line of rank 0's output, read
what it launched (`run.json`), inject a fault, and check that the whole run is gone."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mpress.d2d.runtime.transport import SHM_DIR, run_prefix
from mpress.contract.plan import Plan
from tests.support.plans import d2d_rule, pipeline_plan

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4
GONE_S = 30.0
"""Every process of a run must be gone this long after the fault (issue 17)."""
START_S = 240.0
"""Bound on a run's start-up on a loaded machine: a guard against a hang, not a measurement."""


def tiny_config(tmp: Path, plan: Plan | str = "none", **kw: object) -> Path:
    """gpt-tiny on 4 CPU ranks, 1F1B, a step per log line, many steps (faults come first)."""
    if isinstance(plan, Plan):
        plan.save(tmp / "plan.yaml")
        plan = str(tmp / "plan.yaml")
    cfg = {"model": "gpt-tiny", "schedule": "1f1b", "num_stages": WORLD, "microbatch_size": 2,
           "num_microbatches": 4, "steps": 1000, "plan": plan, "seed": 0, "log_every": 1, **kw}
    path = tmp / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def d2d_plan() -> Plan:
    """Stage 0 stripes its first block's activations over peer pools on devices 2 and 3
    (shared-memory segments on CPU): a run with segments in /dev/shm to leak."""
    return pipeline_plan("1f1b", WORLD, 4, {0: [d2d_rule("layers.0.**", {2: 0.5, 3: 0.5})]},
                         peer_pools={2: 8 << 20, 3: 8 << 20})


@dataclass
class TrainRun:
    """One `mpress train` process and its run directory."""

    proc: subprocess.Popen
    run_dir: Path
    stderr_path: Path
    lines: queue.Queue = field(default_factory=queue.Queue)
    stdout: list[str] = field(default_factory=list)

    @staticmethod
    def start(config: Path, tmp: Path, *args: str, env: dict[str, str] | None = None) -> TrainRun:
        run_dir = tmp / "run"
        stderr_path = tmp / "launcher.stderr"
        cmd = [sys.executable, "-m", "mpress", "train", "--config", str(config), "--run-dir", str(run_dir), *args]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=open(stderr_path, "w"), text=True,
                                env={**os.environ, **(env or {})})
        run = TrainRun(proc, run_dir, stderr_path)
        threading.Thread(target=run._read, daemon=True).start()
        return run

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.stdout.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout_s: float = START_S) -> str:
        """The first line of the launcher's stdout matching `pattern` (fails on its exit)."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"mpress train ended before {pattern!r}: {self.stderr()}"
            if re.search(pattern, line):
                return line

    def info(self) -> dict:
        return json.loads((self.run_dir / "run.json").read_text())

    def finish(self, timeout_s: float = 120) -> int:
        return self.proc.wait(timeout=timeout_s)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def log(self, rank: int) -> str:
        return (self.run_dir / f"rank{rank}.log").read_text()


def run_processes(run_id: str) -> list[int]:
    """Pids of every live process of run `run_id`: the ranks and whatever they started
    (all carry MPRESS_RUN_ID in their environment)."""
    needle = f"MPRESS_RUN_ID={run_id}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state not in ("Z", "X"):
            out.append(int(entry.name))
    return out


def run_segments(run_id: str) -> list[str]:
    """The run's shared-memory segments still in /dev/shm."""
    return sorted(p.name for p in SHM_DIR.glob(run_prefix(run_id) + "*"))


def wait_until_gone(run_id: str, since: float, limit_s: float = GONE_S) -> list[int]:
    """Poll until no process of the run is left or `limit_s` after `since` passed; return
    what is left (empty: all gone in time)."""
    while True:
        left = run_processes(run_id)
        if not left or time.monotonic() - since > limit_s:
            return left
        time.sleep(0.2)
