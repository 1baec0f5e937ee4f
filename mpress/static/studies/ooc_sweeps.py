"""The out-of-core model's two sweeps on one device, and their figures as plain data.

- **Batch-size sweep** (`batch_sweep`): each batch size is one `OocPoint` (both swap-in
  policies planned and emulated). Throughput (samples/s) against batch size: while the
  batch's footprint fits, both policies are the in-memory run; past the knee (the first
  batch whose footprint exceeds device memory) host swaps cost what the copies fail to
  hide, and the two policies differ in when they bring tensors back.
- **Bandwidth sweep** (`bandwidth_sweep`): one batch, planned once on the preset's host
  link (what each policy swaps depends on memory, not on bandwidth), then emulated with
  the host link at each bandwidth: normalised iteration time (iteration / in-memory)
  against host-link bandwidth. A faster link only shortens copies, so the time falls
  towards the in-memory time as the bandwidth grows (to within the copies' latencies).

Plots (`plot_batch_sweep`, `plot_bandwidth_sweep`): throughput (samples/s) against batch
size (log 2 axis) with the in-memory run dashed and the knee as a vertical line; normalised
time (no unit) against host-link GB/s (log axis) with 1 dashed. Points that do not fit are
left out.

Default sizes: batches are powers of two times the microbatch up to past
`DEFAULT_OVER` x the capacity (`default_batch_sizes`, from the footprint's growth per
microbatch); bandwidths from PCIe 3 class to NVLink-C2C class (`DEFAULT_BANDWIDTHS_GBPS`).

Units: bytes, seconds, GB/s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpress.errors import UserError
from mpress.hardware.server import Hardware
from mpress.static.plan.evaluate import evaluate
from mpress.static.studies.ooc_model import (
    OocModel,
    host_link_gbps,
    ooc_setup,
    with_host_link,
)
from mpress.static.studies.ooc_point import (
    POLICIES,
    OocPoint,
    PolicyRun,
    evaluate_point,
    reemulate,
)

"""Effective host-link GB/s per direction: PCIe 3 x4 up to NVLink-C2C (Grace Hopper, 450 GB/s
per direction)."""
DEFAULT_OVER = 3.0
"""The default batch sweep goes until the footprint is this many times the capacity."""
MAX_POINTS = 12
"""The most batch sizes the default sweep takes."""

Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class BandwidthPoint:
    """One host-link bandwidth of a bandwidth sweep."""

    gbps: float
    point: OocPoint


def footprint_bytes(model: OocModel, hardware: Hardware, batch_size: int) -> int:
    """The in-memory emulated peak of a batch (no plan)."""
    return evaluate(ooc_setup(model, hardware, batch_size)).result.peak_bytes[0]


def default_batch_sizes(model: OocModel, hardware: Hardware) -> list[int]:
    """Powers of two times the microbatch, from one microbatch until the footprint passes
    `DEFAULT_OVER` x the usable memory (at most `MAX_POINTS`): the footprint is
    linear in the microbatch count (each adds its activations), read off one and two."""
    b = model.microbatch_size
    one, two = footprint_bytes(model, hardware, b), footprint_bytes(model, hardware, 2 * b)
    per_microbatch = max(two - one, 1)
    target = DEFAULT_OVER * hardware.usable_memory_bytes
    last = max(2, math.ceil((target - one) / per_microbatch) + 1)  # microbatches at the target
    count = min(MAX_POINTS, math.ceil(math.log2(last)) + 1)
    return [b * 2 ** k for k in range(count)]


def batch_sweep(model: OocModel, hardware: Hardware, batch_sizes: Sequence[int],
                progress: Progress | None = None) -> list[OocPoint]:
    """One `OocPoint` per batch size, in the order given."""
    note = progress or (lambda _m: None)
    points = []
    for batch in batch_sizes:
        point = evaluate_point(model, hardware, batch)
        points.append(point)
        note(f"batch {batch}: footprint {point.footprint_bytes / 1e9:.3g} GB, " + ", ".join(
            f"{p} {r.normalised:.3f}x" for p, r in point.runs.items()))
    return points


def knee_batch(points: Sequence[OocPoint]) -> int | None:
    """The smallest batch whose footprint exceeds the device's memory (None: all fit)."""
    return next((p.batch_size for p in sorted(points, key=lambda p: p.batch_size) if p.over_capacity), None)


def bandwidth_sweep(model: OocModel, hardware: Hardware, batch_size: int, bandwidths_gbps: Sequence[float],
                    progress: Progress | None = None) -> list[BandwidthPoint]:
    """The batch planned on `hardware`'s host link, emulated at each bandwidth (GB/s)."""
    note = progress or (lambda _m: None)
    if not bandwidths_gbps or any(not g > 0 for g in bandwidths_gbps):
        raise UserError(f"bandwidths must be > 0 GB/s, got {', '.join(map(str, bandwidths_gbps)) or 'none'}")
    planned = evaluate_point(model, hardware, batch_size)
    out = []
    for gbps in sorted(bandwidths_gbps):
        point = reemulate(planned, model, with_host_link(hardware, gbps))
        out.append(BandwidthPoint(gbps=gbps, point=point))
        note(f"{gbps:g} GB/s: " + ", ".join(f"{p} {r.normalised:.3f}x" for p, r in point.runs.items()))
    return out


