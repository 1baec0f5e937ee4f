"""What a run records of its last step, for a look at it afterwards.

- `trace:` in the train config: one step's compute actions, the memory actions issued
  between and inside them, the swap copies and the waits for them, each CPU device's
  live bytes, and the pipeline's sends as flow arrows, in the layout, names and
  arguments of `mpress emulate --trace` (`mpress.contract.trace_format`), so the predicted and
  the executed iteration read side by side in ui.perfetto.dev. Each rank records its own
  step (`start` before it, `collect` after) and rank 0 writes the gathered records
  (`write`). Times are each rank's `time.perf_counter()` (one clock for all processes of
  a machine), shifted so the step starts at 0.
- `profiler_trace:`: the step under `torch.profiler` (which shows the executed actions:
  they run in `record_function` ranges), one Chrome trace per rank,
  `<path>.rank<N>.json`.
- `memory_snapshot:` (CUDA only): the caching allocator's history over the step
  (`torch.cuda.memory._record_memory_history`), dumped per rank with
  `torch.cuda.memory._dump_snapshot` to `<path>.rank<N>.pickle` (pytorch.org/memory_viz).

`check_options` refuses a snapshot where the ranks will not run on CUDA, before start-up;
`start_recorders` / `stop_recorders` bracket the step for the last two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mpress.contract.actions import Action
from mpress.errors import ConfigError
from mpress.runtime.train_config import TrainConfig, resolve_backend
from mpress.runtime.trainer import PipelineJob
from mpress.contract.trace_format import COMPUTE, TraceBuilder, action_args, action_name, send_target, unit_args, write_trace_doc

SNAPSHOT_MAX_ENTRIES = 200_000
"""Allocator events a memory snapshot keeps (the newest; several kB each)."""
_COPY_VERBS = {"out": "swap-out", "in": "swap-in", "wait": "wait for swap-in"}


def start(job: PipelineJob) -> None:
    """Record this rank's next step."""
    job.spans.clear()
    for rt in job.runtimes:
        for engine in rt.engines:
            engine.trace = []
    if job.live is not None:
        job.live.timeline = []


def collect(job: PipelineJob) -> dict[str, Any]:
    """What this rank recorded since `start` (plain data, for a gather), and stop.
    copies: per copy or wait, its store kind ("host", "d2d"), what ("out", "in",
    "wait"), stage, microbatch, tensor (a unit of the plan's program, or one saved
    tensor), bytes and host times (seconds)."""
    copies = []
    for rt in job.runtimes:
        for engine in rt.engines:
            for what, key, nbytes, a, b in engine.trace or ():
                copies.append({"kind": engine.store.kind, "what": what, "stage": key.stage,
                               "microbatch": key.microbatch, "tensor": key.tensor, "bytes": nbytes,
                               "start_s": a, "end_s": b})
            engine.trace = None
    memory: list[tuple[float, int]] = []
    if job.live is not None:
        memory, job.live.timeline = job.live.timeline or [], None
    return {"rank": job.rank, "device": job.device.index if job.device.type == "cuda" else job.rank,
            "num_stages": len(job.spec.ranges),
            "spans": [(str(s.action), s.start_s, s.end_s, s.action.is_compute) for s in job.spans],
            "copies": copies, "memory": memory, "capacity": job.spec.device_capacity_bytes or 0}


