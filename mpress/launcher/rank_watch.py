"""Every rank of a job watches the others, so that a failure anywhere ends the whole job
within seconds, each rank with one line naming the rank that failed.

Without it a rank whose neighbour failed blocks in a pipeline recv or a collective until
the collective timeout; under NCCL the watchdog then kills it with a stack dump, and
under torchrun the agent kills the ranks still running as soon as the first one exits,
before they could say why. So:

- the watch starts as the rank starts, before the process group is made (when a launcher
  hosts the job's store: `mpress train`, torchrun), so that every phase from spawn is
  watched -- a rank killed while others wait in the rendezvous, the plan's broadcast or the
  stages' set-up is named as it would be mid-run. Each rank publishes its process (pid and
  start time, and the machine it runs on) in the store as its watch starts, and
  `mpress train`'s launcher publishes each rank's as it spawns it, so that a rank killed
  before its first line of Python is named too;
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
  rank; this also covers ranks on other machines, whose pids cannot be checked. A rank
  that has not beaten yet may still be importing torch: it counts as stalled only when
  the kernel has held its process stopped for as long (same machine);
- a rank whose parent (the launcher: `mpress train` or torchrun's agent) is gone stops
  too (its launcher also asks the kernel to kill it then, `lifeline.py`; this is the
  watch's own check).

Nothing here depends on D2D: every job, with or without peer pools, is watched.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
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


def register(store: dist.Store, process: RankProcess) -> None:
    """Publish a rank's process in the watch's store (`watch_store`), for the others'
    watches: by the rank as its watch starts, by `mpress train`'s launcher as it spawns it."""
    store.set(f"proc/{process.rank}", json.dumps([process.machine, process.process.pid, process.process.start_ticks]))


def _registered(store: dist.Store, rank: int) -> RankProcess | None:
    if not store.check([f"proc/{rank}"]):
        return None
    machine, pid, ticks = json.loads(store.get(f"proc/{rank}"))
    return RankProcess(rank=rank, machine=machine, process=ProcessId(pid, ticks))


def watch_store(store: dist.Store) -> dist.PrefixStore:
    """The part of the job's store the watches use: one per start of the job (torchrun's
    restarts count up `TORCHELASTIC_RESTART_COUNT`)."""
    return dist.PrefixStore(f"mpress/rank-watch/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


_TRAINING = "training"


def is_training(store: dist.Store) -> bool:
    """True once the job's step loop has begun (`RankWatch.training`); `store`: the
    watches' part of the job's store (`watch_store`)."""
    return store.check([_TRAINING])


def held_stopped(pid: int) -> bool:
    """True when the kernel holds process `pid` stopped (SIGSTOP, or traced)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class RankWatch:
    """The watch over a job's ranks, from one rank (see the module docstring).

    store: the job's key-value store, under a prefix of this job's own (every rank the
    same). ranks: every rank's process, by rank; None for one not known yet (the watch
    then reads it from the store once it is `register`ed there). heartbeat_timeout_s: silence after which
    a rank counts as stalled. exit: ends the process with a status (tests pass a
    recorder); err: where the lines go.
    """

    def __init__(self, store: dist.Store, ranks: list[RankProcess | None], *, rank: int,
                 interval_s: float = POLL_INTERVAL_S, stop_wait_s: float = STOP_WAIT_S,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, exit: Callable[[int], None] = os._exit, err: TextIO | None = None) -> None:
        self._store = store
        self._ranks = ranks
        self._rank = rank
        self._machine = ranks[rank].machine  # type: ignore[union-attr]
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
        self._beats: dict[int, tuple[int, float]] = {r: (-1, now) for r in range(len(ranks)) if r != rank}
        """Other rank -> (its beat count last seen, when this watch saw it change)."""
        self._held: dict[int, float] = {}
        """Other rank that has not beaten yet -> since when its process is seen stopped."""
        self._gone: set[int] = set()
        """Ranks found dead or stalled: they will never count themselves as stopped."""

    def start(self) -> RankWatch:
        register(self._store, self._ranks[self._rank])  # type: ignore[arg-type]
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
        for r in range(len(self._ranks)):
            if r == self._rank or r in failed or self._store.check([f"finished/{r}"]):
                continue
            p = self._ranks[r] or _registered(self._store, r)
            self._ranks[r] = p
            here = p is not None and p.machine == self._machine
            if here and not p.process.alive():  # type: ignore[union-attr]
                self._gone.add(r)
                out.append(f"rank {r} (pid {p.process.pid}) has died")  # type: ignore[union-attr]
                continue
            beat = int(self._store.add(f"beat/{r}", 0))
            seen, since = self._beats[r]
            if beat != seen:
                self._beats[r] = (beat, now)
            elif beat > 0 and now - since > self._heartbeat_timeout_s:
                self._gone.add(r)
                out.append(f"rank {r} (pid {p.process.pid if p else '?'}) has stalled (no heartbeat for "
                           f"{now - since:.0f} s)")
            elif beat == 0 and here and held_stopped(p.process.pid):  # type: ignore[union-attr]
                held = now - self._held.setdefault(r, now)
                if held > self._heartbeat_timeout_s:
                    self._gone.add(r)
                    out.append(f"rank {r} (pid {p.process.pid}) has stalled (held stopped for "  # type: ignore[union-attr]
                               f"{held:.0f} s before its first heartbeat)")
            else:
                self._held.pop(r, None)
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

    def training(self) -> None:
        """The job has entered its step loop (rank 0 says so): from now on `mpress train`'s
        launcher answers Ctrl-C by asking the ranks to stop at a step boundary (SIGINT,
        `control.catch_interrupts`) rather than ending them (`is_training`)."""
        self._store.set(_TRAINING, "1")

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


def early_rank_watch(*, rank: int, world: int) -> RankWatch | None:
    """This rank's watch, started as the rank starts, before its process group: when a
    launcher hosts the job's store (`mpress train`, torchrun: TORCHELASTIC_USE_AGENT_STORE)
    at MASTER_ADDR:MASTER_PORT, a connection of the watch's own to it. None otherwise
    (rank 0 hosts the store: `start_rank_watch` once the process group is made)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    return _started(store, rank=rank, world=world)


def start_rank_watch(*, rank: int, world: int) -> RankWatch:
    """This rank's watch once the process group is made, on a connection of its own to the
    group's store. Call on every rank, once, early."""
    return _started(_own_store_connection(), rank=rank, world=world)


def _started(store: dist.Store, *, rank: int, world: int) -> RankWatch:
    ranks: list[RankProcess | None] = [None] * world
    ranks[rank] = RankProcess(rank=rank, machine=this_machine(), process=ProcessId.current())
    return RankWatch(watch_store(store), ranks, rank=rank).start()


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
