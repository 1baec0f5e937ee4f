"""The Chrome / Perfetto trace event format, shared by the emulator's trace of a
predicted iteration (`mpress.static.trace`) and the run's trace of an executed one
(`mpress.launcher.run_trace`), so the two have the same tracks and read side by side in
ui.perfetto.dev: one process per rank ("rank r (device d)") whose first thread is the
compute stream and whose other threads are the copy channels it used; one process per
device ("device d memory") with a counter of the bytes in use next to the capacity.
Times are microseconds, as the format requires.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mpress.config import write_text_atomic

US_PER_S = 1e6
COMPUTE_TID = 0
"""The compute stream's thread in a rank's process."""


def meta(name: str, pid: int, tid: int | None, value: str | int, key: str = "name") -> dict[str, Any]:
    """A metadata event (process/thread names and sort order)."""
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": {key: value}}
    if tid is not None:
        event["tid"] = tid
    return event


def complete(name: str, cat: str, pid: int, tid: int, start_s: float, end_s: float) -> dict[str, Any]:
    """Something that ran from `start_s` to `end_s` (seconds)."""
    ts = start_s * US_PER_S
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": end_s * US_PER_S - ts}


def instant(name: str, cat: str, pid: int, tid: int, at_s: float) -> dict[str, Any]:
    """Something that takes no time (a drop, an issued action)."""
    return {"name": name, "cat": cat, "ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": at_s * US_PER_S}


def rank_process(rank: int, device: int) -> list[dict[str, Any]]:
    """The metadata of rank `rank`'s process and its compute thread."""
    return [meta("process_name", rank, None, f"rank {rank} (device {device})"),
            meta("process_sort_index", rank, None, rank, key="sort_index"),
            meta("thread_name", rank, COMPUTE_TID, "compute")]


def memory_counter(pid: int, device: int, points: list[tuple[float, int]], capacity_bytes: int) -> list[dict[str, Any]]:
    """Device `device`'s bytes in use over time, as process `pid`."""
    events = [meta("process_name", pid, None, f"device {device} memory"),
              meta("process_sort_index", pid, None, pid, key="sort_index")]
    for t, used in points:
        events.append({"name": "memory", "ph": "C", "pid": pid, "ts": t * US_PER_S,
                       "args": {"used_bytes": used, "capacity_bytes": capacity_bytes}})
    return events


class ChannelThreads:
    """Thread ids of one rank's copy channels, named the first time each is used."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.tids: dict[str, int] = {}

    def tid(self, channel: str, events: list[dict[str, Any]]) -> int:
        if channel not in self.tids:
            self.tids[channel] = len(self.tids) + 1
            events.append(meta("thread_name", self.pid, self.tids[channel], channel))
        return self.tids[channel]


def write_trace_doc(path: str | Path, events: list[dict[str, Any]], other: dict[str, Any]) -> Path:
    """Write a trace document (atomically); returns the path."""
    path = Path(path)
    doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    write_text_atomic(path, json.dumps(doc, separators=(",", ":")))
    return path
