"""`mpress tile`: plan fused-tiled execution of a reference conv network for one image size.

    mpress tile --model vgg16 --image-size 8192 --device-memory 2GB
    mpress tile --model darknet19 --image-size 1024 --device-memory 8GB --tiles 4 --detail

Prints plain training's predicted peak, then per segment its layers, the must-tile
operators it was grown from, the dimensions it tiles, the tile count, the segment
output tile and the input tile with its halo, the halo overhead and the segment's peak;
`--detail` adds every operator's tile sizes (forward iteration tile, padded input tile,
the output gradient its input gradient reads, the backward halo). Nothing is run: the
network lives on the meta device. Sizes in GB (1e9 bytes). Exit status 2 for bad input
and for the out-of-memory verdict (one line with the numbers).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.table import Table

from mpress.commands.flags import EXIT_STATUS, add_command, add_flag
from mpress.config import limits
from mpress.config.loader import int_arg
from mpress.config.units import fmt_bytes
from mpress.errors import TilingError, UserError
from mpress.static.studies.ooc_defaults import conv_networks
from mpress.ui import make_console

if TYPE_CHECKING:  # the tiling planner imports torch: `run` imports it, flag errors come without
    from mpress.tiling.planner import TilingPlan

DTYPES = ("bfloat16", "float16", "float32", "float64")
"""--dtype's choices: names of torch dtypes."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `tile` subcommand to the `mpress` parser."""
    p = add_command(subparsers, "tile", help="plan fused-tiled (SFT) execution of a conv network for a giant image",
                    description=__doc__, epilog=EXIT_STATUS)
    add_flag(p, "model", aliases=("--network",), default="vgg16", choices=conv_networks(), metavar="NETWORK",
             help=f"reference conv network ({', '.join(conv_networks())}; default: %(default)s)")
    p.add_argument("--image-size", type=int_arg(1, limits.MAX_IMAGE_SIZE), default=4096, help="square image side in pixels (default: %(default)s)")
    add_flag(p, "device_memory", aliases=("--budget",), default="2GB",
             help="memory budget, e.g. 2GB, 512MB (GB = 1e9 bytes; default: %(default)s)")
    p.add_argument("--tiles", type=int_arg(1, limits.MAX_IMAGE_SIZE), default=None,
                   help="tile every maximal tileable run this many ways per side instead of planning")
    add_flag(p, "microbatch_size", aliases=("--batch",), default=1, help="images per batch (default: %(default)s)")
    p.add_argument("--width-div", type=int_arg(1, limits.MAX_WIDTH), default=1, help="divide every channel count by this (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="(default: %(default)s)")
    p.add_argument("--detail", action="store_true", help="print every operator's tile sizes")
    p.set_defaults(func=run)


def _name(plan: TilingPlan, i: int) -> str:
    return plan.graph.nodes[i].name


def segment_table(plan: TilingPlan) -> Table:
    """One row per segment: layers, tiles, tile sizes with halo, overhead, peak."""
    t = Table(title="segments")
    for col in ["segment", "layers", "must-tile", "FT dims", "tiles", "output tile", "input tile (halo)",
                "halo overhead", "segment peak"]:
        t.add_column(col, justify="left" if col in ("segment", "FT dims") else "right")
    phases = dict(plan.prediction.phases)
    for sp in plan.segments:
        seg = sp.segment
        label = f"{_name(plan, seg.positions[0])}..{_name(plan, seg.positions[-1])}"
        first, last = sp.sizes.ops[0], sp.sizes.ops[-1]
        out_tile = f"{last.iteration[2]}x{last.iteration[3]}"
        in_tile = first.inputs[0]
        dims = "".join("NCHW"[d] for d in seg.dims if d < 4)
        peak = max(phases[f"forward segment {label}"], phases[f"backward segment {label}"])
        t.add_row(label, str(len(seg.positions)), str(len(seg.must_tile)), dims,
                  f"{sp.num_tiles[0]}x{sp.num_tiles[1]}", out_tile, f"{in_tile[2]}x{in_tile[3]}",
                  f"{100 * sp.halo_overhead:.1f}%", fmt_bytes(peak))
    return t


def detail_table(plan: TilingPlan, k: int) -> Table:
    """Every operator of segment k with its propagated tile sizes (largest tile)."""
    sp = plan.segments[k]
    t = Table(title=f"tile sizes of segment {k + 1} ({sp.num_tiles[0]}x{sp.num_tiles[1]} tiles)")
    for col in ["layer", "op", "iteration tile", "input tile", "grad-output read", "backward halo"]:
        t.add_column(col, justify="left" if col in ("layer", "op") else "right")
    for i, op in zip(sp.segment.positions, sp.sizes.ops):
        node = plan.graph.nodes[i]
        t.add_row(op.name, node.spec.kind, f"{op.iteration[2]}x{op.iteration[3]}",
                  f"{op.inputs[0][2]}x{op.inputs[0][3]}", f"{op.grad_output[2]}x{op.grad_output[3]}",
                  f"{op.backward_halo[2]}x{op.backward_halo[3]}")
    return t


def _check_tiles_taken(plan: TilingPlan, tiles: int) -> None:
    """--tiles asks for `tiles` per side of every segment; a segment whose output has fewer
    rows or columns than that can have no more (the tiler would give it fewer): refused,
    naming the largest count every segment takes."""
    short = [(sp, n) for sp in plan.segments for n, d in zip(sp.num_tiles, (2, 3))
             if d in sp.segment.tile_dims and n < tiles]
    if short:
        sp, most = min(short, key=lambda x: x[1])
        raise UserError(f"--tiles {tiles}: segment {_name(plan, sp.segment.positions[0])}.."
                        f"{_name(plan, sp.segment.positions[-1])} can be cut into {most} tiles per side at most; "
                        f"give --tiles {most} or fewer")


def run(args: argparse.Namespace) -> int:
    """Plan and print; see the module docstring."""
    import torch

    from mpress.tiling.graph import from_sequential
    from mpress.tiling.networks import NETWORKS
    from mpress.tiling.planner import plan_fixed, plan_for_budget, step_cost

    if args.image_size <= 0:
        raise UserError(f"--image-size must be > 0, got {args.image_size}")
    if args.microbatch_size <= 0 or args.width_div <= 0:
        raise UserError("--microbatch-size and --width-div must be > 0")
    if args.tiles is not None and args.tiles <= 0:
        raise UserError(f"--tiles must be > 0, got {args.tiles}")
    budget = args.device_memory
    net = NETWORKS[args.model](width_div=args.width_div)
    shape = (args.microbatch_size, 3, args.image_size, args.image_size)
    graph = from_sequential(net, shape, getattr(torch, args.dtype))
    plan = plan_fixed(graph, (args.tiles, args.tiles)) if args.tiles else plan_for_budget(graph, budget)
    if args.tiles:
        _check_tiles_taken(plan, args.tiles)
    console = make_console()
    px = args.image_size
    console.print(f"{args.model} on {args.microbatch_size} x 3 x {px} x {px} {args.dtype}, budget {fmt_bytes(budget)}: "
                  f"plain training needs {fmt_bytes(plan.plain_peak_bytes)}")
    if not plan.segments:
        console.print("fits without tiling: no segments")
        return 0
    if plan.threshold_bytes is not None:
        must = sum(1 for c in plan.classes.values() if c == "must")
        console.print(f"checkpoint threshold {fmt_bytes(plan.threshold_bytes)}: {must} must-tile operators "
                      "(output above it); segments end at the first tensors at or below it")
    console.print(segment_table(plan))
    if args.detail:
        for k in range(len(plan.segments)):
            console.print(detail_table(plan, k))
    pred = plan.prediction
    extra = step_cost(graph, plan.segments) / step_cost(graph, []) - 1
    console.print(f"predicted peak {fmt_bytes(pred.peak_bytes)} (in {pred.peak_phase}), kept after forward "
                  f"{fmt_bytes(pred.kept_bytes)}; estimated step work +{100 * extra:.0f}% over plain "
                  "(recompute and halos)")
    if args.tiles and pred.peak_bytes > budget:
        raise TilingError(f"with {args.tiles} tiles per side the predicted peak {fmt_bytes(pred.peak_bytes)} "
                          f"exceeds the budget {fmt_bytes(budget)}")
    return 0
