"""Chrome / Perfetto trace of an emulated iteration (open in ui.perfetto.dev or
chrome://tracing), in the layout `mpress.contract.trace_format` describes, which the trace of a
real run (`mpress.launcher.run_trace`) shares.

On a rank's compute track, each forward or backward of a microbatch is one slice
("forward stage 0 mb3") with its layers' tasks nested in it ("forward layers.3 mb3", a
recompute before its layer's backward); drops, which take no time, are instants.
Copies and sends are slices on the tracks of the channels they use (a copy striped over
several channels appears once on each, with that channel's bytes); copies sharing a
channel's bandwidth at once get lanes of their own. Each send is a flow arrow to the
first task of the action that receives it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mpress.contract.actions import Action, Kind
from mpress.static.emulate.emulator import EmulatorResult
from mpress.contract.trace_format import COMPUTE, TraceBuilder, action_args, action_name, write_trace_doc

_SEND_RE = re.compile(r"^send:(\S+)->(\d+)$")


def trace_events(result: EmulatorResult, layer_names: Sequence[Sequence[str]] | None = None) -> list[dict[str, Any]]:
    """The trace events of `result`, in the Chrome trace event format. layer_names: per
    stage, the names of its layers (for readable names and args); None: "L<index>"."""
    program = result.program
    b = TraceBuilder()
    first_task: dict[tuple[Kind, int, int | None], int] = {}  # (kind, stage, mb) -> its first task's slice
    for r, tasks in enumerate(program.ranks):
        b.rank_process(r, result.rank_device[r])
        group: tuple[Action, float, float] | None = None  # the F/B action whose layer tasks run now
        for task, start_s, end_s in zip(tasks, result.task_start_s[r], result.task_end_s[r]):
            a = task.action
            layer = None
            if task.layer is not None:
                layer = layer_names[a.stage][task.layer] if layer_names else f"L{task.layer}"
            args = {**action_args(a, layer), "task": task.label(), "cost": str(task.cost),
                    "alloc_bytes": task.alloc_bytes, "free_bytes": task.free_bytes}
            if a.is_compute:
                args.update(compute_s=task.compute_s, transient_bytes=task.transient_bytes,
                            release_bytes=task.release_bytes)
                handle = b.slice(r, COMPUTE, action_name(a, layer), "compute", start_s, end_s, args)
                first_task.setdefault((a.kind, a.stage, a.microbatch), handle)
                if a.kind in (Kind.F, Kind.B, Kind.I, Kind.W):
                    if group is not None and group[0] == a:
                        group = (a, group[1], end_s)
                    else:
                        _close(b, r, group)
                        group = (a, start_s, end_s)
            elif a.kind is Kind.DR:
                b.instant(r, COMPUTE, action_name(a, layer), "drop", start_s, args)
            else:
                total = sum(x.bytes for x in task.transfers)
                for x in task.transfers or ():
                    b.slice(r, x.channel, action_name(a, layer), "copy", start_s, end_s,
                            {**args, "channel": x.channel, "bytes": x.bytes, "total_bytes": total})
                if not task.transfers:
                    b.slice(r, "copy", action_name(a, layer), "copy", start_s, end_s, {**args, "bytes": 0})
        _close(b, r, group)
    num_stages = 1 + max((t.action.stage for tasks in program.ranks for t in tasks), default=0)
    for r, sends in enumerate(result.send_spans):
        for span in sends:
            m = _SEND_RE.match(span.action)
            if m is None:
                continue
            source, to_stage = Action.parse(m.group(1)), int(m.group(2))
            what = "activation" if source.kind is Kind.F else "gradient"
            links = program.sends if source.kind is Kind.F else program.grad_sends
            transfers = links.get((source.stage, to_stage), ())
            name = f"send {what} mb{source.microbatch} to stage {to_stage}"
            args = {**action_args(source), "send": span.action, "to_stage": to_stage,
                    "total_bytes": sum(x.bytes for x in transfers)}
            handles = [b.slice(r, x.channel, name, "send", span.start_s, span.end_s,
                               {**args, "channel": x.channel, "bytes": x.bytes}) for x in transfers]
            target = first_task.get((source.kind, to_stage, source.microbatch))
            if handles and target is not None and to_stage < num_stages:
                b.flow(handles[0], target, "send", {"send": span.action, "bytes": args["total_bytes"]})
    for d, points in enumerate(result.timeline):
        b.memory(len(program.ranks) + d, d, list(points), result.capacity_bytes[d])
    return b.events()


def _close(b: TraceBuilder, rank: int, group: tuple[Action, float, float] | None) -> None:
    """The slice of a whole forward or backward, around its layer tasks."""
    if group is not None:
        a, start_s, end_s = group
        b.slice(rank, COMPUTE, action_name(a), "action", start_s, end_s, action_args(a))


def write_trace(result: EmulatorResult, path: str | Path, layer_names: Sequence[Sequence[str]] | None = None) -> Path:
    """Write the trace of `result` as JSON to `path` (atomically); returns the path."""
    return write_trace_doc(path, trace_events(result, layer_names), {
        "iteration_s": result.iteration_s,
        "samples_per_s": result.samples_per_s,
        "model_tflops": result.model_tflops,
        "peak_bytes": list(result.peak_bytes),
        "oom": list(result.oom),
    })
