"""Discrete-event emulation of one iteration of a `Program` (see `program.py`).

What is simulated, and the choices `program.py` leaves open:

- Each rank walks its task list in order. A compute task (F, B, OPT, RC) is reached when
  the compute task before it has finished; the copies (SO, SI, DO, DI, OO, OI) and drops
  (DR) between two compute tasks are issued the moment the first one ends (at time 0
  before a rank's first compute task). A DR frees its bytes at that moment.
- Dependencies of a compute task: F(s, m), s > 0, waits for F(s-1, m) and then the
  activation send `sends[(s-1, s)]`, which starts when F(s-1, m) ends; B(s, m) waits for
  F(s, m) and, unless s is the last stage (no F(s+1, .) anywhere), for B(s+1, m) and the
  gradient send `grad_sends[(s+1, s)]`; RC(s, m) waits for that gradient too (a
  recompute runs inside the backward); every compute task waits for the copy-ins
  (SI, DI, OI) with its stage and microbatch (None for OPT) listed before it since the
  previous compute task of that stage and microbatch (earlier ones were waited for by
  that task); a compute task that names a tensor (RC, or OPT of one chunk of model data)
  waits only for the copy-ins of that tensor. A copy-in waits for the latest copy-out (SO, DO, OO) of the same tensor
  listed before it on the same rank; with none (e.g. optimizer states brought in before
  the step that sends them out again) it waits for nothing.
- Channels share their bandwidth fairly (processor sharing): with n transfers active,
  each moves gbps/n. A transfer *joins* its channel after the channel's latency has
  elapsed, so the latency is paid up front and does not take bandwidth. Implemented with a
  virtual clock per channel that advances gbps/n bytes per second; a transfer finishes
  when the clock reaches its join mark plus its bytes (a heap per channel).
- Swap-in policy "capacity": a ready copy-in waits in a first-in-first-out queue per
  device and starts when the device's usage plus its alloc + transient bytes fits the
  capacity beside the room the next F or B of each rank on the device (or a recompute
  before it) will take; when the
  rank reaches its consumer (the first compute task after it with its stage and
  microbatch) or the end of its list while it still waits, it is forced: it starts as
  soon as it fits the device, or once no copy-out of the device is left in flight (the
  device may then run out of memory).
  "layer-ahead": a copy-in starts no earlier than the start of the compute task listed
  just before its consumer; memory is not checked.
- Memory back-pressure: a compute task that would take its device over capacity while
  copy-outs (SO, DO, OO) of that device are in flight waits until they have freed enough
  room (or none is left in flight); the wait is blamed on the copy-out that made room.
  With no copy-out in flight it starts at once and the device runs out of memory.
- Memory per device: the static bytes of its ranks, plus alloc + transient bytes when a
  task starts, minus free + transient bytes when it ends. A copy-out therefore gives its
  bytes back when the copy has finished, not when it is issued.
- Stalls: a compute task that starts after its rank reached it stalls for the gap, blamed
  on the dependency that was satisfied last: a copy-in (its tensor and technique) or a
  forward/backward of another stage or a send ("pipeline", the bubble). So per rank,
  busy + stall = end of its last compute task.
- A program in which tasks remain but nothing can progress raises `ScheduleError` that
  names each stuck rank, its action and what that action still waits for.

Units: seconds, bytes, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import gc
import heapq
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from mpress.actions import Kind
from mpress.errors import ScheduleError
from mpress.static.program import Program, Transfer

_COMPUTE, _COPY_OUT, _COPY_IN, _DROP, _SEND = range(5)
_CATEGORY = {
    Kind.F: _COMPUTE, Kind.B: _COMPUTE, Kind.OPT: _COMPUTE, Kind.RC: _COMPUTE,
    Kind.SO: _COPY_OUT, Kind.DO: _COPY_OUT, Kind.OO: _COPY_OUT,
    Kind.SI: _COPY_IN, Kind.DI: _COPY_IN, Kind.OI: _COPY_IN,
    Kind.DR: _DROP,
}
_ARRIVAL = -1
"""`blame` value when the last thing a task waited for was the walk reaching it."""
_WAITING, _QUEUED, _STARTED = range(3)
"""Copy-in admission states under the "capacity" policy."""
_EV_COMPUTE_END, _EV_CHANNEL = 0, 1
_BYTES_TOL = 1e-3
"""Virtual-clock differences below this many bytes are rounding, not data."""


class TaskSpan(NamedTuple):
    """When one task (or send) ran. lane: "compute", "drop", or the "+"-joined channel ids
    of its transfers ("" for a copy without transfers)."""

    action: str
    start_s: float
    end_s: float
    lane: str


@dataclass(frozen=True, kw_only=True)
class EmulatorResult:
    """Outcome of one emulated iteration. Per-device tuples are indexed by device, per-rank
    tuples by rank."""

    iteration_s: float
    """Time from the start to the end of the last task, copy or send."""
    samples_per_s: float
    model_tflops: float
    """Model FLOPs (without recompute) per second, in 1e12."""
    peak_bytes: tuple[int, ...]
    capacity_bytes: tuple[int, ...]
    oom: tuple[bool, ...]
    """peak_bytes > capacity_bytes, per device."""
    timeline: tuple[tuple[tuple[float, int], ...], ...]
    """Per device: (time_s, bytes in use) after every change, in time order (several
    points may share a time); the first point is (0.0, static bytes)."""
    stall_s_by_tensor: dict[str, float]
    """Compute-stream stall blamed on each tensor's copy-ins."""
    stall_s_by_technique: dict[str, float]
    """Stall per technique of the copy blamed, plus "pipeline" for bubbles."""
    stall_s_by_rank: tuple[float, ...]
    busy_s_by_rank: tuple[float, ...]
    """Sum of compute_s of the rank's compute tasks."""
    busy_s_by_technique: dict[str, float]
    """Compute time per technique of the compute tasks ("recompute" is RC overhead)."""
    task_start_s: tuple[tuple[float, ...], ...]
    """Per rank, start of each task of `program.ranks[rank]`, in list order."""
    task_end_s: tuple[tuple[float, ...], ...]
    send_spans: tuple[tuple[TaskSpan, ...], ...]
    """Per rank, the activation and gradient sends it started ("send:0F3->1", "send:1B3->0")."""
    program: Program = field(repr=False, compare=False)

    @property
    def fits(self) -> bool:
        """No device ran out of memory."""
        return not any(self.oom)

    @property
    def stall_s(self) -> float:
        """Total stall over all ranks."""
        return sum(self.stall_s_by_rank)

    @property
    def rank_device(self) -> tuple[int, ...]:
        return self.program.rank_device

    def summary(self) -> dict[str, object]:
        """Headline figures as plain data (for YAML/JSON reports), without spans or timelines."""
        return {
            "iteration_s": self.iteration_s, "samples_per_s": self.samples_per_s,
            "model_tflops": self.model_tflops, "fits": self.fits,
            "peak_bytes": list(self.peak_bytes), "capacity_bytes": list(self.capacity_bytes),
            "oom": list(self.oom), "stall_s_by_rank": list(self.stall_s_by_rank),
            "busy_s_by_rank": list(self.busy_s_by_rank),
            "stall_s_by_technique": dict(self.stall_s_by_technique),
            "stall_s_by_tensor": dict(self.stall_s_by_tensor),
            "busy_s_by_technique": dict(self.busy_s_by_technique),
        }

    @cached_property
    def spans(self) -> tuple[tuple[TaskSpan, ...], ...]:
        """Per rank: its tasks in list order, then its sends (built on first use)."""
        out = []
        for r, tasks in enumerate(self.program.ranks):
            rank_spans = [
                TaskSpan(str(t.action), s, e,
                         "compute" if t.action.is_compute else "drop" if t.action.kind is Kind.DR
                         else "+".join(x.channel for x in t.transfers))
                for t, s, e in zip(tasks, self.task_start_s[r], self.task_end_s[r])
            ]
            out.append(tuple(rank_spans) + self.send_spans[r])
        return tuple(out)


