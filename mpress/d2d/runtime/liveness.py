"""Liveness of the job's processes, robust to pid reuse (Linux procfs)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessId:
    """A process, robust to pid reuse: pid plus start time (Linux clock ticks)."""

    pid: int
    start_ticks: int

    @staticmethod
    def current() -> ProcessId:
        return ProcessId(os.getpid(), _start_ticks(os.getpid()) or 0)

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
