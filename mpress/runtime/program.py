"""The program a rank executes: its action list from the plan (`Plan.program`), walked
in step with torch's schedule.

torch's pipeline schedule decides when a forward or backward runs; the plan's list says
the same order (the rewriter made it from the same schedule) and, between and inside
those, where every memory action goes. `RankProgram` holds the list and a position in it:

- `begin(X)` is called right before compute action X runs (F and B by the stage, OPT by
  the job). It checks that the actions the previous compute action was to run inside it
  (swap-outs, D2D-outs and drops after a forward; recomputes after a backward) were
  recorded, issues the actions that stand between the previous compute action and X
  (swap-ins, D2D-ins, optimizer-state moves) through the handlers registered for them,
  waits for the rank's copy-outs (X is their release point: their device storage is
  gone once it starts, as the memory model says), and checks that X is the next compute
  action of the list. A schedule that runs something else is a `PlanError`
  naming both actions.
- `record(A)` is called by whoever runs an inside action (the router, when a unit's
  first tensor leaves or a dropped layer is recomputed; the stage's host layers,
  `mpress/runtime/layer_data`, when a layer's pass ends and its parameters' fetch,
  eviction or its gradients' drain listed inside the compute action runs).
- `end_step()` issues what follows the last compute action and starts the next step.

Every action is logged, in the list's string form, when it is executed (inside actions
when the compute action they belong to is over, in the list's order), so the executed
log of a step can be compared with the plan's list (`last_log`). Spans (start and end
of each compute action, issue of each copy) are kept for the run's trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mpress.contract.actions import Action, Kind, moves_layer_data
from mpress.errors import PlanError
from mpress.contract.live_bytes import LiveBytes

INSIDE_FORWARD = frozenset({Kind.SO, Kind.DO, Kind.DR})
"""Memory actions the list puts right after F(s, m): run inside that forward."""
INSIDE_BACKWARD = frozenset({Kind.RC})
"""Memory actions the list puts right after B(s, m) or I(s, m): run inside that backward."""
ISSUED = frozenset({Kind.SI, Kind.DI, Kind.OI, Kind.OO})
"""Memory actions issued between compute actions, by a handler."""
LAYER_DATA_INSIDE = {Kind.F: frozenset({Kind.SI, Kind.SO}), Kind.B: frozenset({Kind.SI, Kind.SO})}
"""A layer's host parameters and gradients (`param:`/`grad:` host rules): the fetches
and evictions the list puts right after F(s, m), and the fetches, evictions and drains
right after B(s, m), run inside that compute action (each when a layer of the pass
ends); a fetch listed anywhere else is issued by a handler."""

Handler = Callable[[Action], None]


@dataclass(frozen=True)
class Span:
    """One executed action: compute from `start_s` to `end_s`; a copy or marker issued
    at `start_s` (`end_s` == `start_s`). Seconds on `time.perf_counter`."""

    action: Action
    start_s: float
    end_s: float


class RankProgram:
    """One rank's action list and where the rank is in it (see the module docstring).

    handlers: per (kind, stage), what issues an action of that kind (a swap-in of a
    unit, an optimizer chunk in or out); registered by the stage runtimes and the job.
    release: waits for the rank's copy-outs (every swap engine of the rank).
    live: the rank's live-bytes tracker, told which action runs.
    """

    def __init__(self, actions: Sequence[Action], *, rank: int, live: LiveBytes | None = None) -> None:
        self.rank = rank
        self.live = live
        """The rank's live-bytes tracker, told what runs (an out-of-memory error names it)."""
        self.actions = list(actions)
        self._inside: dict[tuple[int, int | None], dict[str, Kind]] = {}
        self._layer_data: dict[Action, list[Action]] = {}
        """Per F or B: the layer-data copies the list runs inside it, in order."""
        current: Action | None = None  # the compute action whose inside actions follow
        for a in self.actions:
            if a.is_compute and a.kind is not Kind.RC:  # (a recompute runs inside a backward)
                current = a
                continue
            if moves_layer_data(a):
                if current is None or not _inside(a, current):
                    current = None  # issued: what follows is no longer inside
                    continue
                self._layer_data.setdefault(current, []).append(a)
                continue
            if current is not None and not _inside(a, current):
                current = None
            if a.kind in INSIDE_FORWARD:
                self._inside.setdefault((a.stage, a.microbatch), {})[a.tensor or ""] = a.kind
        self._split = {(a.stage, a.microbatch) for a in self.actions if a.kind is Kind.I}
        self._handlers: dict[tuple[Kind, int], Handler] = {}
        self._releases: list[Callable[[], None]] = []
        self._pos = 0
        self._current: Action | None = None
        self._recorded: set[Action] = set()
        self._started = 0.0
        self.log: list[Action] = []
        """What this step executed so far."""
        self.last_log: list[Action] = []
        """What the last finished step executed."""
        self.spans: list[Span] = []
        """Executed actions of every step, for the trace (cleared by the caller)."""

    # ---- what the list says ---------------------------------------------------------------

    def compacted(self, stage: int, microbatch: int) -> dict[str, Kind]:
        """The units the list compacts inside F(stage, microbatch): unit name -> SO, DO or DR."""
        return self._inside.get((stage, microbatch), {})

    def layer_data(self, action: Action) -> list[Action]:
        """The layer-data copies the list runs inside compute action `action` (fetches and
        evictions of host parameters, drains of gradients), in the list's order."""
        return self._layer_data.get(action, [])

    def split(self, stage: int, microbatch: int) -> bool:
        """Whether the list splits the backward of (stage, microbatch) into I and W (what
        W reads is unpacked again in W, after I)."""
        return (stage, microbatch) in self._split

    def optimizer_actions(self) -> list[Action]:
        """The list's optimizer steps (whole stages, or one layer's chunk each), in order:
        what the job runs after the schedule's forwards and backwards."""
        return [a for a in self.actions if a.kind is Kind.OPT]

    # ---- wiring ---------------------------------------------------------------------------------

    def on(self, kind: Kind, stage: int, handler: Handler) -> None:
        """Issue actions of `kind` for `stage` through `handler`."""
        if kind not in ISSUED:
            raise PlanError(f"{kind.value} actions run inside compute actions; nothing issues them")
        self._handlers[(kind, stage)] = handler

    def on_release(self, release: Callable[[], None]) -> None:
        """Called at every release point: wait for the copy-outs issued so far."""
        self._releases.append(release)

    # ---- execution --------------------------------------------------------------------------

    def record(self, action: Action) -> None:
        """An inside action of the compute action running now was executed."""
        current = self._current
        if current is None or (action.stage, action.microbatch) != (current.stage, current.microbatch):
            raise PlanError(f"rank {self.rank}: {action} ran outside the compute action it belongs to "
                            f"(running: {current or 'nothing'})")
        self._recorded.add(action)

    def begin(self, action: Action) -> None:
        """Compute action `action` is about to run (see the module docstring)."""
        self._finish_current()
        while self._pos < len(self.actions) and not self.actions[self._pos].is_compute:
            self._issue(self.actions[self._pos])
        for release in self._releases:
            release()
        expected = self.actions[self._pos] if self._pos < len(self.actions) else None
        if expected != action:
            raise PlanError(f"rank {self.rank}: the plan's program runs {expected or 'nothing more'} next, "
                            f"the schedule runs {action} (the plan was made for another schedule order)")
        self._pos += 1
        self._current = action
        if self.live is not None:
            self.live.context = str(action)
        self._started = time.perf_counter()
        self.log.append(action)

    def end(self) -> None:
        """The compute action begun last is over (for the trace)."""
        if self._current is not None:
            self.spans.append(Span(self._current, self._started, time.perf_counter()))

    def end_step(self) -> None:
        """After the step's last compute action: issue what follows it; the next step
        starts from the top of the list. Raises `PlanError` if compute actions are left."""
        self._finish_current()
        while self._pos < len(self.actions):
            a = self.actions[self._pos]
            if a.is_compute:
                raise PlanError(f"rank {self.rank}: the step ended before the program's {a} "
                                f"({len(self.actions) - self._pos} actions left)")
            self._issue(a)
        for release in self._releases:  # copy-outs after the last compute action end with the step
            release()
        self.last_log, self.log = self.log, []
        self._pos = 0

    def _finish_current(self) -> None:
        """Log the inside actions of the compute action that ran last, in the list's
        order; each must have been recorded."""
        current = self._current
        if current is None:
            return
        logged: set[Action] = set()
        while self._pos < len(self.actions):
            a = self.actions[self._pos]
            if not _inside(a, current):
                break
            if a not in self._recorded:
                raise PlanError(f"rank {self.rank}: the program runs {a} inside {current}, which did not "
                                f"execute it")
            self.log.append(a)
            self.spans.append(Span(a, self._started, self._started))
            logged.add(a)
            self._pos += 1
        unplanned = self._recorded - logged
        if unplanned:
            raise PlanError(f"rank {self.rank}: {current} executed {', '.join(sorted(map(str, unplanned)))}, "
                            "which the program does not list there")
        self._recorded.clear()
        self._current = None

    def _issue(self, action: Action) -> None:
        handler = self._handlers.get((action.kind, action.stage))
        if handler is None:
            raise PlanError(f"rank {self.rank}: nothing on this rank executes {action} "
                            f"({action.kind.value} for stage {action.stage})")
        if self.live is not None:
            self.live.context = str(action)
        handler(action)
        now = time.perf_counter()
        self.log.append(action)
        self.spans.append(Span(action, now, now))
        self._pos += 1


def _inside(a: Action, current: Action) -> bool:
    """Whether memory action `a`, listed after compute action `current` (with only inside
    actions between), runs inside it."""
    if (a.stage, a.microbatch) != (current.stage, current.microbatch):
        return False
    if moves_layer_data(a):
        return a.kind in LAYER_DATA_INSIDE.get(current.kind, ())
    inside = INSIDE_FORWARD if current.kind is Kind.F else INSIDE_BACKWARD if current.kind in (Kind.B, Kind.I) else ()
    return a.kind in inside
