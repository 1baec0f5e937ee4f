"""The torchrun form keeps the promise that no rank outlives its launcher: kill -9 of
torchrun's agent ends every worker (each asked the kernel for SIGKILL when its parent
dies), and the peer pools' segments go with them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpress.d2d.runtime.liveness import ProcessId
from tests.faults.run import GONE_S, ROOT, START_S, WORLD, d2d_plan, run_segments, tiny_config


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


@pytest.mark.slow
def test_killing_torchruns_agent_ends_every_worker(tmp_path):
    config = tiny_config(tmp_path, d2d_plan())
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                              str(WORLD), "-m", "mpress.train", "--config", str(config)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    workers: list[int] = []
    try:
        deadline = time.monotonic() + START_S
        for line in agent.stdout:  # type: ignore[union-attr]
            if line.startswith("step 0:") or time.monotonic() > deadline:
                break
        workers = _children(agent.pid)
        assert len(workers) == WORLD, workers
        env = dict(x.split("=", 1) for x in Path(f"/proc/{workers[0]}/environ").read_text().split("\0") if "=" in x)
        run_id = env["TORCHELASTIC_RUN_ID"]
        assert run_segments(run_id), "no shared-memory segment of the run: the /dev/shm check would be idle"
        processes = [ProcessId(p, 0) for p in workers]
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        t0 = time.monotonic()
        while any(p.alive() for p in processes) and time.monotonic() - t0 < GONE_S:
            time.sleep(0.2)
        assert not any(p.alive() for p in processes)
        while run_segments(run_id) and time.monotonic() - t0 < GONE_S:  # the workers' resource trackers unlink them
            time.sleep(0.2)
        assert run_segments(run_id) == []
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if agent.poll() is None:
            agent.kill()
