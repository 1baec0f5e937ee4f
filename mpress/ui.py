"""Terminal output: one place that decides how wide tables may be."""

from __future__ import annotations

import os
import sys

from rich.console import Console

PIPE_WIDTH = 160
"""Columns used when output goes to a file or pipe (rich would assume 80 and squash tables)."""


def make_console(stderr: bool = False) -> Console:
    """A rich console: the terminal's width on a TTY (or $COLUMNS), `PIPE_WIDTH` otherwise."""
    stream = sys.stderr if stderr else sys.stdout
    interactive = stream.isatty() or "COLUMNS" in os.environ
    return Console(stderr=stderr, width=None if interactive else PIPE_WIDTH, highlight=False)
