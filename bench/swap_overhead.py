"""Benchmark: host time per swapped tensor, the cost a swap adds on the CPU side.

At GPT-20.4B scale (~19 saved tensors per layer x 63 layers x 16 microbatches per
iteration) every microsecond of host work per swapped tensor is ~19 ms per iteration on
threads that compete with the training thread for the GIL. This script measures that
work in one run, as CPU time of the whole process (every thread: `time.process_time`):

1. **step**: one GPT stage, forward + backward of one microbatch per step, plain and
   with mpress host swap of every activation (`bench/host_swap_variants.py`: the router
   and program wired as the runtime wires them). Host cost per swapped tensor =
   (CPU time of the mpress step - plain step - the copies' own time) / tensors swapped,
   where the copies' time is the bytes moved at this machine's memcpy rate measured in
   the same run (on a GPU the copy engines move the bytes, not a CPU thread); the
   difference is taken per round (the two steps run back to back), then its median;
2. **engine**: the same number of tiny tensors through the swap engine alone, once as
   one swap per tensor (how the router swapped before tensors were grouped per unit) and
   once as one group per layer's worth of tensors (how it swaps now), out and back.

Tiny tensors by default (`--model gpt-tiny`), so the copies are a small part of the
time and what is left is bookkeeping, hooks, queues and thread hand-offs. Start-up
objects are frozen out of the cyclic collector first (`gc.freeze()`), as `mpress.train`
does: without it, full collections rescanning torch's objects, triggered by the objects
each step makes, cost this benchmark's steps more than the swaps themselves. Timings are
medians of interleaved rounds. The target of the GPU-path issue: under 50 us per tensor.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_swap_variants import build_variants, make_batch, take_census  # noqa: E402

from mpress.errors import UserError  # noqa: E402
from mpress.contract.identity import TensorKey  # noqa: E402
from mpress.config.model_config import load_model_config  # noqa: E402
from mpress.models import build_stage  # noqa: E402
from mpress.runtime.memory.host_pool import PinnedHostPool  # noqa: E402
from mpress.runtime.memory.manager import MemoryManager  # noqa: E402
from mpress.runtime.swap.engine import SwapEngine  # noqa: E402

TARGET_US = 50.0
"""The issue's bound on host time per swapped tensor."""


def cpu_time(fn) -> float:
    """Process CPU time (all threads) of `fn()`, in s."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def memcpy_s_per_byte(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """This machine's host memcpy time per byte (best of `reps`)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    best = min(cpu_time(lambda: dst.copy_(src)) or 1e-9 for _ in range(reps))
    return best / nbytes


