"""Pipeline schedules as data: per-rank F/B action lists for one training iteration.

Every builder is a pure function of the pipeline shape and returns a
`mpress.contract.actions.Schedule`. Stage `s` runs on rank `s` except in the interleaved,
interleaved zero-bubble and looped-BFS schedules, where it runs on rank `s % num_ranks`,
and in the V schedules, where rank r runs stages r and 2R-1-r. Each rank's list holds
the forward (`{s}F{m}`) and backward (`{s}B{m}`, or its halves `{s}I{m}` and `{s}W{m}`)
of every microbatch of each of its stages and
ends with one optimizer step (`{s}OPT`) per stage, after the rank's last backward.
Send/recv are implicit (the emulator and executor derive them from stage order);
memory actions are inserted later by the rewriter.

Families (S = num_stages, M = num_microbatches, r = rank):

- `gpipe`: all forwards, then all backwards in microbatch order 0..M-1 (as torch's
  `ScheduleGPipe` runs them). M microbatches in flight on every stage.
- `1f1b` (DAPPLE, synchronous): min(S-1-r, M) warm-up forwards, then one forward and
  one backward alternately, then the remaining backwards. Peak in flight: min(S-r, M).
  Same order as torch's `Schedule1F1B` (which words it as S-r warm-up forwards and
  then "1B1F": the same sequence).
- `pipedream` (asynchronous 1F1B with weight stashing): see `pipedream`.
- `interleaved` (Megatron virtual stages): torch's `ScheduleInterleaved1F1B` order.
- `interleaved-zb`, `zbv`, `dualpipev`, `looped-bfs`: torch's zero-bubble, V-shaped and
  breadth-first orders (`mpress.static.zero_bubble`). A split backward is an I (input
  gradient, what the stage before waits for) and a later W (weight gradient) of the
  same microbatch on the same rank; a schedule may mix full B and split I/W.
"""

from __future__ import annotations


from mpress.contract.actions import BACKWARD_KINDS, INPUT_GRAD_KINDS, Action, Kind, Schedule, warmup_order
from mpress.errors import ScheduleError
from mpress.config.vocabulary import V_SCHEDULES, ScheduleName
from mpress.static import zero_bubble


def _check_count(what: str, value: int) -> None:
    # bool is an int subclass; `True` stages is a caller bug, not a count
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"{what} must be an integer >= 1, got {value!r}")


def _finish(stage_order: list[int], actions: list[Action]) -> tuple[Action, ...]:
    """Append one OPT per stage, in the order the stages finished their backwards
    (the order torch schedules its per-stage grad reduction)."""
    last_b: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.kind in (Kind.B, Kind.W):
            last_b[a.stage] = i
    order = sorted(stage_order, key=lambda s: last_b.get(s, -1))
    return tuple(actions) + tuple(Action(s, Kind.OPT) for s in order)


