"""Benchmark: fused-tiled execution (SFT) against plain training and checkpoint_sequential.

VGG-16 (random init, a global-pooling head), batch 1, MSE loss, one training step
(forward, loss, backward) on square images of growing size. In one run:

1. Per image size, three contenders on the same network:
   - plain training;
   - `torch.utils.checkpoint.checkpoint_sequential` ("checkpoint_seq") over the conv
     features with the best segment count (the count with the lowest peak among 2..31,
     found by dry runs on the meta device), head untiled;
   - SFT: `TiledSequential(model, budget_bytes=BUDGET)` (the planner picks segments and
     tile counts; where plain training fits the budget it tiles nothing).
   Step time (wall, and CPU time of all threads) is the median over rounds that
   interleave the contenders (so load drift on the machine hits them alike); peak memory is measured on one more step with the same
   measure for every contender: live tensor bytes (mpress.tiling.memory.LiveBytes) on
   CPU, `torch.cuda.max_memory_allocated` on CUDA. Every contender runs at every size,
   also over the budget (the budget is a limit we report against, not one we enforce).
2. The largest square image each contender trains within the budget, by bisection on
   the side (multiples of 32): plain and checkpoint_sequential from LiveBytes dry runs on
   the meta device (the same measure, no compute), SFT from the planner's predicted peak
   (which step 1 checks against the measured one), confirmed by a meta dry run of the
   tiled step where its tile count is moderate; and the largest image SFT trains with at
   most twice plain training's estimated work (near its limit SFT tiles finely and its
   halos dominate).

Sides in `--sft-sizes` run SFT alone (plain training there would only repeat the
over-budget story, slowly): they show its time per pixel past plain training's reach.

Usage: python bench/sft.py [--sizes 192,384,576] [--sft-sizes 1024] [--device-memory 160MiB]
                           [--rounds 2] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from mpress.errors import TilingError
from mpress.tiling.execute import TiledSequential
from mpress.tiling.graph import from_sequential
from mpress.tiling.memory import LiveBytes, cuda_peak_bytes
from mpress.tiling.networks import vgg16
from mpress.tiling.planner import OutOfMemory, TilingPlan, search, step_cost
from mpress.config.units import fmt_bytes, parse_bytes

SEGMENT_COUNTS = [2, 3, 4, 6, 8, 12, 16, 31]
"""checkpoint_sequential segment counts tried (VGG-16 has 31 feature layers)."""
CONFIRM_MAX_TILES = 1024
"""Largest total tile count whose tiled step is dry-run on meta at the max size."""
MAX_WORK = 2.0
"""The second SFT row of the max-size table: plans whose estimated step work (recompute
and halos, planner.step_cost) is at most this many times plain training's."""


