"""Every rank of a job watches the others, so that a failure anywhere ends the whole job
within seconds, each rank with one line naming the rank that failed.

Without it a rank whose neighbour failed blocks in a pipeline recv or a collective until
the collective timeout; under NCCL the watchdog then kills it with a stack dump, and
under torchrun the agent kills the ranks still running as soon as the first one exits,
before they could say why. So:

- at start-up every rank publishes its process (pid and start time, and the machine it
  runs on) over the gloo control group;
- a rank that fails prints its own line, posts the failure in the job's store (its kind,
  e.g. SwapError), and waits (at most `STOP_WAIT_S`) until every other rank has stopped;
- a thread on every rank polls the store and the processes on its own machine every
  `POLL_INTERVAL_S`; on a posted failure, or a process gone without finishing (killed,
  crashed), it prints one line naming that rank, waits likewise for the others, and ends
  this process (the training thread may be blocked in a collective with the dead rank);
- a rank that finishes says so in the store before it leaves, so that leaving is never
  taken for dying;
- every watch beats (a counter in the store) at each poll, and a rank whose beat has not
  moved for `HEARTBEAT_TIMEOUT_S` counts as stalled (SIGSTOPped, or a machine that
  froze): the others stop naming it, without waiting for it, as they wait for no dead
  rank; this also covers ranks on other machines, whose pids cannot be checked;
- a rank whose parent (the launcher: `mpress train` or torchrun's agent) is gone stops
  too (its launcher also asks the kernel to kill it then, `lifeline.py`; this is the
  watch's own check).

Nothing here depends on D2D: every job, with or without peer pools, is watched.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import torch.distributed as dist

from mpress.d2d.runtime.liveness import ProcessId
from mpress.ui import say_line

POLL_INTERVAL_S = 0.5
"""How often each rank looks at the store and at its machine's processes."""
STOP_WAIT_S = 10.0
"""Longest a failed rank waits for the others to stop before it leaves itself."""
STORE_TIMEOUT_S = 60.0
"""Timeout of the watch's own connection to the job's store."""
CONSEQUENCE_WAIT_S = 2.0
"""How long a rank whose failure is not mpress's own (a broken recv, a collective's
error) first looks for another rank's failure that caused it (`RankWatch.fail`)."""
HEARTBEAT_TIMEOUT_S = 10.0
"""A rank whose watch has not beaten for this long counts as stalled. Its watch beats
every `POLL_INTERVAL_S` from a thread of its own that waits on nothing but the store (the
training thread releases the GIL in torch's kernels and collectives), so 20 missed beats
mean a process that does not run, not a slow step."""


def this_machine() -> str:
    """Host name and pid namespace: two processes' pids compare only when these agree
    (containers on one host have their own pid namespaces)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}/{namespace}"


@dataclass(frozen=True)
class RankProcess:
    """One rank's process, as the ranks gather it at start-up."""

    rank: int
    machine: str
    """`this_machine()` of the rank: its pid is checked only from the same machine."""
    process: ProcessId


