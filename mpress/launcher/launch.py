"""`mpress train`'s launcher: start the ranks of one job on this machine, watch them, and
turn how they ended into one line and an exit status.

What it does:

- hosts the job's store (a `TCPStore`; the ranks join it as torchrun's workers join the
  agent's, `TORCHELASTIC_USE_AGENT_STORE`), so the store outlives any rank and every
  surviving rank's watch can name the one that died (`rank_watch.py`);
- starts one `python -m mpress.train --config CFG <overrides>` per rank (forked by a rank
  starter that imported it once, `rank_starter.py`, else executed), in a process
  group of the job's own (a Ctrl-C reaches the launcher only, which stops the ranks);
  each rank asks the kernel to kill it when the launcher dies (`liveness.die_with_parent`);
- rank 0's stdout (progress lines, report tables) is the launcher's stdout, unchanged and
  written by rank 0 alone, so no line is ever split; everything else every rank prints
  goes to its own file `<run dir>/rank<N>.log` (whole lines, one writer per file);
- once a rank has ended badly it gives the others `STOP_WAIT_S` (+ a margin) to stop by
  themselves, each with its line; a rank the kernel holds stopped (SIGSTOP) is killed as
  soon as every other rank has left, any other rank still there after the grace period too;
- when every rank is gone it ends what is left of their process group (shared-memory
  resource trackers), removes every shared-memory segment of the run (`sweep_segments`),
  and reduces the ranks' lines to ONE line naming the cause (`diagnose`).

Why not torch's elastic launcher (`torch.distributed.launcher.api.elastic_launch`):
its agent ends every other worker (SIGTERM) as soon as the first one exits, before they
can say which rank failed; its workers are not killed when the agent is killed with -9
(start_processes offers no hook to ask for a parent-death signal before a worker runs);
it reports a failure as a `ChildFailedError` with per-rank tracebacks and error files,
not as the rank's own line; and its console output carries per-line rank prefixes. The
pieces it would contribute here (Popen per rank, a TCPStore, an env per rank) are a
few lines, so the launcher manages the rank processes itself; the ranks see the same
environment as under torchrun (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...), and
the torchrun form keeps working.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from mpress.d2d.runtime.liveness import LAUNCHER_PID_ENV, ProcessId
from mpress.d2d.runtime.transport import sweep_segments
from mpress.launcher.rank_watch import (
    STOP_WAIT_S,
    RankProcess,
    held_stopped,
    is_training,
    register,
    this_machine,
    watch_store,
)
from mpress.launcher.rank_starter import (
    RANK_MODULE,
    RANK_START_ENV,
    ForkedRank,
    RankStarter,
    StarterRefused,
    start_starter,
    starter_env,
)
from mpress.launcher.rendezvous import RDZV_TIMEOUT_S, RendezvousError, host_store, join_store
from mpress.launcher.verdict import RankEnd, diagnose, interrupted_line
from mpress.config.loader import write_text_atomic
from mpress.config.overrides import Override, override_argv

Rank = subprocess.Popen | ForkedRank
"""A rank process: executed (`Popen`) or forked by the rank starter."""

POLL_S = 0.1
"""How often the launcher looks at its ranks."""
GRACE_S = STOP_WAIT_S + 5.0
"""After the first bad end, how long the other ranks get to stop by themselves (their
watches name the failed rank within a second and wait at most `STOP_WAIT_S` for each
other) before the launcher kills what is left."""
START_GRACE_S = 60.0
"""How long the grace period may wait for ranks still starting (importing torch, not yet
watching: no heartbeat in the store) when another rank ended badly during start-up: each
names the failed rank as soon as its watch runs."""
TERM_WAIT_S = 5.0
"""After the launcher was interrupted: from SIGTERM to the ranks until SIGKILL."""
INTERRUPT_WAIT_S = 120.0
"""After Ctrl-C (SIGINT) while the job trains: how long the ranks get to finish their step,
save a checkpoint and leave, before the launcher ends them (a second Ctrl-C: at once)."""


@dataclass(frozen=True)
class LaunchSpec:
    """One `mpress train` run."""

    config: str
    """The config as given (preset name or path); the ranks load it again, with `overrides`."""
    overrides: list[Override]
    """Dotted overrides, as the launcher validated them."""
    nproc: int
    """Ranks to start (one process each)."""
    run_dir: Path
    """Where the ranks' logs and `run.json` go (created)."""
    run_id: str
    """Names the run's shared-memory segments (`mpress-<run id>-*`)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every rank."""
    json_report: Path | None = None
    """`mpress train --json`: where rank 0 writes the end-of-run report (the config's
    `report`); rank 0's stdout then goes to the launcher's stderr, and the launcher prints
    the report, alone, on its stdout once every rank has finished."""
    nodes: Nodes | None = None
    """A job over several machines, one launcher each; None: this machine only."""
    preload: tuple[str, ...] = ()
    """Modules every rank of this job imports beyond `mpress.train` (a Hugging Face
    model's), imported once by the rank starter before it forks them."""

    @property
    def first_rank(self) -> int:
        """This node's first global rank."""
        return self.nodes.node_rank * self.nproc if self.nodes is not None else 0


