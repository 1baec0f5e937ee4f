"""Benchmark: emulated throughput of a compacted pipeline replicated on 1 to 16 nodes.

For each model and server (dgx-a100, hgx-h100, with their InfiniBand NICs from
configs/clusters/): plan the `mpress` strategy for one 8-stage 1F1B pipeline on one node
(16 microbatches of 1), then emulate that plan replicated on N nodes with data
parallelism across them (DDP: each stage's gradients all-reduced over its GPU's NIC in
25 MB buckets, overlapped with the stage's last backward; `mpress.static.emulate.dp_reduction`).
Under DDP every replica holds what one server holds plus DDP's buckets (a copy of the
gradients), whatever N > 1: one plan for one node, one for every N > 1; with --sharding
fsdp (sharded states free memory, more the more nodes) every node count is planned
anew. The table sets the cluster's samples/s beside linear scaling (N x one node):
`reduction` is the longest a stage's reduction runs, `exposed` how long it holds up a
rank's optimizer step or end (`data_parallel.exposed_reduction_s`; the note says from
how many nodes it exceeds 1% of the iteration), `cost / iteration` what the iteration
gained over one node's (the reduction and the plan its memory needs; with fsdp, less
memory can make it negative: more than linear).

Usage: python bench/multinode.py [--models gpt-20.4b,llama-2-70b,llama-3-70b]
       [--hardware dgx-a100,hgx-h100] [--nodes 1,2,4,8,16] [--sharding ddp|fsdp]
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from mpress.hardware.cluster import Sharding, make_cluster
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.static.emulate.dp_reduction import exposed_reduction_s, reduction_busy_s
from mpress.static.memory.data_parallel import DataParallel
from mpress.static.plan.evaluate import PipelineSetup, setup_pipeline
from mpress.static.plan.plan_eval import evaluate_plan
from mpress.static.plan.planner import plan_strategy
from mpress.config.units import fmt_seconds

STAGES, MICROBATCHES, MICROBATCH_SIZE = 8, 16, 1


def make_setup(model: str, hardware: str, nodes: int, sharding: Sharding) -> PipelineSetup:
    hw = load_hardware(hardware)
    dp = DataParallel(cluster=make_cluster(hw, nodes), sharding=sharding) if nodes > 1 else None
    return setup_pipeline(load_model_config(model), hw, schedule="1f1b", num_stages=STAGES,
                          microbatch_size=MICROBATCH_SIZE, num_microbatches=MICROBATCHES, data_parallel=dp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-20.4b,llama-2-70b,llama-3-70b")
    ap.add_argument("--hardware", default="dgx-a100,hgx-h100")
    ap.add_argument("--nodes", default="1,2,4,8,16")
    ap.add_argument("--sharding", default="ddp", choices=Sharding.words())
    args = ap.parse_args()
    sharding = Sharding(args.sharding)
    node_counts = sorted({int(n) for n in args.nodes.split(",")} | {1})
    console = Console(width=160)
    table = Table(title=f"mpress plan, {STAGES}-stage 1F1B per node ({MICROBATCHES} x {MICROBATCH_SIZE}), "
                        f"replicated across nodes ({sharding}), emulated")
    for col in ["model", "hardware", "nodes", "GPUs", "iteration", "samples/s", "linear", "efficiency",
                "reduction", "exposed", "cost / iteration"]:
        table.add_column(col, justify="left" if col in ("model", "hardware") else "right")
    notes: list[str] = []
    t0 = time.perf_counter()
    for model in args.models.split(","):
        for hardware in args.hardware.split(","):
            plan, planned_for = None, None
            one_node, one_node_s = 0.0, 0.0
            first_exposed = None
            for n in node_counts:
                setup = make_setup(model, hardware, n, sharding)
                # per-device memory: one node (no replicas), ddp on any N > 1 (its buckets), fsdp per N
                key = n if sharding is Sharding.FSDP else min(n, 2)
                if key != planned_for:
                    planned_for = key
                    planned = plan_strategy(setup, "mpress")
                    plan = planned.plan if planned.fits else None
                    if plan is None:
                        notes.append(f"{model} on {hardware}, {n} node(s): no plan fits: {planned.reason}")
                if plan is None:  # another node count may fit (fsdp shards more the more nodes)
                    table.add_row(model, hardware, str(n), *["-"] * 7, "does not fit")
                    continue
                res = evaluate_plan(setup, plan).result
                if n == 1:
                    one_node, one_node_s = res.samples_per_s, res.iteration_s
                exposed = exposed_reduction_s(res)
                cost = res.iteration_s - one_node_s  # what replication costs: the reduction, its memory
                if first_exposed is None and exposed > 0.01 * res.iteration_s:
                    first_exposed = n
                gpus = n * setup.hardware.num_devices
                table.add_row(model, hardware, str(n), str(gpus), fmt_seconds(res.iteration_s),
                              f"{res.samples_per_s:.3g}", f"{n * one_node:.3g}" if one_node else "-",
                              f"{100 * res.samples_per_s / (n * one_node):.1f}%" if one_node else "-",
                              fmt_seconds(reduction_busy_s(res)), fmt_seconds(exposed),
                              f"{100 * cost / res.iteration_s:.1f}%" if one_node else "-")
            if plan is not None:
                where = (f"exposed (costs > 1% of the iteration) from {first_exposed} nodes on" if first_exposed
                         else "hidden behind the backward up to the largest node count")
                notes.append(f"{model} on {hardware}: the inter-node reduction is {where}")
            table.add_section()
    console.print(table)
    for line in notes:
        console.print(line)
    console.print(f"(ran in {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
