"""Pipeline actions and per-rank action lists: schedules are plain data.

An action is written like `torch.distributed.pipelining`'s `_Action` strings:
`{stage}{kind}{microbatch}` (`0F3` = forward of microbatch 3 on stage 0, `2B1` =
backward of microbatch 1 on stage 2, `2I1`/`2W1` = its two halves in a zero-bubble
schedule), with an optional `:{tensor}` suffix naming the
tensor a memory action moves (`1SO4:layers.3.mlp.fc1#0`). Kinds:

| kind | meaning | on |
|------|---------|----|
| F  | forward of a microbatch | compute stream |
| B  | backward of a microbatch (input and weight gradients at once) | compute stream |
| I  | input-gradient half of a split backward (torch's `BACKWARD_INPUT`) | compute stream |
| W  | weight-gradient half of a split backward (torch's `BACKWARD_WEIGHT`), after its I | compute stream |
| OPT| optimizer step of the stage (no microbatch; with `:{tensor}`, the step of that chunk of model data only) | compute stream |
| RC | recompute the forward of a dropped tensor before its backward | compute stream |
| SO | swap a tensor out to pinned host memory | device->host copy |
| SI | swap a tensor back in from host | host->device copy |
| DO | D2D swap out: stripe a tensor over NVLink peers | peer copies |
| DI | D2D swap in: gather the stripes back | peer copies |
| DR | drop a tensor after forward (recompute restores it) | no copy |
| OO | optimizer states / master weights out to host (after OPT) | device->host copy |
| OI | optimizer states / master weights back in (before OPT) | host->device copy |

This module is shared by the static and runtime halves; it imports neither.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from mpress.errors import ScheduleError
from mpress.config.vocabulary import V_SCHEDULES, ScheduleName


class Kind(enum.Enum):
    """What an action does. Values are the codes used in action strings."""

    F = "F"
    B = "B"
    I = "I"
    W = "W"
    OPT = "OPT"
    RC = "RC"
    SO = "SO"
    SI = "SI"
    DO = "DO"
    DI = "DI"
    DR = "DR"
    OO = "OO"
    OI = "OI"

    # members are singletons, equal only to themselves: the built-in identity hash serves
    # (Enum's own calls Python code; the emulator hashes kinds some 700,000 times a plan)
    __hash__ = object.__hash__


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.OPT, Kind.RC})
"""Kinds that occupy the compute stream."""
BACKWARD_KINDS = frozenset({Kind.B, Kind.I, Kind.W})
"""Kinds that run (part of) a microbatch's backward."""
INPUT_GRAD_KINDS = frozenset({Kind.B, Kind.I})
"""Kinds that make the gradient of a stage's input (what the stage before waits for)."""
TENSOR_KINDS = frozenset({Kind.RC, Kind.SO, Kind.SI, Kind.DO, Kind.DI, Kind.DR, Kind.OO, Kind.OI})
"""Kinds that name a tensor."""
_NO_MICROBATCH_KINDS = frozenset({Kind.OPT, Kind.OO, Kind.OI})

# longest codes first so "OPT" is not read as "O"+"PT"
_CODES = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_CODES})(\d+)?(?::(\S+))?$")
_SPACE_RE = re.compile(r"\s")
"""Any whitespace character (what `str.isspace` calls one)."""