@dataclass(frozen=True)
class Nodes:
    """Where this launcher's ranks sit in a job of several machines (torchrun's static
    rendezvous: `--nnodes`, `--node-rank`, `--rdzv-endpoint`): node k runs global ranks
    [k * nproc, (k + 1) * nproc); node 0's launcher hosts the job's store at the endpoint,
    every rank of every node joins it there."""

    nnodes: int
    node_rank: int
    host: str
    """The endpoint's host: node 0's address, as the other nodes reach it."""
    port: int
    timeout_s: float = RDZV_TIMEOUT_S
    """Bound on this launcher's wait for the endpoint (`rendezvous.py`)."""


def threads_per_rank(nproc: int, cores: int | None = None) -> int:
    """CPU threads each of `nproc` ranks on this machine gets: an equal share of the cores
    this process may run on (`cores`, default its affinity), at least one. torchrun gives
    every rank one; a rank whose plan steps its optimizer on the host runs Adam over its
    stage's parameters on the CPU, which one core cannot stream at the host's DRAM
    bandwidth share the emulator costs it at."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, nproc))


def shared_env(spec: LaunchSpec) -> dict[str, str]:
    """The environment every rank of this node shares: the starter's (`starter_env`) and
    the job's."""
    env = {**starter_env(spec.run_id), **spec.env}
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(spec.nproc)))
    # NVLink SHARP buffers take GiB per communicator on an NVSwitch node (vllm-project/
    # vllm#9699) and serve all-reduces; a pipeline's traffic is sends and receives, and
    # no plan budgets them. The user's setting wins.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.update(TORCHELASTIC_USE_AGENT_STORE="True")
    return env


def rank_env(spec: LaunchSpec, local: int, port: int) -> dict[str, str]:
    """Local rank `local`'s environment: as torchrun's workers get it (global rank and
    world over every node), plus the run id and the pid of its parent (this launcher;
    a rank starter puts its own there, `rank_starter.py`)."""
    env = shared_env(spec)
    nodes = spec.nodes or Nodes(nnodes=1, node_rank=0, host="127.0.0.1", port=port)
    rank, world = nodes.node_rank * spec.nproc + local, nodes.nnodes * spec.nproc
    env.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(spec.nproc),
               GROUP_RANK=str(nodes.node_rank), ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world),
               MASTER_ADDR=nodes.host, MASTER_PORT=str(nodes.port))
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    return env


