"""Benchmark: the runtime on 4 CPU ranks (gloo), tiny GPT, 1F1B, 8 microbatches of 4.

In one run, on the same process group, one after the other:
- plain `torch.distributed.pipelining` (no mpress);
- mpress with a keep-all plan (its overhead over plain: the target is under 3%), and
  with an explicit keep rule, which routes and accounts every saved tensor (the cost of
  the hooks themselves);
- recompute-only (every layer of every stage checkpointed);
- host-swap-only (every saved tensor swapped to the pinned pool and back);
- d2d-only (every saved tensor striped over the other ranks' peer pools and back; on CPU
  the pools are shared memory, so this shows the protocol's overhead, not NVLink);
- mixed: the planner's plan for a 1.7 MB budget on cpu-local (as `gpt-tiny-mixed`).
The variants run in interleaved rounds of a few steps each, so load drift on the machine
hits them alike. Per variant: median step time, its ratio to plain,
and the largest per-rank peak of device-resident saved tensors as the memory manager
tracks them (plain: not tracked). On a GPU the host-swap comparison against
`save_on_cpu` belongs here too; this machine has none.

Usage: python bench/runtime.py [--steps N] [--warmup N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from mpress.models import layer_names
from mpress.plan import Stripe, TensorRule
from mpress.runtime.data import batches, build_dataset
from mpress.runtime.memory.manager import Category
from mpress.runtime.stage import MpressStage
from mpress.runtime.train_config import load_train_config, model_config
from mpress.runtime.trainer import JobSpec, PipelineJob

WORLD = 4
STEPS_PER_ROUND = 4


def variants(plan, cfg):
    """(name, plan or None) for every variant, from the planner's mixed plan."""
    names = layer_names(cfg)
    keep = replace(plan, stages=[replace(sp, rules=[]) for sp in plan.stages])
    routed = replace(plan, stages=[replace(sp, rules=[TensorRule(tensor="*", technique="keep")])
                                   for sp in plan.stages])
    recompute = replace(plan, stages=[
        replace(sp, rules=[TensorRule(tensor=f"{n}.**", technique="recompute")
                           for n in names[sp.first_layer:sp.end_layer]]) for sp in plan.stages])
    host = replace(plan, stages=[replace(sp, rules=[TensorRule(tensor="*", technique="host")],
                                         pinned_host_bytes=64 << 20) for sp in plan.stages])
    n = plan.num_stages
    d2d = replace(plan, stages=[
        replace(sp, rules=[TensorRule(tensor="*", technique="d2d", stripes=[
            Stripe(device=(sp.device + k) % n, fraction=0.5) for k in (1, 2)])],
                peer_pool_bytes=64 << 20) for sp in plan.stages])
    return [("plain pipelining", None), ("mpress, keep-all plan", keep),
            ("mpress, keep rule (every tensor routed)", routed), ("mpress, recompute-only", recompute),
            ("mpress, host-swap-only", host), ("mpress, d2d-only (2 peers each)", d2d),
            ("mpress, planner's mixed plan", plan)]


def worker(rank: int, init: str, steps: int, warmup: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    from mpress.launcher.startup import plan_for  # the launcher's planning step, as `plan: auto` runs it
    tcfg = load_train_config("gpt-tiny-mixed")
    cfg = model_config(tcfg)
    box = [plan_for(tcfg, cfg, WORLD, WORLD) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    plan, ranges = box[0]
    dataset = build_dataset(tcfg.data, cfg, seed=0)
    spec = JobSpec(model=cfg, schedule="1f1b", ranges=list(ranges), microbatch_size=tcfg.microbatch_size,
                   num_microbatches=tcfg.num_microbatches, seed=0)
    jobs = [(name, PipelineJob(spec, variant, torch.device("cpu"))) for name, variant in variants(plan, cfg)]
    times: dict[str, list[float]] = {name: [] for name, _ in jobs}
    # rounds interleave the variants, so drift in the machine's load hits all of them alike
    rounds = max(1, steps // STEPS_PER_ROUND)
    for rnd in range(rounds + 1):
        for name, job in jobs:
            for k in range(STEPS_PER_ROUND):
                x, y = batches(dataset, microbatch_size=spec.microbatch_size,
                               num_microbatches=spec.num_microbatches, step=rnd * STEPS_PER_ROUND + k)
                dist.barrier()
                t0 = time.perf_counter()
                job.step(x, y)
                dist.barrier()
                if rnd > 0 or k >= warmup:  # first round: warm-up steps are not timed
                    times[name].append(time.perf_counter() - t0)
    results = []
    for name, job in jobs:
        peak = (job.stage.runtime.manager.peak_device_bytes(Category.ACTIVATION)
                if isinstance(job.stage, MpressStage) else None)
        job.close()
        results.append((name, statistics.median(times[name]), peak))
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24, help="timed steps per variant (in rounds of 4)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of the first round")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        mp.start_processes(worker, args=(os.path.join(tmp, "init"), args.steps, args.warmup, out), nprocs=WORLD,
                           join=True, start_method="spawn")
        per_rank = torch.load(out, weights_only=False)
    table = Table(title=f"runtime: gpt-tiny, {WORLD} CPU ranks (gloo), 1F1B, 8 x 4, median of {args.steps} steps")
    for col in ["variant", "step time", "vs plain", "max per-rank saved-tensor peak (tracked)"]:
        table.add_column(col, justify="left" if col == "variant" else "right")
    plain = max(r[0][1] for r in per_rank)
    for i, (name, _, _) in enumerate(per_rank[0]):
        step_s = max(r[i][1] for r in per_rank)  # the pipeline is as slow as its slowest rank's view
        peaks = [r[i][2] for r in per_rank if r[i][2] is not None]
        table.add_row(name, f"{step_s * 1e3:.1f} ms", f"{step_s / plain:.3f}x",
                      f"{max(peaks) / 1e6:.2f} MB" if peaks else "not tracked")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
