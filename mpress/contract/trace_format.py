"""The Chrome / Perfetto trace event format, shared by the emulator's trace of a
predicted iteration (`mpress.static.emulate.trace`) and the run's trace of an executed one
(`mpress.launcher.run_trace`), so the two have the same tracks, names and arguments and
read side by side in ui.perfetto.dev.

Layout: one process per rank ("rank r (device d)") whose first thread is the compute
stream and whose other threads are the copy channels it used; one process per device
("device d memory") with a counter of the bytes in use next to the capacity. Processes
and threads are named and sorted by metadata events.

Guarantees (the trace viewers drop or misdraw what breaks them):
- no two complete ("X") events on one thread overlap unless one nests inside the other
  (on compute tracks only, where it means "part of"): slices are laid out on lanes
  (`TraceBuilder.events`), and a track whose slices overlap (concurrent copies sharing
  a channel's bandwidth) gets as many lanes, named "pcie-up:0", "pcie-up:0 #2", ...;
- every event carries `args` (an action's stage, kind, microbatch, layer, tensor, bytes);
- times are microseconds with nanosecond resolution: each start and end is rounded to a
  whole nanosecond first, so `ts + dur` of one slice and `ts` of the next compare
  exactly as the viewer (which reads `round(ts * 1000)` ns) compares them;
- pipeline sends are flow arrows (a "s" event bound to the sending slice, an "f" event
  with `"bp": "e"` bound to the receiving slice, sharing an `id`), each placed where
  its slice is the innermost open one on its lane, so the arrow binds to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpress.contract.actions import Action, Kind, UnitId, UnitKind
from mpress.config.loader import write_text_atomic

NS_PER_S = 1_000_000_000
COMPUTE = "compute"
"""The compute stream's track name in a rank's process (its first thread)."""

_VERBS = {
    Kind.F: "forward", Kind.B: "backward", Kind.I: "input-gradient backward", Kind.W: "weight-gradient backward",
    Kind.OPT: "optimizer step", Kind.RC: "recompute",
    Kind.SO: "swap-out", Kind.SI: "swap-in", Kind.DO: "d2d-out", Kind.DI: "d2d-in", Kind.DR: "drop",
    Kind.OO: "optimizer-out", Kind.OI: "optimizer-in",
}


def _ns(t_s: float) -> int:
    return round(t_s * NS_PER_S)


def unit_args(tensor: str | None) -> dict[str, Any]:
    """What a memory action's tensor (unit) name says: its `tensor`, and its `layer` and
    plan `rule` where it names them."""
    if tensor is None:
        return {}
    out: dict[str, Any] = {"tensor": tensor}
    try:
        unit = UnitId.parse(tensor)
    except Exception:  # noqa: BLE001 - a free-form tensor name (hand-written programs): keep it as is
        return out
    out["unit"] = unit.kind.value
    if unit.layer is not None:
        out["layer"] = unit.layer
    if unit.rule is not None:
        out["rule"] = unit.rule
    return out


def action_args(action: Action, layer: str | None = None) -> dict[str, Any]:
    """The arguments of an event for `action` (of layer `layer`, when one layer of it)."""
    out: dict[str, Any] = {"action": str(action), "stage": action.stage, "kind": action.kind.value}
    if action.microbatch is not None:
        out["microbatch"] = action.microbatch
    out.update(unit_args(action.tensor))
    if layer is not None:
        out["layer"] = layer
    return out


def action_name(action: Action, layer: str | None = None) -> str:
    """A readable name: "forward layers.3 mb2", "swap-out layers.1 mb0", "optimizer-in
    optim layers.4", "backward stage 1 mb3" (a whole stage's action)."""
    what = layer
    if what is None and action.tensor is not None:
        args = unit_args(action.tensor)
        unit = args.get("unit")
        if unit == UnitKind.OPTIM.value:
            what = f"optim {args.get('layer', '')}".strip()
        elif unit == UnitKind.STASH.value:
            what = f"stashed weights (rule {args['rule']})"
        else:
            what = args.get("layer", action.tensor)
    if what is None:
        what = f"stage {action.stage}"
    mb = "" if action.microbatch is None else f" mb{action.microbatch}"
    return f"{_VERBS[action.kind]} {what}{mb}"