class Checkpointed(nn.Module):
    """checkpoint_sequential over `features`, then `head` as usual."""

    def __init__(self, model: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.model, self.segments = model, segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint_sequential(self.model.features, self.segments, x, use_reentrant=False,
                                  preserve_rng_state=False)  # VGG draws no random numbers
        return self.model.head(h)


def train_step(model: nn.Module, params: list[nn.Parameter], x: torch.Tensor, target: torch.Tensor) -> None:
    for p in params:
        p.grad = None
    F.mse_loss(model(x), target).backward()


def meta_peak(model: nn.Module, size: int) -> int:
    """Live-bytes peak of one step of `model` (on the meta device) at `size` x `size`."""
    params = list(model.parameters())
    x = torch.empty(1, 3, size, size, device="meta")
    target = torch.empty(1, 10, device="meta")
    with LiveBytes() as tracker:
        train_step(model, params, x, target)
    return tracker.peak_bytes


def best_segments(meta_net: nn.Sequential, size: int) -> tuple[int, int]:
    """(segment count, peak) of the checkpoint_sequential configuration with the lowest peak."""
    peaks = {s: meta_peak(Checkpointed(meta_net, s), size) for s in SEGMENT_COUNTS}
    s = min(peaks, key=peaks.get)
    return s, peaks[s]


def largest_size(fits: Callable[[int], bool], lo: int = 32, hi: int = 1 << 16, step: int = 32) -> int:
    """The largest multiple of `step` in [lo, hi] for which `fits` holds (fits is monotone);
    0 if not even `lo` fits."""
    if not fits(lo):
        return 0
    good, bad = lo, None
    probe = lo
    while bad is None:  # double until it fails
        probe *= 2
        if probe > hi:
            return good if not fits(hi) else hi
        if fits(probe):
            good = probe
        else:
            bad = probe
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        if mid <= good:
            break
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def describe_plan(plan: TilingPlan | None) -> str:
    if plan is None:
        return "does not fit"
    if not plan.segments:
        return "no tiling (fits)"
    g = plan.graph
    return ", ".join(f"{g.nodes[s.segment.positions[0]].name.split('.')[-1]}-"
                     f"{g.nodes[s.segment.positions[-1]].name.split('.')[-1]}:{s.num_tiles[0]}x{s.num_tiles[1]}"
                     for s in plan.segments)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=None, help="comma-separated square image sides (default: 192,384,576 on "
                                                  "cpu; 2048,4096,8192,12288,16384 on cuda)")
    ap.add_argument("--sft-sizes", default=None, help="more sides where only SFT runs, to show its time per pixel "
                                                      "beyond plain's reach (default: 1024 on cpu, none on cuda)")
    ap.add_argument("--device-memory", "--budget", default=None,
                    help="memory budget, e.g. 160MB (default: 160MiB on cpu, 16GiB on cuda)")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds (one step per contender each)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads on cpu (default: torch's)")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench/sft.py: --device cuda but no CUDA GPU is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in (args.sizes or ("2048,4096,8192,12288,16384" if cuda else "192,384,576")).split(",")]
    sft_sizes = [int(s) for s in (args.sft_sizes if args.sft_sizes is not None else ("" if cuda else "1024"))
                 .split(",") if s]
    budget = parse_bytes(args.device_memory or ("16GiB" if cuda else "160MiB"), "--device-memory")
    torch.manual_seed(0)
    net = vgg16().to(device)
    meta_net = copy.deepcopy(net).to("meta")
    params = list(net.parameters())
    console = Console(width=180)

    def measure(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> int:
        if cuda:
            return cuda_peak_bytes(lambda: train_step(model, params, x, target), device)
        with LiveBytes() as tracker:
            train_step(model, params, x, target)
        return tracker.peak_bytes

    rows = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task("steps", total=(3 * len(sizes) + len(sft_sizes)) * (args.rounds + 1))
        for size in sizes + sft_sizes:
            x = torch.randn(1, 3, size, size, device=device)
            target = torch.randn(1, 10, device=device)
            tiled = TiledSequential(net, budget_bytes=budget)
            try:
                plan: TilingPlan | None = tiled.plan(tuple(x.shape))
            except TilingError:
                plan = None
            contenders: list[tuple[str, nn.Module | None, str]] = [
                ("SFT", tiled if plan is not None else None, describe_plan(plan))]
            if size in sizes:
                segs, _ = best_segments(meta_net, size)
                contenders = [("plain", net, ""), ("checkpoint_seq", Checkpointed(net, segs), f"{segs} segments"),
                              *contenders]
            times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in contenders}
            peaks: dict[str, int | None] = {}
            for name, model, _ in contenders:
                progress.update(task, description=f"{size}px {name}: peak")
                peaks[name] = None
                if model is not None:
                    try:
                        peaks[name] = measure(model, x, target)
                    except torch.OutOfMemoryError:
                        contenders = [(n, m if n != name else None, c) for n, m, c in contenders]
                progress.advance(task)  # also the warm-up
            for _ in range(args.rounds):
                for name, model, _ in contenders:
                    progress.update(task, description=f"{size}px {name}: timing")
                    if model is not None:
                        if cuda:
                            torch.cuda.synchronize(device)
                        start, cpu = time.perf_counter(), time.process_time()
                        train_step(model, params, x, target)
                        if cuda:
                            torch.cuda.synchronize(device)
                        times[name].append((time.perf_counter() - start, time.process_time() - cpu))
                    progress.advance(task)
            for name, _, config in contenders:
                wall = statistics.median(t[0] for t in times[name]) if times[name] else None
                cpu = statistics.median(t[1] for t in times[name]) if times[name] else None
                rows.append((size, name, config, wall, cpu, peaks[name],
                             plan.prediction.peak_bytes if name == "SFT" and plan else None))

    where = "live tensor bytes" if not cuda else "torch.cuda.max_memory_allocated"
    table = Table(title=f"VGG-16 training step, batch 1, MSE loss, {device.type} "
                        f"({torch.get_num_threads()} threads), budget {fmt_bytes(budget)}; "
                        f"median of {args.rounds} rounds; peak = {where}")
    # CPU time (process time, all threads) beside wall time: on a shared machine other
    # processes stretch wall time, CPU time much less
    for col in ["image", "contender", "configuration", "wall", "vs plain", "CPU", "CPU / MPix", "vs plain",
                "peak", "vs plain", "predicted", "pred / meas", "in budget"]:
        table.add_column(col, justify="left" if col in ("contender", "configuration") else "right",
                         no_wrap=col == "configuration")
    by_size = {}
    for row in rows:
        by_size.setdefault(row[0], {})[row[1]] = row
    for size, group in by_size.items():
        plain_t, plain_c, plain_p = group["plain"][3:6] if "plain" in group else (None, None, None)
        for _, name, config, step_s, cpu_s, peak, predicted in group.values():
            mpix = size * size / 1e6
            table.add_row(
                f"{size}²", name, config,
                f"{step_s:.2f} s" if step_s else "-", f"{step_s / plain_t:.2f}x" if step_s and plain_t else "-",
                f"{cpu_s:.2f} s" if cpu_s else "-", f"{cpu_s / mpix:.1f} s" if cpu_s else "-",
                f"{cpu_s / plain_c:.2f}x" if cpu_s and plain_c else "-",
                fmt_bytes(peak) if peak else "-", f"{peak / plain_p:.2f}x" if peak and plain_p else "-",
                fmt_bytes(predicted) if predicted else "-",
                f"{predicted / peak:.3f}" if predicted and peak else "-",
                ("yes" if peak <= budget else "[red]no[/]") if peak else "-")
        table.add_section()
    console.print(table)

    # --- the largest image each contender trains within the budget -------------------------
    def sft_plan(size: int) -> TilingPlan | None:
        result = search(from_sequential(net, (1, 3, size, size)), budget)
        return None if isinstance(result, OutOfMemory) else result

    with console.status("searching the largest image per contender"):
        plain_max = largest_size(lambda s: meta_peak(meta_net, s) <= budget)
        ckpt_max = largest_size(lambda s: best_segments(meta_net, s)[1] <= budget)
        sft_max = largest_size(lambda s: sft_plan(s) is not None)
        sft_cheap = largest_size(lambda s: (p := sft_plan(s)) is not None
                                 and step_cost(p.graph, p.segments) <= MAX_WORK * step_cost(p.graph, []))
    results = [("plain", plain_max, meta_peak(meta_net, plain_max) if plain_max else None, "dry run (meta)", None),
               ("checkpoint_seq", ckpt_max, best_segments(meta_net, ckpt_max)[1] if ckpt_max else None,
                f"dry run (meta), {best_segments(meta_net, ckpt_max)[0] if ckpt_max else '-'} segments", None)]
    def sft_row(name: str, side: int) -> tuple[str, int, int | None, str, float | None]:
        plan = sft_plan(side) if side else None
        if plan is None:
            return name, side, None, "planner", None
        how, peak = "planner (predicted)", plan.prediction.peak_bytes
        if sum(s.num_tiles[0] * s.num_tiles[1] for s in plan.segments) <= CONFIRM_MAX_TILES:
            with console.status(f"dry run of the tiled step at {side}² on meta"):
                peak = meta_peak(TiledSequential(meta_net, budget_bytes=budget), side)
            how = f"dry run (meta); planner predicted {fmt_bytes(plan.prediction.peak_bytes)}"
        return name, side, peak, how, step_cost(plan.graph, plan.segments) / step_cost(plan.graph, [])

    results.append(sft_row("SFT", sft_max))
    results.append(sft_row(f"SFT, at most {MAX_WORK:g}x the work", sft_cheap))
    t2 = Table(title=f"largest square image trained within {fmt_bytes(budget)} (side multiple of 32)")
    for col in ["contender", "largest image", "MPix", "pixels vs plain", "peak there", "found by",
                "step work vs plain"]:
        t2.add_column(col, justify="left" if col in ("contender", "found by") else "right")
    for name, side, peak, how, work in results:
        t2.add_row(name, f"{side}²" if side else "none", f"{side * side / 1e6:.2f}" if side else "-",
                   f"{side * side / plain_max ** 2:.1f}x" if side and plain_max else "-",
                   fmt_bytes(peak) if peak else "-", how, f"{work:.2f}x (estimated)" if work else "1.00x")
    console.print(t2)
    for side in (sft_max, sft_cheap):
        if side:
            console.print(f"SFT plan at {side}²: {describe_plan(sft_plan(side))}")


if __name__ == "__main__":
    main()
