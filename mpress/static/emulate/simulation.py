"""The discrete-event simulation behind `emulate` (semantics: `emulator.py`)."""

from __future__ import annotations

import heapq
from collections import deque

from mpress.errors import ScheduleError
from mpress.static.emulate.dependencies import (
    ARRIVAL,
    COMPUTE,
    COPY_IN,
    COPY_OUT,
    MARKER,
    build_dependencies,
    build_nodes,
)
from mpress.static.emulate.emulator_result import EmulatorResult, TaskSpan
from mpress.static.emulate.program import Cost, Program

_EV_COMPUTE_END, _EV_CHANNEL = 0, 1
_BYTES_TOL = 1e-3
"""Virtual-clock differences below this many bytes are rounding, not data."""


class Simulation:
    """State of one run. Nodes are the tasks (numbered rank by rank, in list order)
    followed by the sends; per-node state lives in flat lists indexed by node id, which
    keeps the hot loop free of attribute look-ups on task objects."""

    def __init__(self, program: Program) -> None:
        self.program = program
        nodes = build_nodes(program)
        graph = build_dependencies(program, nodes)
        self.tasks, self.num_tasks, self.rank_nodes = nodes.tasks, nodes.num_tasks, nodes.rank_nodes
        self.rank_of, self.cat, self.transfers = nodes.rank_of, nodes.cat, nodes.transfers
        self.deps, self.missing, self.send_labels = graph.deps, graph.missing, graph.send_labels
        self.pending, self.done_waiters, self.device_of = graph.pending, graph.done_waiters, graph.device_of
        self._build_channels(program)
        num_nodes = len(self.cat)
        self.arrival = [0.0] * num_nodes
        self.start = [-1.0] * num_nodes
        self.end = [-1.0] * num_nodes
        self.remaining = [0] * num_nodes
        self.blame = [ARRIVAL] * num_nodes
        num_devices = len(program.device_capacity_bytes)
        self.mem = [0] * num_devices
        for r, d in enumerate(program.rank_device):
            self.mem[d] += program.static_bytes[r]
        self.peak = list(self.mem)
        self.tl_time: list[list[float]] = [[0.0] for _ in range(num_devices)]
        self.tl_bytes: list[list[int]] = [[m] for m in self.mem]
        self.pos = [nodes.start for nodes in self.rank_nodes]
        self.stall_tensor: dict[str, float] = {}
        self.stall_cost: dict[Cost, float] = {}
        self.stall_rank = [0.0] * len(program.ranks)
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = 0

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
        """Walk rank r from its position: issue copies (and pass markers) up to the next
        compute task, which is reached at time t."""
        cat = self.cat
        stop = self.rank_nodes[r].stop
        n = self.pos[r]
        while n < stop:
            c = cat[n]
            if c == COMPUTE:
                self.pos[r] = n
                self.arrival[n] = t
                self._satisfy(n, ARRIVAL, t)
                return
            if c == MARKER:
                self.start[n] = self.end[n] = t
            else:
                if n < self.num_tasks and self.tasks[n].alloc_bytes:  # a copy-in takes its bytes when issued
                    self._mem(self.device_of[n], self.tasks[n].alloc_bytes, t)
                self._satisfy(n, ARRIVAL, t)
            n += 1
        self.pos[r] = stop

    def _satisfy(self, n: int, by: int, t: float) -> None:
        left = self.pending[n] - 1
        self.pending[n] = left
        self.blame[n] = by
        if left == 0:
            if self.cat[n] == COMPUTE:
                self._start_compute(n, t)
            else:
                self._start_copy(n, t)

    def _start_compute(self, n: int, t: float) -> None:
        task = self.tasks[n]
        self.start[n] = t
        stall = t - self.arrival[n]
        if stall > 0:
            self.stall_rank[self.rank_of[n]] += stall
            b = self.blame[n]
            if b >= 0 and self.cat[b] in (COPY_IN, COPY_OUT):
                culprit = self.tasks[b]
                tensor = culprit.action.tensor or ""
                self.stall_tensor[tensor] = self.stall_tensor.get(tensor, 0.0) + stall
                cost = culprit.cost
            else:
                cost = Cost.PIPELINE
            self.stall_cost[cost] = self.stall_cost.get(cost, 0.0) + stall
        d = self.device_of[n]
        self._mem(d, task.alloc_bytes + task.transient_bytes - task.release_bytes, t)
        self.seq += 1
        heapq.heappush(self.events, (t + task.compute_s, self.seq, n, _EV_COMPUTE_END))

    def _start_copy(self, n: int, t: float) -> None:
        """Start a copy task or send: its transfers join their channels after the latency
        (a copy-in took its bytes when it was issued)."""
        self.start[n] = t
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
        if n < self.num_tasks:
            task = self.tasks[n]
            given = task.free_bytes + (task.transient_bytes if self.cat[n] == COMPUTE else 0)
            if given:
                self._mem(self.device_of[n], -given, t)
        ws = self.done_waiters[n]
        if ws is not None:
            for w in ws:
                self._satisfy(w, n, t)

    def _mem(self, d: int, delta: int, t: float) -> None:
        if delta == 0:
            return
        m = self.mem[d] + delta
        self.mem[d] = m
        if m > self.peak[d]:
            self.peak[d] = m
        self.tl_time[d].append(t)
        self.tl_bytes[d].append(m)

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
        return self.tasks[n].label() if n < self.num_tasks else self.send_labels[n - self.num_tasks]

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
        busy_cost: dict[Cost, float] = {}
        for n, task in enumerate(self.tasks):
            if self.cat[n] == COMPUTE:
                busy[self.rank_of[n]] += task.compute_s
                busy_cost[task.cost] = busy_cost.get(task.cost, 0.0) + task.compute_s
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
            stall_s_by_cost=self.stall_cost,
            stall_s_by_rank=tuple(self.stall_rank),
            busy_s_by_rank=tuple(busy),
            busy_s_by_cost=busy_cost,
            task_start_s=tuple(tuple(self.start[nodes.start:nodes.stop]) for nodes in self.rank_nodes),
            task_end_s=tuple(tuple(self.end[nodes.start:nodes.stop]) for nodes in self.rank_nodes),
            send_spans=tuple(tuple(s) for s in sends),
            program=p,
        )
