"""`mpress ooc`: the out-of-core performance model on ONE device, no pipeline.

    mpress ooc --model vgg16 --hardware hgx-h100 --batch-size 2048
    mpress ooc --model vgg16 --hardware hgx-h100 --sweep batch --plot vgg16-batch.png
    mpress ooc --model gpt-small --hardware hgx-h100 --capacity 8GB --sweep bandwidth --plot bw.png
    mpress ooc --module mymodel:make --layers "embed,blocks.*,head" --sweep batch --json

The model (a conv net: vgg16, vgg19, darknet19 on --image-size images, profiled on fake
tensors; a GPT/BERT preset, profiled analytically; or your --module) runs a batch on one
device as batch / microbatch-size microbatches, all forwards then all backwards: the
microbatch is the unit a swap frees memory by. What does not fit the device's memory
(--capacity, default: the preset's usable memory) goes to the host, as the planner's
host-swap strategy decides, and both swap-in policies are emulated: layer-ahead (vDNN:
each tensor comes back just before the backward that needs it) and capacity (as early as
memory allows). Times are normalised to the in-memory time (infinite capacity).

Without --sweep: one batch, one row per policy with the stalls and the tensors they are
blamed on. --sweep batch: throughput against batch size, the knee where the footprint
passes device memory. --sweep bandwidth: normalised time against host-link bandwidth
(the batch planned once on the preset's link). Defaults derived from the model are said
on the `settings:` line; --json prints the figures instead of the tables.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.table import Table

from mpress.commands.flags import add_command, add_flag, bytes_arg
from mpress.config import limits
from mpress.config.loader import int_arg, output_path_arg
from mpress.config.presets import hardware_presets
from mpress.config.units import fmt_bytes, fmt_seconds
from mpress.errors import UserError
from mpress.static.studies.ooc_defaults import (
    DEFAULT_BANDWIDTHS_GBPS,
    DEFAULT_IMAGE_SIZE,
    POLICIES,
    conv_networks,
    model_choices,
)
from mpress.ui import TaskProgress, make_console, print_json

if TYPE_CHECKING:  # the study's modules import torch (the profilers): `run` imports them
    from mpress.hardware.server import Hardware
    from mpress.static.studies.ooc_model import OocModel
    from mpress.static.studies.ooc_point import OocPoint, PolicyRun
    from mpress.static.studies.ooc_sweeps import BandwidthPoint

DEFAULT_HARDWARE = "hgx-h100"
DEFAULT_MODEL = "vgg16"
SWEEPS = ("batch", "bandwidth")
MAX_BATCH = limits.MAX_MICROBATCHES * limits.MAX_MICROBATCH_SIZE


def _list_arg(convert: Callable[[str], float], what: str) -> Callable[[str], list]:
    """argparse `type=` for a comma-separated list of positive numbers."""
    def check(text: str) -> list:
        out = []
        for part in (x.strip() for x in text.split(",")):
            try:
                value = convert(part)
            except ValueError:
                value = None
            if value is None or not value > 0 or value != value or value == float("inf"):
                raise argparse.ArgumentTypeError(f"expected comma-separated {what} > 0, got {part!r}")
            out.append(value)
        return out
    check.__name__ = what
    return check


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "ooc", help="out-of-core model of one device: swap-in policies, batch and "
                                            "bandwidth sweeps", description=__doc__)
    source = p.add_mutually_exclusive_group()
    add_flag(source, "model", choices=None,
             help=f"conv net or GPT/BERT preset ({', '.join(model_choices())}) or model YAML "
                  f"(default: {DEFAULT_MODEL})")
    add_flag(source, "module")
    add_flag(p, "layers")
    add_flag(p, "hardware", default=DEFAULT_HARDWARE,
             help=f"hardware preset ({', '.join(hardware_presets())}) or YAML; its first device is used "
                  "(default: %(default)s)")
    p.add_argument("--capacity", type=bytes_arg, default=None, metavar="SIZE",
                   help="device memory a plan may fill, e.g. 16GB (default: the preset's memory less its reserve)")
    p.add_argument("--batch-size", type=int_arg(1, MAX_BATCH), default=None, metavar="B",
                   help="samples per iteration (default: the first power-of-two batch past device memory)")
    add_flag(p, "microbatch_size", help="samples per microbatch, the swap unit (default: 32 images for a conv "
                                        "net, 1 sequence for a preset; a --module's example input's)")
    p.add_argument("--image-size", type=int_arg(32, limits.MAX_IMAGE_SIZE), default=DEFAULT_IMAGE_SIZE,
                   metavar="PX", help="conv nets: square image side in pixels (default: %(default)s)")
    p.add_argument("--width-div", type=int_arg(1, 1024), default=1, metavar="N",
                   help="conv nets: divide every channel count by N (default: %(default)s)")
    p.add_argument("--sweep", choices=SWEEPS, default=None,
                   help="batch: throughput against batch size; bandwidth: normalised time against host-link GB/s")
    p.add_argument("--batch-sizes", type=_list_arg(int, "integers"), default=None, metavar="B,B,...",
                   help="--sweep batch: the batch sizes (default: powers of two of the microbatch to 3x the memory)")
    p.add_argument("--bandwidths", type=_list_arg(float, "numbers"), default=None, metavar="GBPS,...",
                   help="--sweep bandwidth: host-link GB/s per direction (default: "
                        f"{','.join(f'{g:g}' for g in DEFAULT_BANDWIDTHS_GBPS)})")
    p.add_argument("--plot", type=output_path_arg(), default=None, metavar="PNG",
                   help="with --sweep: write the sweep's plot as PNG")
    add_flag(p, "json")
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    if args.plot and not args.sweep:
        raise UserError("--plot draws a sweep: give --sweep batch or --sweep bandwidth")
    if args.batch_sizes and args.sweep != "batch":
        raise UserError("--batch-sizes is for --sweep batch (one batch: --batch-size)")
    if args.bandwidths and args.sweep != "bandwidth":
        raise UserError("--bandwidths is for --sweep bandwidth")
    if args.batch_size is not None and args.sweep == "batch":
        raise UserError("--sweep batch takes --batch-sizes, not --batch-size")
    conv_flags = args.image_size != DEFAULT_IMAGE_SIZE or args.width_div != 1
    if conv_flags and (args.module or (args.model and args.model not in conv_networks())):
        raise UserError(f"--image-size and --width-div are for the conv nets ({', '.join(conv_networks())})")


def _default_batch(model: OocModel, hardware: Hardware, sources: dict[str, str]) -> int:
    """The first batch of the default sweep whose footprint passes device memory (else its
    largest)."""
    from mpress.static.studies.ooc_sweeps import default_batch_sizes, footprint_bytes

    sizes = default_batch_sizes(model, hardware)
    for batch in sizes:
        if footprint_bytes(model, hardware, batch) > hardware.usable_memory_bytes:
            sources["batch_size"] = "the first power-of-two batch past device memory"
            return batch
    sources["batch_size"] = "the largest default batch: every one fits"
    return sizes[-1]


def settings_line(model: OocModel, hardware: Hardware, sources: dict[str, str]) -> str:
    """One line: the model, the device, and each value derived rather than given."""
    from mpress.static.studies.ooc_model import host_link_gbps

    parts = [f"model {model.name} ({model.kind}, microbatch {model.microbatch_size})",
             f"hardware {hardware.name}: one {hardware.device.name}, capacity "
             f"{fmt_bytes(hardware.usable_memory_bytes)}, host link {host_link_gbps(hardware):.3g} GB/s"]
    parts += [f"{key} {value}" for key, value in sources.items()]
    return "settings: " + "; ".join(parts)


def _stalls(run: PolicyRun) -> str:
    """The tensors a policy's stalls are blamed on, most first."""
    return ", ".join(f"{t} {fmt_seconds(s)}" for t, s in run.top_stalls) or "-"


