"""The emulator's static task graph: nodes (tasks, then the sends between stages) and
what each waits for, built once per `Program` (semantics: `emulator.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from mpress.actions import Kind
from mpress.errors import ScheduleError
from mpress.static.program import Program, Task, Transfer

COMPUTE, COPY_OUT, COPY_IN, DROP, SEND = range(5)
"""Node categories."""
CATEGORY = {
    Kind.F: COMPUTE, Kind.B: COMPUTE, Kind.OPT: COMPUTE, Kind.RC: COMPUTE,
    Kind.SO: COPY_OUT, Kind.DO: COPY_OUT, Kind.OO: COPY_OUT,
    Kind.SI: COPY_IN, Kind.DI: COPY_IN, Kind.OI: COPY_IN,
    Kind.DR: DROP,
}
ARRIVAL = -1
"""`blame` value when the last thing a task waited for was the walk reaching it."""


@dataclass
class Nodes:
    """The tasks of every rank numbered rank by rank in list order, per-node state in flat
    lists (sends are appended by `build_dependencies`)."""

    tasks: list[Task]
    num_tasks: int
    rank_nodes: list[range]
    rank_of: list[int]
    cat: list[int]
    take: list[int]
    """Bytes a task takes when it starts (alloc + transient)."""
    give: list[int]
    """Bytes a task gives back when it ends (free + transient)."""
    transfers: list[tuple[Transfer, ...]]


def build_nodes(program: Program) -> Nodes:
    tasks = [t for rank_tasks in program.ranks for t in rank_tasks]
    rank_nodes: list[range] = []
    rank_of: list[int] = []
    for r, rank_tasks in enumerate(program.ranks):
        rank_nodes.append(range(len(rank_of), len(rank_of) + len(rank_tasks)))
        rank_of.extend([r] * len(rank_tasks))
    return Nodes(tasks=tasks, num_tasks=len(tasks), rank_nodes=rank_nodes, rank_of=rank_of,
                 cat=[CATEGORY[t.action.kind] for t in tasks],
                 take=[t.alloc_bytes + t.transient_bytes for t in tasks],
                 give=[t.free_bytes + t.transient_bytes for t in tasks],
                 transfers=[t.transfers for t in tasks])


@dataclass
class Graph:
    """What each node waits for. `pending[n]` counts it (for a task, also the walk
    reaching it); `done_waiters[d]` / `start_waiters[d]` list the nodes to notify when d
    ends / starts; `copyin_deps[n]`: the copy-ins compute task n consumes."""

    deps: dict[int, list[int]]
    missing: dict[int, list[str]]
    """Dependencies on actions the program does not have (a deadlock names them)."""
    start_waiters: dict[int, list[int]]
    copyin_deps: dict[int, list[int]]
    send_labels: list[str]
    pending: list[int]
    done_waiters: list[list[int] | None]
    device_of: list[int]


def build_dependencies(program: Program, nodes: Nodes, capacity_policy: bool) -> Graph:
    """The dependency graph of `program` (see `emulator.py`); appends one node per
    activation or gradient send to `nodes`."""
    tasks, cat = nodes.tasks, nodes.cat
    deps: dict[int, list[int]] = {}
    missing: dict[int, list[str]] = {}
    start_waiters: dict[int, list[int]] = {}
    copyin_deps: dict[int, list[int]] = {}
    fb: dict[tuple[Kind, int, int], int] = {}
    recomputes: list[int] = []
    grad_ready: dict[tuple[int, int], int] = {}  # (stage, mb) -> node bringing B's gradient
    for r, rank_range in enumerate(nodes.rank_nodes):
        last_out: dict[tuple[int, int | None, str | None], int] = {}
        open_in: dict[tuple[int, int | None], list[int]] = {}
        prev_compute = -1
        for n in rank_range:
            c = cat[n]
            if c == DROP:
                continue
            a = tasks[n].action
            if c == COMPUTE:
                if a.tensor is None:
                    waits = open_in.pop((a.stage, a.microbatch), None)
                else:  # OPT of one chunk of model data, or RC: only its own tensor
                    pending_in = open_in.get((a.stage, a.microbatch), [])
                    waits = [d for d in pending_in if tasks[d].action.tensor == a.tensor]
                    if waits:
                        pending_in[:] = [d for d in pending_in if tasks[d].action.tensor != a.tensor]
                if waits:
                    deps[n] = list(waits)
                    copyin_deps[n] = waits
                    if not capacity_policy and prev_compute >= 0:
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
            elif c == COPY_OUT:
                last_out[(a.stage, a.microbatch, a.tensor)] = n
            else:
                out = last_out.get((a.stage, a.microbatch, a.tensor))
                if out is not None:
                    deps.setdefault(n, []).append(out)
                open_in.setdefault((a.stage, a.microbatch), []).append(n)

    # cross-stage dependencies; sends become nodes after the tasks
    forward_stages = {s for (k, s, _m) in fb if k is Kind.F}
    send_labels: list[str] = []
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
            cat.append(SEND)
            deps[send] = [p]
            nodes.transfers.append(link)
            nodes.rank_of.append(nodes.rank_of[p])
            send_labels.append(label)
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
    pending = [1] * nodes.num_tasks + [0] * (num_nodes - nodes.num_tasks)
    done_waiters: list[list[int] | None] = [None] * num_nodes
    for n, ds in deps.items():
        pending[n] += len(ds)
        for d in ds:
            if cat[n] == COPY_IN and cat[d] == COMPUTE:
                continue  # a layer-ahead anchor: satisfied when it starts (start_waiters)
            ws = done_waiters[d]
            if ws is None:
                done_waiters[d] = [n]
            else:
                ws.append(n)
    for n, ms in missing.items():
        pending[n] += len(ms)
    return Graph(deps=deps, missing=missing, start_waiters=start_waiters, copyin_deps=copyin_deps,
                 send_labels=send_labels, pending=pending, done_waiters=done_waiters,
                 device_of=[program.rank_device[r] for r in nodes.rank_of])