def emulate(program: Program) -> EmulatorResult:
    """Simulate one iteration of `program`; raises `ScheduleError` on a malformed program
    or a deadlock (with the stuck ranks, actions and what they wait for)."""
    # The run allocates ~10 small objects per task and creates no reference cycles, but
    # each allocation burst makes the cyclic collector rescan the program's own objects:
    # measured at 30-50% of the run time on the 28k-task benchmark. Paused, then restored.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _Simulation(program).run()
    finally:
        if gc_was_enabled:
            gc.enable()


def _check(program: Program) -> None:
    n = len(program.ranks)
    if len(program.rank_device) != n or len(program.static_bytes) != n:
        raise ScheduleError(f"program has {n} ranks but {len(program.rank_device)} rank_device entries "
                            f"and {len(program.static_bytes)} static_bytes entries")
    for r, d in enumerate(program.rank_device):
        if not 0 <= d < len(program.device_capacity_bytes):
            raise ScheduleError(f"rank {r} is on device {d}, but the program has "
                                f"{len(program.device_capacity_bytes)} devices")
    for cid, ch in program.channels.items():
        if ch.gbps <= 0 or ch.latency_s < 0:
            raise ScheduleError(f"channel {cid}: gbps must be > 0 and latency_s >= 0, got {ch.gbps}, {ch.latency_s}")
    if program.swap_in_policy not in ("capacity", "layer-ahead"):
        raise ScheduleError(f"swap_in_policy must be 'capacity' or 'layer-ahead', got {program.swap_in_policy!r}")


