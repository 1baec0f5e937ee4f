"""Benchmark: the runtime on 4 CPU ranks (gloo), tiny GPT, 1F1B, 8 microbatches of 4.

In one run, on the same process group, one after the other:
- plain `torch.distributed.pipelining` (no mpress: `PipelineJob` without a plan);
- mpress with a keep-all plan (its overhead over plain: the target is under 3%), and
  with an explicit keep rule, which routes every saved tensor (the cost of the hooks
  themselves);
- recompute-only (every layer of every stage checkpointed);
- host-swap-only (every saved tensor swapped to the pinned pool and back, on every stage
  where a swap frees anything: not the last, whose backward follows each forward);
- d2d-only (the same tensors striped over two other ranks' peer pools and back; on CPU
  the pools are shared memory, so this shows the protocol's overhead, not NVLink);
- mixed: the planner's plan for `gpt-tiny-mixed` (its `device_memory` budget on
  cpu-local), made as `plan: auto` makes it at start-up.
Every variant but the last is a plan written here (rules only), so each gets the program
its rules make, as `mpress plan` would write it (the static rewriter's action lists),
and pools sized for that program: pinned pools for what it holds at once, D2D quotas
and peer pools for the slots its D2D units take (`mpress.d2d.static.pool_slots`, the
layout the runtime's quotas allocate by); the plan's pinned figure includes its
fragmentation headroom (`mpress.static.emulate.host_memory`). Jobs are started as the launcher starts them
(`start_job`: peer pools first when a plan uses them).
The variants run in interleaved rounds of a few steps each, so load drift on the machine
hits them alike. Per variant: median step time, its ratio to plain, and the largest
per-rank peak of every byte on the rank's device over the timed steps (`StepResult.
peak_bytes`: on CPU the rank's `LiveBytes`, which the job counts on every step and
variant alike; parameters, optimizer states and the peer pools a rank lends included,
so the d2d row carries its pools' headroom; the pinned pools are host memory; no
capacity is set, so no variant stops at the budget). On a GPU the host-swap comparison against
`save_on_cpu` belongs here too; this machine has none.

Usage: python bench/runtime.py [--steps N] [--warmup N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from mpress.contract.actions import Kind
from mpress.hardware.server import load_hardware
from mpress.launcher.job import start_job
from mpress.config.model_config import ModelConfig
from mpress.models import layer_names
from mpress.contract.plan import Plan, StagePlan, Stripe, TensorRule
from mpress.runtime.data import batches, build_dataset
from mpress.runtime.train_config import load_train_config, model_config
from mpress.runtime.trainer import JobSpec
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.plan_eval import plan_from_rules

WORLD = 4
STEPS_PER_ROUND = 4


def with_program(plan: Plan, model: ModelConfig) -> Plan:
    """`plan` (rules written by hand) with the program its rules make for `model` on the
    plan's hardware and its pinned pools sized for that program, as `plan_for` completes
    a plan file without a program, with the D2D quotas and peer pools that program needs
    where `plan` gives none, and its figures derived anew (`plan_from_rules`)."""
    hardware = load_hardware(plan.hardware, num_devices=plan.num_devices, memory_bytes=plan.device_memory_bytes)
    setup = setup_pipeline(model, hardware, schedule=plan.schedule, num_stages=plan.num_stages,
                           microbatch_size=plan.microbatch_size, num_microbatches=plan.num_microbatches,
                           ranges=[(sp.first_layer, sp.end_layer) for sp in plan.stages])
    return plan_from_rules(setup, plan)


def variants(plan: Plan, cfg: ModelConfig) -> list[tuple[str, Plan | None]]:
    """(name, plan or None) for every variant, from the planner's mixed plan (its stages,
    devices and shape; each hand-written variant has its own rules, program and pools)."""
    names = layer_names(cfg)

    def written(rules: Callable[[StagePlan], list[TensorRule]]) -> Plan:
        bare = replace(plan, actions=[], stages=[
            replace(sp, rules=rules(sp), pinned_host_bytes=0, peer_pool_bytes=0, peer_quotas=[])
            for sp in plan.stages])
        return with_program(bare, cfg)

    def swapping(variant: Plan) -> Plan:
        """`variant` without the swap rules of stages its program swaps nothing of (the
        last stage under 1F1B: a swap there frees nothing, so the rewriter lists none):
        the runtime refuses a host rule without a pinned pool, even one that moves nothing."""
        moved = {a.stage for r in range(variant.num_ranks) for a in variant.program(r)
                 if a.kind in (Kind.SO, Kind.DO)}
        return with_program(replace(variant, actions=[], stages=[  # D2D quotas and pools made again
            replace(sp if sp.stage in moved else replace(sp, rules=[]), peer_quotas=[], peer_pool_bytes=0)
            for sp in variant.stages]), cfg)

    keep = written(lambda sp: [])
    routed = written(lambda sp: [TensorRule(tensor="*", technique="keep")])
    recompute = written(lambda sp: [TensorRule(tensor=f"{n}.**", technique="recompute")
                                    for n in names[sp.first_layer:sp.end_layer]])
    host = swapping(written(lambda sp: [TensorRule(tensor="*", technique="host")]))
    n = plan.num_stages
    peers = {sp.stage: [(sp.device + k) % n for k in (1, 2)] for sp in plan.stages}
    d2d = swapping(written(lambda sp: [TensorRule(tensor="*", technique="d2d", stripes=[
        Stripe(device=d, fraction=0.5) for d in peers[sp.stage]])]))
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
    box: list = [None]
    if rank == 0:  # the planning and the variants' programs, once
        start = plan_for(tcfg, cfg, WORLD, WORLD)
        box = [(start.ranges, variants(start.plan, cfg))]
    dist.broadcast_object_list(box, src=0)
    ranges, plans = box[0]
    dataset = build_dataset(tcfg.data, cfg, seed=0)
    spec = JobSpec(model=cfg, schedule="1f1b", ranges=list(ranges), microbatch_size=tcfg.microbatch_size,
                   num_microbatches=tcfg.num_microbatches, seed=0)
    # as the launcher starts a job: the peer pools first (a collective) when the plan uses them
    jobs = [(name, start_job(spec, variant, torch.device("cpu"))) for name, variant in plans]
    times: dict[str, list[float]] = {name: [] for name, _ in jobs}
    peaks: dict[str, int] = {name: 0 for name, _ in jobs}
    # rounds interleave the variants, so drift in the machine's load hits all of them alike
    rounds = max(1, steps // STEPS_PER_ROUND)
    for rnd in range(rounds + 1):
        for name, job in jobs:
            for k in range(STEPS_PER_ROUND):
                x, y = batches(dataset, microbatch_size=spec.microbatch_size,
                               num_microbatches=spec.num_microbatches, step=rnd * STEPS_PER_ROUND + k)
                dist.barrier()
                t0 = time.perf_counter()
                result = job.step(x, y)
                dist.barrier()
                if rnd > 0 or k >= warmup:  # first round: warm-up steps are not timed
                    times[name].append(time.perf_counter() - t0)
                    peaks[name] = max(peaks[name], result.peak_bytes)
    results = []
    for name, job in jobs:
        job.close()
        results.append((name, statistics.median(times[name]), peaks[name]))
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
    for col in ["variant", "step time", "vs plain", "max per-rank peak (every byte, LiveBytes)"]:
        table.add_column(col, justify="left" if col == "variant" else "right")
    plain = max(r[0][1] for r in per_rank)
    for i, (name, _, _) in enumerate(per_rank[0]):
        step_s = max(r[i][1] for r in per_rank)  # the pipeline is as slow as its slowest rank's view
        peak = max(r[i][2] for r in per_rank)
        table.add_row(name, f"{step_s * 1e3:.1f} ms", f"{step_s / plain:.3f}x", f"{peak / 1e6:.2f} MB")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
