"""The emulator's static task graph: nodes (tasks, then the sends between stages) and
what each waits for, built once per `Program` (semantics: `emulator.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from mpress.contract.actions import Kind
from mpress.errors import ScheduleError
from mpress.static.emulate.program import Program, Task, Transfer

COMPUTE, COPY_OUT, COPY_IN, MARKER, SEND = range(5)
"""Node categories."""
CATEGORY = {
    Kind.F: COMPUTE, Kind.B: COMPUTE, Kind.I: COMPUTE, Kind.W: COMPUTE, Kind.OPT: COMPUTE, Kind.RC: COMPUTE,
    Kind.SO: COPY_OUT, Kind.DO: COPY_OUT, Kind.OO: COPY_OUT,
    Kind.SI: COPY_IN, Kind.DI: COPY_IN, Kind.OI: COPY_IN,
    Kind.DR: MARKER,
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
    transfers: list[tuple[Transfer, ...]]


def build_nodes(program: Program) -> Nodes:
    tasks = [t for rank_tasks in program.ranks for t in rank_tasks]
    rank_nodes: list[range] = []
    rank_of: list[int] = []
    for r, rank_tasks in enumerate(program.ranks):
        rank_nodes.append(range(len(rank_of), len(rank_of) + len(rank_tasks)))
        rank_of.extend([r] * len(rank_tasks))
    return Nodes(tasks=tasks, num_tasks=len(tasks), rank_nodes=rank_nodes, rank_of=rank_of,
                 cat=[CATEGORY[t.action.kind] for t in tasks], transfers=[t.transfers for t in tasks])


@dataclass
class Graph:
    """What each node waits for. `pending[n]` counts it (for a task, also the walk
    reaching it); `done_waiters[d]` lists the nodes to notify when d ends."""

    deps: dict[int, list[int]]
    missing: dict[int, list[str]]
    """Dependencies on actions the program does not have (a deadlock names them)."""
    send_labels: list[str]
    pending: list[int]
    done_waiters: list[list[int] | None]
    device_of: list[int]


def _group(task: Task) -> tuple[Kind, int, int | str | None]:
    """The compute action a task belongs to: a recompute runs inside its backward. A
    split backward's I stands for the microbatch's backward (what the stage before waits
    for); its W is a group of its own."""
    a = task.action
    if a.kind in (Kind.RC, Kind.I):
        return (Kind.B, a.stage, a.microbatch)
    return (a.kind, a.stage, a.microbatch if a.kind is not Kind.OPT else a.tensor)


def build_dependencies(program: Program, nodes: Nodes) -> Graph:
    """The dependency graph of `program` (see `emulator.py`); appends one node per
    activation or gradient send to `nodes`."""
    tasks, cat = nodes.tasks, nodes.cat
    deps: dict[int, list[int]] = {}
    missing: dict[int, list[str]] = {}
    groups: dict[tuple[Kind, int, int], list[int]] = {}  # (F|B, stage, mb) -> [first node, last node]
    for r, rank_range in enumerate(nodes.rank_nodes):
        # copies by (stage, microbatch, tensor): a unit has one name in every microbatch
        last_out: dict[tuple[int, int | None, str | None], int] = {}
        open_in: dict[tuple[int, int | None, str | None], int] = {}
        unreleased: list[int] = []
        current = None
        for n in rank_range:
            c, a = cat[n], tasks[n].action
            if c == COPY_OUT:
                last_out[(a.stage, a.microbatch, a.tensor)] = n
                unreleased.append(n)
            elif c == COPY_IN:
                out = last_out.get((a.stage, a.microbatch, a.tensor))
                if out is not None:
                    deps.setdefault(n, []).append(out)
                open_in[(a.stage, a.microbatch, a.tensor)] = n
            elif c == COMPUTE:
                task = tasks[n]
                key = _group(task)
                if key != current:
                    current = key
                    if key[0] in (Kind.F, Kind.B, Kind.W):
                        if key in groups:
                            raise ScheduleError(f"rank {r}: action {key[1]}{key[0].value}{key[2]} appears twice "
                                                "in the program")
                        groups[key] = [n, n]  # type: ignore[index]
                elif key[0] in (Kind.F, Kind.B, Kind.W):
                    groups[key][1] = n  # type: ignore[index]
                if task.starts_action and unreleased:
                    deps.setdefault(n, []).extend(unreleased)
                    unreleased = []
                for tensor in task.consumes:
                    d = open_in.get((a.stage, a.microbatch, tensor))
                    if d is None:
                        missing.setdefault(n, []).append(f"a copy-in of {tensor} (not issued before it)")
                    else:
                        deps.setdefault(n, []).append(d)
    send_labels: list[str] = []
    forward_stages = {s for (k, s, _m) in groups if k is Kind.F}
    for (k, s, m), (first, _last) in groups.items():
        if k is Kind.F and s > 0:
            pred, link, label = (Kind.F, s - 1, m), program.sends.get((s - 1, s)), f"send:{s - 1}F{m}->{s}"
        elif k is Kind.B:
            own = groups.get((Kind.F, s, m))
            if own is None:
                missing.setdefault(first, []).append(f"{s}F{m} (not in the program)")
            else:
                deps.setdefault(first, []).append(own[1])
            if s + 1 not in forward_stages:
                continue
            pred, link, label = (Kind.B, s + 1, m), program.grad_sends.get((s + 1, s)), f"send:{s + 1}B{m}->{s}"
        elif k is Kind.W:  # after its own I
            own = groups.get((Kind.B, s, m))
            if own is None:
                missing.setdefault(first, []).append(f"{s}I{m} (not in the program)")
            else:
                deps.setdefault(first, []).append(own[1])
            continue
        else:
            continue
        p = groups.get(pred)
        if p is None:
            missing.setdefault(first, []).append(f"{pred[1]}{pred[0].value}{m} (not in the program)")
        elif link:
            send = len(cat)
            cat.append(SEND)
            deps[send] = [p[1]]
            nodes.transfers.append(link)
            nodes.rank_of.append(nodes.rank_of[p[1]])
            send_labels.append(label)
            deps.setdefault(first, []).append(send)
        else:
            deps.setdefault(first, []).append(p[1])
    num_nodes = len(cat)
    pending = [1] * nodes.num_tasks + [0] * (num_nodes - nodes.num_tasks)
    done_waiters: list[list[int] | None] = [None] * num_nodes
    for n, ds in deps.items():
        pending[n] += len(ds)
        for d in ds:
            ws = done_waiters[d]
            if ws is None:
                done_waiters[d] = [n]
            else:
                ws.append(n)
    for n, ms in missing.items():
        pending[n] += len(ms)
    return Graph(deps=deps, missing=missing, send_labels=send_labels, pending=pending, done_waiters=done_waiters,
                 device_of=[program.rank_device[r] for r in nodes.rank_of])