def _one_f_one_b_rank(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """DAPPLE order of one stage that has the pipeline to itself on its rank."""
    return warmup_order(stage, num_microbatches, num_stages - 1 - stage)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe fill-drain: each rank runs F0..F(M-1), then B0..B(M-1), then OPT."""
    _check_count("num_stages", num_stages)
    _check_count("num_microbatches", num_microbatches)
    ranks = []
    for s in range(num_stages):
        acts = [Action(s, Kind.F, m) for m in range(num_microbatches)]
        acts += [Action(s, Kind.B, m) for m in range(num_microbatches)]
        ranks.append(_finish([s], acts))
    return Schedule(ScheduleName.GPIPE, num_stages, num_microbatches, tuple(range(num_stages)), tuple(ranks))


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """DAPPLE synchronous 1F1B (flush at the end of the iteration).

    Rank r: min(S-1-r, M) warm-up forwards, then F(next), B(oldest) pairs until every
    forward is done, then the remaining backwards, then OPT. Unlike torch's
    `Schedule1F1B`, M < S is allowed (warm-up is capped by M).
    """
    _check_count("num_stages", num_stages)
    _check_count("num_microbatches", num_microbatches)
    ranks = tuple(
        _finish([s], _one_f_one_b_rank(s, num_stages, num_microbatches)) for s in range(num_stages)
    )
    return Schedule(ScheduleName.ONE_F_ONE_B, num_stages, num_microbatches, tuple(range(num_stages)), ranks)


def pipedream(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream asynchronous 1F1B with weight stashing, one iteration's window.

    Decision (PipeDream, SOSP'19; PAPERS.md "one weight version per microbatch in
    flight"): PipeDream's start-up admits S microbatches into stage 0 (NOAM = S for a
    straight pipeline), stage r then has S-r in flight and alternates one backward and
    one forward. That is exactly the order and the in-flight depth of DAPPLE's 1F1B
    (DAPPLE's "S-1-r warm-up forwards" are counted before the first F/B pair, whose F
    brings the depth to S-r), so PipeDream does NOT keep one more microbatch in
    flight: `max_in_flight(schedule, r) == min(S-r, M)` for both. What differs:

    - `weight_stashing=True`: each in-flight microbatch's backward must use the weights
      its forward used, so stage r keeps `max_in_flight` weight versions (the live
      weights are the newest microbatch's version, hence `max_in_flight - 1` extra
      copies; see `num_weight_versions`).
    - No flush: in a real run iteration i+1's warm-up overlaps iteration i's cool-down.
      The window keeps the fill/drain form so that every F and B of the iteration
      appears once (what the emulator, liveness and validation need); the memory
      peak is the same as the steady state's, the emulated time includes one bubble.
    - The optimizer step is modelled once per window (`{s}OPT` after the last
      backward), as with gradient accumulation over the window; PipeDream proper
      updates after each microbatch, which changes time, not peak memory.
    """
    sched = one_f_one_b(num_stages, num_microbatches)
    return Schedule(ScheduleName.PIPEDREAM, sched.num_stages, sched.num_microbatches, sched.stage_to_rank, sched.ranks,
                    weight_stashing=True)


def interleaved_rounds(num_ranks: int, num_microbatches: int) -> tuple[int, int]:
    """(rounds, microbatches per round) of the interleaved schedule, as torch computes
    them: rounds = max(1, M // num_ranks), which must divide M."""
    rounds = max(1, num_microbatches // num_ranks)
    if num_microbatches % rounds != 0:
        valid = sorted({num_ranks * max(1, num_microbatches // num_ranks), num_ranks * (num_microbatches // num_ranks + 1)})
        raise ScheduleError(
            f"interleaved schedule with {num_ranks} ranks: num_microbatches={num_microbatches} must be "
            f"below {num_ranks} or a multiple of max(1, num_microbatches // num_ranks) = {rounds} "
            f"(as torch's ScheduleInterleaved1F1B requires); e.g. {' or '.join(map(str, valid))}"
        )
    return rounds, num_microbatches // rounds


def interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    """Megatron interleaved 1F1B (virtual stages), in torch's `ScheduleInterleaved1F1B` order.

    S = num_ranks * stages_per_rank stages; stage s runs on rank s % num_ranks. Work is
    cut into rounds of P = M / rounds microbatches (see `interleaved_rounds`). Rank r's
    j-th forward runs local chunk (j // P) % V, i.e. P microbatches on its first
    stage, the same P on its next stage, ..., then the next P microbatches; its j-th
    backward walks the chunks in reverse (last local stage first). Rank r first runs
    W = min((V-1)*P + 2*(num_ranks-1-r), V*M) forwards, then pairs (next forward, next
    backward), then the remaining backwards.
    """
    _check_count("num_ranks", num_ranks)
    _check_count("num_microbatches", num_microbatches)
    _check_count("stages_per_rank", stages_per_rank)
    _, per_round = interleaved_rounds(num_ranks, num_microbatches)
    chunks = stages_per_rank
    total = chunks * num_microbatches  # forwards (and backwards) per rank

    def action(j: int, rank: int, kind: Kind) -> Action:
        # the j-th forward (or backward) of `rank`
        round_index, within = divmod(j, per_round * chunks)
        chunk = within // per_round
        if kind is Kind.B:
            chunk = chunks - 1 - chunk  # backwards leave the last local stage first
        return Action(chunk * num_ranks + rank, kind, round_index * per_round + within % per_round)

    ranks = []
    for r in range(num_ranks):
        warmup = min((chunks - 1) * per_round + 2 * (num_ranks - 1 - r), total)
        acts = [action(j, r, Kind.F) for j in range(warmup)]
        for k in range(total - warmup):
            acts += [action(warmup + k, r, Kind.F), action(k, r, Kind.B)]
        acts += [action(k, r, Kind.B) for k in range(total - warmup, total)]
        ranks.append(_finish([c * num_ranks + r for c in range(chunks)], acts))
    num_stages = num_ranks * chunks
    return Schedule(ScheduleName.INTERLEAVED, num_stages, num_microbatches,
                    tuple(s % num_ranks for s in range(num_stages)), tuple(ranks))


def interleaved_zero_bubble(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    """torch's `ScheduleInterleavedZeroBubble` (see `zero_bubble.interleaved_zero_bubble`);
    stage s on rank s % num_ranks, microbatch counts as the interleaved schedule's."""
    for what, v in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches),
                    ("stages_per_rank", stages_per_rank)):
        _check_count(what, v)
    _, per_round = interleaved_rounds(num_ranks, num_microbatches)
    return _looped(ScheduleName.INTERLEAVED_ZB, num_ranks, stages_per_rank, num_microbatches, [
        zero_bubble.interleaved_zero_bubble(r, num_ranks, stages_per_rank, num_microbatches, per_round)
        for r in range(num_ranks)])


def looped_bfs(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    """torch's `ScheduleLoopedBFS` (see `zero_bubble.looped_bfs`); stage s on rank s % num_ranks."""
    for what, v in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches),
                    ("stages_per_rank", stages_per_rank)):
        _check_count(what, v)
    return _looped(ScheduleName.LOOPED_BFS, num_ranks, stages_per_rank, num_microbatches, [
        zero_bubble.looped_bfs(r, num_ranks, stages_per_rank, num_microbatches) for r in range(num_ranks)])


def _looped(name: ScheduleName, num_ranks: int, chunks: int, num_microbatches: int,
            orders: list[list[Action]]) -> Schedule:
    num_stages = num_ranks * chunks
    ranks = tuple(_finish([c * num_ranks + r for c in range(chunks)], acts) for r, acts in enumerate(orders))
    return Schedule(name, num_stages, num_microbatches, tuple(s % num_ranks for s in range(num_stages)), ranks)


def v_schedule(name: ScheduleName, num_ranks: int, num_microbatches: int) -> Schedule:
    """`zbv` or `dualpipev` on `num_ranks` ranks: 2R stages, rank r runs r and 2R-1-r.
    DualPipeV needs M >= 2R microbatches (as torch's `ScheduleDualPipeV`)."""
    _check_count("num_ranks", num_ranks)
    _check_count("num_microbatches", num_microbatches)
    if name is ScheduleName.DUALPIPEV and num_microbatches < 2 * num_ranks:
        raise ScheduleError(f"schedule dualpipev on {num_ranks} ranks: num_microbatches={num_microbatches} must be "
                            f">= {2 * num_ranks} (the number of stages)")
    build = zero_bubble.zbv if name is ScheduleName.ZBV else zero_bubble.dualpipe_v
    ranks = tuple(_finish([r, 2 * num_ranks - 1 - r], build(r, num_ranks, num_microbatches))
                  for r in range(num_ranks))
    return Schedule(name, 2 * num_ranks, num_microbatches, zero_bubble.v_stage_to_rank(num_ranks), ranks)


_MULTI_STAGE = (ScheduleName.INTERLEAVED, ScheduleName.INTERLEAVED_ZB, ScheduleName.LOOPED_BFS)


def build_schedule(name: ScheduleName, num_stages: int, num_microbatches: int, *,
                   num_ranks: int | None = None) -> Schedule:
    """Build a schedule by family name.

    num_ranks: for `interleaved`, `interleaved-zb` and `looped-bfs` (required there;
    num_stages must be a multiple of it); for `zbv` and `dualpipev` it defaults to
    num_stages / 2 and must be exactly that. For the other families it may be omitted
    or equal num_stages. Raises `ScheduleError` (one line) for a bad name or combination.
    """
    if name not in ScheduleName.words():
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(ScheduleName.words())}")
    name = ScheduleName(name)
    _check_count("num_stages", num_stages)
    _check_count("num_microbatches", num_microbatches)
    if name in _MULTI_STAGE:
        if num_ranks is None:
            raise ScheduleError(f"the {name} schedule needs num_ranks (stages are spread round-robin over ranks)")
        _check_count("num_ranks", num_ranks)
        if num_stages % num_ranks != 0:
            raise ScheduleError(
                f"{name} schedule: num_stages={num_stages} must be a multiple of num_ranks={num_ranks}")
        build = {ScheduleName.INTERLEAVED: interleaved_1f1b, ScheduleName.INTERLEAVED_ZB: interleaved_zero_bubble,
                 ScheduleName.LOOPED_BFS: looped_bfs}[name]
        return _validated(build(num_ranks, num_microbatches, num_stages // num_ranks))
    if name in V_SCHEDULES:
        if num_stages % 2 or (num_ranks is not None and num_ranks * 2 != num_stages):
            raise ScheduleError(f"schedule {name} runs two stages per rank: num_stages={num_stages} must be "
                                f"2 * num_ranks (num_ranks={num_ranks})")
        return _validated(v_schedule(name, num_stages // 2, num_microbatches))
    if num_ranks is not None and num_ranks != num_stages:
        raise ScheduleError(
            f"schedule {name} runs one stage per rank: num_ranks={num_ranks} must equal num_stages={num_stages} "
            f"(use the interleaved schedule for several stages per rank)")
    builders = {ScheduleName.GPIPE: gpipe, ScheduleName.ONE_F_ONE_B: one_f_one_b, ScheduleName.PIPEDREAM: pipedream}
    return _validated(builders[name](num_stages, num_microbatches))


def _validated(schedule: Schedule) -> Schedule:
    validate_schedule(schedule)  # a builder bug would otherwise surface as an emulator deadlock
    return schedule


def max_in_flight(schedule: Schedule, stage: int) -> int:
    """Most microbatches of `stage` whose forward has run and whose backward has not,
    walking the stage's rank list in order. This is how many microbatches' saved
    activations the stage holds at its peak (before any memory action). A split
    backward's microbatch stays in flight until its W (what W needs lives until then)."""
    if not 0 <= stage < schedule.num_stages:
        raise ScheduleError(f"stage {stage} out of range: schedule {schedule.name} has {schedule.num_stages} stages")
    live = peak = 0
    for a in schedule.ranks[schedule.stage_to_rank[stage]]:
        if a.stage != stage:
            continue
        if a.kind is Kind.F:
            live += 1
            peak = max(peak, live)
        elif a.kind in (Kind.B, Kind.W):
            live -= 1
    return peak


def num_weight_versions(schedule: Schedule, stage: int) -> int:
    """Weight versions `stage` holds at its peak, the live weights included: 1 without
    weight stashing, else one per microbatch in flight (PipeDream)."""
    return max_in_flight(schedule, stage) if schedule.weight_stashing else 1


def validate_schedule(schedule: Schedule) -> None:
    """Raise `ScheduleError` unless `schedule` is well formed and can run.

    Checks: one action list per rank of `stage_to_rank`; every (stage, microbatch) has
    one F and either one B or one I and one W, on the stage's rank, in that order; every
    stage has exactly one OPT on its rank, after its last backward; and the ranks cannot
    deadlock: stepping through the lists, F of (s, m) waits for F of (s-1, m) and B or I
    of (s, m) for B or I of (s+1, m). Other actions (memory actions) are not checked here.
    """
    S, M = schedule.num_stages, schedule.num_microbatches
    name = schedule.name
    if len(schedule.stage_to_rank) != S:
        raise ScheduleError(f"schedule {name}: stage_to_rank has {len(schedule.stage_to_rank)} entries, expected {S}")
    used = set(schedule.stage_to_rank)
    if used != set(range(schedule.num_ranks)):
        raise ScheduleError(
            f"schedule {name}: stage_to_rank {list(schedule.stage_to_rank)} must use exactly ranks "
            f"0..{schedule.num_ranks - 1}")
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, stage, mb) -> rank
    opt_seen: set[int] = set()
    before = {Kind.B: Kind.F, Kind.I: Kind.F, Kind.W: Kind.I}
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            if a.kind not in (Kind.F, Kind.OPT) and a.kind not in BACKWARD_KINDS:
                continue
            where = f"schedule {name}, rank {r}, action {i} ({a})"
            if a.stage >= S or schedule.stage_to_rank[a.stage] != r:
                raise ScheduleError(f"{where}: stage {a.stage} does not run on rank {r}")
            if a.kind is Kind.OPT:
                if a.stage in opt_seen:
                    raise ScheduleError(f"{where}: second optimizer step of stage {a.stage}")
                opt_seen.add(a.stage)
                continue
            if a.stage in opt_seen:
                raise ScheduleError(f"{where}: after the optimizer step of stage {a.stage}")
            if a.microbatch >= M:
                raise ScheduleError(f"{where}: microbatch {a.microbatch} >= num_microbatches {M}")
            key = (a.kind, a.stage, a.microbatch)
            other_half = {Kind.B: Kind.I, Kind.I: Kind.B}.get(a.kind)  # a full B and a split one
            if key in done or (other_half, a.stage, a.microbatch) in done:
                raise ScheduleError(f"{where}: runs twice")
            if a.kind in before and (before[a.kind], a.stage, a.microbatch) not in done:
                raise ScheduleError(f"{where}: {'backward before its forward' if before[a.kind] is Kind.F else 'W before its I'}")
            done[key] = r
    for s in range(S):
        for m in range(M):
            if (Kind.F, s, m) not in done:
                raise ScheduleError(f"schedule {name}: {s}F{m} is missing")
            if (Kind.B, s, m) not in done and not {(Kind.I, s, m), (Kind.W, s, m)} <= done.keys():
                raise ScheduleError(f"schedule {name}: {s}B{m} is missing (nor are {s}I{m} and {s}W{m} both there)")
    missing_opt = sorted(set(range(S)) - opt_seen)
    if missing_opt:
        raise ScheduleError(f"schedule {name}: no optimizer step (OPT) for stage(s) {missing_opt}")
    _check_progress(schedule)


def _check_progress(schedule: Schedule) -> None:
    """Raise `ScheduleError` if the ranks' F/B orders wait on each other in a cycle."""
    S = schedule.num_stages
    lists = [[a for a in acts if a.kind is Kind.F or a.kind in BACKWARD_KINDS] for acts in schedule.ranks]
    pos = [0] * len(lists)
    finished: set[tuple[Kind, int, int]] = set()

    def ready(a: Action) -> bool:
        if a.kind is Kind.F:
            return a.stage == 0 or (Kind.F, a.stage - 1, a.microbatch) in finished
        if a.kind is Kind.W:  # after its own I, earlier on the same rank
            return True
        # the last stage's backward starts from the loss of its own forward
        return a.stage == S - 1 or any((k, a.stage + 1, a.microbatch) in finished for k in INPUT_GRAD_KINDS)

    progressed = True
    while progressed:
        progressed = False
        for r, acts in enumerate(lists):
            while pos[r] < len(acts) and ready(acts[pos[r]]):
                a = acts[pos[r]]
                finished.add((a.kind, a.stage, a.microbatch))
                pos[r] += 1
                progressed = True
    stuck = [f"rank {r} at {acts[pos[r]]}" for r, acts in enumerate(lists) if pos[r] < len(acts)]
    if stuck:
        raise ScheduleError(f"schedule {schedule.name} deadlocks: {', '.join(stuck)}")


_HOLD_TO_END = frozenset(ScheduleName) - {ScheduleName.ONE_F_ONE_B, ScheduleName.PIPEDREAM}
"""Schedules whose torch class keeps every send's work until its step returns."""


def held_outputs(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """Stage outputs that torch's schedule keeps alive past their microbatch's backward:
    (stage, microbatch) of the forward -> (stage, microbatch) of the backward (on the same
    rank) at whose end the output is let go.

    A forward's output is sent to the next stage with `isend`; the `Work` object of the
    send holds the tensor until the schedule drops the work, and the schedules drop some
    works late (torch 2.x, `torch/distributed/pipelining/schedules.py`):

    - `ScheduleGPipe` keeps every forward send's work in `fwd_sends_to_wait`, and
      `ScheduleInterleaved1F1B` (`_PipelineScheduleRuntime`) every send's in `send_ops`,
      until the step returns: every output a stage sends lives until the rank's last
      backward ends;
    - `Schedule1F1B` keeps the work of the last warm-up forward it fires on its own
      (forward `min(M, S - s) - 2`) in `send_work` until its 1B1F loop is over: that
      output lives until the end of the backward that follows the stage's last forward.

    The last stage sends nothing. PipeDream runs as `Schedule1F1B`; the zero-bubble, V
    and looped-BFS schedules are `_PipelineScheduleRuntime`s as interleaved 1F1B is (the
    holder is then the rank's last backward action, a B or a W).
    """
    held: dict[tuple[int, int], tuple[int, int]] = {}
    for s in range(schedule.num_stages - 1):
        rank_actions = [a for a in schedule.ranks[schedule.stage_to_rank[s]]
                        if a.kind is Kind.F or a.kind in BACKWARD_KINDS]
        if schedule.name in _HOLD_TO_END:
            last = [a for a in rank_actions if a.kind in BACKWARD_KINDS][-1]
            for m in range(schedule.num_microbatches):
                held[(s, m)] = (last.stage, last.microbatch)  # type: ignore[assignment]
            continue
        m = min(schedule.num_microbatches, schedule.num_stages - s) - 2
        if m < 0:
            continue
        actions = [a for a in rank_actions if a.stage == s]
        last_forward = max(i for i, a in enumerate(actions) if a.kind is Kind.F)
        release = next(a for a in actions[last_forward:] if a.kind is Kind.B)
        own = next(i for i, a in enumerate(actions) if a.kind is Kind.B and a.microbatch == m)
        if actions.index(release) > own:
            held[(s, m)] = (s, release.microbatch)  # type: ignore[assignment]
    return held


def held_input_grads(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """The gradient of a stage's input, made by B(s, m) (stages after the first), lives
    until torch's schedule drops the send that carries it back: (stage, microbatch) of the
    backward -> (stage, microbatch) of the backward (same rank) at whose end it goes.

    `stage_backward` hands the gradient to the stage's `bwd_cache` (the receive buffer's
    `.grad` is cleared) and `get_bwd_send_ops` moves it into the send ops; `Schedule1F1B`
    keeps those ops (`bwd_sends`, then `send_work`) until the stage's next backward has
    made its own; `ScheduleGPipe` and `ScheduleInterleaved1F1B` keep every send's work
    until the step returns (the rank's last backward action), and so do the other
    `_PipelineScheduleRuntime`s (zero bubble, V, looped BFS), where an I makes it."""
    held: dict[tuple[int, int], tuple[int, int]] = {}
    for s in range(1, schedule.num_stages):
        rank_actions = [a for a in schedule.ranks[schedule.stage_to_rank[s]] if a.kind in BACKWARD_KINDS]
        own = [a for a in rank_actions if a.stage == s and a.kind in INPUT_GRAD_KINDS]
        for i, b in enumerate(own):
            if schedule.name in _HOLD_TO_END:
                holder = rank_actions[-1]
            else:
                holder = own[min(i + 1, len(own) - 1)]
            held[(s, b.microbatch)] = (holder.stage, holder.microbatch)  # type: ignore[index,assignment]
    return held
