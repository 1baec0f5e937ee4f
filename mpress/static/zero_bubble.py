"""Compute orders of the schedules torch 2.13 added after interleaved 1F1B: zero bubble
(backward split into an input-gradient half I and a weight-gradient half W), the two
V-shaped schedules, and looped breadth-first.

Each function returns one rank's F/B/I/W actions in execution order (no optimizer
step: `mpress.static.schedules` finishes the lists and wraps them in a `Schedule`).
They follow the order torch's schedule classes lower to (`pipeline_order`), which
`tests/static/test_zero_bubble.py` compares shape by shape. torch's
`OVERLAP_F_B` action (DualPipeV) runs its forward and then its full backward on the
compute stream, so it is written here as those two actions.

Stage placement (R ranks): looped schedules put stage s on rank s % R; V schedules
have 2R stages, rank r runs stages r and 2R-1-r (see `v_stage_to_rank`).
"""

from __future__ import annotations

from collections import defaultdict, deque

from mpress.config.vocabulary import ScheduleName
from mpress.contract.actions import Action, Kind, stage_to_rank


def v_stage_to_rank(num_ranks: int) -> tuple[int, ...]:
    """Rank of each of the 2R stages of a V schedule: down the ranks, then back up."""
    return stage_to_rank(ScheduleName.ZBV, 2 * num_ranks, num_ranks)


