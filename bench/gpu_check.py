"""One command for a GPU machine: every `cuda` test and the GPU benchmarks, one table.

    PYTHONPATH=. python bench/gpu_check.py [--quick] [--log-dir DIR]

Runs, each as its own process (a crash or hang in one is a row, not the end of the
check), and prints one table of what each found:

1. every `@pytest.mark.cuda` test (`pytest -m cuda`): the GPU path's stream, event,
   pinned-memory, IPC and allocator decisions, which CPU tests cannot show;
2. `bench/host_swap.py`: mpress host swap against `save_on_cpu(pin_memory=True)`, with
   GB/s against the pinned-copy peak measured in the same run;
3. `bench/swap_overhead.py`: host CPU time per swapped tensor (the target: under 50 us);
4. `bench/d2d.py`: D2D round-trip bandwidth per stripe (link) count over CUDA IPC; with
   one GPU a second process shares it, which exercises the IPC path;
5. `bench/memory_accuracy.py`: measured against predicted peak per rank for the shipped
   train configs, on GPUs when there are as many as a config has ranks (otherwise on CPU
   ranks, and the row says so).

Without a GPU it runs what can run on CPU (the benchmarks' CPU modes; the cuda tests
skip) and says so in the table. Each check's full output goes to `--log-dir`. Exit
status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
MAIN_RANKS = 4
"""Ranks of the shipped train configs' largest run (GPUs memory_accuracy needs)."""


@dataclass(frozen=True)
class Check:
    name: str
    argv: list[str]
    headline: str
    """Regex of the output line that sums the check up (its last match is shown)."""
    timeout_s: float
    env: dict[str, str] | None = None
    note: str = ""


def checks(cuda: bool, gpus: int, quick: bool) -> list[Check]:
    py = sys.executable
    device = "cuda" if cuda else "cpu"
    rounds = ["--rounds", "5"] if quick else []
    on_gpus = cuda and gpus >= MAIN_RANKS
    return [
        Check("cuda tests", [py, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
              r"^\d+ (passed|failed|skipped|deselected).*|^no tests ran.*", 3600,
              note="" if cuda else "no GPU: every cuda test skips"),
        Check("host swap vs save_on_cpu", [py, "bench/host_swap.py", "--device", device, *rounds],
              r"^target .*", 1800),
        Check("host CPU per swapped tensor", [py, "bench/swap_overhead.py", "--device", device, *rounds],
              r"^summary: .*", 1800),
        Check("D2D bandwidth per stripe count",
              [py, "bench/d2d.py", "--device", device] + (["--reps", "2", "--sizes-mib", "1,16"] if quick else []),
              r"^summary: .*", 1800, note="" if gpus != 1 else "one GPU: a second process shares it (IPC path)"),
        Check("peak: measured vs predicted", [py, "bench/memory_accuracy.py", "--steps", "2" if quick else "3"],
              r"^measured / predicted .*", 3600, env=None if on_gpus else {"CUDA_VISIBLE_DEVICES": ""},
              note="GPU ranks" if on_gpus else f"CPU ranks ({gpus} GPU(s), the configs need {MAIN_RANKS})"),
    ]


def run(check: Check, log_dir: Path, console: Console) -> tuple[str, str, float]:
    """(status, headline, seconds) of one check; its output goes to log_dir/<name>.log."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(check.env or {})}
    log = log_dir / (re.sub(r"[^a-z0-9]+", "-", check.name.lower()).strip("-") + ".log")
    console.print(f"gpu_check: {check.name} ... (log {log})")
    start = time.perf_counter()
    try:
        done = subprocess.run(check.argv, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=check.timeout_s)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output, code = output + f"\n(timed out after {check.timeout_s:g} s)", -1
    seconds = time.perf_counter() - start
    log.write_text(output)
    lines = [ln.strip() for ln in output.splitlines() if re.match(check.headline, ln.strip())]
    headline = lines[-1] if lines else (output.strip().splitlines() or ["(no output)"])[-1]
    return ("ok" if code == 0 else f"failed ({code})"), headline, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and sizes (minutes, not tens of minutes)")
    ap.add_argument("--log-dir", type=Path, help="where each check's full output goes (default: a temp dir)")
    args = ap.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 160)
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    where = (f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
             if cuda else f"no GPU (CPU only), torch {torch.__version__}")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="mpress-gpu-check-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    table = Table(title=f"mpress GPU check on {where}")
    for col in ("check", "status", "result", "time", "note"):
        table.add_column(col, justify="right" if col == "time" else "left")
    failed = False
    for check in checks(cuda, gpus, args.quick):
        status, headline, seconds = run(check, log_dir, console)
        failed |= status != "ok"
        table.add_row(check.name, status if status == "ok" else f"[red]{status}[/]", headline, f"{seconds:.0f} s",
                      check.note)
    console.print(table)
    console.print(f"logs: {log_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
