"""Chrome / Perfetto trace of an emulated iteration (open in ui.perfetto.dev or
chrome://tracing), in the layout `mpress.trace_format` describes, which the trace of a
real run (`mpress.launcher.run_trace`) shares.

Tasks are complete events; drops, which take no time, are instant events; a copy
striped over several channels appears once on each of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mpress.static.emulator import EmulatorResult
from mpress.trace_format import (
    COMPUTE_TID,
    ChannelThreads,
    complete,
    instant,
    memory_counter,
    rank_process,
    write_trace_doc,
)


def trace_events(result: EmulatorResult) -> list[dict[str, Any]]:
    """The trace events of `result`, in the Chrome trace event format."""
    events: list[dict[str, Any]] = []
    num_ranks = len(result.spans)
    for r, spans in enumerate(result.spans):
        events.extend(rank_process(r, result.rank_device[r]))
        channels = ChannelThreads(r)
        for span in spans:
            if span.lane == "compute":
                events.append(complete(span.action, "compute", r, COMPUTE_TID, span.start_s, span.end_s))
            elif span.lane == "drop":
                events.append(instant(span.action, "drop", r, COMPUTE_TID, span.start_s))
            else:
                cat = "send" if span.action.startswith("send:") else "copy"
                for channel in span.lane.split("+"):
                    tid = channels.tid(channel or "copy", events)  # a copy without transfers: "copy"
                    events.append(complete(span.action, cat, r, tid, span.start_s, span.end_s))
    for d, points in enumerate(result.timeline):
        events.extend(memory_counter(num_ranks + d, d, points, result.capacity_bytes[d]))
    return events


def write_trace(result: EmulatorResult, path: str | Path) -> Path:
    """Write the trace of `result` as JSON to `path` (atomically); returns the path."""
    return write_trace_doc(path, trace_events(result), {
        "iteration_s": result.iteration_s,
        "samples_per_s": result.samples_per_s,
        "model_tflops": result.model_tflops,
        "peak_bytes": list(result.peak_bytes),
        "oom": list(result.oom),
    })
