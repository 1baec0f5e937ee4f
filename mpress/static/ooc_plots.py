"""PNG plots of the out-of-core sweeps (house style of `mpress.static.plots`: an Agg
figure, no pyplot state, one unit per axis).

- `plot_batch_sweep`: throughput (samples/s) against batch size (samples, log 2 axis),
  the in-memory run dashed, one line per swap-in policy (points that do not fit left
  out), the knee (the first batch past device memory) as a vertical line.
- `plot_bandwidth_sweep`: normalised iteration time (iteration / in-memory, no unit)
  against host-link bandwidth (GB/s, log axis), one line per policy, 1 dashed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mpress.static.ooc_point import POLICIES, OocPoint
from mpress.static.ooc_sweeps import BandwidthPoint, knee_batch
from mpress.static.plots import new_figure, save

POLICY_STYLE = {POLICIES[0]: dict(color="C3", marker="s"), POLICIES[1]: dict(color="C0", marker="o")}


def plot_batch_sweep(points: Sequence[OocPoint], path: str | Path, title: str) -> Path:
    """Throughput against batch size for both policies and in memory; returns `path`."""
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