class _Interrupted:
    """Records the signal that asked the launcher to stop (SIGINT, SIGTERM, SIGHUP)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        """Signals received (a second Ctrl-C ends the ranks without waiting for their save)."""
        self._old: dict[int, object] = {}

    def __enter__(self) -> _Interrupted:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum
        self.count += 1

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)  # type: ignore[arg-type]


def launch(spec: LaunchSpec, *, err=None, starter: RankStarter | None = None) -> int:
    """Run the job; return the exit status (0 all ranks finished, 1 runtime failure, 2 bad
    input a rank found, 128+N the launcher got signal N). On failure print the one line
    (`diagnose`) to `err` (default stderr). `starter`: one started before the job was
    checked (`start_starter`), which this call closes; None: started here where it can."""
    err = err or sys.stderr
    if starter is None:
        starter = start_starter(spec.run_id)  # it imports while this process sets up the job's store
    try:
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        return _launch(spec, err, starter)
    finally:
        if starter is not None:
            starter.close()


def _launch(spec: LaunchSpec, err, starter: RankStarter | None) -> int:
    nodes = spec.nodes
    # the store outlives every rank: on one machine this launcher's; over several, node 0's
    # at the endpoint (listening on every interface), which the other nodes' launchers and
    # ranks join, each checked first with a bounded wait (rendezvous.py)
    try:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if nodes is None \
            else host_store(nodes.host, nodes.port, timeout_s=nodes.timeout_s) if nodes.node_rank == 0 \
            else join_store(nodes.host, nodes.port, timeout_s=nodes.timeout_s)
    except RendezvousError as exc:
        print(f"mpress train: {exc}", file=err, flush=True)
        return 1
    port = store.port
    watched = watch_store(store)  # where the ranks' watches look each other up (rank_watch.py)
    first = spec.first_rank
    procs: list[Rank] = []
    logs: list[Path] = []
    killed: set[int] = set()  # ranks the launcher itself killed
    with _Interrupted() as interrupted:
        try:
            started_by = _start_ranks(spec, port, starter, procs, logs, functools.partial(_spawned, watched, first))
            _write_run_file(spec, procs, started_by)
            _watch(procs, killed, interrupted, functools.partial(_started, watched, first),
                   functools.partial(_training, watched))
        finally:
            for rank, p in enumerate(procs):  # the launcher itself failed: leave nothing behind
                if p.poll() is None:
                    killed.add(rank)
                    p.kill()
                    p.wait()
    _end_group(procs)
    sweep_segments(spec.run_id)
    del watched, store
    ends = [RankEnd(rank=first + r, pid=p.pid, returncode=p.returncode, killed_by_launcher=r in killed, log=logs[r])
            for r, p in enumerate(procs)]
    if interrupted.signum is not None:
        print(interrupted_line(ends, interrupted.signum, spec.run_dir), file=err, flush=True)
        return 128 + interrupted.signum
    verdict = diagnose(ends, spec.run_dir)
    if verdict is not None:
        line, code = verdict
        print(line, file=err, flush=True)
        return code
    if spec.json_report is not None:
        return _print_report(spec.json_report, err)
    return 0


def _start_ranks(spec: LaunchSpec, port: int, starter: RankStarter | None, procs: list[Rank], logs: list[Path],
                 started: Callable[[int, Rank], None]) -> str:
    """Start this node's ranks into `procs` (their logs into `logs`), forked by `starter`
    where it can (else executed), calling `started` on each as soon as it runs; how they
    were started, for `run.json` ("fork", or "exec" and why not fork)."""
    argv = ["--config", spec.config, *override_argv(spec.overrides)]
    how = "fork" if starter is not None else f"exec ({RANK_START_ENV}=exec or no fork here)"
    for rank in range(spec.nproc):
        log = spec.run_dir / f"rank{spec.first_rank + rank}.log"  # named by global rank
        logs.append(log)
        log.write_bytes(b"")
        pgid = 0 if rank == 0 else procs[0].pid  # rank 0 leads the ranks' own process group
        proc: Rank | None = None
        if starter is not None:
            try:
                if rank == 0:
                    if spec.preload:
                        starter.preload(list(spec.preload))
                    starter.ready()
                proc = starter.fork(argv, rank_env(spec, rank, port),
                                    out=("2" if spec.json_report is not None else None) if rank == 0 else str(log),
                                    err=str(log), pgid=pgid)
            except StarterRefused as exc:
                starter, how = None, f"exec ({exc})"
        if proc is None:
            with open(log, "ab") as f:
                rank0_out = 2 if spec.json_report is not None else None  # fd 2: stdout is the report's alone
                proc = subprocess.Popen([sys.executable, "-m", RANK_MODULE, *argv], stdin=subprocess.DEVNULL,
                                        stdout=rank0_out if rank == 0 else f, stderr=f,
                                        env=rank_env(spec, rank, port), process_group=pgid)
        procs.append(proc)
        started(rank, proc)
    return how


def _print_report(path: Path, err) -> int:
    """`--json`: the report rank 0 wrote, as JSON on stdout; 1 when it is not there."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"mpress train: every rank finished but the report {path} cannot be read: {exc}", file=err, flush=True)
        return 1
    sys.stdout.write(json.dumps(rows, indent=1) + "\n")
    sys.stdout.flush()
    return 0


