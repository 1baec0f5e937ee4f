"""Benchmark: the out-of-core model (`mpress ooc`) against a measured run on this CPU.

One device, no pipeline: gpt-tiny (dropout 0) with a batch run as microbatches on one
stage (GPipe's order: all forwards, then all backwards), as `mpress ooc` models it, at a
few batch sizes. Per batch, in one process (world size 1, gloo) and in interleaved
rounds so that drift in the machine's load hits every variant alike:

- in memory: plain `torch.distributed.pipelining` (`PipelineJob` without a plan), no
  capacity: the reference time, and its measured peak against the emulated footprint;
- mpress with a plan that swaps nothing, no capacity: what the runtime's hooks cost
  (emulated: the in-memory program);
- each swap-in policy (layer-ahead, capacity): the plan `mpress ooc` makes
  (`ooc_point.plan_host_swap`) for a device capacity of `--fraction` of the footprint,
  run by the runtime with that capacity (`JobSpec.device_capacity_bytes`: every byte on
  the stand-in device is counted, `LiveBytes`, and going over it stops the run).

The emulator is given what this machine does: the profile is measured here (same thread
count), and the host link is this machine's copy bandwidth, measured in the same run
(`torch._foreach_copy_` of a swap-sized batch into preallocated host tensors, as the
CPU swap store copies). Printed per batch and variant: normalised time (iteration / in-
memory iteration) emulated and measured, their ratio, and emulated against measured peak.
Measured times are each variant's fastest timed step: on a machine shared with other
processes, load only ever adds time, so the minimum is the figure least moved by it.

Usage: python bench/ooc.py [--microbatch-size 4] [--microbatches 8,16,32] [--fraction 0.6] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from mpress.hardware.server import load_hardware
from mpress.launcher.job import start_job
from mpress.config.model_config import load_model_config
from mpress.runtime.data import batches, build_dataset
from mpress.runtime.train_config import DataConfig
from mpress.runtime.trainer import JobSpec
from mpress.static.plan.evaluate import evaluate
from mpress.static.profile.measured import measure_model_profile
from mpress.static.studies.ooc_model import OocModel, ooc_setup, single_device, with_host_link
from mpress.static.studies.ooc_point import POLICIES, plan_host_swap
from mpress.static.plan.plan_eval import complete_plan
from mpress.static.plan.planner import plan_strategy
from mpress.config.units import fmt_bytes
from mpress.config.vocabulary import Strategy

THREADS = 1
"""Torch threads for the profile and every run (the profile's times are this machine's)."""


def copy_gbps(nbytes: int = 64 << 20, reps: int = 9) -> float:
    """This machine's host-to-host copy bandwidth, GB/s: of `reps` copies of
    `nbytes` in 16 tensors into preallocated ones (the fastest), as the CPU swap store copies."""
    src = [torch.randn(nbytes // 4 // 16) for _ in range(16)]
    dst = [torch.empty_like(t) for t in src]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--microbatches", default="8,16,32", help="comma-separated microbatch counts (batch = count x size)")
    ap.add_argument("--fraction", type=float, default=0.6, help="device capacity as a fraction of the footprint")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant (in rounds of 2)")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
    cfg = replace(load_model_config("gpt-tiny"), dropout=0.0)
    b = args.microbatch_size
    profile = measure_model_profile(cfg, b, "cpu", warmup=2, iters=10)
    model = OocModel(name=cfg.name, kind="preset", model=cfg, profile=profile)
    gbps = copy_gbps()
    dataset = build_dataset(DataConfig(), cfg, seed=0)
    table = Table(title=f"ooc: gpt-tiny on one CPU stand-in device, microbatch {b}, capacity {args.fraction:g} x "
                        f"footprint, host link {gbps:.3g} GB/s (measured copy), fastest of {args.steps} steps")
    for col in ["batch", "capacity", "run", "emulated time", "measured time", "emulated normalised",
                "measured normalised", "measured / emulated", "emulated peak", "measured peak", "peak ratio"]:
        table.add_column(col, justify="left" if col == "run" else "right")
    for count in (int(x) for x in args.microbatches.split(",")):
        batch = count * b
        free = with_host_link(single_device(load_hardware("cpu-local")), gbps)
        base = evaluate(ooc_setup(model, free, batch)).result
        footprint = base.peak_bytes[0]
        hw = single_device(free, int(args.fraction * footprint))
        setup = ooc_setup(model, hw, batch)
        spec = JobSpec(model=cfg, schedule="gpipe", ranges=list(setup.ranges), microbatch_size=b,
                       num_microbatches=count, seed=0)
        variants: list[tuple[str, object, float, int]] = [("in memory", start_job(spec, None, torch.device("cpu")),
                                                           base.iteration_s, footprint)]
        keep, keep_ev = complete_plan(setup, plan_strategy(setup, Strategy.NONE).plan)
        variants.append(("mpress, nothing swapped", start_job(spec, keep, torch.device("cpu")),
                         keep_ev.result.iteration_s, keep_ev.result.peak_bytes[0]))
        for policy in POLICIES:
            plan, _ = plan_host_swap(setup, policy)
            plan, ev = complete_plan(setup, plan)
            if not ev.result.fits:
                print(f"batch {batch}: the {policy} plan does not fit {fmt_bytes(hw.usable_memory_bytes)}; skipped")
                continue
            job = start_job(replace(spec, device_capacity_bytes=hw.usable_memory_bytes), plan, torch.device("cpu"))
            variants.append((str(policy), job, ev.result.iteration_s, ev.result.peak_bytes[0]))
        times: dict[str, list[float]] = {name: [] for name, *_ in variants}
        peaks: dict[str, int] = {name: 0 for name, *_ in variants}
        for rnd in range(args.steps // 2 + 1):  # round 0 is warm-up
            for name, job, *_ in variants:
                for k in range(2):
                    x, y = batches(dataset, microbatch_size=b, num_microbatches=count, step=2 * rnd + k)
                    t0 = time.perf_counter()
                    result = job.step(x, y)  # type: ignore[attr-defined]
                    if rnd:
                        times[name].append(time.perf_counter() - t0)
                        peaks[name] = max(peaks[name], result.peak_bytes)
        plain_s = min(times["in memory"])
        for name, job, emulated_s, emulated_peak in variants:
            job.close()  # type: ignore[attr-defined]
            measured_s = min(times[name])
            em_norm, me_norm = emulated_s / base.iteration_s, measured_s / plain_s
            table.add_row(str(batch), fmt_bytes(hw.usable_memory_bytes) if name in POLICIES else "-", name,
                          f"{emulated_s * 1e3:.1f} ms", f"{measured_s * 1e3:.1f} ms", f"{em_norm:.3f}",
                          f"{me_norm:.3f}", f"{me_norm / em_norm:.3f}", fmt_bytes(emulated_peak),
                          fmt_bytes(peaks[name]), f"{peaks[name] / emulated_peak:.3f}")
        table.add_section()
    dist.destroy_process_group()
    Console(width=180).print(table)


if __name__ == "__main__":
    main()
