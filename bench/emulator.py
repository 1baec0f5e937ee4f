"""Benchmark: how fast `emulate` runs one iteration of a realistic program.

The program is built by hand with synthetic costs (no profile, no memory model): an
8-stage GPT of 48 layers (6 per stage), 32 microbatches, 1F1B order, and per layer and
microbatch 10 saved tensors: 4 host-swapped (SO after the forward, SI prefetched one
compute task before the backward's predecessor), 3 D2D-swapped (striped over two NVLink
channels), 2 dropped and recomputed (DR, RC), 1 kept. Optimizer states go out after the
step and come back before it. About 28k tasks.

Usage: python bench/emulator.py [--repeats N] [--policy capacity|layer-ahead] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from rich.console import Console
from rich.table import Table

from mpress.actions import Action, Kind
from mpress.static.emulator import EmulatorResult, emulate
from mpress.static.program import Channel, Program, Task, Transfer

NUM_STAGES = 8
NUM_MICROBATCHES = 32
LAYERS_PER_STAGE = 6
GIB = 1 << 30
MIB = 1 << 20
LAYER_FORWARD_S = 1.2e-3
TENSOR_BYTES = (6 * MIB, 4 * MIB, 3 * MIB, 2 * MIB, 5 * MIB, 3 * MIB, 2 * MIB, 4 * MIB, 2 * MIB, 8 * MIB)
"""Saved tensors of one layer for one microbatch: 0-3 host swap, 4-6 D2D, 7-8 dropped, 9 kept."""
HOST, D2D, DROPPED = range(0, 4), range(4, 7), range(7, 9)


def local_one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Synchronous 1F1B (one stage per rank): warm-up forwards, steady 1F1B, cool-down."""
    ranks = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, num_microbatches)
        acts = [Action(s, Kind.F, m) for m in range(warmup)]
        f, b = warmup, 0
        while b < num_microbatches:
            if f < num_microbatches:
                acts.append(Action(s, Kind.F, f))
                f += 1
            acts.append(Action(s, Kind.B, b))
            b += 1
        ranks.append(acts)
    return ranks


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Forwards and backwards of the project's 1F1B schedule when it exists, else the local one."""
    try:
        from mpress.static.schedules import (
            one_f_one_b as shared,  # written alongside this bench
        )
    except ImportError:
        return local_one_f_one_b(num_stages, num_microbatches)
    # the bench adds its own optimizer step with offload around it
    return [[a for a in r if a.kind in (Kind.F, Kind.B)] for r in shared(num_stages, num_microbatches).ranks]


