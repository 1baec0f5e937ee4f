"""`mpress maxsize`: the largest model of a family each strategy fits on a server.

    mpress maxsize --family gpt --hardware dgx1-v100 --schedule 1f1b --stages 8 \\
        --microbatch-size 2 --microbatches 16
"""

from __future__ import annotations

import argparse

from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from mpress.errors import UserError
from mpress.hardware import load_hardware
from mpress.static.maxsize import MaxSize, find_max_size
from mpress.vocabulary import ScheduleName, Strategy
from mpress import limits
from mpress.config import int_arg, output_path_arg
from mpress.ui import make_console
from mpress.units import fmt_seconds, parse_bytes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("maxsize", help="largest model of a family each strategy fits", description=__doc__)
    p.add_argument("--family", default="gpt", choices=["gpt", "bert"], help="model family (default: %(default)s)")
    p.add_argument("--hardware", default="dgx1-v100", help="hardware preset or YAML (default: %(default)s)")
    p.add_argument("--schedule", default=ScheduleName.ONE_F_ONE_B.value, choices=ScheduleName.words(),
                   help="pipeline schedule (default: %(default)s)")
    p.add_argument("--stages", type=int_arg(1, limits.MAX_STAGES), default=8, help="pipeline stages (default: %(default)s)")
    p.add_argument("--ranks", type=int_arg(1, limits.MAX_STAGES), default=None, help="pipeline ranks; only for interleaved")
    p.add_argument("--microbatch-size", type=int_arg(1, limits.MAX_MICROBATCH_SIZE), default=2, help="samples per microbatch (default: %(default)s)")
    p.add_argument("--microbatches", type=int_arg(1, limits.MAX_MICROBATCHES), default=16, help="microbatches per iteration (default: %(default)s)")
    p.add_argument("--strategies", default=",".join(Strategy.words()),
                   help="comma-separated strategies to search (default: all)")
    p.add_argument("--devices", type=int_arg(1, limits.MAX_DEVICES), default=None, help="override the device count (cpu-local)")
    p.add_argument("--device-memory", default=None, help="override device memory, e.g. 2GB (cpu-local)")
    p.add_argument("--plot", type=output_path_arg(), default=None,
                   help="write a PNG bar chart of the largest model per strategy")
    p.set_defaults(func=run)


def table(rows: list[MaxSize], title: str) -> Table:
    ref = next((r for r in rows if r.strategy == Strategy.MPRESS and r.model), None)
    t = Table(title=title)
    for col in ["strategy", "largest model", "parameters", "layers", "hidden", "iteration", "samples/s",
                "size / mpress", "plans"]:
        t.add_column(col, justify="left" if col in ("strategy", "largest model") else "right")
    for r in rows:
        if r.model is None or r.result is None:
            t.add_row(r.strategy, "[red]nothing fits[/]", "-", "-", "-", "-", "-", "-", str(r.evaluations))
            continue
        res = r.result.evaluation.result
        t.add_row(r.strategy, r.model.name, f"{r.num_parameters / 1e9:.2f} B", str(r.model.num_layers),
                  str(r.model.hidden_size), fmt_seconds(res.iteration_s), f"{res.samples_per_s:.3g}",
                  f"{r.num_parameters / ref.num_parameters:.2f}x" if ref else "-", str(r.evaluations))
    return t


def run(args: argparse.Namespace) -> int:
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in Strategy.words()]
    if unknown or not strategies:
        raise UserError(f"--strategies: unknown strategy {unknown[0] if unknown else '(none)'!r} "
                        f"(allowed: {', '.join(Strategy.words())})")
    memory = parse_bytes(args.device_memory, "--device-memory") if args.device_memory else None
    hardware = load_hardware(args.hardware, num_devices=args.devices, memory_bytes=memory)
    console = make_console()
    rows = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("searching", total=len(strategies))
        for strategy in strategies:
            rows.append(find_max_size(
                args.family, hardware, strategy, schedule=args.schedule, num_stages=args.stages,
                num_ranks=args.ranks, microbatch_size=args.microbatch_size, num_microbatches=args.microbatches,
                progress=lambda msg: progress.update(task, description=msg)))
            progress.advance(task)
    title = (f"largest {args.family.upper()} on {hardware.name}: {args.schedule}, {args.stages} stages, "
             f"{args.microbatches} x {args.microbatch_size}")
    console.print(table(rows, title))
    if args.plot:
        from mpress.static.plots import plot_maxsize
        plot_maxsize(rows, args.plot, title)
        console.print(f"bar chart written to {args.plot}")
    return 0
