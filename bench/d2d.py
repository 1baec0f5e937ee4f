"""Benchmark: D2D swap (PeerStore) versus host swap (HostStore), through the swap engine.

Per tensor size and stripe count: swap-out time (`swap_out` until the copies completed,
i.e. `wait_idle`), swap-in time (`fetch` until the tensor is usable; on CUDA after a
synchronize), GB/s of each, and the round trip's speed relative to the host path measured
in the same run on the same tensor. Paths run interleaved, one repetition of each in turn
(after untimed warm-ups), so drift in the machine's load hits them alike; times are means.
Stripes are equal shares over the first k peers (the plan's weights would come from the
link bandwidths; here all links are alike). Each configuration's first round trip is also
checked bit for bit.

The job is real: `setup_peer_pools` over a gloo group of k_max + 1 processes. Rank 0 is
the exporter (it runs the timings); ranks 1..k_max are importers, each holding one peer
pool and idle until the exporter is done.

- `--device cpu`: pools are shared-memory segments of the importer processes and the host
  pool is ordinary memory, so both paths are memcpys in the exporter process: the numbers
  show the D2D path's overheads (striping, stripe table, ledger, one copy per stripe, the
  mapping of another process's memory), not link speeds.
- `--device cuda`: pools are CUDA allocations of the importers, opened by the exporter
  through CUDA IPC; the host path uses a pinned pool. With several GPUs the exporter runs
  on GPU 0 and importer r on GPU r, so stripes cross peer links (at most n-1 peers). With
  one GPU a second process is the importer on the same GPU (same-process IPC open fails),
  so only one stripe is possible and the "D2D" copy stays inside that GPU's memory.

Usage: python bench/d2d.py [--device cpu|cuda] [--sizes-mib 1,16,64] [--stripes 1,2,3]
                           [--reps 5] [--warmup 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from mpress.d2d.runtime.peer_pool import setup_peer_pools
from mpress.d2d.runtime.peer_store import PeerStore
from mpress.contract.identity import TensorKey
from mpress.contract.plan import Plan, StagePlan, Stripe, TensorRule
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import MemoryManager
from mpress.runtime.swap.engine import SwapEngine

MiB = 1 << 20
SLACK_BYTES = 1 * MiB
"""Room in each pool beyond the largest tensor (alignment of blocks)."""


def layout(device_type: str, max_stripes: int) -> tuple[list[int], list[int]]:
    """(plan device per rank, physical device index per rank); rank 0 is the exporter."""
    if device_type == "cpu":
        plan_devices = list(range(max_stripes + 1))
        return plan_devices, [0] * len(plan_devices)
    n = torch.cuda.device_count()
    if n == 1:  # the importer shares the GPU; the plan still needs two devices
        return [1, 0], [0, 0]
    plan_devices = list(range(max_stripes + 1))
    return plan_devices, plan_devices


def bench_plan(plan_devices: list[int], pool_bytes: int) -> Plan:
    """Stage r on plan_devices[r]; stage 0 stripes over every other stage's device, each of
    which reserves a pool of `pool_bytes`."""
    peers = plan_devices[1:]
    rule = TensorRule(tensor="*", technique="d2d",
                      stripes=[Stripe(device=d, fraction=1 / len(peers)) for d in peers])
    stages = [StagePlan(stage=r, device=d, first_layer=r, end_layer=r + 1, rules=[rule] if r == 0 else [],
                        peer_pool_bytes=pool_bytes if r else 0) for r, d in enumerate(plan_devices)]
    return Plan(strategy="bench", model="bench", model_fingerprint="bench", profile_fingerprint="bench",
                hardware="bench", hardware_fingerprint="bench", num_devices=max(plan_devices) + 1,
                device_memory_bytes=1 << 40, schedule="1f1b", num_stages=len(stages), num_ranks=len(stages),
                num_microbatches=1, microbatch_size=1, stage_to_device=plan_devices, stages=stages, fits=True)


def worker(rank: int, world: int, init: str, out: str, device_type: str, plan_devices: list[int],
           physical: list[int], sizes: list[int], stripe_counts: list[int], reps: int, warmup: int) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu") if device_type == "cpu" else torch.device("cuda", physical[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    plan = bench_plan(plan_devices, max(sizes) + SLACK_BYTES)
    pools = setup_peer_pools(plan, [rank], device)
    try:
        if rank == 0:
            rows = measure(pools, device, plan_devices[1:], sizes, stripe_counts, reps, warmup)
            torch.save({"rows": rows, "transport": pools.transport.name}, out)
        dist.barrier()  # importers keep their pools until the exporter is done
    finally:
        pools.close()
        dist.barrier()
        dist.destroy_process_group()


def measure(pools, device: torch.device, peers: list[int], sizes: list[int], stripe_counts: list[int],
            reps: int, warmup: int) -> list[dict]:
    """Rows of (size, path, stripes, mean out/in seconds), host and D2D interleaved."""
    manager = MemoryManager(device, rank=0)
    host_pool = PinnedHostPool(max(sizes) + SLACK_BYTES, pin_memory=device.type == "cuda")
    store = PeerStore(pools, 0, device, tuple((p, 1 / len(peers)) for p in peers), min_stripe_bytes=MiB)
    paths = [("host", None)] + [(f"d2d x{k}", tuple((p, 1 / k) for p in peers[:k])) for k in stripe_counts]
    rows = []
    with SwapEngine(host_pool, manager, device, rank=0, stage=0) as host, \
            SwapEngine(store, manager, device, rank=0, stage=0) as d2d:
        for nbytes in sizes:
            tensor = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
            times: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in paths}
            for rep in range(warmup + reps):
                for name, weights in paths:
                    engine = host if weights is None else d2d
                    key = TensorKey(rank=0, stage=0, microbatch=rep, tensor=f"{name}:{nbytes}")
                    out_s, in_s, back = round_trip(engine, key, tensor, weights)
                    if rep == 0 and not torch.equal(back, tensor):
                        raise RuntimeError(f"{name}: {nbytes} bytes came back changed")
                    if rep >= warmup:
                        times[name].append((out_s, in_s))
            for name, _ in paths:
                rows.append({"nbytes": nbytes, "path": name,
                             "out_s": statistics.fmean(t[0] for t in times[name]),
                             "in_s": statistics.fmean(t[1] for t in times[name])})
    if host_pool.in_use_bytes or any(pools.quota(0, p).in_use_bytes for p in peers):
        raise RuntimeError("a pool still holds bytes after the benchmark")
    return rows


def round_trip(engine: SwapEngine, key: TensorKey, tensor: torch.Tensor,
               weights: object) -> tuple[float, float, torch.Tensor]:
    """Swap `tensor` out and back: (out seconds, in seconds, the tensor it came back as)."""
    cuda = tensor.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(tensor.device)
    start = time.perf_counter()
    handle = engine.swap_out(key, tensor, weights=weights)
    engine.wait_idle()  # the worker waited for the out copies
    middle = time.perf_counter()
    back = engine.fetch(handle)
    if cuda:
        torch.cuda.synchronize(tensor.device)
    end = time.perf_counter()
    engine.discard(handle)
    engine.wait_idle()  # the in worker released the placement
    return middle - start, end - middle, back


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes-mib", default="1,16,64", help="tensor sizes, MiB, comma separated")
    ap.add_argument("--stripes", default="1,2,3", help="stripe counts (peers), comma separated")
    ap.add_argument("--reps", type=int, default=5, help="timed round trips per configuration")
    ap.add_argument("--warmup", type=int, default=1, help="untimed round trips first")
    args = ap.parse_args()
    sizes = [int(float(s) * MiB) for s in args.sizes_mib.split(",")]
    wanted = sorted({int(k) for k in args.stripes.split(",")})
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is present")
    if args.device == "cuda":
        n = torch.cuda.device_count()
        possible = 1 if n == 1 else n - 1
    else:
        possible = max(wanted)
    stripe_counts = [k for k in wanted if 1 <= k <= possible]
    skipped = [k for k in wanted if k not in stripe_counts]
    if not stripe_counts:
        raise SystemExit(f"none of the stripe counts {wanted} is possible here (at most {possible})")
    plan_devices, physical = layout(args.device, max(stripe_counts))
    world = len(plan_devices)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.start_processes(worker, args=(world, os.path.join(tmp, "init"), out, args.device, plan_devices, physical,
                                         sizes, stripe_counts, args.reps, args.warmup),
                           nprocs=world, join=True, start_method="spawn")
        result = torch.load(out, weights_only=False)
    where = (f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if args.device == "cuda"
             else "CPU")
    table = Table(title=f"D2D swap vs host swap on {where}: {world} processes, pools over {result['transport']}, "
                        f"mean of {args.reps} round trips")
    for col in ["size", "path", "out", "in", "out GB/s", "in GB/s", "round trip vs host"]:
        table.add_column(col, justify="left" if col in ("size", "path") else "right")
    host = {r["nbytes"]: r["out_s"] + r["in_s"] for r in result["rows"] if r["path"] == "host"}
    for r in result["rows"]:
        total = r["out_s"] + r["in_s"]
        table.add_row(f"{r['nbytes'] / MiB:g} MiB", r["path"], f"{r['out_s'] * 1e3:.2f} ms",
                      f"{r['in_s'] * 1e3:.2f} ms", f"{r['nbytes'] / r['out_s'] / 1e9:.2f}",
                      f"{r['nbytes'] / r['in_s'] / 1e9:.2f}",
                      "1" if r["path"] == "host" else f"{host[r['nbytes']] / total:.2f}x")
    console = Console(width=140)
    console.print(table)
    console.print("round trip vs host: host round-trip time / this path's (above 1: faster than host swap)")
    if skipped:
        console.print(f"skipped stripe counts {skipped}: at most {possible} peer(s) here")
    largest = max(r["nbytes"] for r in result["rows"])
    rates = ", ".join(f"{r['path']} {2 * largest / (r['out_s'] + r['in_s']) / 1e9:.2f}"
                      for r in result["rows"] if r["nbytes"] == largest)
    console.print(f"summary: round-trip GB/s at {largest / MiB:g} MiB on {where}: {rates}")


if __name__ == "__main__":
    main()