class _Counted:
    """One rank's action list, with the next microbatch of each (stage, kind) counted:
    a zero-bubble schedule names work by stage and kind, microbatches come in order."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self._next: dict[tuple[int, Kind], int] = defaultdict(int)
        self.pending_w: deque[tuple[int, int]] = deque()  # (stage, microbatch) whose I ran, W not yet

    def add(self, stage: int, kind: Kind) -> None:
        # B and I of one stage share a counter: either starts the microbatch's backward
        key = (stage, Kind.I if kind is Kind.B else kind)
        m = self._next[key]
        self._next[key] = m + 1
        self.actions.append(Action(stage, kind, m))
        if kind is Kind.I:
            self.pending_w.append((stage, m))

    def add_w(self) -> None:
        """W of the oldest microbatch whose I ran and whose W has not (nothing if none)."""
        if self.pending_w:
            stage, m = self.pending_w.popleft()
            self.actions.append(Action(stage, Kind.W, m))

    def count(self, stage: int, kind: Kind) -> int:
        return self._next[(stage, kind)]


def interleaved_zero_bubble(rank: int, num_ranks: int, stages_per_rank: int, num_microbatches: int,
                            per_round: int) -> list[Action]:
    """torch's `ScheduleInterleavedZeroBubble` (ZB1P; ZB-H1 with one stage per rank).

    Like interleaved 1F1B, forwards walk the rank's stages round by round (`per_round`
    microbatches per stage) and backwards walk them in reverse, but rank r warms up with
    (V-1)*P + (R-1-r) forwards (one per hop, not two), runs I in place of B, and runs
    each W r steady-state steps after its I (rank 0 at once); the Ws left over close the
    iteration, oldest first.
    """
    chunks, total = stages_per_rank, stages_per_rank * num_microbatches
    warmup = min((chunks - 1) * per_round + (num_ranks - 1 - rank), total)
    out = _Counted()

    def forward_stage(j: int) -> int:
        return ((j // per_round) % chunks) * num_ranks + rank

    def backward_stage(k: int) -> int:
        return (chunks - 1 - (k // per_round) % chunks) * num_ranks + rank

    for j in range(warmup):
        out.add(forward_stage(j), Kind.F)
    for k in range(total):  # k-th backward; a forward precedes it while forwards remain
        if warmup + k < total:
            out.add(forward_stage(warmup + k), Kind.F)
        out.add(backward_stage(k), Kind.I)
        if k >= rank:
            out.add_w()
    while out.pending_w:
        out.add_w()
    return out.actions


def zbv(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    """torch's `ScheduleZBVZeroBubble`: rank r holds stage a = r (going down) and
    b = 2R-1-r (coming back up).

    The order is planned for n = max(M, 2R-1) microbatches (enough to fill the V) and
    the actions of microbatches >= M are then left out: warm-up 2(R-r)-1 forwards of a,
    r pairs (F b, F a), R-r triples (F b, I b, W b); steady state while forwards remain:
    (F a if any left, I a, W a, F b, I b, W b); cool-down r pairs (I a, I b), R-r pairs
    (I a, W a), then the Ws of b, then the Ws of a left.
    """
    n = max(num_microbatches, 2 * num_ranks - 1)
    a, b = rank, 2 * num_ranks - 1 - rank
    out = _Counted()
    for _ in range(2 * (num_ranks - rank) - 1):
        out.add(a, Kind.F)
    for _ in range(rank):
        out.add(b, Kind.F)
        out.add(a, Kind.F)
    for _ in range(num_ranks - rank):
        out.add(b, Kind.F)
        out.add(b, Kind.I)
        out.add(b, Kind.W)
    while out.count(b, Kind.F) < out.count(a, Kind.F) or out.count(a, Kind.F) < n:
        if out.count(a, Kind.F) < n:
            out.add(a, Kind.F)
        for stage in (a, b):
            if stage == b:
                out.add(b, Kind.F)
            out.add(stage, Kind.I)
            out.add(stage, Kind.W)
    w_a, w_b = out.count(a, Kind.W), out.count(b, Kind.W)
    for _ in range(rank):
        out.add(a, Kind.I)
        out.add(b, Kind.I)
    for _ in range(num_ranks - rank):
        out.add(a, Kind.I)
        out.actions.append(Action(a, Kind.W, w_a))
        w_a += 1
    out.actions.extend(Action(b, Kind.W, m) for m in range(w_b, out.count(b, Kind.I)))
    out.actions.extend(Action(a, Kind.W, m) for m in range(w_a, out.count(a, Kind.I)))
    return [act for act in out.actions if act.microbatch < num_microbatches]  # type: ignore[operator]


def dualpipe_v(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    """torch's `ScheduleDualPipeV` (M >= 2R): rank r holds stage a = r and b = 2R-1-r.

    Eight phases, as DeepSeek's DualPipeV: 2(R-1-r) forwards of a; r+1 pairs (F a,
    F b); R-1-r triples (I b, oldest W, F b); M-2R+r+1 overlapped pairs (F a with B b,
    then F b with B a; the last rank runs its first F a and B b apart); R-1-r pairs
    (B b, then F b with B a); r+1 pairs of backwards of b then a, full in their first
    half and split into I from the middle on (b first on odd ranks, a first on even);
    R-1-r pairs (oldest W, backward of a, split if the last phase split); r+1 oldest Ws.
    """
    R, M = num_ranks, num_microbatches
    a, b = rank, 2 * R - 1 - rank
    out = _Counted()
    for _ in range(2 * (R - 1 - rank)):
        out.add(a, Kind.F)
    for _ in range(rank + 1):
        out.add(a, Kind.F)
        out.add(b, Kind.F)
    for _ in range(R - 1 - rank):
        out.add(b, Kind.I)
        out.add_w()
        out.add(b, Kind.F)
    for i in range(M - 2 * R + rank + 1):
        out.add(a, Kind.F)  # overlapped or not, the forward runs first
        out.add(b, Kind.B)
        out.add(b, Kind.F)
        out.add(a, Kind.B)
    for _ in range(R - 1 - rank):
        out.add(b, Kind.B)
        out.add(b, Kind.F)
        out.add(a, Kind.B)
    split = False
    half = (rank + 1) // 2
    for i in range(rank + 1):
        for stage, odd in ((b, True), (a, False)):
            if i == half and (rank % 2 == 1) == odd:
                split = True
            out.add(stage, Kind.I if split else Kind.B)
    for _ in range(R - 1 - rank):
        out.add_w()
        out.add(a, Kind.I if split else Kind.B)
    for _ in range(rank + 1):
        out.add_w()
    return out.actions


def looped_bfs(rank: int, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> list[Action]:
    """torch's `ScheduleLoopedBFS`: every forward of the rank's first stage (microbatch
    order), then of its next stage, ...; then the backwards from its last stage back to
    its first, each stage's microbatches newest first."""
    stages = [c * num_ranks + rank for c in range(stages_per_rank)]
    acts = [Action(s, Kind.F, m) for s in stages for m in range(num_microbatches)]
    acts += [Action(s, Kind.B, m) for s in reversed(stages) for m in reversed(range(num_microbatches))]
    return acts
