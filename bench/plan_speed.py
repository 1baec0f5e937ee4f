"""How long `mpress plan` (and the CLI's start-up) takes: an older checkout against this one.

    git worktree add /tmp/plan-old 286b511      # the commit before the speed work
    python3 bench/plan_speed.py --old /tmp/plan-old [--repeat 1] [--quick]

Each command runs as `python -m mpress ...` in a fresh process, in the old tree and in
this one, one after the other (the same machine, the same load), with `PYTHONPATH` set
to the tree. This tree runs each command twice over: with an empty probe cache (cold:
the analytic profiler probes its layers on the meta device, which loads torch) and with
the cache a first, untimed run filled (warm: what every later plan of the same model
and microbatch size costs; `mpress/static/profile/analytic_probe.py`), each in a cache
directory of the bench's own (`MPRESS_CACHE_DIR`). The table gives the old tree's wall
and CPU time (user + system of the child), the new tree's CPU time cold and warm, and
the ratio old / new of CPU time, the fairer figure on a shared machine; with
`--repeat N`, the least of N runs. `--quick` leaves out the llama-3-70b plan.
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

HERE = Path(__file__).resolve().parent.parent

COMMANDS: list[tuple[str, list[str]]] = [
    ("mpress --version", ["--version"]),
    ("mpress --help", ["--help"]),
    ("mpress plan --bogus (argument error)", ["plan", "--bogus"]),
    ("plan gpt-20.4b dgx1-v100", ["plan", "--model", "gpt-20.4b", "--hardware", "dgx1-v100"]),
    ("plan gpt-20.4b dgx1-v100 1f1b 8x16 mb2", ["plan", "--model", "gpt-20.4b", "--hardware", "dgx1-v100",
                                                "--schedule", "1f1b", "--num-stages", "8", "--microbatch-size", "2",
                                                "--num-microbatches", "16", "--strategy", "mpress"]),
    ("plan llama-3-70b hgx-h100", ["plan", "--model", "llama-3-70b", "--hardware", "hgx-h100"]),
]
"""(label, mpress arguments): the README's plan commands and the start-up paths."""


def run_once(tree: Path, argv: list[str], cache: str | None = None) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, exit status) of `python -m mpress argv` in `tree`, with
    the probe cache in `cache` (None: this environment's)."""
    env = {**os.environ, "PYTHONPATH": str(tree), **({"MPRESS_CACHE_DIR": cache} if cache else {})}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mpress", *argv], cwd=tree, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode


def best_of(tree: Path, argv: list[str], repeat: int, cache: str | None = None,
            cold: bool = False) -> tuple[float, float, int]:
    """The least wall and CPU time of `repeat` runs; `cold`: each in an empty cache."""
    runs = []
    for _ in range(repeat):
        if cold:
            with tempfile.TemporaryDirectory(prefix="mpress-cold-") as empty:
                runs.append(run_once(tree, argv, empty))
        else:
            runs.append(run_once(tree, argv, cache))
    return min(r[0] for r in runs), min(r[1] for r in runs), runs[-1][2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, required=True, help="a checkout of the older commit (git worktree add)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per command and tree (the least counts)")
    ap.add_argument("--quick", action="store_true", help="leave out the llama-3-70b plan")
    args = ap.parse_args()
    old = args.old.resolve()
    if not (old / "mpress" / "cli.py").exists():
        ap.error(f"{old} holds no mpress checkout")
    header = (f"{'command':40} {'old wall':>9} {'old CPU':>8} {'new CPU cold':>12} {'new CPU warm':>12} "
              f"{'old/cold':>8} {'old/warm':>8}  exit")
    print(f"old: {old}\nnew: {HERE}\n\n{header}\n{'-' * len(header)}")
    with tempfile.TemporaryDirectory(prefix="mpress-warm-") as warm:
        for label, argv in COMMANDS:
            if args.quick and "llama" in label:
                continue
            o_wall, o_cpu, o_rc = best_of(old, argv, args.repeat)
            _c_wall, c_cpu, c_rc = best_of(HERE, argv, args.repeat, cold=True)
            run_once(HERE, argv, warm)  # fills the cache (a command that profiles nothing leaves it as it was)
            _w_wall, w_cpu, w_rc = best_of(HERE, argv, args.repeat, warm)
            codes = {o_rc, c_rc, w_rc}
            status = f"{o_rc}" if len(codes) == 1 else f"{o_rc} -> {c_rc}/{w_rc} (differs!)"
            print(f"{label:40} {o_wall:8.2f}s {o_cpu:7.2f}s {c_cpu:11.2f}s {w_cpu:11.2f}s "
                  f"{o_cpu / c_cpu:7.2f}x {o_cpu / w_cpu:7.2f}x  {status}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
