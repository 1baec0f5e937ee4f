"""PNG plots of an emulated iteration and of `mpress maxsize` (matplotlib, Agg backend,
no display needed).

Sizes are in GB (1e9 bytes), the unit of every table (`mpress.config.units.fmt_bytes`), so a
figure read beside a table agrees with it. Figures are built with
`matplotlib.figure.Figure` and an Agg canvas directly rather than `pyplot`, so plotting
leaves no global figure state behind and works headless.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mpress.static.emulate.emulator import EmulatorResult
from mpress.static.studies.maxsize import MaxSize
from mpress.static.emulate.breakdown import CATEGORIES

GB = 1e9
"""The plots' unit of size: GB, as `fmt_bytes` prints in the tables."""
CATEGORY_COLORS = dict(zip(CATEGORIES, ("C0", "C1", "C2", "C3", "C7")))


def new_figure(width: float, height: float) -> Figure:
    """A figure on an Agg canvas (no pyplot state)."""
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: str | Path) -> Path:
    """Write `fig` as PNG to `path` (its folder made); returns the path."""
    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def plot_memory(result: EmulatorResult, path: str | Path, title: str | None = None,
                breakdown: Sequence[dict[str, int]] | None = None) -> Path:
    """Memory in use per device over the iteration (GB against seconds), each with its
    capacity as a dashed line of the same colour; devices that run out of memory are
    marked "OOM" in the legend. With `breakdown` (per device, bytes by category at its
    peak: `memory_breakdown.peak_breakdown`), a second panel stacks each device's peak
    by category against its capacity. Devices no rank uses are left out. Returns `path`."""
    used_devices = sorted(set(result.rank_device))
    fig = new_figure(10, 9 if breakdown is not None else 5.5)
    ax = fig.add_subplot(2 if breakdown is not None else 1, 1, 1)
    colors = [f"C{i % 10}" for i in range(len(used_devices))]
    for d, color in zip(used_devices, colors):
        points = list(result.timeline[d])
        if points[-1][0] < result.iteration_s:  # hold the last value to the end of the iteration
            points.append((result.iteration_s, points[-1][1]))
        times = [t for t, _ in points]
        gb = [b / GB for _, b in points]
        label = f"device {d} (peak {result.peak_bytes[d] / GB:.3g} GB{', OOM' if result.oom[d] else ''})"
        ax.step(times, gb, where="post", color=color, linewidth=1.2, label=label)
        ax.axhline(result.capacity_bytes[d] / GB, color=color, linestyle="--", linewidth=0.8, alpha=0.7)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("memory in use (GB); dashed: capacity")
    ax.set_xlim(0.0, max(result.iteration_s, 1e-9))
    ax.set_ylim(bottom=0.0)
    ax.set_title(title or f"memory per device, iteration {result.iteration_s * 1e3:.1f} ms")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    if breakdown is not None:
        _plot_breakdown(fig.add_subplot(2, 1, 2), result, breakdown, used_devices)
    return save(fig, path)


def _plot_breakdown(ax, result: EmulatorResult, breakdown: Sequence[dict[str, int]], devices: list[int]) -> None:
    xs = list(range(len(devices)))
    bottom = [0.0] * len(devices)
    for cat in CATEGORIES:
        heights = [breakdown[d][cat] / GB for d in devices]
        ax.bar(xs, heights, bottom=bottom, color=CATEGORY_COLORS[cat], label=cat, width=0.7)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, d in zip(xs, devices):
        ax.hlines(result.capacity_bytes[d] / GB, x - 0.4, x + 0.4, colors="black", linestyles="--", linewidth=1)
    ax.set_xticks(xs, [f"device {d}" for d in devices])
    ax.set_ylabel("memory at the device's peak (GB); dashed: capacity")
    ax.set_title("peak memory by category")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")


def maxsize_bars(rows: Sequence[MaxSize]) -> list[tuple[str, float, str]]:
    """The bars of `plot_maxsize`: (strategy, billions of parameters, label) per row."""
    return [(str(r.strategy), r.num_parameters / 1e9 if r.model is not None else 0.0,
             r.model.name if r.model is not None else "nothing fits") for r in rows]


def plot_maxsize(rows: Sequence[MaxSize], path: str | Path, title: str) -> Path:
    """`mpress maxsize` as bars: per strategy, the parameters (billions) of the largest
    model it fits, labelled with the model's name ("nothing fits": an empty bar)."""
    fig = new_figure(8, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    bars_data = maxsize_bars(rows)
    xs = list(range(len(bars_data)))
    heights = [h for _s, h, _l in bars_data]
    bars = ax.bar(xs, heights, color=[f"C{i % 10}" for i in xs], width=0.6)
    for bar, (_s, _h, label) in zip(bars, bars_data):
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize="small", xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(xs, [s for s, _h, _l in bars_data])
    ax.set_ylabel("parameters of the largest model that fits (billions)")
    ax.set_ylim(0, max(heights + [1e-9]) * 1.15)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    return save(fig, path)