class _Simulation:
    """State of one run. Nodes are the tasks (numbered rank by rank, in list order)
    followed by the sends; per-node state lives in flat lists indexed by node id, which
    keeps the hot loop free of attribute look-ups on task objects."""

    def __init__(self, program: Program) -> None:
        _check(program)
        self.program = program
        self.capacity_policy = program.swap_in_policy == "capacity"
        self._build_nodes(program)
        self._build_dependencies(program)
        self._build_channels(program)
        num_nodes = len(self.cat)
        self.arrival = [0.0] * num_nodes
        self.start = [-1.0] * num_nodes
        self.end = [-1.0] * num_nodes
        self.remaining = [0] * num_nodes
        self.admission = [_WAITING] * num_nodes
        self.forced = [False] * num_nodes
        self.blame = [_ARRIVAL] * num_nodes
        num_devices = len(program.device_capacity_bytes)
        self.mem = [0] * num_devices
        for r, d in enumerate(program.rank_device):
            self.mem[d] += program.static_bytes[r]
        self.peak = list(self.mem)
        self.tl_time: list[list[float]] = [[0.0] for _ in range(num_devices)]
        self.tl_bytes: list[list[int]] = [[m] for m in self.mem]
        self.fifo: list[deque[int]] = [deque() for _ in range(num_devices)]
        self.admitting = [False] * num_devices
        # memory back-pressure: compute tasks waiting for in-flight copy-outs to free room
        self.frees_in_flight = [0] * num_devices
        self.alloc_waiting: list[deque[int]] = [deque() for _ in range(num_devices)]
        self.pos = [nodes.start for nodes in self.rank_nodes]
        # per node: the first compute task after it on its rank (-1: none); per device: its ranks
        self.next_compute = [-1] * num_nodes
        for nodes in self.rank_nodes:
            following = -1
            for n in reversed(nodes):
                self.next_compute[n] = following
                if self.cat[n] == _COMPUTE:
                    following = n
        self.device_ranks: list[list[int]] = [[] for _ in range(num_devices)]
        for r, dev in enumerate(program.rank_device):
            self.device_ranks[dev].append(r)
        self.stall_tensor: dict[str, float] = {}
        self.stall_technique: dict[str, float] = {}
        self.stall_rank = [0.0] * len(program.ranks)
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = 0

    def _build_nodes(self, program: Program) -> None:
        self.tasks = [t for rank_tasks in program.ranks for t in rank_tasks]
        self.num_tasks = len(self.tasks)
        self.rank_nodes: list[range] = []
        self.rank_of: list[int] = []
        for r, rank_tasks in enumerate(program.ranks):
            self.rank_nodes.append(range(len(self.rank_of), len(self.rank_of) + len(rank_tasks)))
            self.rank_of.extend([r] * len(rank_tasks))
        self.cat = [_CATEGORY[t.action.kind] for t in self.tasks]
        self.take = [t.alloc_bytes + t.transient_bytes for t in self.tasks]
        self.give = [t.free_bytes + t.transient_bytes for t in self.tasks]
        self.transfers: list[tuple[Transfer, ...]] = [t.transfers for t in self.tasks]

    def _build_dependencies(self, program: Program) -> None:
        """Static dependency graph: `pending[n]` counts what node n waits for (for a task,
        also the walk reaching it); `done_waiters[d]` / `start_waiters[d]` list the nodes
        to notify when d ends / starts."""
        tasks, cat = self.tasks, self.cat
        deps: dict[int, list[int]] = {}
        missing: dict[int, list[str]] = {}
        start_waiters: dict[int, list[int]] = {}
        self.copyin_deps: dict[int, list[int]] = {}
        fb: dict[tuple[Kind, int, int], int] = {}
        recomputes: list[int] = []
        grad_ready: dict[tuple[int, int], int] = {}  # (stage, mb) -> node bringing B's gradient
        for r, nodes in enumerate(self.rank_nodes):
            last_out: dict[tuple[int, int | None, str | None], int] = {}
            open_in: dict[tuple[int, int | None], list[int]] = {}
            prev_compute = -1
            for n in nodes:
                c = cat[n]
                if c == _DROP:
                    continue
                a = tasks[n].action
                if c == _COMPUTE:
                    if a.tensor is None:
                        waits = open_in.pop((a.stage, a.microbatch), None)
                    else:  # OPT of one chunk of model data, or RC: only its own tensor
                        pending_in = open_in.get((a.stage, a.microbatch), [])
                        waits = [d for d in pending_in if tasks[d].action.tensor == a.tensor]
                        if waits:
                            pending_in[:] = [d for d in pending_in if tasks[d].action.tensor != a.tensor]
                    if waits:
                        deps[n] = list(waits)
                        self.copyin_deps[n] = waits
                        if not self.capacity_policy and prev_compute >= 0:
                            for d in waits:  # layer-ahead: d starts with the compute before n
                                deps.setdefault(d, []).append(prev_compute)
                                start_waiters.setdefault(prev_compute, []).append(d)
                    if a.kind is Kind.RC:
                        recomputes.append(n)
                    if a.kind is Kind.F or a.kind is Kind.B:
                        key = (a.kind, a.stage, a.microbatch)
                        if key in fb:
                            raise ScheduleError(f"rank {r}: action {a} appears twice in the program")
                        fb[key] = n  # type: ignore[assignment]
                    prev_compute = n
                elif c == _COPY_OUT:
                    last_out[(a.stage, a.microbatch, a.tensor)] = n
                else:
                    out = last_out.get((a.stage, a.microbatch, a.tensor))
                    if out is not None:
                        deps.setdefault(n, []).append(out)
                    open_in.setdefault((a.stage, a.microbatch), []).append(n)

        # cross-stage dependencies; sends become nodes after the tasks
        forward_stages = {s for (k, s, _m) in fb if k is Kind.F}
        self.send_labels: list[str] = []
        for (k, s, m), n in fb.items():
            if k is Kind.F and s > 0:
                pred, link, label = (Kind.F, s - 1, m), program.sends.get((s - 1, s)), f"send:{s - 1}F{m}->{s}"
            elif k is Kind.B:
                own = fb.get((Kind.F, s, m))
                if own is None:
                    missing.setdefault(n, []).append(f"{s}F{m} (not in the program)")
                else:
                    deps.setdefault(n, []).append(own)
                if s + 1 not in forward_stages:
                    continue
                pred, link, label = (Kind.B, s + 1, m), program.grad_sends.get((s + 1, s)), f"send:{s + 1}B{m}->{s}"
            else:
                continue
            p = fb.get(pred)
            if p is None:
                missing.setdefault(n, []).append(f"{pred[1]}{pred[0].value}{m} (not in the program)")
            elif link:
                send = len(cat)
                cat.append(_SEND)
                deps[send] = [p]
                self.transfers.append(link)
                self.rank_of.append(self.rank_of[p])
                self.send_labels.append(label)
                deps.setdefault(n, []).append(send)
                if k is Kind.B:
                    grad_ready[(s, m)] = send
            else:
                deps.setdefault(n, []).append(p)
                if k is Kind.B:
                    grad_ready[(s, m)] = p
        # a recompute runs inside the backward: not before the gradient has arrived
        for n in recomputes:
            a = tasks[n].action
            ready = grad_ready.get((a.stage, a.microbatch))  # type: ignore[arg-type]
            if ready is not None:
                deps.setdefault(n, []).append(ready)

        num_nodes = len(cat)
        self.deps, self.missing, self.start_waiters = deps, missing, start_waiters
        self.pending = [1] * self.num_tasks + [0] * (num_nodes - self.num_tasks)
        self.done_waiters: list[list[int] | None] = [None] * num_nodes
        for n, ds in deps.items():
            self.pending[n] += len(ds)
            for d in ds:
                if cat[n] == _COPY_IN and cat[d] == _COMPUTE:
                    continue  # a layer-ahead anchor: satisfied when it starts (start_waiters)
                ws = self.done_waiters[d]
                if ws is None:
                    self.done_waiters[d] = [n]
                else:
                    ws.append(n)
        for n, ms in missing.items():
            self.pending[n] += len(ms)
        self.device_of = [program.rank_device[r] for r in self.rank_of]

    def _build_channels(self, program: Program) -> None:
        self.channel_ids = list(program.channels)
        self.chan_index = {cid: i for i, cid in enumerate(self.channel_ids)}
        for n, tr in enumerate(self.transfers):
            for x in tr:
                if x.channel not in self.chan_index:
                    raise ScheduleError(f"{self._name(n)}: transfer names unknown channel {x.channel!r}; "
                                        f"the program has {sorted(self.chan_index)}")
        nch = len(self.channel_ids)
        self.chan_bw = [program.channels[c].gbps * 1e9 for c in self.channel_ids]  # bytes/s
        self.chan_latency = [program.channels[c].latency_s for c in self.channel_ids]
        self.chan_v = [0.0] * nch           # virtual clock: bytes served to each active transfer
        self.chan_t = [0.0] * nch           # time chan_v was brought up to date
        self.chan_active: list[list[tuple[float, int, int]]] = [[] for _ in range(nch)]  # (finish mark, seq, owner)
        # transfers waiting out the latency, in join-time order (same latency per channel)
        self.chan_joining: list[deque[tuple[float, int, int]]] = [deque() for _ in range(nch)]
        self.chan_due = [float("inf")] * nch  # when the head of chan_active finishes, as scheduled
        self.chan_version = [0] * nch       # a channel event with an older version is stale
        self.chan_dirty: list[int] = []     # channels whose next event must be rescheduled
        self.is_dirty = [False] * nch

    # ---- event loop ----------------------------------------------------------------

    def run(self) -> EmulatorResult:
        for r in range(len(self.rank_nodes)):
            self._advance(r, 0.0)
        self._flush_channels()
        events, pop = self.events, heapq.heappop
        chan_version, rank_of, pos = self.chan_version, self.rank_of, self.pos
        while events:
            # (time, tie-break, a, what): what == _EV_COMPUTE_END: compute task a ended;
            # otherwise channel a's next event, stale unless what - _EV_CHANNEL is its version
            t, _, a, what = pop(events)
            if what == _EV_COMPUTE_END:
                self._done(a, t)
                r = rank_of[a]
                pos[r] = a + 1
                self._advance(r, t)
            elif chan_version[a] == what - _EV_CHANNEL:
                self._channel_event(a, t)
            if self.chan_dirty:
                self._flush_channels()
        stuck = [r for r, nodes in enumerate(self.rank_nodes) if pos[r] < nodes.stop]
        if stuck:
            raise ScheduleError("deadlock: " + "; ".join(self._stuck_reason(r) for r in stuck))
        return self._result()

    def _advance(self, r: int, t: float) -> None:
        """Walk rank r from its position: issue copies and drops up to the next compute
        task, which is reached at time t."""
        cat = self.cat
        stop = self.rank_nodes[r].stop
        n = self.pos[r]
        while n < stop:
            c = cat[n]
            if c == _COMPUTE:
                self.pos[r] = n
                self.arrival[n] = t
                if self.capacity_policy and n in self.copyin_deps:
                    for d in self.copyin_deps[n]:
                        self._force(d, t)
                self._satisfy(n, _ARRIVAL, t)
                return
            if c == _DROP:
                self.start[n] = self.end[n] = t
                self._mem(self.device_of[n], self.take[n] - self.give[n], t)
            else:
                self._satisfy(n, _ARRIVAL, t)
            n += 1
        self.pos[r] = stop
        if self.capacity_policy:  # copy-ins no compute task consumes: nothing else will start them
            for d in self.rank_nodes[r]:
                if cat[d] == _COPY_IN:
                    self._force(d, t)

    def _satisfy(self, n: int, by: int, t: float) -> None:
        left = self.pending[n] - 1
        self.pending[n] = left
        self.blame[n] = by
        if left == 0:
            c = self.cat[n]
            if c == _COMPUTE:
                d = self.device_of[n]
                if (self.take[n] and self.frees_in_flight[d]
                        and self.mem[d] + self.take[n] > self.program.device_capacity_bytes[d]):
                    self.alloc_waiting[d].append(n)  # wait for the copy-outs to free room
                    return
                self._start_compute(n, t)
            elif c == _COPY_IN and self.capacity_policy:
                self.admission[n] = _QUEUED
                d = self.device_of[n]
                self.fifo[d].append(n)
                self._admit(d, t)
            else:
                self._start_copy(n, t)

    def _force(self, n: int, t: float) -> None:
        self.forced[n] = True
        if self.admission[n] == _QUEUED:
            self._admit(self.device_of[n], t)

    def _admit(self, d: int, t: float) -> None:
        """Start queued copy-ins of device d. A copy-in whose consumer has been reached
        (forced) starts when it fits the device, or when no copy-out of the device is in
        flight to make room; the others start in order while they fit beside the room
        that compute tasks waiting on this device will take (compute goes first)."""
        if self.admitting[d]:
            return  # re-entered from a start below; the loop re-checks
        self.admitting[d] = True
        q = self.fifo[d]
        cap = self.program.device_capacity_bytes[d]
        for n in [x for x in q if self.forced[x] and self.admission[x] == _QUEUED]:
            if self.mem[d] + self.take[n] <= cap or not self.frees_in_flight[d]:
                self._start_copy(n, t)
        reserved = self._reserved(d)
        while q:
            n = q[0]
            if self.admission[n] != _QUEUED:
                q.popleft()
            elif self.forced[n]:
                break  # waits for room above; later ones must not overtake it
            elif self.mem[d] + self.take[n] + reserved <= cap:
                q.popleft()
                self._start_copy(n, t)
            else:
                break
        self.admitting[d] = False

    def _reserved(self, d: int) -> int:
        """Room the next F or B of each rank on device d will take, or a recompute before
        it (prefetches must leave it: a swap-in never pushes the compute stream out of
        memory)."""
        total = 0
        for r in self.device_ranks[d]:
            n = self.pos[r]
            if n >= self.rank_nodes[r].stop:
                continue
            if self.cat[n] != _COMPUTE or self.start[n] >= 0:
                n = self.next_compute[n]
            need = 0
            while n >= 0:
                need = max(need, self.take[n])
                if self.tasks[n].action.kind is not Kind.RC:
                    break
                n = self.next_compute[n]
            total += need
        return total

    def _start_compute(self, n: int, t: float) -> None:
        task = self.tasks[n]
        self.start[n] = t
        stall = t - self.arrival[n]
        if stall > 0:
            self.stall_rank[self.rank_of[n]] += stall
            b = self.blame[n]
            if b >= 0 and self.cat[b] in (_COPY_IN, _COPY_OUT):
                culprit = self.tasks[b]
                tensor = culprit.action.tensor or ""
                self.stall_tensor[tensor] = self.stall_tensor.get(tensor, 0.0) + stall
                technique: str = culprit.technique
            else:
                technique = "pipeline"
            self.stall_technique[technique] = self.stall_technique.get(technique, 0.0) + stall
        self._mem(self.device_of[n], self.take[n], t)
        for w in self.start_waiters.get(n, ()):
            self._satisfy(w, n, t)
        self.seq += 1
        heapq.heappush(self.events, (t + task.compute_s, self.seq, n, _EV_COMPUTE_END))

    def _start_copy(self, n: int, t: float) -> None:
        """Start a copy task or send: its transfers join their channels after the latency."""
        self.admission[n] = _STARTED
        self.start[n] = t
        if n < self.num_tasks and self.take[n]:
            self._mem(self.device_of[n], self.take[n], t)
        if n < self.num_tasks and self.give[n] and self.cat[n] == _COPY_OUT:
            self.frees_in_flight[self.device_of[n]] += 1
        transfers = self.transfers[n]
        if not transfers:
            self._done(n, t)
            return
        self.remaining[n] = len(transfers)
        index, joining, latency, is_dirty = self.chan_index, self.chan_joining, self.chan_latency, self.is_dirty
        for x in transfers:
            ch = index[x.channel]
            joining[ch].append((t + latency[ch], n, x.bytes))
            if not is_dirty[ch]:
                is_dirty[ch] = True
                self.chan_dirty.append(ch)

    def _done(self, n: int, t: float) -> None:
        self.end[n] = t
        if n < self.num_tasks and self.give[n]:
            d = self.device_of[n]
            if self.cat[n] == _COPY_OUT:
                self.frees_in_flight[d] -= 1
                self._mem(d, -self.give[n], t, admit=False)
                if self.alloc_waiting[d]:  # compute first, then prefetches
                    self._release_waiting(d, n, t)
                if self.fifo[d]:
                    self._admit(d, t)
            else:
                self._mem(d, -self.give[n], t)
        ws = self.done_waiters[n]
        if ws is not None:
            for w in ws:
                self._satisfy(w, n, t)

    def _release_waiting(self, d: int, freed_by: int, t: float) -> None:
        """Start compute tasks of device d that waited for room, in order, while they fit
        (or once no copy-out is left in flight to wait for); their stall is blamed on the
        copy-out that made the room."""
        q = self.alloc_waiting[d]
        cap = self.program.device_capacity_bytes[d]
        while q:
            n = q[0]
            if self.frees_in_flight[d] and self.mem[d] + self.take[n] > cap:
                break
            q.popleft()
            self.blame[n] = freed_by
            self._start_compute(n, t)

    def _mem(self, d: int, delta: int, t: float, admit: bool = True) -> None:
        if delta == 0:
            return
        m = self.mem[d] + delta
        self.mem[d] = m
        if m > self.peak[d]:
            self.peak[d] = m
        self.tl_time[d].append(t)
        self.tl_bytes[d].append(m)
        if admit and delta < 0 and self.fifo[d]:
            self._admit(d, t)

    # ---- channels: processor sharing with a virtual clock -----------------------------

    def _channel_event(self, ch: int, t: float) -> None:
        """At time t, finish the transfers that are due on ch and let in those whose
        latency has elapsed."""
        active = self.chan_active[ch]
        v = self.chan_v[ch]
        if active:
            v += (t - self.chan_t[ch]) * self.chan_bw[ch] / len(active)
        finished = []
        if active and t >= self.chan_due[ch]:
            v = max(v, active[0][0])  # scheduled for the head: done, whatever the rounding
            limit = v + max(_BYTES_TOL, v * 1e-12)
            while active and active[0][0] <= limit:
                finished.append(heapq.heappop(active)[2])
        if not active:
            v = 0.0  # an idle channel restarts its clock at 0, which keeps marks small
        joining = self.chan_joining[ch]
        while joining and joining[0][0] <= t:
            _, owner, nbytes = joining.popleft()
            if nbytes <= 0:
                finished.append(owner)
            else:
                self.seq += 1
                heapq.heappush(active, (v + nbytes, self.seq, owner))
        self.chan_v[ch] = v
        self.chan_t[ch] = t
        if not self.is_dirty[ch]:
            self.is_dirty[ch] = True
            self.chan_dirty.append(ch)
        for owner in finished:
            left = self.remaining[owner] - 1
            self.remaining[owner] = left
            if left == 0:
                self._done(owner, t)

    def _flush_channels(self) -> None:
        """Schedule the next event of every channel whose state changed."""
        for ch in self.chan_dirty:
            self.is_dirty[ch] = False
            self.chan_version[ch] += 1
            active, joining = self.chan_active[ch], self.chan_joining[ch]
            due = float("inf")
            if active:
                due = self.chan_t[ch] + (active[0][0] - self.chan_v[ch]) * len(active) / self.chan_bw[ch]
            self.chan_due[ch] = due
            nxt = min(due, joining[0][0]) if joining else due
            if nxt < float("inf"):
                self.seq += 1
                heapq.heappush(self.events, (nxt, self.seq, ch, _EV_CHANNEL + self.chan_version[ch]))
        self.chan_dirty.clear()

    # ---- reporting ---------------------------------------------------------------------

    def _name(self, n: int) -> str:
        return str(self.tasks[n].action) if n < self.num_tasks else self.send_labels[n - self.num_tasks]

    def _stuck_reason(self, r: int) -> str:
        n = self.pos[r]
        waits = [f"{self._name(d)} (rank {self.rank_of[d]}, not finished)"
                 for d in self.deps.get(n, ()) if self.end[d] < 0]
        waits += self.missing.get(n, [])
        return f"rank {r} stuck at {self._name(n)} waiting for {', '.join(waits) or 'nothing'}"

    def _result(self) -> EmulatorResult:
        p = self.program
        iteration_s = max(0.0, max(self.end, default=0.0))
        busy = [0.0] * len(self.rank_nodes)
        busy_technique: dict[str, float] = {}
        for n, task in enumerate(self.tasks):
            if self.cat[n] == _COMPUTE:
                busy[self.rank_of[n]] += task.compute_s
                busy_technique[task.technique] = busy_technique.get(task.technique, 0.0) + task.compute_s
        sends: list[list[TaskSpan]] = [[] for _ in self.rank_nodes]
        for i, label in enumerate(self.send_labels):
            n = self.num_tasks + i
            lane = "+".join(x.channel for x in self.transfers[n])
            sends[self.rank_of[n]].append(TaskSpan(label, self.start[n], self.end[n], lane))
        caps = tuple(p.device_capacity_bytes)
        return EmulatorResult(
            iteration_s=iteration_s,
            samples_per_s=p.samples_per_iteration / iteration_s if iteration_s > 0 else 0.0,
            model_tflops=p.model_flops_per_iteration / iteration_s / 1e12 if iteration_s > 0 else 0.0,
            peak_bytes=tuple(self.peak),
            capacity_bytes=caps,
            oom=tuple(pk > cap for pk, cap in zip(self.peak, caps)),
            timeline=tuple(tuple(zip(ts, bs)) for ts, bs in zip(self.tl_time, self.tl_bytes)),
            stall_s_by_tensor=self.stall_tensor,
            stall_s_by_technique=self.stall_technique,
            stall_s_by_rank=tuple(self.stall_rank),
            busy_s_by_rank=tuple(busy),
            busy_s_by_technique=busy_technique,
            task_start_s=tuple(tuple(self.start[nodes.start:nodes.stop]) for nodes in self.rank_nodes),
            task_end_s=tuple(tuple(self.end[nodes.start:nodes.stop]) for nodes in self.rank_nodes),
            send_spans=tuple(tuple(s) for s in sends),
            program=p,
        )
