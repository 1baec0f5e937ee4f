"""Benchmark: mpress host swap against `save_on_cpu(pin_memory=True)`, and the PCIe copy peak.

One process, one device, one GPT stage (`build_stage` of a model preset), forward and
backward of one microbatch per step. Variants, each on its own copy of the stage (same
seed, so the same parameters; routers install hooks and must not share a module):

1. plain: every saved tensor stays on the device;
2. `torch.autograd.graph.save_on_cpu(pin_memory=True)` around the forward: every tensor
   autograd saves (parameters included) is copied into a freshly allocated pinned host
   tensor and back in backward, on the compute stream, so the copies queue behind and in
   front of the kernels instead of running beside them;
3. mpress host swap of the same activations: a `StagePlan` with the rule `* -> host`,
   driven through `SavedTensorRouter.microbatch(0)` around the forward; the swap engine
   copies on its own out/in streams into one pinned pool allocated at start-up; the
   swap-in is issued with `--prefetch`: `after-forward` (as the stage runtime does when
   its budget has room), `before-backward`, or `on-demand` (no prefetch: each tensor is
   fetched when backward unpacks it); `finish(0)` after backward;
4. mpress recompute of the same layers (for context: no copies, one extra forward).

With one microbatch, `after-forward` and `before-backward` differ only by the loss, and
both bring every swapped tensor back before backward has used any (the router prefetches
a whole microbatch, in the order the forward saved it), so the step's peak is plain's;
`on-demand` is the one whose peak, like save_on_cpu's, stays below plain's in backward.

Variants run in interleaved rounds, one step each per round, so drift in the machine's
load hits them alike; step times are medians. Every step starts from the same RNG seed
and the same inputs, and every variant's parameter (and input) gradients are compared
with plain's by `torch.equal` after every step: a variant that computes something else
is reported, not timed silently.

Memory: on CUDA the peak of `torch.cuda.max_memory_allocated` above what was allocated
when the step started (parameters, gradients, inputs); on CPU the memory manager's
tracked peak of saved tensors on the device (plain: the saved storages a census pass
counts; save_on_cpu: not tracked). Bytes moved per step: mpress from the engine's
counters, save_on_cpu from the census (it also copies the parameters ops save).

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
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from rich.console import Console
from rich.table import Table

from mpress.errors import UserError
from mpress.model_config import ModelConfig, load_model_config
from mpress.models import build_stage, lm_loss
from mpress.models.transformer import TORCH_DTYPES, check_layer_range
from mpress.plan import StagePlan, TensorRule
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import MemoryManager
from mpress.runtime.router import SavedTensorRouter
from mpress.runtime.swap.engine import SwapEngine, SwapStats
from mpress.units import ALIGNMENT_BYTES

MiB = 1 << 20
POOL_SLACK = 1.25
"""Pinned pool over the census's activation bytes (alignment, blocks of a step still
held when the next one starts)."""


@dataclass(kw_only=True)
class Batch:
    """One microbatch, the same for every variant and step."""

    x: torch.Tensor
    """(B, T) int64 ids for a stage with the embedding, else (B, T, h) hidden states."""
    targets: torch.Tensor | None
    """(B, T) int64 next tokens when the stage ends with the head."""
    upstream: torch.Tensor | None
    """(B, T, h) gradient of the stage's output when it has no head (as the next stage
    would send it)."""

    def leaf(self) -> torch.Tensor:
        """A fresh input for one step (hidden states require grad, as a received
        activation does in a pipeline)."""
        return self.x.detach().requires_grad_() if self.x.is_floating_point() else self.x

    def loss(self, out: torch.Tensor) -> torch.Tensor:
        if self.targets is not None:
            return lm_loss(out, self.targets)
        return (out.float() * self.upstream).sum()


@dataclass(kw_only=True)
class Census:
    """What autograd saves in one forward of the stage (counted by hooks that keep all)."""

    num_activations: int
    activation_bytes: int
    """Per saved tensor, parameters excluded: what a per-tensor swap moves each way."""
    activation_storage_bytes: int
    """Distinct storages of those: what keeping them holds on the device."""
    parameter_bytes: int
    """Saved tensors sharing a parameter's storage (save_on_cpu copies these too)."""


@dataclass(kw_only=True)
class Variant:
    """One way of running the step, on its own copy of the stage."""

    name: str
    stage: torch.nn.Module
    step: Callable[[Variant, Batch], torch.Tensor]
    """Forward + backward of one microbatch; returns the input leaf (for its grad)."""
    router: SavedTensorRouter | None = None
    engine: SwapEngine | None = None
    manager: MemoryManager | None = None
    times_s: list[float] = field(default_factory=list)
    peaks_bytes: list[int] = field(default_factory=list)
    max_diff: float = 0.0
    """Largest |gradient - plain's| over every checked step (0: all equal)."""
    grads_equal: bool = True
    stats_start: SwapStats | None = None
    stats_end: SwapStats | None = None

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
        if self.engine is not None:
            self.engine.close()
            self.engine.store.close()


