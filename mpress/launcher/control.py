"""The job's control plane: the process group set-up (NCCL's error handling included), a
gloo group for object collectives, the one line a failure is reported as, a rank's
interrupt (SIGINT: stop at a step boundary) and the fault tests' start-up hold."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

from mpress.errors import MpressError, UserError

COLLECTIVE_TIMEOUT_S = 300
"""Longest a collective or pipeline send/recv may wait for a peer before the rank fails.
A rank that fails or dies is noticed by the others' rank watch (launcher/rank_watch.py)
within seconds; this bounds only what nothing else notices (a hung peer)."""

NCCL_ASYNC_ERROR_HANDLING = "3"
"""TORCH_NCCL_ASYNC_ERROR_HANDLING for the job: when NCCL reports an error or a timeout,
end the process without aborting its communicators first (torch's own default; torchrun
sets 1, abort then end, and an abort can itself block on a dead peer). The other ranks'
watches then see the process gone and stop, each with one line naming it; the values
that keep the process alive (0, 2) would leave it blocked in its next CUDA sync."""


def nccl_error_handling() -> None:
    """Set NCCL's error handling for this process (read when a NCCL process group is
    made: call before `init_process_group`)."""
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ASYNC_ERROR_HANDLING


def rank_from_env() -> int:
    """This process's global rank from the environment torchrun (or `mpress train`) sets,
    checked before anything waits on it. A one-line `UserError` naming the variable for
    RANK or WORLD_SIZE set alone or not a whole number, a rank outside the world (its
    rendezvous would wait for ranks that never come), a LOCAL_RANK that is not a whole
    number, or a world of several ranks without MASTER_ADDR and a MASTER_PORT in 1..65535.
    Neither RANK nor WORLD_SIZE set: a world of one (`single_process_env`), rank 0."""
    env = os.environ
    if ("RANK" in env) != ("WORLD_SIZE" in env):
        given, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        raise UserError(f"{given}={env[given]} without {missing}: set both (as torchrun does) or neither (a world "
                        "of one)")
    if "RANK" not in env:
        return 0
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if name in env:
            text = env[name].strip()
            if not text.isdigit():
                raise UserError(f"{name}={env[name]!r}: expected a whole number >= 0")
            numbers[name] = int(text)
    rank, world = numbers["RANK"], numbers["WORLD_SIZE"]
    if not 0 <= rank < world:
        raise UserError(f"RANK={rank}: must be in 0..{world - 1} with WORLD_SIZE={world}" if world else
                        "WORLD_SIZE=0: a world has at least one rank")
    if world > 1:
        port = env.get("MASTER_PORT", "")
        if not env.get("MASTER_ADDR") or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"MASTER_ADDR={env.get('MASTER_ADDR', '')!r} MASTER_PORT={port!r}: a world of {world} "
                            "ranks meets at rank 0's host and a port in 1..65535 (torchrun and mpress train set them)")
    return rank


def single_process_env() -> None:
    """Let `python -m mpress.train` run without torchrun as a world of one."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def broadcast(obj: object, group: dist.ProcessGroup | None) -> object:
    """Rank 0's `obj` on every rank (one object collective)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def control_group() -> dist.ProcessGroup | None:
    """A gloo group for object collectives before the device is known (the plan's
    broadcast, the peer pools' handshake); None = the default group, when it is gloo."""
    if dist.get_backend() != "nccl":
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def root_cause(exc: BaseException) -> str:
    """One line for a failure: torch wraps stage failures in generic errors, so follow the
    causes to mpress's own error (it names rank, stage, microbatch and tensor) or, if
    there is none, to the innermost cause."""
    exc = _innermost(exc)
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def root_kind(exc: BaseException) -> str:
    """The type name of `root_cause`'s error (what the other ranks' lines name)."""
    return type(_innermost(exc)).__name__


def is_own_failure(exc: BaseException) -> bool:
    """True when `root_cause`'s error is mpress's own (a swap, an out-of-memory, bad
    input): a failure of this rank, not the echo of a peer's (a broken recv)."""
    return isinstance(_innermost(exc), MpressError)


def _innermost(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None and not isinstance(exc, MpressError):
        exc = exc.__cause__
    return exc


START_PAUSE_ENV = "MPRESS_START_PAUSE"
"""`RANK:PHASE`: hold rank RANK at start-up phase PHASE (`start_phase`); fault tests only."""
START_PAUSE_S = 120.0
"""How long a held rank sleeps before it goes on (a bound: nothing waits for it forever)."""


def start_phase(phase: str, rank: int) -> None:
    """Rank `rank` reaches start-up phase `phase` ("init": before the process group,
    "plan": before the plan's broadcast, "build": before the stages are built). With
    $MPRESS_START_PAUSE=RANK:PHASE that rank says so on stderr and sleeps there, so that a
    fault test kills or stops it while the other ranks wait for it in the phase's
    collective (a fault at a known start-up phase, as `step 0: loss` marks one mid-run)."""
    if os.environ.get(START_PAUSE_ENV) != f"{rank}:{phase}":
        return
    print(f"mpress start-up: rank {rank} held at {phase}", file=sys.stderr, flush=True)
    time.sleep(START_PAUSE_S)


_interrupt = threading.Event()


def catch_interrupts() -> None:
    """SIGINT to a rank asks the job to stop at the next step boundary (`interrupted`),
    saving a checkpoint first, instead of raising KeyboardInterrupt wherever the rank is
    (`mpress train`'s launcher sends it on Ctrl-C once the job trains; a terminal's Ctrl-C
    under torchrun reaches the ranks themselves)."""
    signal.signal(signal.SIGINT, lambda _signum, _frame: _interrupt.set())


def interrupted() -> bool:
    """True once this rank got SIGINT (`catch_interrupts`)."""
    return _interrupt.is_set()