class RankWatch:
    """The watch over a job's ranks, from one rank (see the module docstring).

    store: the job's key-value store, under a prefix of this job's own (every rank the
    same). ranks: every rank's process, by rank. heartbeat_timeout_s: silence after which
    a rank counts as stalled. exit: ends the process with a status (tests pass a
    recorder); err: where the lines go.
    """

    def __init__(self, store: dist.Store, ranks: list[RankProcess], *, rank: int,
                 interval_s: float = POLL_INTERVAL_S, stop_wait_s: float = STOP_WAIT_S,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, exit: Callable[[int], None] = os._exit, err: TextIO | None = None) -> None:
        self._store = store
        self._ranks = ranks
        self._rank = rank
        self._machine = ranks[rank].machine
        self._interval_s = interval_s
        self._stop_wait_s = stop_wait_s
        self._exit = exit
        self._err = err
        self._lock = threading.Lock()
        self._stopping = False  # this rank is stopping (failed, or told to stop): one line only
        self._counted = False  # this rank is counted in the store's "stopped"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpress-rank-watch", daemon=True)
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._parent = os.getppid()
        now = time.monotonic()
        self._beats: dict[int, tuple[int, float]] = {p.rank: (-1, now) for p in ranks if p.rank != rank}
        """Other rank -> (its beat count last seen, when this watch saw it change)."""
        self._gone: set[int] = set()
        """Ranks found dead or stalled: they will never count themselves as stopped."""

    def start(self) -> RankWatch:
        self._beat()
        self._thread.start()
        return self

    # -- what the others are doing ---------------------------------------------------------------
    def reasons(self) -> list[str]:
        """Why this rank must stop, one phrase per other rank: a failure one posted, its
        process gone (same machine only) or its heartbeat silent for `heartbeat_timeout_s`
        without having finished, or this rank's launcher gone; [] while all is well."""
        out: list[str] = []
        failed: set[int] = set()
        if int(self._store.add("failures", 0)) > 0:
            for r in range(len(self._ranks)):
                if r != self._rank and self._store.check([f"failed/{r}"]):
                    failed.add(r)
                    out.append(f"rank {r} failed ({self._store.get(f'failed/{r}').decode()})")
        now = time.monotonic()
        for p in self._ranks:
            if p.rank == self._rank or p.rank in failed or self._store.check([f"finished/{p.rank}"]):
                continue
            if p.machine == self._machine and not p.process.alive():
                self._gone.add(p.rank)
                out.append(f"rank {p.rank} (pid {p.process.pid}) has died")
                continue
            beat = int(self._store.add(f"beat/{p.rank}", 0))
            seen, since = self._beats[p.rank]
            if beat != seen:
                self._beats[p.rank] = (beat, now)
            elif now - since > self._heartbeat_timeout_s:
                self._gone.add(p.rank)
                out.append(f"rank {p.rank} (pid {p.process.pid}) has stalled (no heartbeat for "
                           f"{now - since:.0f} s)")
        if os.getppid() != self._parent:
            out.append(f"this rank's launcher (pid {self._parent}) has gone")
        return out

    def _beat(self) -> None:
        self._store.add(f"beat/{self._rank}", 1)

    def _run(self) -> None:
        while not self._done.wait(self._interval_s):
            try:
                self._beat()
                reasons = self.reasons()
            except Exception as exc:  # noqa: BLE001 - the store's host (torchrun's agent, or rank 0) is gone
                text = str(exc).strip().splitlines()
                reasons = [f"the job's store stopped answering ({type(exc).__name__}: {text[0] if text else ''})"]
            if reasons and not self._done.is_set() and self._claim():
                self._say(self._stop_line(reasons))
                try:
                    self._count_stopped()
                    self._wait_for_the_others()
                finally:
                    self._exit(1)
                return

    # -- this rank -----------------------------------------------------------------------------------
    def fail(self, line: str, kind: str, *, others_first_s: float = 0.0) -> bool:
        """This rank failed: print `line` (its one line), post the failure (`kind`, e.g.
        "SwapError", names it in the others' lines) and wait until every other rank has
        stopped (at most `stop_wait_s`), so that a launcher that ends the job when one
        rank exits does not end the others before they have said why. The caller then
        leaves. False, printing nothing, when the watch is already stopping this rank
        because another one failed first (its thread prints and ends the process).

        others_first_s: first look this long for another rank's failure, death or stall
        (a failure that may be the consequence of one: a recv from a peer killed with -9
        breaks before its process is seen gone); if there is one, this rank stops naming
        it, as the watch's thread would, instead of posting a failure of its own."""
        deadline = time.monotonic() + others_first_s
        reasons: list[str] = []
        while others_first_s > 0:
            try:
                reasons = self.reasons()
            except Exception:  # noqa: BLE001 - no store: this rank's own failure is all there is to say
                reasons = []
            if reasons or time.monotonic() >= deadline:
                break
            time.sleep(self._interval_s / 5)
        if not self._claim():
            return False
        self._done.set()
        self._say(self._stop_line(reasons) if reasons else line)
        try:
            if not reasons:
                self._store.set(f"failed/{self._rank}", kind)
                self._store.add("failures", 1)
            self._count_stopped()
            self._wait_for_the_others()
        except Exception:  # noqa: BLE001 - no store: nobody left to tell
            pass
        return True

    def _stop_line(self, reasons: list[str]) -> str:
        return f"mpress.train: rank {self._rank}: stopping: {'; '.join(reasons)}"

    def stop(self) -> None:
        """This rank finished: stop watching, and count as finished (its process leaving
        is then no death) and as stopped (for a rank that fails after it)."""
        self._done.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        try:
            self._store.set(f"finished/{self._rank}", "1")
            self._count_stopped()
        except Exception:  # noqa: BLE001 - no store: nobody left to tell
            pass

    def _wait_for_the_others(self) -> None:
        """Until every rank has stopped or finished (a dead or stalled one excepted), at
        most `stop_wait_s`: a rank that leaves first would have torchrun end the others
        before they have said why."""
        deadline = time.monotonic() + self._stop_wait_s
        while time.monotonic() < deadline:
            try:
                self.reasons()  # finds ranks that died or stalled meanwhile: they never count
            except Exception:  # noqa: BLE001 - no store: nobody left to wait for
                return
            if int(self._store.add("stopped", 0)) + len(self._gone) >= len(self._ranks):
                return
            self._beat()  # still here: a rank that waits is not stalled
            time.sleep(self._interval_s / 5)

    def _claim(self) -> bool:
        with self._lock:
            if self._stopping:
                return False
            self._stopping = True
            return True

    def _count_stopped(self) -> None:
        with self._lock:
            if self._counted:
                return
            self._counted = True
        self._store.add("stopped", 1)

    def _say(self, line: str) -> None:
        say_line(line, self._err)


def start_rank_watch(group: dist.ProcessGroup | None, *, rank: int, world: int) -> RankWatch:
    """Gather every rank's process over `group` (the gloo control group: one object
    collective), and start this rank's watch. Call on every rank, once, early."""
    mine = (RankProcess(rank=rank, machine=this_machine(), process=ProcessId.current()), uuid.uuid4().hex)
    gathered: list[tuple[RankProcess, str]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine, group=group)
    job = gathered[0][1]  # rank 0's: this start of the job, apart from any earlier one under the same store
    store = dist.PrefixStore(f"mpress/rank-watch/{job}/", _own_store_connection())
    return RankWatch(store, [p for p, _ in gathered], rank=rank).start()


def _own_store_connection() -> dist.Store:
    """A connection of the watch's own to the job's store. The training thread may block
    in the store (a communicator's set-up waits there for its peers' ids) while holding
    its connection; the watch must not queue behind it."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    return store  # a file or hash store: no connection to queue on