def _spawned(watched: dist.Store, first: int, local: int, proc: Rank) -> None:
    """Make local rank `local` known to the other ranks' watches from spawn: a rank killed
    before it runs a line of its own is named by its pid (same machine) like one killed
    mid-run."""
    register(watched, RankProcess(rank=first + local, machine=this_machine(), process=ProcessId.of(proc.pid)))


def _started(watched: dist.Store, first: int, local: int) -> bool:
    """True when local rank `local`'s watch has beaten (it runs and watches the others)."""
    try:
        return int(watched.add(f"beat/{first + local}", 0)) > 0
    except RuntimeError:
        return True  # no store to ask: nothing to wait for


def _training(watched: dist.Store) -> bool:
    try:
        return is_training(watched)
    except RuntimeError:  # node 0's store is gone: the job no longer trains
        return False


def _watch(procs: list[Rank], killed: set[int], interrupted: _Interrupted,
           started: Callable[[int], bool], training: Callable[[], bool]) -> None:
    """Until every rank has ended: after a bad end, the grace period (from when every rank
    still there watches, `START_GRACE_S` at most) and the killing of stopped or left-over
    ranks; on a signal to the launcher, SIGTERM then SIGKILL -- but for a Ctrl-C while the
    job trains: SIGINT to every rank, which stop at a step boundary after saving a
    checkpoint (`INTERRUPT_WAIT_S` at most, or until a second signal)."""
    first_bad: float | None = None
    grace_from = 0.0
    asked_until: float | None = None  # SIGINT forwarded: the ranks' time to save and leave
    terminated_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        alive = [r for r, c in enumerate(codes) if c is None]
        if not alive:
            return
        now = time.monotonic()
        if interrupted.signum is not None:
            if asked_until is None and terminated_at is None and interrupted.signum == signal.SIGINT \
                    and interrupted.count == 1 and training():
                asked_until = now + INTERRUPT_WAIT_S
                for r in alive:
                    procs[r].send_signal(signal.SIGINT)
            elif terminated_at is None and (asked_until is None or interrupted.count > 1 or now > asked_until):
                terminated_at = now
                for r in alive:
                    killed.add(r)
                    procs[r].terminate()
            elif terminated_at is not None and now - terminated_at > TERM_WAIT_S:
                _kill(procs, alive, killed)
        elif first_bad is None and any(c not in (None, 0) for c in codes):
            first_bad = grace_from = now
        elif first_bad is not None:
            stopped = [r for r in alive if held_stopped(procs[r].pid)]
            if now - first_bad < START_GRACE_S and any(not started(r) for r in alive if r not in stopped):
                grace_from = now
            if len(stopped) == len(alive) or now - grace_from > GRACE_S:
                _kill(procs, alive, killed)
        time.sleep(POLL_S)


def _kill(procs: list[Rank], ranks: list[int], killed: set[int]) -> None:
    for r in ranks:
        killed.add(r)
        procs[r].kill()  # SIGKILL ends a stopped process too


def _end_group(procs: list[Rank]) -> None:
    """SIGKILL what is left of the ranks' process group (their shared-memory resource
    trackers), right after the ranks were reaped."""
    if not procs:
        return
    try:
        os.killpg(procs[0].pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _write_run_file(spec: LaunchSpec, procs: list[Rank], started_by: str) -> None:
    """`<run dir>/run.json`: what ran (config, overrides, run id, the launcher's and every
    rank's pid, how the ranks were started), for whoever reads the logs, and for tests."""
    info = {"config": spec.config, "overrides": [list(o) for o in spec.overrides], "run_id": spec.run_id,
            "launcher_pid": os.getpid(), "ranks": [p.pid for p in procs], "started_by": started_by}
    write_text_atomic(spec.run_dir / "run.json", json.dumps(info, indent=1) + "\n")  # read while the run starts