@dataclass(frozen=True)
class Action:
    """One step of one rank's schedule.

    stage: pipeline stage index (global, not the rank).
    kind: what the action does.
    microbatch: microbatch index, None for OPT/OO/OI.
    tensor: identity of the tensor a memory action moves, None otherwise.
    """

    stage: int
    kind: Kind
    microbatch: int | None = None
    tensor: str | None = None

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ScheduleError(f"action stage must be >= 0, got {self.stage}")
        if self.kind in _NO_MICROBATCH_KINDS:
            if self.microbatch is not None:
                raise ScheduleError(f"{self.kind.value} actions take no microbatch")
        elif self.microbatch is None or self.microbatch < 0:
            raise ScheduleError(f"{self.kind.value} actions need a microbatch >= 0")
        if self.kind in TENSOR_KINDS and not self.tensor:
            raise ScheduleError(f"{self.kind.value} actions need a tensor name")
        if self.kind not in TENSOR_KINDS and self.kind is not Kind.OPT and self.tensor is not None:
            raise ScheduleError(f"{self.kind.value} actions take no tensor name")
        if self.tensor is not None and _SPACE_RE.search(self.tensor):
            raise ScheduleError(f"tensor name may not contain spaces: {self.tensor!r}")

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        suffix = "" if self.tensor is None else f":{self.tensor}"
        return f"{self.stage}{self.kind.value}{mb}{suffix}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @staticmethod
    def parse(text: str) -> "Action":
        """Inverse of `str(action)`; raises `ScheduleError` on malformed text."""
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ScheduleError(f"not an action: {text!r} (expected e.g. 0F3, 1B2, 0SO1:layers.0.attn#2)")
        stage, code, mb, tensor = m.groups()
        return Action(int(stage), Kind(code), None if mb is None else int(mb), tensor)


class UnitKind(enum.Enum):
    """What a memory action moves (see `UnitId`)."""

    ACTIVATIONS = "activations"
    OPTIM = "optim"
    STASH = "stash"
    GRADS = "grads"
    PARAMS = "params"


@dataclass(frozen=True)
class UnitId:
    """The tensor name of a memory action: what one action moves, as the rewriter groups
    it, written into the action string after the colon.

    - activations: the saved tensors of `layer` that rule `rule` of `stage` decides in
      the action's microbatch, `{stage}:{layer}.**@r{rule}`;
    - optim: one layer's optimizer states and master weights, `{stage}:optim:{layer}`;
    - stash: the stashed weight versions rule `rule` moves, `{stage}:stash@r{rule}`;
    - grads / params: one layer's gradients going to the host and its updated parameters
      coming back in the optimizer step of a stage that steps on the host
      (`optimizer_step: host`), `{stage}:grads:{layer}`, `{stage}:params:{layer}`. The
      copies run inside that step (`OPT:{stage}:optim:{layer}`): the emulator's tasks name
      them, a plan's program never lists them. With a microbatch, the same names are the
      program's copies of a layer that `param:`/`grad:` host rules keep on the host: its
      parameters fetched (SI) and evicted (SO) around each forward and backward, its
      gradients drained (SO) after each backward (`static/plan/layer_data.py`).
    """

    stage: int
    kind: UnitKind
    layer: str | None = None
    rule: int | None = None

    def __post_init__(self) -> None:
        needs = {UnitKind.ACTIVATIONS: (True, True), UnitKind.OPTIM: (True, False), UnitKind.STASH: (False, True),
                 UnitKind.GRADS: (True, False), UnitKind.PARAMS: (True, False)}
        layer, rule = needs[self.kind]
        if (self.layer is not None) != layer or (self.rule is not None) != rule:
            raise ScheduleError(f"a {self.kind.value} unit {'needs' if layer else 'takes no'} layer and "
                                f"{'needs' if rule else 'takes no'} rule")

    def __str__(self) -> str:
        if self.kind is UnitKind.ACTIVATIONS:
            return f"{self.stage}:{self.layer}.**@r{self.rule}"
        if self.kind in (UnitKind.OPTIM, UnitKind.GRADS, UnitKind.PARAMS):
            return f"{self.stage}:{self.kind.value}:{self.layer}"
        return f"{self.stage}:stash@r{self.rule}"

    @staticmethod
    def parse(text: str) -> "UnitId":
        """Inverse of `str(unit)`; raises `ScheduleError` on anything else."""
        m = _UNIT_RE.match(text)
        if not m:
            raise ScheduleError(f"not a unit name: {text!r} (expected e.g. 0:layers.3.**@r1, 0:optim:layers.3, "
                                "0:stash@r2)")
        stage, data, data_layer, stash_rule, layer, rule = m.groups()
        if data is not None:
            return UnitId(int(stage), UnitKind(data), layer=data_layer)
        if stash_rule is not None:
            return UnitId(int(stage), UnitKind.STASH, rule=int(stash_rule))
        return UnitId(int(stage), UnitKind.ACTIVATIONS, layer=layer, rule=int(rule))


