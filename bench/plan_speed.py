"""How long `mpress plan` (and the CLI's start-up) takes: an older checkout against this one.

    git worktree add /tmp/plan-old 286b511      # the commit before the speed work
    python3 bench/plan_speed.py --old /tmp/plan-old [--repeat 1] [--quick]

Each command runs as `python -m mpress ...` in a fresh process, in the old tree and in
this one, one after the other (the same machine, the same load), with `PYTHONPATH` set
to the tree. The table gives wall time and CPU time (user + system of the child) of
each and the ratio old / new of CPU time, the fairer figure on a shared machine; with
`--repeat N`, the least of N runs. `--quick` leaves out the llama-3-70b plan (the
slowest, about a minute of CPU on the old tree).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
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


def run_once(tree: Path, argv: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, exit status) of `python -m mpress argv` in `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mpress", *argv], cwd=tree, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode


def best_of(tree: Path, argv: list[str], repeat: int) -> tuple[float, float, int]:
    runs = [run_once(tree, argv) for _ in range(repeat)]
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
    header = f"{'command':40} {'old wall':>9} {'new wall':>9} {'old CPU':>8} {'new CPU':>8} {'CPU old/new':>11}  exit"
    print(f"old: {old}\nnew: {HERE}\n\n{header}\n{'-' * len(header)}")
    for label, argv in COMMANDS:
        if args.quick and "llama" in label:
            continue
        o_wall, o_cpu, o_rc = best_of(old, argv, args.repeat)
        n_wall, n_cpu, n_rc = best_of(HERE, argv, args.repeat)
        status = f"{o_rc}" if o_rc == n_rc else f"{o_rc} -> {n_rc} (differs!)"
        print(f"{label:40} {o_wall:8.2f}s {n_wall:8.2f}s {o_cpu:7.2f}s {n_cpu:7.2f}s {o_cpu / n_cpu:10.2f}x  {status}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
