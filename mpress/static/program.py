"""What the emulator runs: per-rank action lists resolved into costed tasks.

A `Program` is a `Schedule` (possibly rewritten with memory actions) in which every
action carries its costs: compute-stream time, the copies it makes on which channels,
and the memory it takes and gives back. The memory model (`memory.py`) builds it from a
profile, a partition, the hardware and a schedule; tests build small ones by hand.

Semantics the emulator implements (see `emulator.py`):

- Each rank walks its task list in order. Compute tasks (F, B, OPT, RC) run one at a
  time on the rank's compute stream. Copy tasks (SO, SI, DO, DI, OO, OI) are issued when
  the compute task before them in the list has finished (they wait on its event), and run
  concurrently with compute on their channels; a task is done when all of its transfers
  are done (plus the channel latency).
- Dependencies: F(s, m) waits for F(s-1, m) and the activation send from the rank of s-1;
  B(s, m) waits for B(s+1, m) and the gradient send back; a compute task with a
  microbatch waits for every copy-in (SI, DI) of the same stage and microbatch issued
  before it; OPT waits for the OI of its stage; a copy-in of a tensor waits for the
  copy-out of the same tensor.
- Memory: `alloc_bytes` is taken when a task starts, `free_bytes` given back when it
  ends; `transient_bytes` is held only while it runs.

Units: seconds, bytes, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpress.actions import Action
from mpress.vocabulary import SwapInPolicy, Technique, Word


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
    PIPELINE = "pipeline"
    """A stall waiting for another stage (the bubble), never a task's own cost."""


@dataclass(frozen=True)
class Channel:
    """A copy path whose bandwidth concurrent transfers share fairly.

    id: e.g. "pcie-up:0" (host<-GPUs of PCIe group 0), "pcie-down:0", "nvlink:2->5",
        "nvswitch-out:3".
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
    """One action of one rank with its costs.

    compute_s: time on the compute stream (compute kinds only).
    transfers: copies made by a copy kind, run concurrently; all must finish.
    alloc_bytes: device bytes taken when the task starts.
    free_bytes: device bytes released when the task ends.
    transient_bytes: bytes held only while the task runs (workspace).
    cost: what the task's time is spent on, and what a stall waiting on it is blamed on.
    """

    action: Action
    compute_s: float = 0.0
    transfers: tuple[Transfer, ...] = ()
    alloc_bytes: int = 0
    free_bytes: int = 0
    transient_bytes: int = 0
    cost: Cost = Cost.COMPUTE


@dataclass(frozen=True)
class Program:
    """Everything one emulated iteration needs.

    ranks: per rank, tasks in execution order.
    rank_device: device index of each rank.
    device_capacity_bytes: memory capacity of each device (indexed by device).
    static_bytes: per rank, bytes resident for the whole iteration (parameters,
        gradients, optimizer states, stashed weights, communication buffers).
    channels: every channel a transfer may name, by id.
    sends: (from_stage, to_stage) -> transfers for the activation of one microbatch
        (forward direction; the gradient goes back over `grad_sends`).
    grad_sends: (from_stage, to_stage) -> transfers for the gradient going back.
    samples_per_iteration: microbatch size x microbatches (for samples/s).
    model_flops_per_iteration: useful model FLOPs of one iteration, without recompute
        (for model TFLOP/s).
    swap_in_policy: "capacity": a copy-in starts at its place in the list as soon as the
        device has room for it; "layer-ahead" (vDNN-like): it starts when the compute task
        just before its consumer starts.
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
    swap_in_policy: SwapInPolicy = SwapInPolicy.CAPACITY