def moves_layer_data(action: Action) -> bool:
    """Whether a memory action fetches, evicts or drains a layer's host parameters or
    gradients in a microbatch (`param:`/`grad:` host rules; a host step's own copies
    carry no microbatch)."""
    if action.microbatch is None or action.kind not in (Kind.SI, Kind.SO) or not action.tensor:
        return False
    m = _UNIT_RE.match(action.tensor)
    return m is not None and m.group(2) in (UnitKind.PARAMS.value, UnitKind.GRADS.value)


_UNIT_RE = re.compile(r"^(\d+):(?:(optim|grads|params):(\S*)|stash@r(\d+)|(\S*?)\.\*\*@r(\d+))$")


def F(stage: int, microbatch: int) -> Action:
    """Forward of `microbatch` on `stage`."""
    return Action(stage, Kind.F, microbatch)


def B(stage: int, microbatch: int) -> Action:
    """Backward of `microbatch` on `stage`."""
    return Action(stage, Kind.B, microbatch)


def I(stage: int, microbatch: int) -> Action:
    """Input-gradient half of the backward of `microbatch` on `stage`."""
    return Action(stage, Kind.I, microbatch)


def W(stage: int, microbatch: int) -> Action:
    """Weight-gradient half of the backward of `microbatch` on `stage`."""
    return Action(stage, Kind.W, microbatch)


def warmup_order(stage: int, num_microbatches: int, warmup: int) -> list[Action]:
    """F/B order of one stage that runs `warmup` forwards, then alternates one forward and
    one backward (oldest microbatch first), then runs the remaining backwards.

    DAPPLE 1F1B is warmup = num_stages - 1 - stage; GPipe is warmup = num_microbatches - 1
    (every forward, then every backward). Shared by the schedules and the runtime's
    prefetcher, which must know when each backward comes.
    """
    warmup = max(0, min(warmup, num_microbatches))
    acts = [Action(stage, Kind.F, m) for m in range(warmup)]
    # steady state: forward of the next microbatch, then backward of the oldest one
    for k in range(num_microbatches - warmup):
        acts.append(Action(stage, Kind.F, warmup + k))
        acts.append(Action(stage, Kind.B, k))
    acts.extend(Action(stage, Kind.B, m) for m in range(num_microbatches - warmup, num_microbatches))
    return acts


def format_actions(actions: list[Action]) -> str:
    """Space-separated string form of an action list."""
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> list[Action]:
    """Inverse of `format_actions` (commas are accepted as separators too)."""
    return [Action.parse(tok) for tok in re.split(r"[\s,]+", text.strip()) if tok]


def stage_to_rank(schedule: str, num_stages: int, num_ranks: int) -> tuple[int, ...]:
    """The rank that runs each stage: in a V schedule (`zbv`, `dualpipev`; 2R stages)
    down the ranks and back up (rank r runs stages r and 2R-1-r), elsewhere round-robin
    (stage s on rank s % num_ranks: one stage per rank, or several looped ones)."""
    if schedule in V_SCHEDULES:
        return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))
    return tuple(s % num_ranks for s in range(num_stages))


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one training iteration.

    name: schedule family (`ScheduleName`).
    num_stages: pipeline stages (>= ranks; interleaved, zero-bubble, V and looped-BFS
        schedules put several on one rank).
    num_microbatches: microbatches per iteration.
    stage_to_rank: rank that runs each stage, indexed by stage.
    ranks: one action list per rank, in execution order.
    weight_stashing: True for PipeDream asynchronous 1F1B (one weight version per
        microbatch in flight is kept).
    """

    name: ScheduleName
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]
    weight_stashing: bool = False

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def stages_of_rank(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def to_text(self) -> str:
        """One line per rank: `rank 0: 0F0 0F1 0B0 ...`."""
        return "\n".join(f"rank {r}: {format_actions(list(acts))}" for r, acts in enumerate(self.ranks))

    def with_ranks(self, ranks: list[list[Action]]) -> "Schedule":
        """Same schedule with new per-rank lists (what rewriting passes return)."""
        return Schedule(
            self.name, self.num_stages, self.num_microbatches, self.stage_to_rank,
            tuple(tuple(r) for r in ranks), self.weight_stashing,
        )
