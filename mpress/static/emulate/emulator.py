"""Discrete-event emulation of one iteration of a `Program` (see `program.py`).

What is simulated:

- Each rank walks its task list in order. A compute task (F, B, OPT, RC; the forward and
  backward of a microbatch are one task per layer) is reached when the compute task
  before it has finished; the copies (SO, SI, DO, DI, OO, OI) between two compute tasks
  are issued the moment the first one ends (at time 0 before a rank's first compute
  task); a marker (DR) does nothing.
- Dependencies of a compute task: the first task of F(s, m), s > 0, waits for the last
  task of F(s-1, m) and then the activation send `sends[(s-1, s)]`, which starts when
  F(s-1, m) ends; the first task of B(s, m) (a recompute is part of the backward) waits
  for F(s, m) and, unless s is the last stage (no F(s+1, .) anywhere), for B(s+1, m) and
  the gradient send `grad_sends[(s+1, s)]`; a task waits for the copy-ins of the tensors
  it `consumes` (of its own stage and microbatch, the latest issued before it on the
  rank); the first task of a compute action (`starts_action`) waits for every copy-out
  issued before it on the rank and not yet waited for: its release point. A copy-in
  waits for the latest copy-out of the same tensor, stage and microbatch listed before it
  on the rank; with none (e.g. optimizer states brought in before the step that sends
  them out again) it waits for nothing.
- Channels share their bandwidth fairly (processor sharing): with n transfers active,
  each moves gbps/n. A transfer *joins* its channel after the channel's latency has
  elapsed, so the latency is paid up front and does not take bandwidth. Implemented with a
  virtual clock per channel that advances gbps/n bytes per second; a transfer finishes
  when the clock reaches its join mark plus its bytes (a heap per channel). A copy that
  crosses several channels (an NVSwitch copy: the sender's egress and the receiver's
  ingress port; a host copy: its PCIe uplink and host DRAM; `channels.py`) has one
  transfer of all its bytes on each and ends when the last one does: the busiest
  channel on its path bounds it (the device mapper's cut model).
- Memory per device: the static bytes of its ranks; a compute task gives back its
  `release_bytes` and takes `alloc_bytes + transient_bytes` when it starts, and gives back
  `free_bytes + transient_bytes` when it ends; a copy-in takes `alloc_bytes` when it is
  issued; a copy-out gives back `free_bytes` (only set when no release point follows it)
  when it ends. Every change happens at a point of the rank's list, so the memory of a
  rank is a walk of its list in order, whatever the timing: the runtime takes and gives
  back memory at the same points, and its measured peak is the emulated one.
- Stalls: a compute task that starts after its rank reached it stalls for the gap, blamed
  on the dependency that was satisfied last: a copy (its tensor and technique) or a
  forward/backward of another stage or a send ("pipeline", the bubble). So per rank,
  busy + stall = end of its last compute task.
- A program in which tasks remain but nothing can progress raises `ScheduleError` that
  names each stuck rank, its action and what that action still waits for.

Units: seconds, bytes, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import gc

from mpress.errors import ScheduleError
from mpress.static.emulate.emulator_result import EmulatorResult, TaskSpan
from mpress.static.emulate.program import Program
from mpress.static.emulate.simulation import Simulation

__all__ = ["EmulatorResult", "TaskSpan", "emulate"]


def emulate(program: Program) -> EmulatorResult:
    """Simulate one iteration of `program`; raises `ScheduleError` on a malformed program
    or a deadlock (with the stuck ranks, actions and what they wait for)."""
    # The run allocates ~10 small objects per task and creates no reference cycles, but
    # each allocation burst makes the cyclic collector rescan the program's own objects:
    # measured at 30-50% of the run time on the 28k-task benchmark. Paused, then restored.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        _check(program)
        return Simulation(program).run()
    finally:
        if gc_was_enabled:
            gc.enable()


def _check(program: Program) -> None:
    n = len(program.ranks)
    if len(program.rank_device) != n or len(program.static_bytes) != n:
        raise ScheduleError(f"program has {n} ranks but {len(program.rank_device)} rank_device entries "
                            f"and {len(program.static_bytes)} static_bytes entries")
    for r, d in enumerate(program.rank_device):
        if not 0 <= d < len(program.device_capacity_bytes):
            raise ScheduleError(f"rank {r} is on device {d}, but the program has "
                                f"{len(program.device_capacity_bytes)} devices")
    for cid, ch in program.channels.items():
        if ch.gbps <= 0 or ch.latency_s < 0:
            raise ScheduleError(f"channel {cid}: gbps must be > 0 and latency_s >= 0, got {ch.gbps}, {ch.latency_s}")
