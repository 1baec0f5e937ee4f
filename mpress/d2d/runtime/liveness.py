"""Liveness of the job's processes, robust to pid reuse (Linux procfs), and a rank's
lifeline to its launcher (`die_with_parent`)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass

from mpress.ui import say_line

RUN_ID_ENV = "MPRESS_RUN_ID"
"""The run id `mpress train` gives its ranks (and its rank starter, so that a forked
rank's process environment carries it too); shared-memory segment names start with it
(`transport.run_prefix`)."""
LAUNCHER_PID_ENV = "MPRESS_LAUNCHER_PID"
"""The pid of the process that started this rank: the `mpress train` launcher, or the
rank starter it forks ranks from (`mpress/launcher/rank_starter.py`)."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class ProcessId:
    """A process, robust to pid reuse: pid plus start time (Linux clock ticks)."""

    pid: int
    start_ticks: int

    @staticmethod
    def current() -> ProcessId:
        return ProcessId.of(os.getpid())

    @staticmethod
    def of(pid: int) -> ProcessId:
        """Process `pid` as it is now (a launcher's child, before it is reaped)."""
        return ProcessId(pid, _start_ticks(pid) or 0)

    def alive(self) -> bool:
        """False when the process exited (also when it is a zombie or the pid was reused)."""
        try:
            with open(f"/proc/{self.pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            return False
        except OSError:  # no procfs: ask the kernel about the pid only
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
            return True
        state, start = fields[0], int(fields[19])
        return state not in ("Z", "X") and (self.start_ticks == 0 or start == self.start_ticks)


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def die_with_parent() -> None:
    """Have the kernel kill this process (SIGKILL) when its parent dies, so that no rank
    outlives a launcher killed with -9 (`mpress train`, or torchrun's agent).

    Race-free under `mpress train`: the parent's pid is in $MPRESS_LAUNCHER_PID, and if the
    parent died before the request took effect (this process was already re-parented),
    the process ends now with status 1. Under another launcher the parent at this call is
    the one watched. No-op where prctl does not exist (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    expected = os.environ.get(LAUNCHER_PID_ENV)
    if expected and expected.isdigit() and os.getppid() != int(expected):
        say_line(f"mpress.train: the launcher (pid {expected}) is gone; not starting")
        os._exit(1)