def channels() -> dict[str, Channel]:
    chans = {}
    for g in range(NUM_STAGES // 2):  # two GPUs per PCIe switch share its up/down link
        chans[f"pcie-up:{g}"] = Channel(f"pcie-up:{g}", 12.0, 10e-6)
        chans[f"pcie-down:{g}"] = Channel(f"pcie-down:{g}", 12.0, 10e-6)
    for a in range(NUM_STAGES):
        for b in range(NUM_STAGES):
            if a != b:
                chans[f"nvlink:{a}->{b}"] = Channel(f"nvlink:{a}->{b}", 25.0, 5e-6)
    return chans


def _peers(d: int) -> tuple[int, int]:
    return (d + 4) % NUM_STAGES, (d + 5) % NUM_STAGES


def _tensor(s: int, kind: Kind, m: int | None, layer: int, i: int) -> Action:
    return Action(s, kind, m, f"layers.{layer}.t#{i}")


def forward_tasks(s: int, m: int) -> list[Task]:
    saved = LAYERS_PER_STAGE * sum(TENSOR_BYTES)
    tasks = [Task(Action(s, Kind.F, m), compute_s=LAYERS_PER_STAGE * LAYER_FORWARD_S, alloc_bytes=saved,
                  transient_bytes=64 * MIB)]
    p1, p2 = _peers(s)
    for k in range(LAYERS_PER_STAGE):
        layer = s * LAYERS_PER_STAGE + k
        for i in HOST:
            tasks.append(Task(_tensor(s, Kind.SO, m, layer, i),
                              transfers=(Transfer(f"pcie-up:{s // 2}", TENSOR_BYTES[i]),),
                              free_bytes=TENSOR_BYTES[i], technique="host-swap"))
        for i in D2D:
            half = TENSOR_BYTES[i] // 2
            tasks.append(Task(_tensor(s, Kind.DO, m, layer, i),
                              transfers=(Transfer(f"nvlink:{s}->{p1}", half), Transfer(f"nvlink:{s}->{p2}", half)),
                              free_bytes=TENSOR_BYTES[i], technique="d2d"))
        for i in DROPPED:
            tasks.append(Task(_tensor(s, Kind.DR, m, layer, i), free_bytes=TENSOR_BYTES[i], technique="recompute"))
    return tasks


def prefetch_tasks(s: int, m: int) -> list[Task]:
    tasks = []
    p1, p2 = _peers(s)
    for k in reversed(range(LAYERS_PER_STAGE)):
        layer = s * LAYERS_PER_STAGE + k
        for i in HOST:
            tasks.append(Task(_tensor(s, Kind.SI, m, layer, i),
                              transfers=(Transfer(f"pcie-down:{s // 2}", TENSOR_BYTES[i]),),
                              alloc_bytes=TENSOR_BYTES[i], technique="host-swap"))
        for i in D2D:
            half = TENSOR_BYTES[i] // 2
            tasks.append(Task(_tensor(s, Kind.DI, m, layer, i),
                              transfers=(Transfer(f"nvlink:{p1}->{s}", half), Transfer(f"nvlink:{p2}->{s}", half)),
                              alloc_bytes=TENSOR_BYTES[i], technique="d2d"))
    return tasks


def backward_tasks(s: int, m: int) -> list[Task]:
    tasks = []
    for k in reversed(range(LAYERS_PER_STAGE)):
        layer = s * LAYERS_PER_STAGE + k
        for i in DROPPED:
            tasks.append(Task(_tensor(s, Kind.RC, m, layer, i), compute_s=LAYER_FORWARD_S / 4,
                              alloc_bytes=TENSOR_BYTES[i], technique="recompute"))
    saved = LAYERS_PER_STAGE * sum(TENSOR_BYTES)
    tasks.append(Task(Action(s, Kind.B, m), compute_s=2 * LAYERS_PER_STAGE * LAYER_FORWARD_S, free_bytes=saved,
                      transient_bytes=64 * MIB))
    return tasks


def build_program(policy: str) -> Program:
    optim_bytes = GIB // 2
    ranks = []
    for s, order in enumerate(one_f_one_b(NUM_STAGES, NUM_MICROBATCHES)):
        tasks = [Task(Action(s, Kind.OI, None, "optim"), transfers=(Transfer(f"pcie-down:{s // 2}", optim_bytes),),
                      alloc_bytes=optim_bytes, technique="optimizer-offload")]
        for i, a in enumerate(order):
            nxt = order[i + 1] if i + 1 < len(order) else None
            if nxt is not None and nxt.kind is Kind.B:
                tasks.extend(prefetch_tasks(s, nxt.microbatch))  # issued before the compute ahead of B
            tasks.extend(forward_tasks(s, a.microbatch) if a.kind is Kind.F else backward_tasks(s, a.microbatch))
        tasks.append(Task(Action(s, Kind.OPT), compute_s=4e-3, transient_bytes=256 * MIB))
        tasks.append(Task(Action(s, Kind.OO, None, "optim"), transfers=(Transfer(f"pcie-up:{s // 2}", optim_bytes),),
                          free_bytes=optim_bytes, technique="optimizer-offload"))
        ranks.append(tuple(tasks))
    act_bytes = 16 * MIB
    return Program(
        ranks=tuple(ranks), rank_device=tuple(range(NUM_STAGES)),
        device_capacity_bytes=(8 * GIB,) * NUM_STAGES, static_bytes=(6 * GIB,) * NUM_STAGES,
        channels=channels(),
        sends={(s, s + 1): (Transfer(f"nvlink:{s}->{s + 1}", act_bytes),) for s in range(NUM_STAGES - 1)},
        grad_sends={(s + 1, s): (Transfer(f"nvlink:{s + 1}->{s}", act_bytes),) for s in range(NUM_STAGES - 1)},
        samples_per_iteration=4 * NUM_MICROBATCHES, model_flops_per_iteration=3.0e15,
        swap_in_policy=policy,  # type: ignore[arg-type]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policy", choices=["capacity", "layer-ahead"], default=None,
                        help="one policy only (default: both)")
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile of one run")
    args = parser.parse_args()
    console = Console(width=150)
    table = Table(title=f"emulate(): {NUM_STAGES} stages x {NUM_MICROBATCHES} microbatches, "
                        f"{NUM_STAGES * LAYERS_PER_STAGE} layers, {len(TENSOR_BYTES)} tensors/layer")
    for col in ("policy", "tasks", "mean s/run", "min s/run", "tasks/s", "iteration ms",
                "stall ms: pipeline / host / d2d", "peak GiB (max)", "fits"):
        table.add_column(col, justify="right")
    for policy in [args.policy] if args.policy else ["capacity", "layer-ahead"]:
        program = build_program(policy)
        num_tasks = sum(len(r) for r in program.ranks)
        times = []
        result: EmulatorResult | None = None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = emulate(program)
            times.append(time.perf_counter() - t0)
        assert result is not None  # repeats >= 1; a bench script, not library code
        mean = statistics.mean(times)
        table.add_row(policy, f"{num_tasks}", f"{mean:.3f}", f"{min(times):.3f}", f"{num_tasks / min(times):,.0f}",
                      f"{result.iteration_s * 1e3:.1f}",
                      " / ".join(f"{result.stall_s_by_technique.get(k, 0.0) * 1e3:.0f}"
                                 for k in ("pipeline", "host-swap", "d2d")),
                      f"{max(result.peak_bytes) / GIB:.2f}", str(result.fits))
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(emulate, program)
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    console.print(table)


if __name__ == "__main__":
    main()
