"""`mpress maxsize`: the largest model of a family each strategy fits on a server.

    mpress maxsize --model gpt --hardware dgx1-v100 --schedule 1f1b --num-stages 8 \\
        --microbatch-size 2 --num-microbatches 16
    mpress maxsize --model bert --hardware dgx-a100 --strategy recompute,mpress --json
    mpress maxsize --setting paper-bert --hardware dgx-a100 --time-budget 60
    mpress maxsize --model llama-2-7b --hardware hgx-h100 --strategy mpress

Models grow as the family's presets do, width and depth together (`maxsize.ShapeRule`);
--model names a family (its largest preset sets sequence, vocabulary, head size and, for
Llama, the MLP proportion and key/value heads) or a preset of one (that preset sets them).
Each row says what bounds it: why the next size up does not fit (device memory, pinned
host, host RAM, peer memory, drives), or the search's --time-budget, or the widest shape
tried. The ZeRO baselines (zero-offload, zero-infinity, and zero-infinity-nvme where the
server states drives) are searched beside the planner's strategies, and so is
mpress-nvme there (mpress with optimizer data on the drive when the host cannot pin it;
plain mpress keeps to the host). The drive's bounds are named: its capacity and bandwidth
on the settings line, and per row what it holds and its traffic's time per iteration.
Flags left unset derive from the hardware: one stage per device (interleaved: one rank
per device, two stages each), 2 microbatches per rank, microbatch size 1; `--setting`
(e.g. paper-bert: the MPress paper's) gives the family, its precision (models are
trained in it), the pipeline's shape and the hardware instead; the line `settings: ...`
says what was used and where each value came from. --json prints the table's figures as JSON instead of
the table.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.table import Table

from mpress.commands.flags import add_command, add_flag
from mpress.commands.pipeline_args import (
    DEFAULT_HARDWARE,
    DEFAULT_SCHEDULE,
    PipelineShape,
    add_setting_flag,
    resolve_shape,
    setting_from_args,
)
from mpress.errors import UserError
from mpress.hardware.server import Hardware, load_hardware
from mpress.config.presets import hardware_presets
from mpress.static.baselines.zero import ZERO_VARIANTS, zero_variants
from mpress.config.vocabulary import MPRESS_NVME, Strategy
from mpress.config.loader import int_arg, output_path_arg
from mpress.ui import TaskProgress, make_console, print_json
from mpress.config.units import fmt_bytes, fmt_seconds

if TYPE_CHECKING:  # the search loads torch (through the analytic profile): imported when the command runs
    from mpress.static.studies.maxsize import MaxSize


FAMILIES = ("gpt", "bert", "llama")
"""The families `--model` names (`maxsize.FAMILIES`; a preset of one is taken too)."""
DEFAULT_FAMILY = "gpt"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "maxsize", help="largest model of a family each strategy fits", description=__doc__)
    add_flag(p, "model", aliases=("--family",), default=None, choices=None, metavar="FAMILY|PRESET",
             help=f"model family whose billion-scale presets are scaled ({', '.join(FAMILIES)}), or a preset of "
                  f"one, the base of its family's scaling (default: the setting's family, else {DEFAULT_FAMILY})")
    add_flag(p, "hardware", default=None,
             help=f"hardware preset ({', '.join(hardware_presets())}) or YAML (default: the setting's first, "
                  f"else {DEFAULT_HARDWARE})")
    add_setting_flag(p)
    add_flag(p, "schedule", help=f"pipeline schedule (default: {DEFAULT_SCHEDULE.value})")
    add_flag(p, "num_stages", help="pipeline stages (default: one per device; interleaved: 2 per rank)")
    add_flag(p, "num_ranks", help="pipeline ranks; interleaved only (default: one per device)")
    add_flag(p, "microbatch_size", help="samples per microbatch (default: 1)")
    add_flag(p, "num_microbatches", help="microbatches per iteration (default: 2 per pipeline rank)")
    add_flag(p, "strategy", aliases=("--strategies",), type=searchable_arg, choices=None, metavar="NAMES",
             default=None,
             help=f"comma-separated strategies to search ({', '.join(SEARCHABLE)}; default: all, the NVMe "
                  "baseline where the server states drives)")
    add_flag(p, "num_devices", default=None, help="override the hardware's device count (cpu-local)")
    add_flag(p, "device_memory", default=None, help="override device memory, e.g. 2GB (cpu-local)")
    p.add_argument("--time-budget", type=int_arg(0, 10**6), default=None, metavar="SECONDS",
                   help="per strategy, stop trying larger sizes after this many seconds (default: no limit)")
    p.add_argument("--plot", type=output_path_arg(), default=None,
                   help="write a PNG bar chart of the largest model per strategy")
    add_flag(p, "json")
    p.set_defaults(func=run)


SEARCHABLE = (*Strategy.words(), MPRESS_NVME, *ZERO_VARIANTS)
"""What maxsize searches: the planner's strategies and the ZeRO baselines."""


