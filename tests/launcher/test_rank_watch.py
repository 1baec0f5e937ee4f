"""The rank watch in one process: ranks sharing an in-memory store, fake processes, and a
recorder in place of os._exit (one test ends a real process)."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch.distributed as dist

from mpress.d2d.runtime.liveness import ProcessId
from mpress.launcher.rank_watch import RankProcess, RankWatch, register, this_machine
from tests.support.peers import exited_process

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 60  # a guard against a hang, not a measurement


class Exits:
    """Records a watch's exit status in place of ending the process."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


def _ranks(n: int, *, dead: dict[int, ProcessId] | None = None, machine: dict[int, str] | None = None):
    me = ProcessId.current()
    return [RankProcess(rank=r, machine=(machine or {}).get(r, this_machine()), process=(dead or {}).get(r, me))
            for r in range(n)]


def _watch(store, ranks, rank, **kw) -> tuple[RankWatch, Exits, io.StringIO]:
    exits, err = Exits(), io.StringIO()
    kw.setdefault("stop_wait_s", 0.2)  # the others in these tests are not all watching
    return RankWatch(store, ranks, rank=rank, interval_s=0.02, exit=exits, err=err, **kw), exits, err


def test_all_well_gives_no_reason() -> None:
    store = dist.HashStore()
    watch, _, _ = _watch(store, _ranks(4), 1)
    assert watch.reasons() == []


def test_a_posted_failure_stops_the_others_with_one_line_naming_it() -> None:
    store = dist.HashStore()
    ranks = _ranks(3)
    failing, _, failing_err = _watch(store, ranks, 0, stop_wait_s=HANG_S)
    others = [_watch(store, ranks, r) for r in (1, 2)]
    for w, _, _ in others:
        w.start()
    assert failing.fail("mpress.train: rank 0: SwapError: swap-out failed: ...", "SwapError")
    for r, (w, exits, err) in zip((1, 2), others):
        assert exits.called.wait(HANG_S)
        assert exits.codes == [1]
        assert err.getvalue() == f"mpress.train: rank {r}: stopping: rank 0 failed (SwapError)\n"
    assert failing_err.getvalue() == "mpress.train: rank 0: SwapError: swap-out failed: ...\n"
    assert int(store.add("stopped", 0)) == 3  # the failed rank waited for both: it returned, they had stopped


def test_a_failed_rank_waits_no_longer_than_its_bound_for_ranks_that_do_not_answer() -> None:
    store = dist.HashStore()
    failing, _, _ = _watch(store, _ranks(2), 0, stop_wait_s=0.1)  # rank 1 runs no watch
    assert failing.fail("mpress.train: rank 0: boom", "RuntimeError")
    assert int(store.add("stopped", 0)) == 1


def test_a_process_gone_on_this_machine_is_named_with_its_pid() -> None:
    dead = exited_process()
    store = dist.HashStore()
    watch, exits, err = _watch(store, _ranks(4, dead={2: dead}), 0)
    watch.start()
    assert exits.called.wait(HANG_S)
    assert err.getvalue() == f"mpress.train: rank 0: stopping: rank 2 (pid {dead.pid}) has died\n"


def test_finished_ranks_and_other_machines_are_not_deaths() -> None:
    store = dist.HashStore()
    ranks = _ranks(3, dead={1: exited_process(), 2: exited_process()}, machine={2: "elsewhere/pid:[1]"})
    leaver, _, _ = _watch(store, ranks, 1)
    leaver.stop()  # rank 1 finished, then its process left
    watch, _, _ = _watch(store, ranks, 0)
    assert watch.reasons() == []


def test_a_rank_the_watch_is_stopping_does_not_also_report_its_own_failure() -> None:
    store = dist.HashStore()
    ranks = _ranks(2)
    store.set("failed/1", "SwapError")
    store.add("failures", 1)
    watch, exits, err = _watch(store, ranks, 0)
    watch.start()
    assert exits.called.wait(HANG_S)
    # the training thread fails too (its recv from rank 1 broke): the watch already spoke for it
    assert not watch.fail("mpress.train: rank 0: RuntimeError: Connection closed by peer", "RuntimeError")
    assert err.getvalue() == "mpress.train: rank 0: stopping: rank 1 failed (SwapError)\n"


