"""Benchmark: mpress host swap against `save_on_cpu(pin_memory=True)`, and the PCIe copy peak.

One process, one device, one GPT stage (`build_stage` of a model preset), forward and
backward of one microbatch per step. Variants, each on its own copy of the stage (same
seed, so the same parameters; routers install hooks and must not share a module):

1. plain: every saved tensor stays on the device;
2. `torch.autograd.graph.save_on_cpu(pin_memory=True)` around the forward: every tensor
   autograd saves (parameters included) is copied into a freshly allocated pinned host
   tensor and back in backward, on the compute stream, so the copies queue behind and in
   front of the kernels instead of running beside them;
3. mpress host swap of the same activations: a `StagePlan` with the rule `* -> host` and
   the one-microbatch program a plan's list would give the stage (`RankProgram`): `0F0`
   with the swap-out (SO) of each layer's unit inside it, the swap-ins (SI) of those
   units (last layer first: the backward needs it first), then `0B0`. The stage runs as
   `MpressStage` runs it: `program.begin` / `end` around the forward (inside
   `SavedTensorRouter.microbatch(0)`) and around the backward, SIs issued by
   `router.prefetch_unit` when the backward begins, the copy-outs' device storage given
   up there (the engine holds it until that release point), `finish(0)` after the
   backward. The swap engine copies on its own out/in streams into one pinned pool
   allocated at start-up. `--prefetch` says where the backward begins, i.e. where the
   SIs are issued: `after-forward` (before the loss), `before-backward` (after it), or
   `on-demand` (a list without SIs: each tensor is fetched when backward unpacks it);
4. mpress recompute of the same layers: the program drops (DR) each layer's unit inside
   the forward and recomputes (RC) it inside the backward (for context: no copies, one
   extra forward).
Every mpress step checks that the program executed exactly its list.

With one microbatch, `after-forward` and `before-backward` differ only by the loss, and
both bring every swapped tensor back before backward has used any; the SIs are issued
before the release point that gives up the swapped-out storages, so for a moment both
are live and the step's peak is above plain's (as the memory model counts such a list);
`on-demand` is the one whose peak, like save_on_cpu's, stays below plain's in backward.

The variants are built in `bench/host_swap_variants.py`. They run in interleaved rounds,
one step each per round, so drift in the machine's load hits them alike; step times are
medians. Every step starts from the same RNG seed and the same inputs, and every
variant's parameter (and input) gradients are compared with plain's by `torch.equal`
after every step: a variant that computes something else is reported, not timed
silently.

Memory: the peak above what was live when the step started (parameters, gradients,
inputs). On CUDA `torch.cuda.max_memory_allocated`, on every timed step. On CPU every
byte on the stand-in device as the runtime counts a CPU rank (`mpress.contract.live_bytes.
LiveBytes`; the pinned pool is host memory), on one more step per variant after the
timed rounds (untimed: its dispatch hook would slow the timed steps); save_on_cpu is not
measured on CPU, where its host copies cannot be told from device bytes. Bytes moved per
step: mpress from the engine's counters, save_on_cpu from the census (it also copies the
stage's input and the parameters ops save, which mpress never moves).

Copy bandwidth, measured in the same run: a `--copy-mib` D2H copy into pinned memory
and H2D back, timed with CUDA events, best of `--copy-reps` (CPU: a host memcpy). The
mpress row reports bytes / copy time on the side streams (the engine's `copy_s`) and
the effective rate bytes / (step - plain step); "vs peak" is the time the measured peak
would need for the same bytes in each direction over the time taken.

On CPU there are no streams: the engine copies on worker threads next to the one compute
thread the benchmark allows itself, and save_on_cpu's unpack returns the host tensor
without a copy, so nothing overlaps as on a GPU and the run only checks the plumbing.

Usage: python bench/host_swap.py [--device auto|cpu|cuda] [--model NAME] [--layers FIRST:END]
           [--microbatch-size N] [--seq-len N] [--rounds N] [--warmup N]
           [--prefetch after-forward|before-backward|on-demand] [--copy-mib N] [--copy-reps N]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import replace

import torch
from rich.console import Console
from rich.table import Table

from mpress.errors import UserError
from mpress.config.model_config import ModelConfig, load_model_config
from mpress.models import build_stage
from mpress.models.transformer import check_layer_range

# bench/host_swap_variants.py, beside this script (its directory is on sys.path when run)
from host_swap_variants import Batch, Variant, build_variants, make_batch, take_census  # isort: skip

MiB = 1 << 20


# ---- measurement ------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grads(v: Variant, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {name: p.grad.detach().clone() for name, p in v.stage.named_parameters()}
    if x.grad is not None:
        out["<input>"] = x.grad.detach().clone()
    return out


def run_step(v: Variant, batch: Batch, device: torch.device, seed: int,
             measure: bool) -> tuple[float, int | None, torch.Tensor]:
    """One step: (seconds, peak bytes above the step's start or None, the input leaf).
    Outstanding copies belong to the step: it ends when the device and the swap engine
    are idle. `measure`: count the step's memory (CPU: under the variant's LiveBytes)."""
    for p in v.stage.parameters():
        if p.grad is not None:
            p.grad.zero_()  # kept allocated, so the memory baseline holds them
    torch.manual_seed(seed)  # the same dropout masks in every variant and step
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    live = v.live if measure else None
    if live is not None:
        live.reset_peak()
        base = live.live_bytes
    start = time.perf_counter()
    with live.watch() if live is not None else contextlib.nullcontext():
        x = v.step(v, batch)
    sync(device)
    if v.engine is not None:
        v.engine.wait_idle()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base if measure else None
    else:
        peak = live.peak_bytes - base if live is not None else None
    return elapsed, peak, x


def compare(v: Variant, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    for name, g in ref.items():
        other = got.get(name)
        if other is None or not torch.equal(other, g):
            v.grads_equal = False
            if other is not None:
                v.max_diff = max(v.max_diff, (other.float() - g.float()).abs().max().item())


def copy_peak(device: torch.device, nbytes: int, reps: int) -> tuple[float, float]:
    """Best (D2H, H2D) GB/s of one `nbytes` copy between the device and pinned memory
    (CPU: between two host buffers, both directions)."""
    if device.type != "cuda":
        a, b = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        best = []
        for src, dst in ((a, b), (b, a)):
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - t0)
            best.append(nbytes / min(times[1:]) / 1e9)
        return best[0], best[1]
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    result = []
    for dst, src in ((host, dev), (dev, host)):
        times = []
        for _ in range(reps + 1):  # the first copy is a warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        result.append(nbytes / min(times[1:]) / 1e9)
    return result[0], result[1]


# ---- main -------------------------------------------------------------------------------

def parse_layers(text: str | None, cfg: ModelConfig) -> tuple[int, int]:
    if text is None:  # up to four blocks, no embedding or head
        return 1, min(cfg.num_layers, 4) + 1
    try:
        first, end = (int(s) for s in text.split(":"))
    except ValueError:
        raise UserError(f"--layers {text!r}: expected FIRST:END (layer indices, 0 = embed, 1.. = blocks)") from None
    check_layer_range(cfg, first, end)
    return first, end


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "not measured"
    return f"{n / MiB:.2f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--model", help="model preset or YAML (default: gpt-small on CUDA, gpt-tiny on CPU)")
    ap.add_argument("--layers", help="FIRST:END layer range [FIRST, END) (0 = embed, 1..L = blocks, "
                                     "L+1 = head; default: up to 4 blocks from 1)")
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, help="override the preset's sequence length")
    ap.add_argument("--rounds", type=int, default=20, help="timed steps per variant, one per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--prefetch", choices=["after-forward", "before-backward", "on-demand"],
                    default="after-forward", help="when mpress issues the swap-in of the microbatch")
    ap.add_argument("--copy-mib", type=float, default=256, help="size of the peak-copy measurement, MiB")
    ap.add_argument("--copy-reps", type=int, default=5, help="copies per direction (best is kept)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU is present")
    if min(args.microbatch_size, args.rounds, args.copy_reps) < 1 or args.warmup < 0 or args.copy_mib <= 0:
        ap.error("--microbatch-size, --rounds and --copy-reps must be >= 1, --warmup >= 0, --copy-mib > 0")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        cfg = load_model_config(args.model or ("gpt-small" if device.type == "cuda" else "gpt-tiny"))
        if args.seq_len is not None:
            cfg = replace(cfg, seq_len=args.seq_len)
        first, end = parse_layers(args.layers, cfg)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if device.type == "cpu":
        # One compute thread, so the swap engine's worker threads have a core of their own
        # (a stand-in for copy engines) and a loaded machine disturbs the timings less.
        torch.set_num_threads(1)
    console = Console(width=150)

    d2h_gbps, h2d_gbps = copy_peak(device, int(args.copy_mib * MiB), args.copy_reps)
    batch = make_batch(cfg, first, end, args.microbatch_size, device, args.seed)
    census_stage = build_stage(cfg, first, end, seed=args.seed, device=device)
    torch.manual_seed(args.seed)
    census = take_census(census_stage, batch)
    del census_stage
    variants = build_variants(cfg, first, end, device, args.seed, args.prefetch, census, batch)
    plain = variants[0]
    ref: dict[str, torch.Tensor] = {}
    timed_end = args.warmup + args.rounds
    # CPU: one more, untimed round measures memory (LiveBytes' dispatch hook costs time)
    num_rounds = timed_end + (device.type == "cpu")
    try:
        for rnd in range(num_rounds):
            for v in variants:
                if v.engine is not None and rnd in (args.warmup, timed_end):
                    if rnd == args.warmup:
                        v.stats_start = v.engine.stats
                    else:
                        v.stats_end = v.engine.stats
                timed = args.warmup <= rnd < timed_end
                step_s, peak, x = run_step(v, batch, device, args.seed,
                                           measure=timed if device.type == "cuda" else rnd == timed_end)
                got = grads(v, x)
                if not ref:
                    ref = got  # plain's first step: the reference for everyone
                compare(v, got, ref)
                if timed:
                    v.times_s.append(step_s)
                if peak is not None:
                    v.peaks_bytes.append(peak)
        for v in variants:
            if v.engine is not None and v.stats_end is None:
                v.stats_end = v.engine.stats
    finally:
        for v in variants:
            v.close()

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    med = {v.name: statistics.median(v.times_s) for v in variants}
    plain_s, soc = med[plain.name], variants[1]
    host = variants[2]
    out_bytes = (host.stats_end.bytes_out - host.stats_start.bytes_out) / args.rounds
    in_bytes = (host.stats_end.bytes_in - host.stats_start.bytes_in) / args.rounds
    copy_s = (host.stats_end.copy_s - host.stats_start.copy_s) / args.rounds
    wait_s = (host.stats_end.wait_s - host.stats_start.wait_s) / args.rounds
    soc_bytes = census.activation_bytes + census.input_bytes + census.parameter_bytes

    mem_col = "peak allocated above step start" if device.type == "cuda" else "peak live bytes above step start"
    table = Table(title=f"host swap on {where}: {cfg.name} layers [{first}, {end}), microbatch "
                        f"{args.microbatch_size} x {cfg.seq_len}, {cfg.precision}, median of {args.rounds} steps")
    for col in ["variant", "step time", "vs plain", "vs save_on_cpu", mem_col, "moved out / step",
                "moved in / step", "fetch wait / step", "grads = plain"]:
        table.add_column(col, justify="left" if col == "variant" else "right")
    moved = {plain.name: (0, 0), soc.name: (soc_bytes, soc_bytes), host.name: (out_bytes, in_bytes),
             variants[3].name: (0, 0)}
    for v in variants:
        peak = max(v.peaks_bytes) if v.peaks_bytes else None
        step_s = med[v.name]
        table.add_row(v.name, f"{step_s * 1e3:.2f} ms", f"{step_s / plain_s:.3f}x", f"{step_s / med[soc.name]:.3f}x",
                      fmt_bytes(peak), fmt_bytes(moved[v.name][0]), fmt_bytes(moved[v.name][1]),
                      f"{wait_s * 1e3:.2f} ms" if v is host else "",
                      "✓" if v.grads_equal else f"✗ (max |diff| {v.max_diff:.3g})")
    console.print(table)
    console.print(f"saved per forward: {census.num_activations} activation tensors, "
                  f"{fmt_bytes(census.activation_bytes)} "
                  f"(distinct storages {fmt_bytes(census.activation_storage_bytes)}); "
                  f"save_on_cpu also copies the stage's input ({fmt_bytes(census.input_bytes)} as saved) and "
                  f"{fmt_bytes(census.parameter_bytes)} of parameters ops save, which stay on "
                  f"the device anyway. mpress moved the census's activations each way: "
                  f"{'✓' if out_bytes == in_bytes == census.activation_bytes else '✗'}")

    ratio = med[host.name] / med[soc.name]
    met = "met" if ratio < 1 else "not met"
    console.print(f"target (mpress host swap faster than save_on_cpu at equal memory saved): {met} on {where} "
                  f"(mpress / save_on_cpu = {ratio:.3f}x)")
    if device.type != "cuda":
        console.print("CPU: no CUDA streams, so nothing overlaps: the swap engine copies on worker threads "
                      "that share the cores with the compute, and save_on_cpu's unpack is a no-op; this run "
                      "checks the plumbing, the target applies to a GPU. One compute thread; memory is "
                      "counted by LiveBytes on one untimed step per variant")

    def peak_s(nbytes_out: float, nbytes_in: float) -> float:
        return nbytes_out / (d2h_gbps * 1e9) + nbytes_in / (h2d_gbps * 1e9)

    def rate_row(name: str, nbytes_out: float, nbytes_in: float, seconds: float) -> list[str]:
        if seconds <= 0:
            return [name, "hidden (step <= plain)", ""]
        return [name, f"{(nbytes_out + nbytes_in) / seconds / 1e9:.2f}",
                f"{peak_s(nbytes_out, nbytes_in) / seconds:.2f}"]

    kind = "PCIe, pinned" if device.type == "cuda" else "host memcpy, no PCIe"
    bw = Table(title=f"copy bandwidth on {where} ({kind}): peak of a {args.copy_mib:g} MiB copy, "
                     f"best of {args.copy_reps}")
    for col in ["what", "GB/s", "vs peak"]:
        bw.add_column(col, justify="left" if col == "what" else "right")
    bw.add_row("peak D2H (device -> pinned host)" if device.type == "cuda" else "peak memcpy a -> b",
               f"{d2h_gbps:.2f}", "1")
    bw.add_row("peak H2D (pinned host -> device)" if device.type == "cuda" else "peak memcpy b -> a",
               f"{h2d_gbps:.2f}", "1")
    bw.add_row(*rate_row("mpress: bytes / copy time on its streams", out_bytes, in_bytes, copy_s))
    bw.add_row(*rate_row("mpress: effective, bytes / (step - plain)", out_bytes, in_bytes,
                         med[host.name] - plain_s))
    bw.add_row(*rate_row("save_on_cpu: effective, bytes / (step - plain)", soc_bytes, soc_bytes,
                         med[soc.name] - plain_s))
    console.print(bw)
    console.print("vs peak: time the peak copies would need for the same bytes each way / time taken "
                  "(1 = at peak); effective rates charge every extra second of the step to the copies")


if __name__ == "__main__":
    main()