def searchable_arg(text: str) -> list[str]:
    """argparse `type=` for a comma-separated list of `SEARCHABLE` names (at least one)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SEARCHABLE]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown strategy {unknown[0] if unknown else '(none)'!r} "
                                         f"(allowed: {', '.join(SEARCHABLE)}, comma-separated)")
    return names


searchable_arg.__name__ = "strategies"


def table(rows: list[MaxSize], title: str, hardware: Hardware) -> Table:
    ref = next((r for r in rows if r.strategy == Strategy.MPRESS and r.model), None)
    t = Table(title=title)
    drive = any(r.drive_bytes for r in rows)
    for col in ["strategy", "largest model", "parameters", "layers", "hidden", "iteration", "samples/s",
                "size / mpress", "bound", "plans", *(["on drive", "drive s/iter"] if drive else [])]:
        t.add_column(col, justify="left" if col in ("strategy", "largest model") else "right")
    for r in rows:
        if r.model is None:
            t.add_row(r.strategy, "[red]nothing fits[/]", "-", "-", "-", "-", "-", "-", _bound(r),
                      str(r.evaluations), *(["-", "-"] if drive else []))
            continue
        t.add_row(r.strategy, r.model.name, f"{r.num_parameters / 1e9:.2f} B", str(r.model.num_layers),
                  str(r.model.hidden_size), fmt_seconds(r.iteration_s), f"{r.samples_per_s:.3g}",
                  f"{r.num_parameters / ref.num_parameters:.2f}x" if ref else "-", _bound(r), str(r.evaluations),
                  *([fmt_bytes(r.drive_bytes) if r.drive_bytes else "-",
                     fmt_seconds(r.drive_s(hardware)) if r.drive_bytes else "-"] if drive else []))
    return t


def _bound(row: MaxSize) -> str:
    return row.bound.value if row.bound is not None else "-"


def maxsize_json(rows: list[MaxSize], hardware: Hardware, family: str, shape: PipelineShape,
                 precision: str | None = None) -> dict[str, object]:
    """The table's figures (times in seconds). precision: the setting's (None: the presets')."""
    ref = next((r for r in rows if r.strategy == Strategy.MPRESS and r.model), None)
    out = []
    for r in rows:
        out.append({"strategy": r.strategy, "largest_model": r.model.name if r.model else None,
                    "num_parameters": r.num_parameters if r.model else None,
                    "num_layers": r.model.num_layers if r.model else None,
                    "hidden_size": r.model.hidden_size if r.model else None,
                    "iteration_s": r.iteration_s if r.model else None,
                    "samples_per_s": r.samples_per_s if r.model else None,
                    "size_over_mpress": r.num_parameters / ref.num_parameters if ref and r.model else None,
                    "bound": r.bound.value if r.bound is not None else None, "bound_detail": r.bound_detail,
                    "plans": r.evaluations, "drive_bytes": r.drive_bytes if r.model else None,
                    "drive_s": r.drive_s(hardware) if r.model else None})
    return {"settings": {"model": family, "precision": precision, "hardware": hardware.name,
                         "num_devices": hardware.num_devices,
                         "device_memory_bytes": hardware.device.memory_bytes,
                         "usable_memory_bytes": hardware.usable_memory_bytes,
                         "pinnable_host_bytes": hardware.pinnable_bytes, "nvme_bytes": hardware.nvme_bytes,
                         "nvme_read_gbps": hardware.nvme_read_gbps,
                         "nvme_write_gbps": hardware.nvme_gbps("write") if hardware.has_nvme else None,
                         **shape.settings(),
                         "defaults": dict(shape.sources)},
            "strategies": out}


def run(args: argparse.Namespace) -> int:
    from mpress.static.studies.maxsize import family_of, find_max_size

    setting = setting_from_args(args)
    try:
        chosen = family_of(args.model) if args.model is not None else None
    except UserError as exc:
        raise UserError(f"--model: {exc}") from None
    if setting is not None and chosen not in (None, setting.family):
        raise UserError(f"--setting {setting.name} trains the {setting.family} family, not --model {args.model}")
    family = args.model or (setting.family if setting is not None else DEFAULT_FAMILY)
    precision = setting.precision if setting is not None else None
    hardware = load_hardware(args.hardware or (setting.hardware[0] if setting is not None else DEFAULT_HARDWARE),
                             num_devices=args.num_devices, memory_bytes=args.device_memory)
    shape = resolve_shape(args, hardware, num_layers=None, setting=setting)
    console = make_console(stderr=args.json)
    if setting is not None:  # which of family, hardware and precision are the setting's
        origin = f"the setting {setting.name}'s"
        shape.sources["precision"] = origin
        if args.model is None:
            shape.sources["model"] = origin
        if args.hardware is None:
            shape.sources["hardware"] = origin

    def v(key: str, text: str) -> str:
        return f"{text} ({shape.sources[key]})" if key in shape.sources else text

    trained = f", {v('precision', f'precision {precision}')}" if precision is not None else ""
    server = (f"hardware {hardware.name} ({hardware.num_devices} x {fmt_bytes(hardware.device.memory_bytes)}, "
              f"{fmt_bytes(hardware.usable_memory_bytes)} usable; {fmt_bytes(hardware.pinnable_bytes)} pinnable host"
              + (f"; drives {fmt_bytes(hardware.nvme_bytes)} at {hardware.nvme_gbps('read'):g} GB/s read, "
                 f"{hardware.nvme_gbps('write'):g} GB/s write" if hardware.has_nvme else "") + ")")
    model = f"model family {family}" if family in FAMILIES else f"model family {chosen}, scaled from {family}"
    console.print(f"settings: {v('model', model)}{trained}, {v('hardware', server)}, "
                  f"{shape.describe()}", markup=False, soft_wrap=True)
    strategies = args.strategy or [*Strategy.words(), *((MPRESS_NVME,) if hardware.has_nvme else ()),
                                   *zero_variants(hardware)]
    rows = []
    with TaskProgress(console, len(strategies), "searching") as progress:
        for strategy in strategies:
            progress.update(f"searching {strategy}")
            row = find_max_size(
                family, hardware, strategy, schedule=shape.schedule, num_stages=shape.num_stages,
                num_ranks=shape.num_ranks, microbatch_size=shape.microbatch_size,
                num_microbatches=shape.num_microbatches, precision=precision, time_budget_s=args.time_budget,
                progress=progress.update)
            rows.append(row)
            progress.advance(f"{strategy}: largest {row.model.name if row.model else 'none'} "
                             f"({row.evaluations} plans)")
    title = (f"largest {family.upper()}{f' ({precision})' if precision else ''} on {hardware.name}: "
             f"{shape.schedule}, {shape.num_stages} stages, {shape.num_microbatches} x {shape.microbatch_size}")
    if args.json:
        print_json({**maxsize_json(rows, hardware, family, shape, precision), "plot": args.plot})
    else:
        console.print(table(rows, title, hardware))
        for r in rows:
            if r.bound_detail:
                console.print(f"{r.strategy}: bound by {_bound(r)}: {r.bound_detail}", markup=False, soft_wrap=True)
            if r.result is not None and any(rule.tensor.startswith(("param:", "grad:"))
                                            for sp in r.result.plan.stages for rule in sp.rules):
                console.print(f"{r.strategy}: keeps layers' parameters or gradients on the host (param:/grad: rules); "
                              "mpress train runs such plans, its grad: rules without gradient clipping, replicas or "
                              "tied weights", markup=False, soft_wrap=True)
    if args.plot:
        from mpress.static.studies.plots import plot_maxsize
        plot_maxsize(rows, args.plot, title)
        console.print(f"bar chart written to {args.plot}")
    return 0