def engine_round(engine: SwapEngine, tensors: list[torch.Tensor], group: int, rnd: int) -> None:
    """Swap `tensors` out and back: one swap per tensor (`group` 1) or per `group` tensors."""
    chunks = [tensors[i:i + group] for i in range(0, len(tensors), group)]
    handles = [engine.swap_out_group(TensorKey(rank=0, stage=0, microbatch=rnd, tensor=f"g{i}"),
                                     [(f"t{j}", t) for j, t in enumerate(chunk)])
               for i, chunk in enumerate(chunks)]
    engine.wait_outs()
    for handle in reversed(handles):
        engine.prefetch(handle)
    back = [engine.fetch_group(h) for h in handles]
    del back, handles
    engine.wait_idle()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny", help="model preset (default: gpt-tiny)")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks in the stage (from block 1)")
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: copies run on the GPU's copy engines, so none of their time is subtracted")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU is present")
    if min(args.layers, args.microbatch_size, args.rounds) < 1 or args.warmup < 0:
        ap.error("--layers, --microbatch-size and --rounds must be >= 1, --warmup >= 0")
    try:
        cfg = load_model_config(args.model)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    first, end = 1, min(1 + args.layers, cfg.num_layers + 1)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    torch.set_num_threads(1)  # the swap workers get the other core, as copy engines would
    console = Console(width=130)

    # host time of the copies themselves: a CPU thread's memcpy on CPU, none on a GPU
    per_byte_s = memcpy_s_per_byte() if device.type == "cpu" else 0.0
    batch = make_batch(cfg, first, end, args.microbatch_size, device, args.seed)
    census = take_census(build_stage(cfg, first, end, seed=args.seed, device=device), batch)
    plain, _soc, host, _rc = build_variants(cfg, first, end, device, args.seed, "after-forward", census, batch)
    for v in (plain, host):
        v.live = None  # its dispatch hook would be timed too

    def step(v) -> None:
        x = v.step(v, batch)
        del x
        for p in v.stage.parameters():
            p.grad = None

    num_tensors = census.num_activations
    tensors = [torch.randn(max(1, census.activation_bytes // max(1, num_tensors) // 4), device=device)
               for _ in range(num_tensors)]
    per_layer = max(1, round(num_tensors / (end - first)))
    pool = PinnedHostPool(sum(t.numel() * 4 for t in tensors) + 2 * num_tensors * 512)
    engine = SwapEngine(pool, MemoryManager(device, rank=0), device, rank=0, stage=0, hold_until_release=True)
    times: dict[str, list[float]] = {"plain": [], "host": [], "single": [], "grouped": []}
    gc.freeze()  # as `mpress.train` does before its first step: start-up objects are not rescanned
    swapped: list[int] = []
    try:
        for rnd in range(args.warmup + args.rounds):
            before = host.router.tensors_swapped
            cost = {}
            for name, run in (("plain", lambda: step(plain)), ("host", lambda: step(host)),
                              ("single", lambda: engine_round(engine, tensors, 1, rnd)),
                              ("grouped", lambda: engine_round(engine, tensors, per_layer, rnd))):
                cost[name] = cpu_time(run)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # untimed: a host spin here is not the swap's
            if rnd >= args.warmup:
                swapped.append(host.router.tensors_swapped - before)
                for name, seconds in cost.items():
                    times[name].append(seconds)
        moved = (host.engine.stats.bytes_out + host.engine.stats.bytes_in) / (args.warmup + args.rounds)
    finally:
        for v in (plain, host):
            v.close()
        engine.close()
        pool.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    n_step = statistics.median(swapped)
    copy_s = moved * per_byte_s
    engine_copy_s = 2 * sum(t.numel() * 4 for t in tensors) * per_byte_s
    # per round, so drift in the machine's speed between rounds cancels
    extra_s = statistics.median(h - p for h, p in zip(times["host"], times["plain"]))
    rows = [
        ("stage step, mpress host swap (grouped per unit)", n_step, (extra_s - copy_s) / n_step),
        ("engine alone, one swap per tensor (ungrouped)", num_tensors,
         (med["single"] - engine_copy_s) / num_tensors),
        (f"engine alone, one swap per {per_layer} tensors (grouped)", num_tensors,
         (med["grouped"] - engine_copy_s) / num_tensors),
    ]
    table = Table(title=f"host CPU time per swapped tensor on {device.type}: {cfg.name} blocks [{first}, {end}), "
                        f"microbatch {args.microbatch_size}, median of {args.rounds} rounds")
    for col in ("path", "tensors per step", "us per tensor", f"vs {TARGET_US:g} us target"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for name, n, seconds in rows:
        table.add_row(name, f"{n:g}", f"{seconds * 1e6:.1f}", f"{seconds * 1e6 / TARGET_US:.2f}x")
    console.print(table)
    console.print(f"plain step {med['plain'] * 1e3:.2f} ms CPU, mpress host-swap step {med['host'] * 1e3:.2f} ms CPU; "
                  f"copies {moved / 1e6:.2f} MB per step at {1 / per_byte_s / 1e9:.1f} GB/s memcpy = "
                  f"{copy_s * 1e3:.2f} ms, subtracted; {census.activation_bytes / max(1, num_tensors):.0f} B per "
                  f"tensor on average")
    console.print(f"grouping: {med['single'] / med['grouped']:.1f}x less host time than one swap per tensor")
    console.print(f"summary: {rows[0][2] * 1e6:.1f} us host CPU per swapped tensor in a {device.type} stage step "
                  f"(target {TARGET_US:g} us), {rows[2][2] * 1e6:.1f} us in the engine alone")


if __name__ == "__main__":
    main()
