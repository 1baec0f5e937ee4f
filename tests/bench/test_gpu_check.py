"""`bench/gpu_check.py`, the first run on a lent GPU machine, run here on CPU: it keeps to
its budget (killing a check's whole process group when the budget ends), and leaves a
partial table behind, rewritten after every check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_budget_returns_a_partial_table_within_it(tmp_path):
    budget = 30
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--budget-s", str(budget), "--out", str(tmp_path)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=budget + 60)
    elapsed = time.perf_counter() - start
    assert elapsed < budget + 15, elapsed  # the budget, plus the interpreter's start and the last write
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())
    names = [r["check"] for r in rows]
    assert names[0] == "environment" and "cuda tests" in names and len(names) == 8
    assert rows[0]["status"] == "ok" and "torch" in rows[0]["result"]
    assert all(r["status"] == "ok" or r["status"].startswith(("skipped", "cut by the budget")) for r in rows), rows
    assert any(r["status"].startswith(("skipped", "cut")) for r in rows)  # 30 s cannot hold every check
    assert "| environment | ok |" in (tmp_path / "results.md").read_text()


def test_a_budget_it_cannot_keep_is_refused_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--budget-s", "3", "--out", str(tmp_path)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "--budget-s" in done.stderr