def write(path: str | Path, ranks: list[dict[str, Any]], *, step: int) -> Path:
    """Write the gathered records of every rank as one trace."""
    t0 = min((s[1] for r in ranks for s in r["spans"]), default=0.0)
    b = TraceBuilder()
    computes: dict[str, int] = {}  # action -> its slice
    for r in ranks:
        pid = r["rank"]
        b.rank_process(pid, r["device"])
        for text, start_s, end_s, is_compute in r["spans"]:
            action = Action.parse(text)
            if is_compute:
                computes[text] = b.slice(pid, COMPUTE, action_name(action), "compute", start_s - t0, end_s - t0,
                                         action_args(action))
            else:  # issued, or run inside the compute action around it
                b.instant(pid, COMPUTE, action_name(action), "issue", start_s - t0, action_args(action))
        for c in r["copies"]:
            args = {"stage": c["stage"], "kind": f"{c['kind']} {c['what']}", "bytes": c["bytes"],
                    **({} if c["microbatch"] is None else {"microbatch": c["microbatch"]}), **unit_args(c["tensor"])}
            what = args.get("layer", c["tensor"])
            mb = "" if c["microbatch"] is None else f" mb{c['microbatch']}"
            name = f"{c['kind']} {_COPY_VERBS.get(c['what'], c['what'])} {what}{mb}"
            waits = c["what"] == "wait"  # a wait holds up the compute stream: it is drawn there
            b.slice(pid, COMPUTE if waits else f"{c['kind']} {c['what']}", name, "wait" if waits else "copy",
                    c["start_s"] - t0, c["end_s"] - t0, args)
    num_stages = max((r.get("num_stages", 0) for r in ranks), default=0)
    for text, source in computes.items():
        target = send_target(Action.parse(text), num_stages)
        if target is not None and str(target) in computes:
            b.flow(source, computes[str(target)], "send", {"from": text, "to": str(target)})
    for r in ranks:
        if r["memory"]:
            b.memory(len(ranks) + r["rank"], r["device"], [(t - t0, v) for t, v in r["memory"]], r["capacity"])
    return write_trace_doc(path, b.events(), {"step": step, "source": "mpress.train (executed)"})


# ---- torch.profiler and the CUDA allocator's history -----------------------------------------

def check_options(cfg: TrainConfig, source: str = "") -> None:
    """Refuse `memory_snapshot` unless the ranks will run on CUDA (the caching allocator
    is what it records): a `ConfigError` naming the key."""
    if cfg.memory_snapshot is not None and not (torch.cuda.is_available() and resolve_backend(cfg) == "nccl"):
        raise ConfigError(source, "memory_snapshot", "records the CUDA caching allocator; this run is on CPU "
                                                     "(remove it, or run on CUDA GPUs with backend nccl)")


@dataclass
class Recorders:
    """What `start_recorders` started for one step of rank `rank`."""

    rank: int
    profiler: torch.profiler.profile | None
    profiler_path: Path | None
    snapshot_path: Path | None


def rank_path(path: str | Path, rank: int, suffix: str) -> Path:
    """`<path>.rank<N><suffix>`: one file per rank next to the configured path."""
    return Path(f"{path}.rank{rank}{suffix}")


def start_recorders(cfg: TrainConfig, rank: int, device: torch.device) -> Recorders | None:
    """Start the torch profiler and/or the allocator's history for the next step, as the
    config asks; None when it asks for neither."""
    if cfg.profiler_trace is None and cfg.memory_snapshot is None:
        return None
    profiler = None
    if cfg.profiler_trace is not None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
        profiler.start()
    snapshot = None
    if cfg.memory_snapshot is not None:
        # Python stacks of allocations only: C++ stacks ("all", the default) are unwound
        # on every allocation and free, and the recorded step is the one timed
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES, device=device,
                                                 context="alloc", stacks="python")
        snapshot = rank_path(cfg.memory_snapshot, rank, ".pickle")
    return Recorders(rank=rank, profiler=profiler,
                     profiler_path=None if cfg.profiler_trace is None else rank_path(cfg.profiler_trace, rank, ".json"),
                     snapshot_path=snapshot)


def stop_recorders(rec: Recorders | None, say: Callable[[str], object] | None = None) -> list[Path]:
    """Stop what `start_recorders` started and write its files; returns their paths.
    say: told one line naming what was written (rank 0 passes its console's print)."""
    if rec is None:
        return []
    written = []
    if rec.snapshot_path is not None:
        rec.snapshot_path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(rec.snapshot_path))
        torch.cuda.memory._record_memory_history(enabled=None)
        written.append(rec.snapshot_path)
    if rec.profiler is not None and rec.profiler_path is not None:
        rec.profiler.stop()
        rec.profiler_path.parent.mkdir(parents=True, exist_ok=True)
        rec.profiler.export_chrome_trace(str(rec.profiler_path))
        written.append(rec.profiler_path)
    if say is not None and written:
        say("written per rank: " + ", ".join(str(p).replace(f".rank{rec.rank}", ".rank<N>") for p in written))
    return written
