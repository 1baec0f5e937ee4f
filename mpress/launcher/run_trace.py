"""The trace of what a run executed (`trace:` in the train config): one step's compute
actions, the memory actions issued between and inside them, the swap copies and the
waits for them, and each CPU device's live bytes, in the layout of `mpress emulate
--trace` (`mpress.trace_format`), so the predicted and the executed iteration can be
compared by eye in ui.perfetto.dev.

Each rank records its own step (`start` before it, `collect` after) and rank 0 writes
the gathered records (`write`). Times are each rank's `time.perf_counter()` (one clock
for all processes of a machine), shifted so the step starts at 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mpress.runtime.trainer import PipelineJob
from mpress.trace_format import (
    COMPUTE_TID,
    ChannelThreads,
    complete,
    instant,
    memory_counter,
    rank_process,
    write_trace_doc,
)


def start(job: PipelineJob) -> None:
    """Record this rank's next step."""
    job.spans.clear()
    for rt in job.runtimes:
        for engine in rt.engines:
            engine.trace = []
    if job.live is not None:
        job.live.timeline = []


def collect(job: PipelineJob) -> dict[str, Any]:
    """What this rank recorded since `start` (plain data, for a gather), and stop."""
    copies = []
    for rt in job.runtimes:
        for engine in rt.engines:
            kind = engine.store.kind
            copies += [(f"{kind} {what}", key, a, b) for what, key, a, b in engine.trace or ()]
            engine.trace = None
    memory: list[tuple[float, int]] = []
    if job.live is not None:
        memory, job.live.timeline = job.live.timeline or [], None
    return {"rank": job.rank, "device": job.device.index if job.device.type == "cuda" else job.rank,
            "spans": [(str(s.action), s.start_s, s.end_s, s.action.is_compute) for s in job.spans],
            "copies": copies, "memory": memory, "capacity": job.spec.device_capacity_bytes or 0}


def write(path: str | Path, ranks: list[dict[str, Any]], *, step: int) -> Path:
    """Write the gathered records of every rank as one trace."""
    t0 = min((s[1] for r in ranks for s in r["spans"]), default=0.0)
    events: list[dict[str, Any]] = []
    for r in ranks:
        pid = r["rank"]
        events.extend(rank_process(pid, r["device"]))
        channels = ChannelThreads(pid)
        for name, start_s, end_s, is_compute in r["spans"]:
            if is_compute:
                events.append(complete(name, "compute", pid, COMPUTE_TID, start_s - t0, end_s - t0))
            else:  # issued, or run inside the compute action around it
                events.append(instant(name, "issue", pid, COMPUTE_TID, start_s - t0))
        for what, key, start_s, end_s in r["copies"]:
            tid = COMPUTE_TID if what.endswith("wait") else channels.tid(what, events)
            events.append(complete(f"{what} {key}", "wait" if what.endswith("wait") else "copy", pid, tid,
                                   start_s - t0, end_s - t0))
    num_ranks = len(ranks)
    for r in ranks:
        if r["memory"]:
            points = [(t - t0, b) for t, b in r["memory"]]
            events.extend(memory_counter(num_ranks + r["rank"], r["device"], points, r["capacity"]))
    return write_trace_doc(path, events, {"step": step, "source": "mpress.train (executed)"})