def point_table(model: OocModel, point: OocPoint) -> Table:
    t = Table(title=f"{model.name}, batch {point.batch_size} ({point.num_microbatches} x {point.microbatch_size}): "
                    f"footprint {fmt_bytes(point.footprint_bytes)} of {fmt_bytes(point.capacity_bytes)}")
    for col in ["run", "iteration", "normalised", "samples/s", "peak", "on host", "stall", "stall by technique",
                "stalls blamed on"]:
        t.add_column(col, justify="left" if col in ("run", "stall by technique", "stalls blamed on") else "right")
    t.add_row("in memory", fmt_seconds(point.in_memory_s), "1.000", f"{point.in_memory_samples_per_s:.4g}",
              fmt_bytes(point.footprint_bytes), "-", "-", "-", "-")
    for policy in POLICIES:
        r = point.runs[policy]
        t.add_row(f"{policy}" + ("" if r.fits else " [red](does not fit)[/]"), fmt_seconds(r.iteration_s),
                  f"{r.normalised:.3f}", f"{r.samples_per_s:.4g}", fmt_bytes(r.peak_bytes), fmt_bytes(r.host_bytes),
                  fmt_seconds(r.stall_s),
                  ", ".join(f"{k} {fmt_seconds(v)}" for k, v in r.stall_s_by_cost.items()) or "-", _stalls(r))
    return t


