"""Benchmark: how fast `emulate` runs one iteration of a real plan.

The pipeline: a 48-layer GPT (the gpt-10.3b shape, 48 blocks) on dgx1-v100, 8 stages,
32 microbatches of 2, 1F1B. Programs: the plain schedule (no memory actions) and the
`mpress` plan for it (recompute, host swap, streamed optimizer states, D2D), lowered
through the rewriter and the memory model, under both swap-in policies, and a stress
plan that host-swaps every saved tensor separately (tens of thousands of tasks). Each program is
emulated `--repeats` times; the table shows seconds per simulated iteration.

Usage: python bench/emulator.py [--repeats N] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.contract.plan import TensorRule
from mpress.static.emulate.emulator import emulate
from mpress.static.plan.evaluate import evaluate, setup_pipeline
from mpress.static.plan.plan_eval import evaluate_plan
from mpress.static.plan.planner import plan_strategy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one mpress-plan run")
    args = ap.parse_args()
    model = replace(load_model_config("gpt-10.3b"), name="gpt-48-layers", num_layers=48)
    setup = setup_pipeline(model, load_hardware("dgx1-v100"), schedule="1f1b", num_stages=8,
                           microbatch_size=2, num_microbatches=32)
    plan = plan_strategy(setup, "mpress").plan
    # stress: every saved tensor of every layer its own host-swap unit (one SO and one SI
    # per tensor and microbatch): the largest program a plan can make of this pipeline.
    # Variants of the plan drop its carried program (`actions=[]`): evaluate_plan refuses
    # a program that is not the one the changed rules or policy make, so it re-derives it.
    per_tensor = replace(plan, actions=[], stages=[
        replace(sp, rules=[TensorRule(tensor=t.id, technique="host", prefetch_lead=2) for t in c.saved])
        for sp, c in zip(plan.stages, setup.costs)])
    programs = {
        "no memory actions": evaluate(setup).program,
        "mpress plan, capacity": evaluate_plan(setup, plan).program,
        "mpress plan, layer-ahead": evaluate_plan(
            setup, replace(plan, swap_in_policy="layer-ahead", actions=[])).program,
        "every tensor host-swapped": evaluate_plan(setup, per_tensor).program,
    }
    table = Table(title="emulate(): one iteration, 8 stages x 32 microbatches, 48-layer GPT on dgx1-v100")
    for col in ["program", "tasks", "mean s/iteration", "min s/iteration", "tasks/s", "emulated iteration",
                "peak GB (max)", "fits"]:
        table.add_column(col, justify="left" if col == "program" else "right")
    for name, program in programs.items():
        tasks = sum(len(r) for r in program.ranks)
        times = []
        result = None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = emulate(program)
            times.append(time.perf_counter() - t0)
        assert result is not None
        table.add_row(name, str(tasks), f"{statistics.mean(times):.3f}", f"{min(times):.3f}",
                      f"{tasks / statistics.mean(times):,.0f}", f"{result.iteration_s:.2f} s",
                      f"{max(result.peak_bytes) / 1e9:.1f}", str(result.fits))
    Console(width=150).print(table)
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(emulate, programs["mpress plan, capacity"])
        pstats.Stats(prof).sort_stats("cumulative").print_stats(15)


if __name__ == "__main__":
    main()
