"""The first run on a lent GPU machine: one budgeted command, one table, results kept as it goes.

    PYTHONPATH=. python bench/gpu_check.py --budget-s 480 --out gpu-check

A lent machine gives about 15 minutes of device time, its start included, and installs
nothing: this runs in a budget (`--budget-s`, default 480 s) it never exceeds, each check
as its own process group under a hard timeout (the smaller of its own cap and what is
left of the budget; a check that cannot get its minimum is skipped and says so), and
writes the table to `--out` after every check (`results.md`, `results.json`, one log per
check), so a run cut off from outside still returns what it measured. In this order:

1. environment: torch, CUDA, the GPUs and their memory;
2. every `@pytest.mark.cuda` test (`pytest -m cuda`): stream, event, pinned-memory, IPC
   and allocator decisions CPU tests cannot show;
3. the CPU tests most sensitive to torch's version (the machine's torch is not CI's):
   op-level recompute, stage inspection, wrapping a stage, fake profiles;
4. `bench/host_swap.py`: host swap against `save_on_cpu(pin_memory=True)`, GB/s against
   the pinned-copy peak measured in the same run;
5. `bench/gpu_job.py`: a single-process job of a GPT of a few hundred MB with host swap,
   optimizer offload and partial recompute: start-up peak, step peak against predicted,
   step time with and without the plan;
6. `bench/d2d.py`: the CUDA IPC path between two processes (on one GPU they share it);
7. `bench/swap_overhead.py`: host CPU time per swapped tensor;
8. `bench/memory_accuracy.py`: measured against predicted peak of the shipped configs,
   only where there are at least 4 GPUs (their ranks).

Without a GPU the same checks run in their CPU modes (the cuda tests skip), which is how
this script itself is tested. Exit status 1 when a check failed, 0 otherwise (skipped
checks included: the table says why).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAIN_RANKS = 4
"""Ranks of the shipped train configs' largest run (GPUs memory_accuracy needs)."""
VERSION_SENSITIVE = ["tests/contract/test_selective.py", "tests/runtime/test_selective_recompute.py",
                     "tests/runtime/test_wrap_stage.py", "tests/contract/test_identity.py",
                     "tests/static/profile/test_fake_profile.py"]
"""CPU tests that lean on torch internals (checkpoint policies, pipelining's stage,
saved-tensor hooks, fake tensors)."""
RESERVE_S = 5.0
"""Budget kept back for writing the results after the last check."""


@dataclass(frozen=True)
class Check:
    name: str
    argv: list[str]
    headline: str
    """Regex of the output line that sums the check up (its last match is shown)."""
    cap_s: float
    """The most this check may take, whatever the budget."""
    min_s: float
    """Below this much budget left, the check is skipped."""
    env: dict[str, str] | None = None
    note: str = ""
    skip: str = ""
    """Why the check does not run here ("" = it runs)."""


@dataclass
class Row:
    check: str
    status: str
    result: str
    seconds: float
    note: str


