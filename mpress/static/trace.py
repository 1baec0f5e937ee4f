"""Chrome / Perfetto trace of an emulated iteration (open in ui.perfetto.dev or
chrome://tracing).

Layout: one process per rank ("rank r (device d)") whose threads are the compute stream
and each copy channel the rank's copies and sends used; one process per device
("device d memory") holding a counter of the bytes in use next to the capacity.
Tasks are complete events (ph "X"); drops, which take no time, are instant events
(ph "i"); a copy striped over several channels appears once on each of them. Times are
microseconds, as the format requires.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mpress.config import write_text_atomic
from mpress.static.emulator import EmulatorResult

_US_PER_S = 1e6
_COMPUTE_TID = 0


def trace_events(result: EmulatorResult) -> list[dict[str, Any]]:
    """The trace events of `result`, in the Chrome trace event format."""
    events: list[dict[str, Any]] = []
    num_ranks = len(result.spans)
    for r, spans in enumerate(result.spans):
        events.append(_meta("process_name", r, None, f"rank {r} (device {result.rank_device[r]})"))
        events.append(_meta("process_sort_index", r, None, r, key="sort_index"))
        events.append(_meta("thread_name", r, _COMPUTE_TID, "compute"))
        tids: dict[str, int] = {}
        for span in spans:
            ts = span.start_s * _US_PER_S
            if span.lane == "compute":
                events.append(_complete(span.action, "compute", r, _COMPUTE_TID, ts, span.end_s * _US_PER_S - ts))
                continue
            if span.lane == "drop":
                events.append({"name": span.action, "cat": "drop", "ph": "i", "s": "t",
                               "pid": r, "tid": _COMPUTE_TID, "ts": ts})
                continue
            cat = "send" if span.action.startswith("send:") else "copy"
            for channel in span.lane.split("+"):
                channel = channel or "copy"  # a copy without transfers
                if channel not in tids:
                    tids[channel] = len(tids) + 1
                    events.append(_meta("thread_name", r, tids[channel], channel))
                events.append(_complete(span.action, cat, r, tids[channel], ts, span.end_s * _US_PER_S - ts))
    for d, points in enumerate(result.timeline):
        pid = num_ranks + d
        capacity = result.capacity_bytes[d]
        events.append(_meta("process_name", pid, None, f"device {d} memory"))
        events.append(_meta("process_sort_index", pid, None, pid, key="sort_index"))
        for t, used in points:
            events.append({"name": "memory", "ph": "C", "pid": pid, "ts": t * _US_PER_S,
                           "args": {"used_bytes": used, "capacity_bytes": capacity}})
    return events


def write_trace(result: EmulatorResult, path: str | Path) -> Path:
    """Write the trace of `result` as JSON to `path` (atomically); returns the path."""
    path = Path(path)
    doc = {
        "traceEvents": trace_events(result),
        "displayTimeUnit": "ms",
        "otherData": {
            "iteration_s": result.iteration_s,
            "samples_per_s": result.samples_per_s,
            "model_tflops": result.model_tflops,
            "peak_bytes": list(result.peak_bytes),
            "oom": list(result.oom),
        },
    }
    write_text_atomic(path, json.dumps(doc, separators=(",", ":")))
    return path


def _meta(name: str, pid: int, tid: int | None, value: str | int, key: str = "name") -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": {key: value}}
    if tid is not None:
        event["tid"] = tid
    return event


def _complete(name: str, cat: str, pid: int, tid: int, ts_us: float, dur_us: float) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts_us, "dur": dur_us}
