"""What the emulator runs: per-rank action lists resolved into costed tasks.

A `Program` is a `Schedule` (rewritten with memory actions) in which every action is a
task, or several: the forward and backward of a microbatch are one task per layer of the
stage (a recompute is a task before its layer's backward), so a swap-out starts when its
layer's forward ends and a swap-in must land before its layer's backward, as at run
time. Each task carries its compute-stream time, the copies it makes on which channels,
and the memory it takes and gives back. `lowering.py` builds programs from a profile,
a partition, the hardware and a schedule; tests build small ones by hand.

Semantics (see `emulator.py` for the details):

- Each rank walks its list in order: compute tasks (F, B, OPT, RC) one at a time on the
  rank's compute stream; copies (SO, SI, DO, DI, OO, OI) are issued when the compute task
  before them ends and run on their channels; a marker (DR) does nothing.
- Memory is a walk of each rank's list, in list order, independent of timing:
  `alloc_bytes` taken when a task starts (a copy-in's at its issue), `transient_bytes`
  held while a compute task runs, `free_bytes` given back when it ends, and
  `release_bytes` given back when the first task of a compute action starts: the bytes of
  the copy-outs issued since the last such point, which that task waits for (the runtime
  drops a swapped-out tensor's device storage at the same point); a copy-out with no
  release point after it gives its bytes (`free_bytes`) back when it ends.
- `consumes`: the tensors whose copy-ins a compute task waits for.

Units: seconds, bytes, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mpress.contract.actions import Action
from mpress.config.vocabulary import Technique, Word


class Cost(Word):
    """What a task's time (and a stall waiting on it) is spent on: the plan's techniques
    by their own words, plus plain compute, drops, optimizer-data moves and, for stalls,
    the pipeline bubble."""

    COMPUTE = "compute"
    HOST = Technique.HOST.value
    D2D = Technique.D2D.value
    RECOMPUTE = Technique.RECOMPUTE.value
    DROP = "drop"
    OPTIMIZER_OFFLOAD = "optimizer-offload"
    DATA_PARALLEL = "dp-reduce"
    """The data-parallel gradient reduction across nodes (`data_parallel.py`)."""
    PIPELINE = "pipeline"
    """A stall waiting for another stage (the bubble), never a task's own cost."""


@dataclass(frozen=True)
class Channel:
    """A copy path whose bandwidth concurrent transfers share fairly.

    id: e.g. "pcie-up:0" (host<-GPUs of PCIe group 0), "pcie-down:0", "host-mem",
        "nvlink:2->5", "nvswitch-out:3", "nvswitch-in:5" (`channels.py`).
    gbps: effective bandwidth, GB/s.
    latency_s: fixed cost added to each transfer on it.
    """

    id: str
    gbps: float
    latency_s: float = 0.0


@dataclass(frozen=True)
class Transfer:
    """`bytes` moved over channel `channel` (an id in `Program.channels`)."""

    channel: str
    bytes: int


@dataclass(frozen=True)
class Task:
    """One action of one rank, or one layer of it, with its costs.

    layer: the layer within the stage a forward/backward/recompute task runs (None for
        actions that are one task).
    compute_s: time on the compute stream (compute kinds only).
    transfers: copies made by a copy kind, run concurrently; all must finish.
    alloc_bytes: device bytes taken when the task starts (a copy-in: when it is issued).
    transient_bytes: bytes held only while a compute task runs (workspace).
    free_bytes: device bytes given back when the task ends.
    starts_action: the first task of a compute action (F, B, OPT): the release point of the
        copy-outs issued before it on the rank, which it waits for.
    release_bytes: what those copy-outs give back when it starts.
    consumes: tensors whose copy-ins must have landed before a compute task starts.
    cost: what the task's time is spent on, and what a stall waiting on it is blamed on.
    """

    action: Action
    layer: int | None = None
    compute_s: float = 0.0
    transfers: tuple[Transfer, ...] = ()
    alloc_bytes: int = 0
    transient_bytes: int = 0
    free_bytes: int = 0
    starts_action: bool = False
    release_bytes: int = 0
    consumes: tuple[str, ...] = ()
    cost: Cost = Cost.COMPUTE

    def label(self) -> str:
        """The action, and the layer for a layer task (`0F3 L2`)."""
        return str(self.action) if self.layer is None else f"{self.action} L{self.layer}"


@dataclass(frozen=True)
class Program:
    """Everything one emulated iteration needs.

    ranks: per rank, tasks in execution order.
    rank_device: device index of each rank.
    device_capacity_bytes: memory capacity of each device (indexed by device).
    static_bytes: per rank, bytes resident when the iteration starts (parameters,
        optimizer states on the device, torch's receive buffers, the input batch, a peer
        pool the device lends).
    channels: every channel a transfer may name, by id.
    sends: (from_stage, to_stage) -> transfers for the activation of one microbatch
        (forward direction; the gradient goes back over `grad_sends`).
    grad_sends: (from_stage, to_stage) -> transfers for the gradient going back.
    samples_per_iteration: microbatch size x microbatches (for samples/s).
    model_flops_per_iteration: useful model FLOPs of one iteration, without recompute
        (for model TFLOP/s).
    """

    ranks: tuple[tuple[Task, ...], ...]
    rank_device: tuple[int, ...]
    device_capacity_bytes: tuple[int, ...]
    static_bytes: tuple[int, ...]
    channels: dict[str, Channel]
    sends: dict[tuple[int, int], tuple[Transfer, ...]] = field(default_factory=dict)
    grad_sends: dict[tuple[int, int], tuple[Transfer, ...]] = field(default_factory=dict)
    samples_per_iteration: int = 1
    model_flops_per_iteration: float = 0.0


def walk_peaks(tasks: Sequence[Task], static_bytes: int) -> list[int]:
    """The memory walk of one rank's tasks (see the module docstring): for each task, the
    most device bytes while it runs (a copy or marker: after it is issued), starting from
    `static_bytes`. Independent of timing, so plans can be shaped by it before emulation."""
    return [peak for _entry, peak in walk(tasks, static_bytes)]


def walk(tasks: Sequence[Task], static_bytes: int) -> list[tuple[int, int]]:
    """Per task: (the device bytes when it is reached, before a compute task's release;
    its peak, as `walk_peaks`)."""
    mem = static_bytes
    out = []
    for t in tasks:
        entry = mem
        if t.action.is_compute:
            mem -= t.release_bytes
            out.append((entry, mem + t.alloc_bytes + t.transient_bytes))
            mem += t.alloc_bytes - t.free_bytes
        else:
            mem += t.alloc_bytes
            out.append((entry, mem))
            mem -= t.free_bytes
    return out
