"""Benchmark: the planner on every billion-scale preset, on DGX-1 and DGX A100.

For each preset (GPT: 1F1B, microbatch 2; BERT: PipeDream asynchronous 1F1B,
microbatch 12; 8 stages, 16 microbatches), all measured in this run:
- planning time of `mpress` (whole search) and its device-mapping share;
- every strategy: fits or not, emulated iteration, samples/s, time ratio to `mpress`;
- `mpress`'s emulated iteration over the ideal one (same model and pipeline with
  unlimited device memory: the `none` plan, whose emulation ignores capacity) — the
  overhead memory compaction costs.

A second table per hardware compares recompute granularity, side by side in the same
run: the `recompute` and `mpress` strategies planned with whole-layer recompute only and
with per-tensor (op-level) recompute (`PlannerOptions.op_level_recompute`), each as its
iteration over the ideal, for the GPT and Llama presets (Llama where the device has bf16).

Usage: python bench/plan_search.py [--hardware dgx1-v100,dgx-a100] [--models gpt-20.4b,...]
       [--granularity-models gpt-20.4b,llama-2-7b,...] [--no-strategies]
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from mpress.errors import UserError
from mpress.hardware.server import Hardware, load_hardware
from mpress.config.model_config import load_model_config, model_presets
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.planner import PlannerOptions, plan_strategy
from mpress.config.vocabulary import Strategy


def billion_presets() -> list[str]:
    names = [n for n in model_presets() if n.endswith("b") and n.split("-")[0] in ("gpt", "bert")]
    return sorted(names, key=lambda n: (n.split("-")[0], float(n.split("-")[1][:-1])))


def granularity_presets() -> list[str]:
    """The GPT billion-scale presets and the Llama presets."""
    llama = sorted(n for n in model_presets() if n.startswith("llama-") and n != "llama-tiny")
    return [n for n in billion_presets() if n.startswith("gpt")] + llama


def _setup(name: str, hw: Hardware, num_microbatches: int):
    model = load_model_config(name)
    schedule, mbsize = ("pipedream", 12) if model.family == "bert" else ("1f1b", 2 if model.family == "gpt" else 1)
    return setup_pipeline(model, hw, schedule=schedule, num_stages=8, microbatch_size=mbsize,
                          num_microbatches=num_microbatches)


def granularity_table(hw: Hardware, names: list[str], num_microbatches: int) -> Table:
    """Iteration over the ideal of `recompute` and `mpress`, whole-layer vs per-tensor recompute."""
    table = Table(title=f"recompute granularity on {hw.name}: iteration / ideal (8 stages, {num_microbatches} "
                        "microbatches); x = does not fit")
    skipped: list[str] = []
    for col in ["model", "recompute, whole layers", "recompute, per tensor", "per tensor / whole",
                "mpress, whole layers", "mpress, per tensor", "per tensor / whole "]:
        table.add_column(col, justify="left" if col == "model" else "right")
    for name in names:
        try:
            setup = _setup(name, hw, num_microbatches)
        except UserError as exc:  # e.g. a bf16 model on a device without bf16
            table.add_row(name, "[dim]cannot plan here[/]", *[""] * 5)
            skipped.append(f"{name}: {exc}")
            continue
        ideal = plan_strategy(setup, "none").evaluation.result.iteration_s
        cells = [name]
        for strategy in ("recompute", "mpress"):
            its = []
            for op_level in (False, True):
                r = plan_strategy(setup, strategy, PlannerOptions(op_level_recompute=op_level))
                it = r.evaluation.result.iteration_s
                its.append((it, r.fits))
                cells.append(f"{'[green]' if r.fits else '[red]x '}{it / ideal:.3f}[/]")
            (whole, whole_fits), (per, per_fits) = its
            cells.append(f"{per / whole:.3f}" if whole_fits and per_fits else
                         "only per tensor fits" if per_fits else "only whole fits" if whole_fits else "-")
        table.add_row(*cells)
    if skipped:
        table.caption = "; ".join(dict.fromkeys(x.split(": ", 1)[1] for x in skipped))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="dgx1-v100,dgx-a100")
    ap.add_argument("--models", default=",".join(billion_presets()))
    ap.add_argument("--num-microbatches", "--microbatches", type=int, default=16,
                    help="microbatches per iteration (default: %(default)s)")
    ap.add_argument("--granularity-models", default=",".join(granularity_presets()),
                    help="presets of the recompute-granularity table ('' for none)")
    ap.add_argument("--no-strategies", action="store_true", help="only the recompute-granularity table")
    args = ap.parse_args()
    console = Console(width=170)
    for hw_name in args.hardware.split(","):
        hw = load_hardware(hw_name)
        if args.granularity_models:
            console.print(granularity_table(hw, args.granularity_models.split(","), args.num_microbatches))
        if args.no_strategies:
            continue
        summary = Table(title=f"planner on {hw.name}: 8 stages, {args.num_microbatches} microbatches "
                              "(GPT 1f1b x2, BERT pipedream x12)")
        for col in ["model", "plan s", "mapping s", *Strategy.words(), "mpress / best fitting baseline",
                    "mpress / ideal"]:
            summary.add_column(col, justify="left" if col == "model" else "right")
        for name in args.models.split(","):
            setup = _setup(name, hw, args.num_microbatches)
            results = {}
            for strategy in Strategy.words():
                t0 = time.perf_counter()
                r = plan_strategy(setup, strategy)
                results[strategy] = (r, time.perf_counter() - t0)
            mp, mp_s = results["mpress"]
            mp_iter = mp.evaluation.result.iteration_s
            ideal = results["none"][0].evaluation.result.iteration_s
            cells = []
            for strategy in Strategy.words():
                r, _ = results[strategy]
                it = r.evaluation.result.iteration_s
                mark = "[green]" if r.fits else "[red]x "
                cells.append(f"{mark}{it:.2f}s ({it / mp_iter:.2f}x)[/]")
            fitting = [r.evaluation.result.iteration_s for s, (r, _) in results.items() if r.fits and s != "mpress"]
            vs_best = f"{mp_iter / min(fitting):.2f}x" if fitting and mp.fits else "only mpress fits" if mp.fits else "-"
            summary.add_row(name, f"{mp_s:.2f}", f"{mp.mapping_s:.2f}", *cells, vs_best,
                            f"{mp_iter / ideal:.2f}x" if mp.fits else "does not fit")
        console.print(summary)
        console.print("cells: emulated iteration (ratio to mpress); red x = does not fit on the device")


if __name__ == "__main__":
    main()