def send_target(action: Action, num_stages: int) -> Action | None:
    """The action that receives what `action` sends down the pipeline: a forward's
    activation goes to the next stage's forward of the microbatch, a backward's input
    gradient to the previous stage's backward; None when nothing is sent."""
    if action.kind is Kind.F and action.stage + 1 < num_stages:
        return Action(action.stage + 1, Kind.F, action.microbatch)
    if action.kind in (Kind.B, Kind.I) and action.stage > 0:  # the receiver's backward (B or I) starts
        return Action(action.stage - 1, Kind.B, action.microbatch)
    return None


@dataclass
class _Slice:
    pid: int
    track: str
    name: str
    cat: str
    start_ns: int
    end_ns: int
    args: dict[str, Any]
    lane: int = 0


@dataclass
class TraceBuilder:
    """Collects slices, instants, counters and flows by (process, track name); `events`
    lays the slices out on lanes (see the module docstring) and returns the trace events.
    `process` names a process (and sorts it); tracks are sorted compute first, then by name."""

    _processes: dict[int, str] = field(default_factory=dict)
    _slices: list[_Slice] = field(default_factory=list)
    _instants: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    _counters: list[dict[str, Any]] = field(default_factory=list)
    _flows: list[tuple[int, int, str, dict[str, Any]]] = field(default_factory=list)

    def process(self, pid: int, name: str) -> None:
        self._processes[pid] = name

    def rank_process(self, rank: int, device: int) -> None:
        """Rank `rank`'s process (pid = rank), with its compute track first."""
        self.process(rank, f"rank {rank} (device {device})")

    def slice(self, pid: int, track: str, name: str, cat: str, start_s: float, end_s: float,
              args: dict[str, Any]) -> int:
        """Something that ran from `start_s` to `end_s` (seconds); returns its handle (for `flow`)."""
        start = _ns(start_s)
        self._slices.append(_Slice(pid, track, name, cat, start, max(start, _ns(end_s)), dict(args)))
        return len(self._slices) - 1

    def instant(self, pid: int, track: str, name: str, cat: str, at_s: float, args: dict[str, Any]) -> None:
        """Something that takes no time (a drop, an issued action), on the track's first lane."""
        self._instants.append((pid, track, {"name": name, "cat": cat, "ph": "i", "s": "t", "ts": _ns(at_s) / 1000,
                                             "args": dict(args)}))

    def counter(self, pid: int, name: str, at_s: float, values: dict[str, int]) -> None:
        self._counters.append({"name": name, "ph": "C", "pid": pid, "ts": _ns(at_s) / 1000, "args": dict(values)})

    def memory(self, pid: int, device: int, points: list[tuple[float, int]], capacity_bytes: int) -> None:
        """Device `device`'s bytes in use over time (seconds, bytes), as process `pid`."""
        self.process(pid, f"device {device} memory")
        for t, used in points:
            self.counter(pid, "memory (bytes)", t, {"used_bytes": used, "capacity_bytes": capacity_bytes})

    def flow(self, source: int, target: int, name: str, args: dict[str, Any]) -> None:
        """An arrow from slice `source` to slice `target` (handles from `slice`)."""
        self._flows.append((source, target, name, dict(args)))

    def events(self) -> list[dict[str, Any]]:
        """Every event: metadata first, then the rest in time order (a slice before the
        slices it encloses)."""
        tids = self._lay_out()
        meta: list[dict[str, Any]] = []
        for pid in sorted(self._processes):
            meta.append(_meta("process_name", pid, None, {"name": self._processes[pid]}))
            meta.append(_meta("process_sort_index", pid, None, {"sort_index": pid}))
        for (pid, track, lane), tid in sorted(tids.items(), key=lambda kv: (kv[0][0], kv[1])):
            name = track if lane == 0 else f"{track} #{lane + 1}"
            meta.append(_meta("thread_name", pid, tid, {"name": name}))
            meta.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
        timed: list[dict[str, Any]] = []
        for s in self._slices:
            timed.append({"name": s.name, "cat": s.cat, "ph": "X", "pid": s.pid, "tid": tids[(s.pid, s.track, s.lane)],
                          "ts": s.start_ns / 1000, "dur": (s.end_ns - s.start_ns) / 1000, "args": s.args})
        for pid, track, event in self._instants:
            timed.append({**event, "pid": pid, "tid": tids[(pid, track, 0)]})
        timed.extend(self._counters)
        for i, (source, target, name, args) in enumerate(self._flows):
            for ph, handle in (("s", source), ("f", target)):
                s = self._slices[handle]
                event = {"name": name, "cat": "flow", "ph": ph, "id": i, "pid": s.pid,
                         "tid": tids[(s.pid, s.track, s.lane)], "ts": self._bind_point(handle) / 1000, "args": args}
                if ph == "f":
                    event["bp"] = "e"  # bind to the enclosing slice, not the next one
                timed.append(event)
        timed.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        return meta + timed

    def _lay_out(self) -> dict[tuple[int, str, int], int]:
        """Give each slice a lane of its track: the first lane where it starts after the
        lane's open slices end or, on a compute track (where a slice inside another is
        part of it: a layer of a forward, a wait in a backward), nests inside the
        innermost one; concurrent copies never nest. Returns the thread id
        of each (process, track, lane); a process's compute track is thread 0."""
        open_: dict[tuple[int, str], list[list[int]]] = {}  # per track, per lane: stack of open slice ends
        for s in sorted(self._slices, key=lambda s: (s.start_ns, -s.end_ns)):
            lanes = open_.setdefault((s.pid, s.track), [])
            for k, stack in enumerate(lanes + [[]]):
                while stack and stack[-1] <= s.start_ns:
                    stack.pop()
                if not stack or (s.track == COMPUTE and s.end_ns <= stack[-1]):
                    if k == len(lanes):
                        lanes.append(stack)
                    stack.append(s.end_ns)
                    s.lane = k
                    break
        tracks = sorted(set(open_) | {(pid, track) for pid, track, _e in self._instants},
                        key=lambda pt: (pt[0], pt[1] != COMPUTE, pt[1]))
        tids: dict[tuple[int, str, int], int] = {}
        for pid, track in tracks:
            for lane in range(max(1, len(open_.get((pid, track), [])))):
                tids[(pid, track, lane)] = _next_tid(tids, pid)
        return tids

    def _bind_point(self, handle: int) -> int:
        """A time (ns) inside slice `handle` where it is the innermost open slice of its
        lane: the middle of its first stretch that no slice nested in it covers (its
        start when it takes no time), so a flow event there binds to it."""
        s = self._slices[handle]
        children = sorted((c.start_ns, c.end_ns) for c in self._slices if c is not s and
                          (c.pid, c.track, c.lane) == (s.pid, s.track, s.lane) and
                          s.start_ns <= c.start_ns and c.end_ns <= s.end_ns)
        t = s.start_ns
        for a, b in children:
            if a > t:
                break  # a stretch [t, a) that nothing nested covers
            t = max(t, b)
        else:
            a = s.end_ns
        return (t + a) // 2 if a > t else min(t, s.end_ns)


def _next_tid(tids: dict[tuple[int, str, int], int], pid: int) -> int:
    return sum(1 for p, _t, _l in tids if p == pid)


def _meta(name: str, pid: int, tid: int | None, args: dict[str, Any]) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def write_trace_doc(path: str | Path, events: list[dict[str, Any]], other: dict[str, Any]) -> Path:
    """Write a trace document (atomically); returns the path."""
    path = Path(path)
    doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    write_text_atomic(path, json.dumps(doc, separators=(",", ":")))
    return path
