"""What starting a job's ranks costs: executed (one interpreter per rank, each importing
torch and mpress's runtime) against forked from the rank starter (one import,
`mpress/launcher/rank_starter.py`), in the same run.

    PYTHONPATH=. python3 bench/rank_start.py [--ranks 2,4] [--repeat 3] [--steps 3]

Each job is `mpress train` on gpt-tiny, 1F1B, one stage per rank, plain pipelining
(`plan: none`), `--steps` steps, in a fresh process; the two ways alternate run by run
(the same machine, the same load). Per way and rank count, the least of `--repeat` runs:
wall time of the whole command, time to rank 0's line for step 0 (what a user waits
for), and CPU time (user + system of the launcher and everything it started). The last
columns are the ratios executed / forked.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from rich.table import Table

from mpress.ui import make_console

HERE = Path(__file__).resolve().parent.parent
WAYS = ("exec", "fork")


def run_job(config: Path, run_dir: Path, way: str) -> tuple[float, float, float]:
    """(wall s, s to step 0's line, CPU s) of one `mpress train` with ranks started `way`."""
    env = {**os.environ, "PYTHONPATH": str(HERE), "MPRESS_RANK_START": way}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    first_step: float | None = None
    with subprocess.Popen([sys.executable, "-m", "mpress", "train", "--config", str(config), "--run-dir",
                           str(run_dir)], cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True) as proc:
        for line in proc.stdout:  # type: ignore[union-attr]
            if first_step is None and line.startswith("step 0:"):
                first_step = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench/rank_start.py: mpress train ({way}) exited with {proc.returncode}; logs in {run_dir}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if first_step is None:
        raise SystemExit(f"bench/rank_start.py: mpress train ({way}) printed no line for step 0; logs in {run_dir}")
    return wall, first_step, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4", help="rank counts, comma-separated")
    ap.add_argument("--repeat", type=int, default=3, help="runs per way and rank count (the least counts)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    console = make_console()
    table = Table(title=f"mpress train, gpt-tiny 1F1B, {args.steps} steps: ranks executed vs forked "
                        f"(least of {args.repeat}; seconds)")
    for col in ("ranks", "exec wall", "exec to step 0", "exec CPU", "fork wall", "fork to step 0", "fork CPU",
                "wall exec/fork", "CPU exec/fork"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory(prefix="mpress-rank-start-") as tmp:
        for n in [int(x) for x in args.ranks.split(",")]:
            config = Path(tmp, f"train{n}.yaml")
            config.write_text(yaml.safe_dump({"model": "gpt-tiny", "schedule": "1f1b", "num_stages": n,
                                              "microbatch_size": 2, "num_microbatches": 4, "steps": args.steps,
                                              "plan": "none", "seed": 0, "log_every": 1}))
            runs: dict[str, list[tuple[float, float, float]]] = {w: [] for w in WAYS}
            for i in range(args.repeat):
                for way in WAYS:
                    console.print(f"[{n} ranks] run {i + 1}/{args.repeat}: {way}", markup=False, highlight=False)
                    runs[way].append(run_job(config, Path(tmp, f"run-{n}-{way}-{i}"), way))
            best = {w: tuple(min(r[k] for r in runs[w]) for k in range(3)) for w in WAYS}
            (ew, es, ec), (fw, fs, fc) = best["exec"], best["fork"]
            table.add_row(str(n), f"{ew:.2f}", f"{es:.2f}", f"{ec:.2f}", f"{fw:.2f}", f"{fs:.2f}", f"{fc:.2f}",
                          f"{ew / fw:.2f}x", f"{ec / fc:.2f}x")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
