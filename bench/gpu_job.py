"""One single-process training job on one device, with and without a memory plan.

    PYTHONPATH=. python bench/gpu_job.py [--device cuda|cpu] [--model gpt-small] [--steps 4]

A GPT (on CUDA `gpt-small` in bf16, about 250 MB of parameters; on CPU `gpt-tiny`) as one
pipeline stage on one rank (a world-1 process group: NCCL on CUDA, gloo on CPU), trained
twice in this process: plain, then under a plan written here that host-swaps the first
layers' saved tensors, recomputes the next ones whole, recomputes one layer's attention
core only (op-level), and offloads every layer's optimizer states and fp32 masters to
pinned host memory. The plan's program and predicted peak come from the static half
(`complete_plan`, as `mpress train` completes a plan file). Prints one table: start-up
peak (from the job's first allocation), step peak (less cuBLAS's workspaces, which the
prediction puts in the reserve) against the predicted peak, and the
median step time, with the planned run's ratios to the plain one, all from this run.

Its last line starts with `summary:` (what `bench/gpu_check.py` shows).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpress.config.model_config import load_model_config  # noqa: E402
from mpress.config.units import fmt_bytes  # noqa: E402
from mpress.config.vocabulary import ScheduleName  # noqa: E402
from mpress.contract.plan import Plan, StagePlan, TensorRule, hardware_fingerprint  # noqa: E402
from mpress.hardware.server import load_hardware  # noqa: E402
from mpress.launcher.job import start_job  # noqa: E402
from mpress.launcher.report import cublas_workspace_bytes  # noqa: E402
from mpress.models import example_batch  # noqa: E402
from mpress.runtime.trainer import JobSpec  # noqa: E402
from mpress.static.plan.evaluate import setup_pipeline  # noqa: E402
from mpress.static.plan.plan_eval import complete_plan  # noqa: E402

NUM_MICROBATCHES = 4
MICROBATCH_SIZE = 2


def make_plan(model, hardware_name: str, device_memory_bytes: int) -> Plan:
    """The plan this bench runs: host swap, whole-layer and op-level recompute, optimizer
    offload, on one stage holding the whole model."""
    hardware = load_hardware(hardware_name, num_devices=1, memory_bytes=device_memory_bytes)
    n = model.num_layers
    setup = setup_pipeline(model, hardware, schedule=ScheduleName.ONE_F_ONE_B, num_stages=1,
                           microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES)
    swapped = max(1, n // 3)
    rules = [TensorRule(tensor="optim:*", technique="host")]
    rules += [TensorRule(tensor=f"layers.{i}.**", technique="host") for i in range(swapped)]
    rules += [TensorRule(tensor=f"layers.{i}.**", technique="recompute") for i in range(swapped, n - 1)]
    layers = {layer.name: layer for layer in setup.profile.layers}
    last = layers.get(f"layers.{n - 1}")
    if last is not None and last.recompute_options:  # op-level: keep what its first choice keeps
        chosen = last.recompute_options[0]
        rules += [TensorRule(tensor=t.id, technique="keep") for p, t in enumerate(last.saved)
                  if t.op_index >= 0 and p not in chosen.tensors]
        rules.append(TensorRule(tensor=f"layers.{n - 1}.**", technique="recompute"))
    stage = StagePlan(stage=0, device=0, first_layer=0, end_layer=setup.profile.num_layers, rules=rules)
    plan = Plan(strategy="bench", model=model.name, model_fingerprint=model.fingerprint(),
                profile_fingerprint="bench", hardware=hardware_name, hardware_fingerprint=hardware_fingerprint(hardware),
                num_devices=1, device_memory_bytes=device_memory_bytes, schedule=ScheduleName.ONE_F_ONE_B,
                num_stages=1, num_ranks=1, num_microbatches=NUM_MICROBATCHES, microbatch_size=MICROBATCH_SIZE,
                stage_to_device=[0], stages=[stage], fits=True)
    return complete_plan(setup, plan)[0]


def run_job(spec: JobSpec, plan: Plan | None, device: torch.device, steps: int) -> dict[str, float]:
    job = start_job(spec, plan, device)
    startup = job.startup_peak_bytes
    x, y = example_batch(spec.model, MICROBATCH_SIZE * NUM_MICROBATCHES, seed=1)
    times, peaks = [], []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = job.step(x.to(device), y.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        peaks.append(result.peak_bytes)
    workspaces = cublas_workspace_bytes(device)  # in the reserve, not the prediction (as `mpress train` reports)
    job.close()
    steady = times[1:] or times  # the first step warms kernels and pools
    return {"startup": startup, "peak": max(peaks) - workspaces, "step_s": statistics.median(steady),
            "predicted": plan.stages[0].predicted_peak_bytes if plan is not None else 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="model preset (default: gpt-small on CUDA, gpt-tiny on CPU)")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_job: error: --device cuda, but CUDA is not available", file=sys.stderr)
        return 2
    model = load_model_config(args.model or ("gpt-small" if cuda else "gpt-tiny"))
    if cuda:
        model = dataclasses.replace(model, precision="bf16")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = Path(tempfile.mkdtemp(prefix="mpress-gpu-job-")) / "store"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        memory = torch.cuda.get_device_properties(0).total_memory if cuda else 1 << 34
        plan = make_plan(model, "hgx-h100" if cuda else "cpu-local", memory)
        spec = JobSpec(model=model, schedule=ScheduleName.ONE_F_ONE_B, ranges=[(0, plan.stages[0].end_layer)],
                       microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES, seed=0)
        rows = {"plain": run_job(spec, None, device, args.steps), "planned": run_job(spec, plan, device, args.steps)}
    finally:
        dist.destroy_process_group()
    console = Console(width=None if sys.stdout.isatty() else 140)
    where = torch.cuda.get_device_name(0) if cuda else "CPU"
    table = Table(title=f"{model.name} ({model.precision}) on one {where}, {NUM_MICROBATCHES} x {MICROBATCH_SIZE}, "
                        f"torch {torch.__version__}")
    for c in ("run", "start-up peak", "step peak", "predicted peak", "step / predicted", "step time", "time / plain"):
        table.add_column(c, justify="right")
    plain = rows["plain"]
    for name, r in rows.items():
        ratio = f"{r['peak'] / r['predicted']:.1%}" if r["predicted"] else "-"
        table.add_row(name, fmt_bytes(int(r["startup"])), fmt_bytes(int(r["peak"])),
                      fmt_bytes(int(r["predicted"])) if r["predicted"] else "-", ratio,
                      f"{r['step_s'] * 1e3:.1f} ms", f"{r['step_s'] / plain['step_s']:.2f}x")
    console.print(table)
    planned = rows["planned"]
    print(f"summary: planned step peak {planned['peak'] / planned['predicted']:.1%} of predicted, start-up "
          f"{fmt_bytes(int(planned['startup']))} (step {fmt_bytes(int(planned['peak']))}), step time "
          f"{planned['step_s'] / plain['step_s']:.2f}x plain, peak {planned['peak'] / plain['peak']:.2f}x plain")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