# -- plain data (--json) ---------------------------------------------------------------------------
def run_json(run: PolicyRun) -> dict[str, object]:
    """A policy's figures (bytes as integers, seconds)."""
    return {"policy": str(run.policy), "fits": run.fits, "swapped": run.swapped, "iteration_s": run.iteration_s,
            "normalised_time": run.normalised, "samples_per_s": run.samples_per_s if run.fits else None,
            "peak_bytes": run.peak_bytes, "host_bytes": run.host_bytes, "stall_s": run.stall_s,
            "stall_s_by_technique": dict(run.stall_s_by_cost),
            "top_stalls": [{"tensor": t, "stall_s": s} for t, s in run.top_stalls]}


def point_json(point: OocPoint) -> dict[str, object]:
    """A batch's figures: its in-memory iteration and each policy's."""
    return {"batch_size": point.batch_size, "microbatch_size": point.microbatch_size,
            "num_microbatches": point.num_microbatches, "capacity_bytes": point.capacity_bytes,
            "footprint_bytes": point.footprint_bytes, "over_capacity": point.over_capacity,
            "in_memory_s": point.in_memory_s, "in_memory_samples_per_s": point.in_memory_samples_per_s,
            "policies": {str(p): run_json(r) for p, r in point.runs.items()}}


def settings_json(model: OocModel, hardware: Hardware) -> dict[str, object]:
    """What every ooc report is about."""
    return {"model": model.name, "model_kind": model.kind, "hardware": hardware.name,
            "capacity_bytes": hardware.usable_memory_bytes, "host_link_gbps": host_link_gbps(hardware),
            "microbatch_size": model.microbatch_size, "policies": [str(p) for p in POLICIES]}


def batch_sweep_json(points: Sequence[OocPoint]) -> dict[str, object]:
    return {"knee_batch_size": knee_batch(points), "points": [point_json(p) for p in points]}


def bandwidth_sweep_json(rows: Sequence[BandwidthPoint]) -> dict[str, object]:
    return {"batch_size": rows[0].point.batch_size if rows else None,
            "points": [{"host_link_gbps": r.gbps, **point_json(r.point)} for r in rows]}


# -- plots (house style of `mpress.static.studies.plots`: an Agg figure, one unit per axis) -----------------
POLICY_STYLE = {POLICIES[0]: dict(color="C3", marker="s"), POLICIES[1]: dict(color="C0", marker="o")}


def plot_batch_sweep(points: Sequence[OocPoint], path: str | Path, title: str) -> Path:
    """Throughput against batch size for both policies and in memory; returns `path`."""
    from mpress.static.studies.plots import new_figure, save

    points = sorted(points, key=lambda p: p.batch_size)
    fig = new_figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    batches = [p.batch_size for p in points]
    ax.plot(batches, [p.in_memory_samples_per_s for p in points], color="0.4", linestyle="--", linewidth=1.2,
            label="in memory (infinite capacity)")
    for policy in POLICIES:
        xs = [p.batch_size for p in points if p.runs[policy].fits]
        ys = [p.runs[policy].samples_per_s for p in points if p.runs[policy].fits]
        ax.plot(xs, ys, linewidth=1.6, label=f"{policy} swap-in", **POLICY_STYLE[policy])  # type: ignore[arg-type]
    knee = knee_batch(points)
    if knee is not None:
        ax.axvline(knee, color="0.2", linestyle=":", linewidth=1.0, label=f"footprint > device memory from {knee}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (samples)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_ylim(0.0, 1.1 * max(p.in_memory_samples_per_s for p in points))
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize="small")
    return save(fig, path)


def plot_bandwidth_sweep(rows: Sequence[BandwidthPoint], path: str | Path, title: str) -> Path:
    """Normalised iteration time against host-link bandwidth for both policies."""
    from mpress.static.studies.plots import new_figure, save

    fig = new_figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    xs = [r.gbps for r in rows]
    for policy in POLICIES:
        ax.plot(xs, [r.point.runs[policy].normalised for r in rows], linewidth=1.6, label=f"{policy} swap-in",
                **POLICY_STYLE[policy])  # type: ignore[arg-type]
    ax.axhline(1.0, color="0.4", linestyle="--", linewidth=1.0, label="in memory")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{g:g}" for g in xs])
    ax.set_xlabel("host-link bandwidth per direction (GB/s)")
    ax.set_ylabel("iteration time / in-memory iteration time")
    ax.set_ylim(bottom=0.0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    return save(fig, path)
