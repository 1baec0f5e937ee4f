"""`mpress report RUN_DIR`: plot a training run's metrics and print its figures.

Reads RUN_DIR/metrics.jsonl (what `mpress train` writes per logged step,
`mpress/launcher/metrics_log.py`), draws the training loss, the validation loss (where an
evaluation happened) and the learning rate against the step as one PNG (loss on the left
axis, learning rate on a twin right axis: each axis one unit), and prints the first, last
and smallest value of each figure the file holds. A missing, empty or malformed metrics
file is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from rich.table import Table

from mpress.commands.flags import EXIT_STATUS, HelpFormatter
from mpress.errors import UserError
from mpress.launcher.metrics_log import METRICS_FILE, read_metrics
from mpress.ui import make_console

PLOT_FILE = "metrics.png"
"""The plot's default name, in the run directory."""

FIGURES = [
    # (field, column label, format)
    ("loss", "loss", "{:.4f}"),
    ("val_loss", "val loss", "{:.4f}"),
    ("lr", "learning rate", "{:.3g}"),
    ("grad_norm", "grad norm", "{:.3g}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("samples_per_s", "samples/s", "{:,.1f}"),
    ("mfu", "MFU", "{:.2%}"),
]
"""The figures the table shows, where the file has them."""

EPILOG = """\
examples:
    mpress train --config gpt-tiny-mixed --steps 80 --run-dir run
    mpress report run                      # writes run/metrics.png, prints the table
    mpress report run/metrics.jsonl --out loss.png

""" + EXIT_STATUS


def register(subparsers: Any) -> None:
    """Add the `report` subcommand to the `mpress` parser."""
    parser = subparsers.add_parser(
        "report", help="plot a run's loss, validation loss and learning rate; print first/last/min",
        description="Plot a training run's metrics.jsonl (loss, validation loss, learning rate against the step) "
                    "as one PNG and print the first, last and smallest value of each figure.",
        epilog=EPILOG, formatter_class=HelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help=f"the run directory of `mpress train` (its {METRICS_FILE}), or a metrics file")
    parser.add_argument("--out", default=None, metavar="PNG",
                        help=f"where the plot goes (default RUN_DIR/{PLOT_FILE})")
    parser.set_defaults(func=run)


def load_run(path: Path) -> tuple[Path, list[dict[str, Any]]]:
    """The metrics file of `path` (a run directory or the file itself) and its records;
    a one-line `UserError` when it is missing, empty or malformed."""
    file = path / METRICS_FILE if path.is_dir() else path
    if not file.is_file():
        where = f"{path} has no {METRICS_FILE}" if path.is_dir() else f"no such run directory or file {path}"
        raise UserError(f"{where} (mpress train writes it to its --run-dir)")
    try:
        records = read_metrics(file)
    except ValueError as exc:
        raise UserError(f"{file}: {exc}: not a metrics file of mpress train") from None
    except OSError as exc:
        raise UserError(f"{file}: cannot read it: {exc.strerror}") from None
    if not records:
        raise UserError(f"{file}: holds no step yet")
    for number, r in enumerate(records, 1):
        if not _is_number(r.get("loss")) and r.get("loss") is not None:
            raise UserError(f"{file}: step {r['step']} (line {number}): loss is not a number")
    return file, records


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """The steps at which `key` is a finite number, and its values there."""
    steps, values = [], []
    for r in records:
        if _is_number(r.get(key)):
            steps.append(int(r["step"]))
            values.append(float(r[key]))
    return steps, values


def summary_rows(records: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(figure, first, last, min) for each of `FIGURES` the records hold, formatted;
    first and last name their step."""
    rows = []
    for key, label, fmt in FIGURES:
        steps, values = series(records, key)
        if not values:
            continue
        low = min(range(len(values)), key=values.__getitem__)
        rows.append((label, *(f"{fmt.format(values[i])} (step {steps[i]})" for i in (0, -1, low))))
    return rows


def plot(records: list[dict[str, Any]], out: Path, *, title: str) -> None:
    """Loss and validation loss (left axis) and learning rate (right axis) against the
    step, as a PNG at `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    lines = []
    for key, label, style in (("loss", "training loss", dict(color="tab:blue", lw=1.6)),
                              ("val_loss", "validation loss", dict(color="tab:orange", lw=1.6, marker="o", ms=4))):
        steps, values = series(records, key)
        if values:
            lines += ax.plot(steps, values, label=label, marker=style.pop("marker", "." if len(values) < 30 else None),
                             **style)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylabel("loss (nats)")
    ax.grid(alpha=0.3)
    steps, lrs = series(records, "lr")
    if lrs:
        lr_ax = ax.twinx()
        lines += lr_ax.plot(steps, lrs, color="tab:green", lw=1.2, ls="--", label="learning rate")
        lr_ax.set_ylabel("learning rate")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        lr_ax.set_ylim(bottom=0, top=max(lrs) * 1.1 if max(lrs) > 0 else 1)
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right", frameon=True)
    ax.set_title(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Plot and print; see the module docstring for the exit status."""
    path = Path(args.run_dir)
    file, records = load_run(path)
    out = Path(args.out) if args.out else file.parent / PLOT_FILE
    try:
        plot(records, out, title=f"{file.parent.name}: {len(records)} logged steps")
    except OSError as exc:
        raise UserError(f"--out: cannot write {out}: {exc.strerror}") from None
    table = Table(title=f"{file} ({len(records)} logged steps, {records[0]['step']}..{records[-1]['step']})")
    for column in ("figure", "first", "last", "min"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for row in summary_rows(records):
        table.add_row(*row)
    console = make_console()
    console.print(table)
    console.print(f"plot written to {out}")
    return 0