# ---- steps ------------------------------------------------------------------------------

def step_plain(v: Variant, batch: Batch) -> torch.Tensor:
    x = batch.leaf()
    batch.loss(v.stage(x)).backward()
    return x


def step_save_on_cpu(v: Variant, batch: Batch) -> torch.Tensor:
    x = batch.leaf()
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        out = v.stage(x)
    batch.loss(out).backward()
    return x


def step_mpress(prefetch: str) -> Callable[[Variant, Batch], torch.Tensor]:
    """The router's forward/backward with the swap-in issued at `prefetch`."""
    def step(v: Variant, batch: Batch) -> torch.Tensor:
        x = batch.leaf()
        with v.router.microbatch(0):
            out = v.stage(x)
        if prefetch == "after-forward":
            v.router.prefetch(0)
        loss = batch.loss(out)
        if prefetch == "before-backward":
            v.router.prefetch(0)
        loss.backward()  # on-demand: each unpack fetches its own tensor
        v.router.finish(0)
        return x
    return step


# ---- set-up -----------------------------------------------------------------------------

def make_batch(cfg: ModelConfig, first_layer: int, end_layer: int, microbatch_size: int,
               device: torch.device, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed + 1)
    b, t, h = microbatch_size, cfg.seq_len, cfg.hidden_size
    dtype = TORCH_DTYPES[cfg.precision]
    if first_layer == 0:
        x = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    else:
        x = torch.randn(b, t, h, generator=g).to(dtype)  # (B, T, h)
    has_head = end_layer == cfg.num_layers + 2
    targets = torch.randint(0, cfg.vocab_size, (b, t), generator=g).to(device) if has_head else None
    upstream = None if has_head else (torch.randn(b, t, h, generator=g) / (b * t)).to(device)  # (B, T, h)
    return Batch(x=x.to(device), targets=targets, upstream=upstream)


