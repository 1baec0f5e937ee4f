"""The job's control plane: the process group set-up, a gloo group for object
collectives, and the one line a failure is reported as."""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from mpress.errors import MpressError

COLLECTIVE_TIMEOUT_S = 300
"""Longest a collective or pipeline send/recv may wait for a peer before the rank fails."""


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
    while exc.__cause__ is not None and not isinstance(exc, MpressError):
        exc = exc.__cause__
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
