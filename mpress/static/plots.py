"""PNG plots of an emulated iteration (matplotlib, Agg backend, no display needed).

Figures are built with `matplotlib.figure.Figure` and an Agg canvas directly rather
than `pyplot`, so plotting leaves no global figure state behind and works headless.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mpress.static.emulator import EmulatorResult

_GIB = float(1 << 30)


def plot_memory(result: EmulatorResult, path: str | Path, title: str | None = None) -> Path:
    """Memory in use per device over the iteration (GiB against seconds), each with its
    capacity as a dashed line of the same colour; devices that run out of memory are
    marked "OOM" in the legend. Devices no rank uses are left out. Returns `path`."""
    path = Path(path)
    used_devices = sorted(set(result.rank_device))
    fig = Figure(figsize=(10, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = [f"C{i % 10}" for i in range(len(used_devices))]
    for d, color in zip(used_devices, colors):
        points = list(result.timeline[d])
        if points[-1][0] < result.iteration_s:  # hold the last value to the end of the iteration
            points.append((result.iteration_s, points[-1][1]))
        times = [t for t, _ in points]
        gib = [b / _GIB for _, b in points]
        label = f"device {d} (peak {result.peak_bytes[d] / _GIB:.2f} GiB{', OOM' if result.oom[d] else ''})"
        ax.step(times, gib, where="post", color=color, linewidth=1.2, label=label)
        ax.axhline(result.capacity_bytes[d] / _GIB, color=color, linestyle="--", linewidth=0.8, alpha=0.7)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("memory in use (GiB); dashed: capacity")
    ax.set_xlim(0.0, max(result.iteration_s, 1e-9))
    ax.set_ylim(bottom=0.0)
    ax.set_title(title or f"memory per device, iteration {result.iteration_s * 1e3:.1f} ms")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
