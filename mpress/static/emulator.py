"""Discrete-event emulation of one iteration of a `Program` (see `program.py`).

What is simulated, and the choices `program.py` leaves open:

- Each rank walks its task list in order. A compute task (F, B, OPT, RC) is reached when
  the compute task before it has finished; the copies (SO, SI, DO, DI, OO, OI) and drops
  (DR) between two compute tasks are issued the moment the first one ends (at time 0
  before a rank's first compute task). A DR frees its bytes at that moment.
- Dependencies of a compute task: F(s, m), s > 0, waits for F(s-1, m) and then the
  activation send `sends[(s-1, s)]`, which starts when F(s-1, m) ends; B(s, m) waits for
  F(s, m) and, unless s is the last stage (no F(s+1, .) anywhere), for B(s+1, m) and the
  gradient send `grad_sends[(s+1, s)]`; RC(s, m) waits for that gradient too (a
  recompute runs inside the backward); every compute task waits for the copy-ins
  (SI, DI, OI) with its stage and microbatch (None for OPT) listed before it since the
  previous compute task of that stage and microbatch (earlier ones were waited for by
  that task); a compute task that names a tensor (RC, or OPT of one chunk of model data)
  waits only for the copy-ins of that tensor. A copy-in waits for the latest copy-out (SO, DO, OO) of the same tensor
  listed before it on the same rank; with none (e.g. optimizer states brought in before
  the step that sends them out again) it waits for nothing.
- Channels share their bandwidth fairly (processor sharing): with n transfers active,
  each moves gbps/n. A transfer *joins* its channel after the channel's latency has
  elapsed, so the latency is paid up front and does not take bandwidth. Implemented with a
  virtual clock per channel that advances gbps/n bytes per second; a transfer finishes
  when the clock reaches its join mark plus its bytes (a heap per channel).
- Swap-in policy "capacity": a ready copy-in waits in a first-in-first-out queue per
  device and starts when the device's usage plus its alloc + transient bytes fits the
  capacity beside the room the next F or B of each rank on the device (or a recompute
  before it) will take; when the
  rank reaches its consumer (the first compute task after it with its stage and
  microbatch) or the end of its list while it still waits, it is forced: it starts as
  soon as it fits the device, or once no copy-out of the device is left in flight (the
  device may then run out of memory).
  "layer-ahead": a copy-in starts no earlier than the start of the compute task listed
  just before its consumer; memory is not checked.
- Memory back-pressure: a compute task that would take its device over capacity while
  copy-outs (SO, DO, OO) of that device are in flight waits until they have freed enough
  room (or none is left in flight); the wait is blamed on the copy-out that made room.
  With no copy-out in flight it starts at once and the device runs out of memory.
- Memory per device: the static bytes of its ranks, plus alloc + transient bytes when a
  task starts, minus free + transient bytes when it ends. A copy-out therefore gives its
  bytes back when the copy has finished, not when it is issued.
- Stalls: a compute task that starts after its rank reached it stalls for the gap, blamed
  on the dependency that was satisfied last: a copy-in (its tensor and technique) or a
  forward/backward of another stage or a send ("pipeline", the bubble). So per rank,
  busy + stall = end of its last compute task.
- A program in which tasks remain but nothing can progress raises `ScheduleError` that
  names each stuck rank, its action and what that action still waits for.

Units: seconds, bytes, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import gc

from mpress.errors import ScheduleError
from mpress.static.emulator_result import EmulatorResult, TaskSpan
from mpress.static.program import Program
from mpress.static.simulation import Simulation
from mpress.vocabulary import SwapInPolicy

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
    if program.swap_in_policy not in SwapInPolicy.words():
        raise ScheduleError(f"swap_in_policy must be one of {', '.join(SwapInPolicy.words())}, "
                            f"got {program.swap_in_policy!r}")
