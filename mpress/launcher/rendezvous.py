"""The rendezvous endpoint of a job over several machines, checked before any rank starts.

Node 0's launcher hosts the job's store (a c10d `TCPStore`) at `--rdzv-endpoint
HOST:PORT`; every other node's launcher and every rank joins it there. Left to torch, a
wrong endpoint fails badly: a host that does not resolve has each rank's store client
retry with c10d's warnings for minutes; a port where nothing listens, or where something
that is not a store listens, holds the ranks until the collective timeout (a `TCPStore`
client waits forever for a listener that accepts and never answers); a port already taken
on node 0 ends in a multi-line `DistNetworkError`. So each launcher checks the endpoint
first, each step bounded:

- the host's name resolves (`socket.getaddrinfo`, in a thread of its own so that a slow
  resolver cannot hold the launcher past the bound);
- node 0: the port is free on one of the host's addresses of this machine (a plain
  socket bound there, then closed), and the store is then started on it;
- node k > 0: something accepts a TCP connection there (retried until the bound: node 0
  may start later), and it answers as a c10d store (a `TCPStore` client connects and
  reads a key, in a thread of its own, the bound applying to it too).

A failure is a `RendezvousError`: one line with the host, the port, what failed and how
long the launcher waited; `mpress train` prints it and exits with status 1.
"""

from __future__ import annotations

import datetime
import errno
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from mpress.errors import MpressError

if TYPE_CHECKING:  # imported where a store is made: `mpress train`'s flags come without torch
    import torch.distributed as dist

RDZV_TIMEOUT_S = 60.0
"""Default bound on each node's wait for the endpoint (`mpress train --rdzv-timeout`)."""
RETRY_S = 0.25
"""Pause between two connection attempts while node 0 is not there yet."""

T = TypeVar("T")


class RendezvousError(MpressError):
    """The rendezvous endpoint cannot be used: one line naming host, port, what failed and
    how long the launcher waited."""

    def __init__(self, host: str, port: int, what: str, waited_s: float) -> None:
        self.host, self.port, self.what, self.waited_s = host, port, what, waited_s
        waited = f"{waited_s:.1f}" if isinstance(waited_s, (int, float)) else waited_s
        super().__init__(f"rendezvous endpoint {host}:{port}: {what} (waited {waited} s)")


def host_store(host: str, port: int, *, timeout_s: float = RDZV_TIMEOUT_S) -> dist.TCPStore:
    """Node 0: the job's store at HOST:PORT, after checking that HOST is this machine's and
    PORT free on it. A `RendezvousError` when not."""
    t0 = time.monotonic()
    addresses = _resolve(host, port, timeout_s, t0)
    why = ""
    for family, address in addresses:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's own socket
            try:
                s.bind(address)
                break
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise RendezvousError(host, port, "the port is taken by another process on this machine "
                                          "(node 0 hosts the job's store there): choose a free port",
                                          time.monotonic() - t0) from None
                why = why or f"{address[0]}: {exc.strerror}"
    else:
        raise RendezvousError(host, port, f"the host is not this machine ({why}): --node-rank 0 runs on the host "
                              "the endpoint names", time.monotonic() - t0)
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    except (RuntimeError, ValueError) as exc:
        text = str(exc).strip().splitlines()
        raise RendezvousError(host, port, f"cannot host the job's store: {text[0] if text else type(exc).__name__}",
                              time.monotonic() - t0) from None


def join_store(host: str, port: int, *, timeout_s: float = RDZV_TIMEOUT_S) -> dist.TCPStore:
    """Node k > 0: a connection to the job's store at HOST:PORT, once node 0 hosts it there
    (waited for at most `timeout_s`). A `RendezvousError` when the host does not resolve,
    nothing accepts a connection in time, or what accepts it is not a c10d store."""
    t0 = time.monotonic()
    addresses = _resolve(host, port, timeout_s, t0)
    last = ""
    while True:
        left = timeout_s - (time.monotonic() - t0)
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(left, 5.0))):
                break
        except OSError as exc:
            last = exc.strerror or type(exc).__name__
        if time.monotonic() - t0 + RETRY_S >= timeout_s:
            shown = ", ".join(sorted({a[0] for _, a in addresses}))
            raise RendezvousError(host, port, f"nothing accepts a connection at {shown} ({last}): is node 0's "
                                  "mpress train running?", time.monotonic() - t0)
        time.sleep(RETRY_S)

    import torch.distributed as dist

    def probe() -> dist.TCPStore:
        left = max(1.0, timeout_s - (time.monotonic() - t0))
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=left))
        store.check(["mpress/rendezvous-probe"])  # one request and its reply: the c10d protocol
        return store

    what = "a TCP listener accepts connections there but does not answer as a c10d store (another service?)"
    return _bounded(probe, timeout_s - (time.monotonic() - t0), host, port, t0, what)


def _resolve(host: str, port: int, timeout_s: float, t0: float) -> list[tuple[int, tuple]]:
    """(family, socket address) of HOST, IPv4 first."""
    def lookup() -> list[tuple[int, tuple]]:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return sorted({(family, address) for family, _, _, _, address in infos},
                      key=lambda fa: fa[0] != socket.AF_INET)

    try:
        return _bounded(lookup, timeout_s, host, port, t0, "the host name did not resolve in time")
    except socket.gaierror as exc:
        raise RendezvousError(host, port, f"cannot resolve the host name ({exc.strerror})",
                              time.monotonic() - t0) from None


def _bounded(fn: Callable[[], T], timeout_s: float, host: str, port: int, t0: float, what: str) -> T:
    """`fn()` in a daemon thread, given at most `timeout_s`: its result, its error
    raised here, or a `RendezvousError(what)` when it has not returned in time (the thread
    is left behind, blocked; it does not keep the process alive)."""
    box: list[object] = []

    def run() -> None:
        try:
            box.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append(("error", exc))

    thread = threading.Thread(target=run, name="mpress-rendezvous-check", daemon=True)
    thread.start()
    thread.join(max(0.0, timeout_s))
    if not box:
        raise RendezvousError(host, port, what, time.monotonic() - t0)
    kind, value = box[0]  # type: ignore[misc]
    if kind == "error":
        if isinstance(value, (socket.gaierror, RendezvousError)):
            raise value  # type: ignore[misc]
        text = str(value).strip().splitlines()
        raise RendezvousError(host, port, f"{what}: {text[0] if text else type(value).__name__}",
                              time.monotonic() - t0)
    return value  # type: ignore[return-value]