def checks(cuda: bool, gpus: int) -> list[Check]:
    py = sys.executable
    device = "cuda" if cuda else "cpu"
    return [
        Check("cuda tests", [py, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
              r"^\d+ (passed|failed|skipped|deselected).*|^no tests ran.*", 240, 20,
              note="" if cuda else "no GPU: every cuda test skips"),
        Check("torch-version-sensitive CPU tests", [py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                                    *VERSION_SENSITIVE],
              r"^\d+ (passed|failed).*", 180, 20, env={"CUDA_VISIBLE_DEVICES": ""}),
        Check("host swap vs save_on_cpu", [py, "bench/host_swap.py", "--device", device, "--rounds", "3"],
              r"^target .*", 120, 20),
        Check("single-GPU job: peaks and step time", [py, "bench/gpu_job.py", "--device", device, "--steps", "4"],
              r"^summary: .*", 180, 30),
        Check("IPC path between two processes", [py, "bench/d2d.py", "--device", device, "--reps", "2",
                                                 "--sizes-mib", "1,16"],
              r"^summary: .*", 120, 20, note="one GPU: a second process shares it" if gpus == 1 else ""),
        Check("host CPU per swapped tensor", [py, "bench/swap_overhead.py", "--rounds", "3"],
              r"^summary: .*", 120, 20),
        Check("peak: measured vs predicted", [py, "bench/memory_accuracy.py", "--steps", "2"],
              r"^measured / predicted .*", 300, 60,
              skip="" if cuda and gpus >= MAIN_RANKS else f"needs {MAIN_RANKS} GPUs ({gpus} here)"),
    ]


def environment() -> Row:
    """torch, CUDA and the GPUs, read in this process (no CUDA context is made)."""
    start = time.perf_counter()
    import torch

    if torch.cuda.is_available():
        names = [f"{torch.cuda.get_device_name(i)} "
                 f"({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
                 for i in range(torch.cuda.device_count())]
        result = f"torch {torch.__version__}, CUDA {torch.version.cuda}, {len(names)} GPU(s): {', '.join(names)}"
    else:
        result = f"torch {torch.__version__}, no GPU (CPU only)"
    return Row("environment", "ok", result, time.perf_counter() - start, f"python {sys.version.split()[0]}")


def run(check: Check, timeout_s: float, log: Path) -> Row:
    """One check as its own process group, killed whole at `timeout_s` (its cap: a
    failure; less, the budget's end: the check was cut, not failed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(check.env or {})}
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(check.argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
            status = "ok" if code == 0 else f"failed ({code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its ranks and workers too
            proc.wait()
            status = (f"timed out ({timeout_s:.0f} s)" if timeout_s >= check.cap_s
                      else f"cut by the budget ({timeout_s:.0f} s)")
    seconds = time.perf_counter() - start
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()]
    found = [ln for ln in lines if re.match(check.headline, ln)]
    result = found[-1] if found else next((ln for ln in reversed(lines) if ln), "(no output)")
    return Row(check.name, status, result[:300], seconds, check.note)


def write(rows: list[Row], out: Path, title: str) -> None:
    """The table so far, as Markdown and JSON (rewritten after every check)."""
    lines = [f"# {title}", "", "| check | status | result | time | note |", "|---|---|---|---|---|"]
    lines += [f"| {r.check} | {r.status} | {r.result.replace('|', '/')} | {r.seconds:.0f} s | {r.note} |"
              for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=480.0, help="the most the whole run takes (default 480)")
    ap.add_argument("--out", type=Path, default=Path("gpu-check"), help="results and logs (default ./gpu-check)")
    args = ap.parse_args()
    if args.budget_s <= RESERVE_S:
        print(f"gpu_check: error: --budget-s must be over {RESERVE_S:g} s", file=sys.stderr)
        return 2
    deadline = time.perf_counter() + args.budget_s - RESERVE_S
    args.out.mkdir(parents=True, exist_ok=True)
    env_row = environment()
    title = f"mpress GPU check: {env_row.result}, budget {args.budget_s:.0f} s"
    rows = [env_row]
    write(rows, args.out, title)
    print(f"gpu_check: {env_row.result}; results in {args.out}/results.md", flush=True)
    import torch

    cuda = torch.cuda.is_available()
    for check in checks(cuda, torch.cuda.device_count() if cuda else 0):
        left = deadline - time.perf_counter()
        if check.skip or left < check.min_s:
            why = check.skip or f"budget: {max(left, 0):.0f} s left, needs {check.min_s:.0f} s"
            rows.append(Row(check.name, "skipped", why, 0.0, check.note))
        else:
            log = args.out / (re.sub(r"[^a-z0-9]+", "-", check.name.lower()).strip("-") + ".log")
            print(f"gpu_check: {check.name} (at most {min(check.cap_s, left):.0f} s, log {log}) ...", flush=True)
            rows.append(run(check, min(check.cap_s, left), log))
        write(rows, args.out, title)
        print(f"gpu_check: {rows[-1].check}: {rows[-1].status}: {rows[-1].result}", flush=True)
    print((args.out / "results.md").read_text())
    return 1 if any(r.status.startswith(("failed", "timed out")) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
