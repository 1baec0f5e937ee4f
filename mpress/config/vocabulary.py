"""The words both halves share: techniques, schedules, swap-in policies, strategies.

Each is a `str` enum, so a member equals its word (`Technique.HOST == "host"`), prints
as its word, and is stored in YAML as its word (`mpress.config.loader` reads and writes enums
by value). Code names members, never the literal words, so there is one spelling of
each word in the whole project: here.
"""

from __future__ import annotations

import enum

from mpress.errors import ConfigError


class Word(str, enum.Enum):
    """A `str` enum that prints and formats as its value."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    @classmethod
    def words(cls) -> tuple[str, ...]:
        """Every value, in declaration order (for messages and CLI choices)."""
        return tuple(m.value for m in cls)


class ConvNetwork(Word):
    """The reference conv nets of fused-tiled execution and the out-of-core study
    (`mpress.tiling.networks.NETWORKS` builds each): named here so that `mpress tile`
    and `mpress ooc` list them without importing torch."""

    VGG16 = "vgg16"
    VGG19 = "vgg19"
    DARKNET19 = "darknet19"


def as_word(obj: object, name: str, vocabulary: type[Word]) -> None:
    """Store field `name` of a (frozen) dataclass as a member of `vocabulary`, so code that
    builds one may pass the plain word; an unknown word is a `ConfigError` naming the
    key and the allowed words."""
    value = getattr(obj, name)
    try:
        object.__setattr__(obj, name, vocabulary(value))
    except ValueError:
        raise ConfigError("", name, f"expected one of {', '.join(vocabulary.words())}, got {value!r}") from None


class Technique(Word):
    """What a plan does with a tensor."""

    KEEP = "keep"
    """Stays on its device."""
    RECOMPUTE = "recompute"
    """Dropped after the forward, recomputed before its backward."""
    HOST = "host"
    """Swapped to pinned host memory and back."""
    D2D = "d2d"
    """Striped over NVLink peers' spare memory and back."""
    NVME = "nvme"
    """Optimizer states only (`optim:LAYER`): written to files on a local drive between
    steps and read back for the step (`mpress/runtime/swap/nvme.py`)."""


SWAPS = frozenset({Technique.HOST, Technique.D2D})
"""Techniques that copy a tensor off the device and back."""


MPRESS_NVME = "mpress-nvme"
"""What `mpress maxsize` and the benches call the mpress strategy allowed the server's
local drive for optimizer data (`PlannerOptions.drive`); plain `mpress` rows there keep
the host as their only tier."""


class ScheduleName(Word):
    """A pipeline schedule family (see `mpress/static/schedules.py`)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    """DAPPLE's synchronous 1F1B (torch's `Schedule1F1B`)."""
    PIPEDREAM = "pipedream"
    """Asynchronous 1F1B with weight stashing (planned; torch runs it as 1F1B)."""
    INTERLEAVED = "interleaved"
    """Interleaved 1F1B, several stages per rank (torch's `ScheduleInterleaved1F1B`)."""
    INTERLEAVED_ZB = "interleaved-zb"
    """Zero bubble with the backward split into I and W, stages round-robin over ranks
    (torch's `ScheduleInterleavedZeroBubble`); with one stage per rank it is ZB-H1."""
    ZBV = "zbv"
    """Zero bubble V: two stages per rank in a V (torch's `ScheduleZBVZeroBubble`)."""
    DUALPIPEV = "dualpipev"
    """DeepSeek's DualPipe folded into a V, two stages per rank (torch's `ScheduleDualPipeV`)."""
    LOOPED_BFS = "looped-bfs"
    """Breadth-first: every microbatch of a rank's first stage, then its next
    (torch's `ScheduleLoopedBFS`)."""


RUNNABLE_SCHEDULES = (ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B, ScheduleName.INTERLEAVED,
                      ScheduleName.INTERLEAVED_ZB, ScheduleName.ZBV, ScheduleName.DUALPIPEV, ScheduleName.LOOPED_BFS)
"""Schedules torch's pipelining runs (the training config's choices)."""
SPLIT_BACKWARD_SCHEDULES = (ScheduleName.INTERLEAVED_ZB, ScheduleName.ZBV, ScheduleName.DUALPIPEV)
"""Schedules that split (some) backwards into an input-gradient and a weight-gradient part."""
V_SCHEDULES = (ScheduleName.ZBV, ScheduleName.DUALPIPEV)
"""Schedules with exactly two stages per rank, placed in a V (rank r runs stages r and 2R-1-r)."""


class SwapInPolicy(Word):
    """When a swapped-out tensor comes back (the out-of-core model of Zhang et al.)."""

    CAPACITY = "capacity"
    """As early as the device's memory allows."""
    LAYER_AHEAD = "layer-ahead"
    """One compute action ahead of its consumer (vDNN-like)."""


class OptimizerStep(Word):
    """Where a stage's optimizer step runs (`StagePlan.optimizer_step`)."""

    DEVICE = "device"
    HOST = "host"


class Strategy(Word):
    """Which techniques the planner may use."""

    NONE = "none"
    RECOMPUTE = "recompute"
    HOST_SWAP = "host-swap"
    D2D = "d2d"
    MPRESS = "mpress"
    """All three, the cheapest per tensor."""
    MEGATRON_SELECTIVE = "megatron-selective"
    """Megatron-LM's selective recompute: every layer's attention core recomputed, all
    else kept (`mpress/static/plan/megatron.py`)."""
