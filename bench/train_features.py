"""Benchmark: what the training job's features cost per step -- global-norm gradient
clipping, evaluation and the metrics file -- against the same job without them.

Each variant is a real `mpress train` of `gpt-tiny-plain` on 2 CPU ranks (2 stages, 1F1B,
4 microbatches of 4), logging every step:

- baseline: no clipping, no evaluation, no metrics file (`--metrics null`);
- clip: `optimizer.clip_grad_norm: 1.0` (one all-reduce and a pass over the gradients);
- eval: the validation loss over one held-out batch every 5 steps (forward only through
  the pipeline), its cost spread over the steps it comes after;
- metrics: the metrics line of every step (rank 0 writes JSON; TensorBoard too where it
  is installed);
- all: the three together.

The job trains on text (the config's standard-library data, tokenized once and cached
before the first round).

The time of a step is taken where the user sees it: the interval between consecutive
`step k:` lines of rank 0's output, timestamped as they arrive (the output is
unbuffered), so what happens after the step's own timer -- the metrics write -- is
counted. The first `--warmup` steps are dropped; the variants run in interleaved rounds
so load drift on the machine hits them alike. Per variant: median ms per step over every
round and its 10th percentile (the least disturbed steps: on a machine shared with other
work the median drifts with the load), each with its ratio to the baseline measured in
the same run.

Usage: PYTHONPATH=. python bench/train_features.py [--steps N] [--warmup N] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

_OFF = ["--optimizer.clip-grad-norm", "0", "--eval-every", "0"]
_EVAL = ["--eval-every", "5", "--eval-batches", "1"]
VARIANTS: dict[str, list[str]] = {
    "baseline": ["--metrics", "null", *_OFF],
    "clip": ["--metrics", "null", "--eval-every", "0", "--optimizer.clip-grad-norm", "1.0"],
    "eval": ["--metrics", "null", "--optimizer.clip-grad-norm", "0", *_EVAL],
    "metrics": [*_OFF],
    "all": ["--optimizer.clip-grad-norm", "1.0", *_EVAL],
}
"""Each variant's overrides on top of `JOB` (`mpress train` writes RUN_DIR/metrics.jsonl
unless the config's `metrics` is given: `null` turns it off)."""

JOB = ["train", "--config", "gpt-tiny-plain", "--nproc-per-node", "2", "--num-stages", "2",
       "--num-microbatches", "4", "--log-every", "1"]

_STEP_LINE = re.compile(rb"^step (\d+): loss")  # not its "val loss" line


def step_times(extra: list[str], steps: int, run_dir: Path) -> list[float]:
    """Seconds between consecutive `step k:` lines of one `mpress train` run."""
    argv = [sys.executable, "-m", "mpress", *JOB, "--steps", str(steps), "--run-dir", str(run_dir), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    stamps: list[float] = []
    tail: list[bytes] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if _STEP_LINE.match(line):
            stamps.append(time.perf_counter())
        tail = (tail + [line])[-20:]
    if proc.wait() != 0:
        raise SystemExit(f"mpress train failed ({' '.join(extra) or 'baseline'}):\n" + b"".join(tail).decode())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _p10(ts: list[float]) -> float:
    """The 10th percentile of `ts` (its minimum when there are fewer than 10)."""
    return statistics.quantiles(ts, n=10)[0] if len(ts) >= 10 else min(ts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="first step intervals dropped (default 5)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per variant, interleaved (default 2)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="mpress-bench-") as tmp:
        for r in range(args.rounds):
            for name, extra in VARIANTS.items():
                run_dir = Path(tmp) / f"{name.replace(' + ', '-')}-{r}"
                times[name] += step_times(extra, args.steps, run_dir)[args.warmup:]
    base = statistics.median(times["baseline"])
    table = Table(title=f"gpt-tiny-plain, 2 CPU ranks, {args.steps} steps x {args.rounds} rounds "
                        f"(first {args.warmup} dropped): ms per step")
    base_p10 = _p10(times["baseline"])
    for column in ("variant", "median ms/step", "vs baseline", "p10 ms/step", "vs baseline (p10)", "steps timed"):
        table.add_column(column, justify="right")
    for name, ts in times.items():
        med, p10 = statistics.median(ts), _p10(ts)
        table.add_row(name, f"{med * 1e3:.1f}", f"{med / base:.3f}x", f"{p10 * 1e3:.1f}", f"{p10 / base_p10:.3f}x",
                      str(len(ts)))
    Console().print(table)


if __name__ == "__main__":
    main()
