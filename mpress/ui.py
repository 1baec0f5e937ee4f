"""Terminal output: how wide tables may be, progress of long commands, JSON output.

On a terminal a long command shows a rich progress bar; off a terminal (a pipe, a log
file, a test's capture) the bar would show nothing at all, so `TaskProgress` prints
plain lines instead: one per finished unit of work, and news within a unit at most every
`PLAIN_EVERY_S`. `--json` output goes to stdout alone (`print_json`); the human output of
such a run (progress, notes) goes to stderr. A training rank 0 says each phase of its
start-up as it enters it (`phase_line`), so the time before step 0 is never silent.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

PIPE_WIDTH = 160
"""Columns used when output goes to a file or pipe (rich would assume 80 and squash tables)."""
PLAIN_EVERY_S = 5.0
"""Off a terminal: the least time between two lines of news within one unit of work."""


def make_console(stderr: bool = False) -> Console:
    """A rich console: the terminal's width on a TTY (or $COLUMNS), `PIPE_WIDTH` otherwise."""
    stream = sys.stderr if stderr else sys.stdout
    interactive = stream.isatty() or "COLUMNS" in os.environ
    return Console(stderr=stderr, width=None if interactive else PIPE_WIDTH, highlight=False)


def say_line(line: str, stream: Any = None) -> None:
    """Write `line` and its newline to `stream` (default stderr) in one write, flushed.
    Ranks under torchrun share one stderr, unbuffered (PYTHONUNBUFFERED, as mpress's own
    launcher sets it too): `print` writes the text and the newline in two calls, and two
    ranks' lines then run together ("...failed (SwapError)mpress.train: rank 3: ...").
    One short write to a pipe is atomic (POSIX, up to PIPE_BUF bytes)."""
    stream = stream or sys.stderr
    stream.write(line + "\n")
    stream.flush()


START_TIME_ENV = "MPRESS_START_TIME"
"""When `mpress train` started (seconds since the epoch), for its ranks' `phase_line`."""

_IMPORTED = time.time()


def phase_line(text: str, stream: Any = None) -> None:
    """The line of a training job's start-up phase before step 0 (the ranks starting,
    meeting, profiling, planning, the data, building the stages), as it is entered:
    `start-up: TEXT (h:mm:ss)`, on `stream` (default stdout: rank 0's is the launcher's) at
    once. The time is since `mpress train` started ($MPRESS_START_TIME, which it sets
    for its ranks), else since this process loaded mpress (the launcher; torchrun)."""
    try:
        start = float(os.environ.get(START_TIME_ENV, _IMPORTED))
    except ValueError:
        start = _IMPORTED
    say_line(f"start-up: {text} ({_elapsed(max(0.0, time.time() - start))})", stream or sys.stdout)


def _elapsed(seconds: float) -> str:
    minutes, sec = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{sec:02d}"


class TaskProgress:
    """Progress through `total` units of work (strategies planned, steps trained).

    On a terminal: a rich bar (transient unless `keep`), `info` beside it. Off one: no bar;
    `advance(line=...)` prints `[done/total] line (elapsed)`, and `update` prints its
    description when `PLAIN_EVERY_S` have passed since the last line (or when told to). `console.print`
    prints above the bar either way. Use as a context manager.
    """

    def __init__(self, console: Console, total: int, description: str, *, bar: bool = False,
                 keep: bool = False, completed: int = 0, enabled: bool = True) -> None:
        self.console = console
        self.total = total
        self.completed = completed
        self.description = description
        self.enabled = enabled
        self.terminal = console.is_terminal
        self._start = time.monotonic()
        self._last_line = self._start
        columns = ([TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}")]
                   if bar else [SpinnerColumn(), TextColumn("{task.description}")])
        self._rich = Progress(*columns, TimeElapsedColumn(), console=console, transient=not keep,
                              disable=not (enabled and self.terminal))
        self._task = self._rich.add_task(description, total=total, completed=completed, info="")

    def __enter__(self) -> TaskProgress:
        self._rich.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._rich.__exit__(*exc)  # type: ignore[arg-type]

    def elapsed(self) -> str:
        """Time since the start, as h:mm:ss."""
        return _elapsed(time.monotonic() - self._start)

    def _plain(self, text: str) -> None:
        self._last_line = time.monotonic()
        self.console.print(f"{text} ({self.elapsed()})", markup=False, highlight=False, soft_wrap=True)

    def update(self, description: str, *, say: bool = False) -> None:
        """News within the current unit (`planning mpress: D2D round 2`); `say`: print it
        off a terminal now (what a long unit is about to do), not only when it is due."""
        self.description = description
        self._rich.update(self._task, description=description)
        due = say or time.monotonic() - self._last_line >= PLAIN_EVERY_S
        if self.enabled and not self.terminal and due:
            self._plain(f"[{self.completed}/{self.total}] {description}")

    def advance(self, line: str | None = None, *, info: str = "") -> None:
        """One unit done; `line` says what it was (printed off a terminal), `info` goes
        beside a bar."""
        self.completed += 1
        self._rich.update(self._task, advance=1, info=info)
        if self.enabled and not self.terminal and line is not None:
            self._plain(f"[{self.completed}/{self.total}] {line}")


def _finite(obj: Any) -> Any:
    """`obj` with NaN and infinities as None (JSON has no such numbers)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def to_json(obj: Any) -> str:
    """`obj` as JSON text (NaN and infinities as null)."""
    return json.dumps(_finite(obj), indent=1, allow_nan=False)


def print_json(obj: Any) -> None:
    """`obj` as JSON on stdout (the whole of stdout of a `--json` run)."""
    sys.stdout.write(to_json(obj) + "\n")
    sys.stdout.flush()