def test_the_watch_ends_a_real_process_blocked_elsewhere() -> None:
    """The training thread blocked (here: asleep) while a neighbour failed: the watch's
    thread prints the line and ends the process with status 1."""
    code = (
        "import time, torch.distributed as dist\n"
        "from mpress.launcher.rank_watch import RankWatch, RankProcess, this_machine\n"
        "from mpress.d2d.runtime.liveness import ProcessId\n"
        "store = dist.HashStore()\n"
        "store.set('failed/0', 'DeviceOutOfMemory'); store.add('failures', 1)\n"
        "ranks = [RankProcess(rank=r, machine=this_machine(), process=ProcessId.current()) for r in range(4)]\n"
        "RankWatch(store, ranks, rank=3, interval_s=0.05, stop_wait_s=0.1).start()\n"
        "time.sleep(60)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert res.returncode == 1
    assert res.stderr == "mpress.train: rank 3: stopping: rank 0 failed (DeviceOutOfMemory)\n"


def test_a_rank_whose_heartbeat_stops_is_named_as_stalled() -> None:
    """Rank 1's process is alive (it is this one) but its watch beat once and no more, as a SIGSTOPped rank's."""
    store = dist.HashStore()
    store.add("beat/1", 1)
    watch, exits, err = _watch(store, _ranks(2), 0, heartbeat_timeout_s=0.3)
    watch.start()
    assert exits.called.wait(HANG_S)
    assert re.fullmatch(r"mpress\.train: rank 0: stopping: rank 1 \(pid \d+\) has stalled \(no heartbeat for \d+ s\)\n",
                        err.getvalue()), err.getvalue()


def test_ranks_that_beat_are_not_stalled() -> None:
    store = dist.HashStore()
    ranks = _ranks(2)
    other, other_exits, _ = _watch(store, ranks, 1, heartbeat_timeout_s=0.3)
    watch, exits, err = _watch(store, ranks, 0, heartbeat_timeout_s=0.3)
    other.start()
    watch.start()
    assert not exits.called.wait(1.5)  # five heartbeat timeouts, every one of them beaten
    other.stop()
    watch.stop()
    assert err.getvalue() == "" and not other_exits.codes


def test_a_failed_rank_does_not_wait_for_a_dead_one() -> None:
    store = dist.HashStore()
    failing, _, _ = _watch(store, _ranks(2, dead={1: exited_process()}), 0, stop_wait_s=HANG_S)
    returned = threading.Event()
    threading.Thread(target=lambda: (failing.fail("mpress.train: rank 0: boom", "RuntimeError"), returned.set()),
                     daemon=True).start()
    assert returned.wait(HANG_S / 4)  # it would wait HANG_S for a rank that can never count itself stopped


def test_a_failure_that_echoes_a_dead_peer_names_the_peer_instead() -> None:
    """The training thread's recv broke because rank 1 was killed: the rank's line names
    rank 1, and it posts no failure of its own for the others to name."""
    dead = exited_process()
    store = dist.HashStore()
    watch, _, err = _watch(store, _ranks(3, dead={1: dead}), 0)
    assert watch.fail("mpress.train: rank 0: RuntimeError: Connection closed by peer", "RuntimeError",
                      others_first_s=HANG_S)
    assert err.getvalue() == f"mpress.train: rank 0: stopping: rank 1 (pid {dead.pid}) has died\n"
    assert not store.check(["failed/0"])


def test_a_rank_not_yet_beating_is_stalled_only_when_held_stopped() -> None:
    """Before its first beat a rank may still be importing torch (running, no watch yet):
    not stalled. Held stopped by the kernel that long (SIGSTOP at start-up): stalled."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ranks = _ranks(2)
        ranks[1] = None  # not known to this watch: it reads the process the launcher registered
        store = dist.HashStore()
        register(store, RankProcess(rank=1, machine=this_machine(), process=ProcessId.of(child.pid)))
        watch, exits, err = _watch(store, ranks, 0, heartbeat_timeout_s=0.3)
        watch.start()
        assert not exits.called.wait(1.5)  # five heartbeat timeouts without a beat, but running
        os.kill(child.pid, signal.SIGSTOP)
        assert exits.called.wait(HANG_S)
        assert re.fullmatch(rf"mpress\.train: rank 0: stopping: rank 1 \(pid {child.pid}\) has stalled \(held "
                            r"stopped for \d+ s before its first heartbeat\)\n", err.getvalue()), err.getvalue()
    finally:
        child.kill()
        child.wait()


def test_a_registered_process_that_dies_before_its_watch_starts_is_named() -> None:
    """The launcher registered rank 1 as it spawned it; it was killed before its watch ran."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    store = dist.HashStore()
    register(store, RankProcess(rank=1, machine=this_machine(), process=ProcessId.of(child.pid)))
    child.kill()
    child.wait()
    ranks = _ranks(2)
    ranks[1] = None
    watch, _, _ = _watch(store, ranks, 0)
    assert watch.reasons() == [f"rank 1 (pid {child.pid}) has died"]