def take_census(stage: torch.nn.Module, batch: Batch) -> Census:
    """Count what one forward saves (parameters apart), keeping everything."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    storages: dict[int, int] = {}
    counts = {"n": 0, "act": 0, "param": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        ptr = t.untyped_storage().data_ptr()
        if ptr in params:
            counts["param"] += nbytes
        else:
            counts["n"] += 1
            counts["act"] += nbytes
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(batch.leaf())
    del out
    return Census(num_activations=counts["n"], activation_bytes=counts["act"],
                  activation_storage_bytes=sum(storages.values()), parameter_bytes=counts["param"])


def stage_plan(first_layer: int, end_layer: int, rules: list[TensorRule], pinned_bytes: int = 0) -> StagePlan:
    return StagePlan(stage=0, device=0, first_layer=first_layer, end_layer=end_layer, rules=rules,
                     pinned_host_bytes=pinned_bytes)


def build_variants(cfg: ModelConfig, first_layer: int, end_layer: int, device: torch.device, seed: int,
                   prefetch: str, census: Census, batch: Batch) -> list[Variant]:
    def stage() -> torch.nn.Module:
        return build_stage(cfg, first_layer, end_layer, seed=seed, device=device)

    plain = Variant(name="plain (keep all)", stage=stage(), step=step_plain)
    soc = Variant(name="save_on_cpu(pin_memory=True)", stage=stage(), step=step_save_on_cpu)

    host_stage = stage()
    pool_bytes = int(census.activation_bytes * POOL_SLACK)
    # one alignment unit per tensor for block rounding; pinned when CUDA is there
    pool = PinnedHostPool(pool_bytes + census.num_activations * ALIGNMENT_BYTES)
    host_manager = MemoryManager(device, rank=0)
    engine = SwapEngine(pool, host_manager, device, rank=0, stage=0)
    host_plan = stage_plan(first_layer, end_layer, [TensorRule(tensor="*", technique="host")], pool_bytes)
    host = Variant(name=f"mpress host swap ({prefetch})", stage=host_stage, step=step_mpress(prefetch),
                   router=SavedTensorRouter(host_stage, host_plan, engine, rank=0, example_args=(batch.x,),
                                            manager=host_manager),
                   engine=engine, manager=host_manager)

    rc_stage = stage()
    rc_rules = [TensorRule(tensor=f"{name}.**", technique="recompute") for name in rc_stage.layer_names()]
    rc_manager = MemoryManager(device, rank=0)
    recompute = Variant(name="mpress recompute", stage=rc_stage, step=step_mpress("none"),
                        router=SavedTensorRouter(rc_stage, stage_plan(first_layer, end_layer, rc_rules), None,
                                                 rank=0, example_args=(batch.x,), manager=rc_manager),
                        manager=rc_manager)
    return [plain, soc, host, recompute]


# ---- measurement ------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grads(v: Variant, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {name: p.grad.detach().clone() for name, p in v.stage.named_parameters()}
    if x.grad is not None:
        out["<input>"] = x.grad.detach().clone()
    return out


def run_step(v: Variant, batch: Batch, device: torch.device, seed: int) -> tuple[float, int | None, torch.Tensor]:
    """One timed step: (seconds, peak bytes or None, the input leaf). Outstanding copies
    belong to the step: it ends when the device and the swap engine are idle."""
    for p in v.stage.parameters():
        if p.grad is not None:
            p.grad.zero_()  # kept allocated, so the memory baseline holds them
    torch.manual_seed(seed)  # the same dropout masks in every variant and step
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    if v.manager is not None:
        v.manager.reset_peaks()
    start = time.perf_counter()
    x = v.step(v, batch)
    sync(device)
    if v.engine is not None:
        v.engine.wait_idle()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = v.manager.peak_device_bytes() if v.manager is not None else None
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
        return "not tracked"
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
    try:
        for rnd in range(args.warmup + args.rounds):
            for v in variants:
                if rnd == args.warmup and v.engine is not None:
                    v.stats_start = v.engine.stats
                step_s, peak, x = run_step(v, batch, device, args.seed)
                got = grads(v, x)
                if not ref:
                    ref = got  # plain's first step: the reference for everyone
                compare(v, got, ref)
                if rnd >= args.warmup:
                    v.times_s.append(step_s)
                    if peak is not None:
                        v.peaks_bytes.append(peak)
        for v in variants:
            if v.engine is not None:
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
    soc_bytes = census.activation_bytes + census.parameter_bytes

    mem_col = "peak allocated above step start" if device.type == "cuda" else "saved-tensor peak (tracked)"
    table = Table(title=f"host swap on {where}: {cfg.name} layers [{first}, {end}), microbatch "
                        f"{args.microbatch_size} x {cfg.seq_len}, {cfg.precision}, median of {args.rounds} steps")
    for col in ["variant", "step time", "vs plain", "vs save_on_cpu", mem_col, "moved out / step",
                "moved in / step", "fetch wait / step", "grads = plain"]:
        table.add_column(col, justify="left" if col == "variant" else "right")
    moved = {plain.name: (0, 0), soc.name: (soc_bytes, soc_bytes), host.name: (out_bytes, in_bytes),
             variants[3].name: (0, 0)}
    for v in variants:
        if v.peaks_bytes:
            peak = max(v.peaks_bytes)
        elif v is plain:
            peak = census.activation_storage_bytes  # CPU: what keeping them all holds
        else:
            peak = None
        step_s = med[v.name]
        table.add_row(v.name, f"{step_s * 1e3:.2f} ms", f"{step_s / plain_s:.3f}x", f"{step_s / med[soc.name]:.3f}x",
                      fmt_bytes(peak), fmt_bytes(moved[v.name][0]), fmt_bytes(moved[v.name][1]),
                      f"{wait_s * 1e3:.2f} ms" if v is host else "",
                      "✓" if v.grads_equal else f"✗ (max |diff| {v.max_diff:.3g})")
    console.print(table)
    console.print(f"saved per forward: {census.num_activations} activation tensors, "
                  f"{fmt_bytes(census.activation_bytes)} "
                  f"(distinct storages {fmt_bytes(census.activation_storage_bytes)}); "
                  f"save_on_cpu also copies {fmt_bytes(census.parameter_bytes)} of parameters ops save, which stay on "
                  f"the device anyway. mpress moved the census's activations each way: "
                  f"{'✓' if out_bytes == in_bytes == census.activation_bytes else '✗'}")

    ratio = med[host.name] / med[soc.name]
    met = "met" if ratio < 1 else "not met"
    console.print(f"target (mpress host swap faster than save_on_cpu at equal memory saved): {met} on {where} "
                  f"(mpress / save_on_cpu = {ratio:.3f}x)")
    if device.type != "cuda":
        console.print("CPU: no CUDA streams, so nothing overlaps: the swap engine copies on worker threads "
                      "that share the cores with the compute, and save_on_cpu's unpack is a no-op; this run "
                      "checks the plumbing, the target applies to a GPU. One compute thread; plain's "
                      "memory figure is the census's distinct saved storages")

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