def batch_table(model: OocModel, points: list[OocPoint]) -> Table:
    from mpress.static.studies.ooc_sweeps import knee_batch

    knee = knee_batch(points)
    t = Table(title=f"{model.name}: throughput against batch size (footprint past device memory from "
                    f"{knee if knee is not None else 'none of these'})")
    for col in ["batch", "microbatches", "footprint", "in memory samples/s",
                *[f"{p} samples/s (normalised)" for p in POLICIES], "capacity: stalls blamed on"]:
        t.add_column(col, justify="left" if col.startswith("capacity:") else "right")
    for p in points:
        cells = []
        for policy in POLICIES:
            r = p.runs[policy]
            cells.append(f"{r.samples_per_s:.4g} ({r.normalised:.3f}x)" if r.fits else "[red]does not fit[/]")
        t.add_row(str(p.batch_size), str(p.num_microbatches), fmt_bytes(p.footprint_bytes),
                  f"{p.in_memory_samples_per_s:.4g}", *cells, _stalls(p.runs[POLICIES[-1]]))
    return t


def bandwidth_table(model: OocModel, rows: list[BandwidthPoint]) -> Table:
    batch = rows[0].point.batch_size
    t = Table(title=f"{model.name}, batch {batch}: iteration time / in-memory time against host-link bandwidth")
    for col in ["host link GB/s", *[f"{p} normalised" for p in POLICIES], *[f"{p} stall" for p in POLICIES]]:
        t.add_column(col, justify="right")
    for r in rows:
        runs = [r.point.runs[p] for p in POLICIES]
        t.add_row(f"{r.gbps:g}", *[f"{x.normalised:.3f}" for x in runs], *[fmt_seconds(x.stall_s) for x in runs])
    return t


def run(args: argparse.Namespace) -> int:
    from mpress.models.user_module import parse_layers
    from mpress.static.studies.ooc_model import (
        host_link_gbps,
        load_ooc_model,
        load_single_device,
    )
    from mpress.static.studies.ooc_point import evaluate_point
    from mpress.static.studies.ooc_sweeps import (
        bandwidth_sweep,
        bandwidth_sweep_json,
        batch_sweep,
        batch_sweep_json,
        default_batch_sizes,
        point_json,
        settings_json,
    )

    _check_args(args)
    console = make_console(stderr=args.json)
    hardware = load_single_device(args.hardware, args.capacity)
    sources: dict[str, str] = {}
    with TaskProgress(console, 1, "profiling") as progress:
        progress.update(f"profiling {args.module or args.model or DEFAULT_MODEL}", say=True)
        model = load_ooc_model(model=None if args.module else (args.model or DEFAULT_MODEL), module=args.module,
                               hardware=hardware, microbatch_size=args.microbatch_size, image_size=args.image_size,
                               width_div=args.width_div, layers=parse_layers(args.layers))
        progress.advance(f"profiled {model.name}: {len(model.profile.layers)} layers")
    out: dict[str, object] = {}
    if args.sweep == "batch":
        sizes = args.batch_sizes or default_batch_sizes(model, hardware)
        if not args.batch_sizes:
            sources["batch_sizes"] = f"{sizes[0]}..{sizes[-1]} (powers of two to 3x the memory)"
        console.print(settings_line(model, hardware, sources), markup=False, soft_wrap=True)
        with TaskProgress(console, len(sizes), "batch sweep") as progress:
            points = batch_sweep(model, hardware, sizes, progress=progress.advance)
        out = batch_sweep_json(points)
        if not args.json:
            console.print(batch_table(model, points))
        if args.plot:
            from mpress.static.studies.ooc_sweeps import plot_batch_sweep
            plot_batch_sweep(points, args.plot, f"{model.name} on one {hardware.device.name}")
    elif args.sweep == "bandwidth":
        batch = args.batch_size or _default_batch(model, hardware, sources)
        gbps = args.bandwidths or list(DEFAULT_BANDWIDTHS_GBPS)
        console.print(settings_line(model, hardware, sources), markup=False, soft_wrap=True)
        with TaskProgress(console, len(gbps), "bandwidth sweep") as progress:
            progress.update(f"planning batch {batch} on {host_link_gbps(hardware):.3g} GB/s", say=True)
            rows = bandwidth_sweep(model, hardware, batch, gbps, progress=progress.advance)
        out = bandwidth_sweep_json(rows)
        if not args.json:
            console.print(bandwidth_table(model, rows))
        if args.plot:
            from mpress.static.studies.ooc_sweeps import plot_bandwidth_sweep
            plot_bandwidth_sweep(rows, args.plot, f"{model.name}, batch {batch}, on one {hardware.device.name}")
    else:
        batch = args.batch_size or _default_batch(model, hardware, sources)
        console.print(settings_line(model, hardware, sources), markup=False, soft_wrap=True)
        point = evaluate_point(model, hardware, batch)
        out = point_json(point)
        if not args.json:
            console.print(point_table(model, point))
    if args.plot:
        console.print(f"plot written to {args.plot}")
    if args.json:
        print_json({"settings": {**settings_json(model, hardware), "defaults": sources}, "sweep": args.sweep,
                    **out, "plot": args.plot})
    return 0
