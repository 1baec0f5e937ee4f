"""Starting a job's ranks by forking them from one process that has imported the rank's
code once (a "rank starter"), rather than executing a fresh interpreter per rank.

Why: a rank's imports (torch, torch.distributed.pipelining, mpress's runtime) take about
3 s of CPU. Executed per rank, N ranks pay N times that, at once, on the cores they are
about to train on; forked from a starter they pay it once, and the starter imports while
the launcher sets up the job's store. A forked rank starts from the starter's fresh
imports, never from the launcher's state: the starter is its own interpreter, started
with the environment every rank shares (`StarterSpec.env`), and each rank gets its own
environment, argv, output files and process group as an executed one would.

When the starter may not fork: its process must run no Python thread but its own, and
hold no CUDA driver (a CUDA context does not survive a fork: `torch.cuda` refuses to
initialise in a child of a process that initialised it). The starter
checks both before every fork and says why it cannot; the launcher then executes each
rank as before (`RANK_START_ENV=exec` asks for that, for comparison and as a fallback).

The protocol, newline-delimited JSON: the launcher writes requests on the starter's
stdin ({"argv", "env", "out", "err", "pgid"}, or {"preload": modules} to import before
the next fork, with no reply); the starter writes on the reply pipe
("ready" once its imports are done, then {"pid"} per request and {"exit", "status"} as each
child ends; {"refused": why} instead of a pid when it may not fork). The starter ends
once the launcher has closed its stdin and every child has ended; it dies with the
launcher (the kernel's parent-death signal) and its children die with it.

Runs on Linux only (`pidfd_open`, `prctl`); elsewhere the launcher executes ranks.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from mpress.d2d.runtime.liveness import LAUNCHER_PID_ENV, RUN_ID_ENV, die_with_parent

RANK_START_ENV = "MPRESS_RANK_START"
"""`exec`: the launcher executes one interpreter per rank; unset or `fork`: it forks them
from a rank starter where it can."""
RANK_MODULE = "mpress.train"
"""What a rank runs (`python -m mpress.train ...`)."""
READY_TIMEOUT_S = 120.0
"""Bound on the starter's imports (a guard against a hang, on a loaded machine)."""


@dataclass
class StarterSpec:
    """What every rank of the job shares: the starter runs in `env`, imports `module`."""

    env: dict[str, str]
    module: str = RANK_MODULE


def starter_env(run_id: str) -> dict[str, str]:
    """The environment a rank starter starts in, which needs no more of the job than its
    run id: this process's, unbuffered (an interpreter reads that as it starts, and a
    forked rank keeps the starter's streams), with the run id (the process environment a
    forked rank shows, /proc/PID/environ, is the starter's). So the starter can import
    while the launcher still checks the job; the rest of a rank's environment comes with
    its request (`_run_rank`)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", RUN_ID_ENV: run_id}


def can_fork() -> bool:
    """Whether this platform can start ranks from a starter, and the user did not ask
    for executed ranks."""
    return (sys.platform.startswith("linux") and hasattr(os, "pidfd_open")
            and os.environ.get(RANK_START_ENV, "fork") != "exec")


class ForkedRank:
    """A rank forked by the starter, as the launcher uses a `subprocess.Popen`: `pid`,
    `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`. Its end is reported
    by the starter (which reaps it); a rank the starter did not report when the starter
    itself ended was killed with it (the parent-death signal: -SIGKILL)."""

    def __init__(self, starter: RankStarter, pid: int) -> None:
        self.starter = starter
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.starter.collect(block=False)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            self.starter.collect(block=True, timeout=left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_starter(run_id: str, module: str = RANK_MODULE) -> RankStarter | None:
    """A rank starter for run `run_id` in `starter_env`, importing `module` from now on;
    None where the ranks are executed instead (`can_fork`)."""
    return RankStarter.start(StarterSpec(env=starter_env(run_id), module=module)) if can_fork() else None


class StarterRefused(RuntimeError):
    """The starter may not fork (or is gone); the launcher executes the ranks instead."""


@dataclass
class RankStarter:
    """The launcher's side of a rank starter (started by `start`)."""

    proc: subprocess.Popen
    replies: int
    """Read end of the reply pipe."""
    ranks: dict[int, ForkedRank] = field(default_factory=dict)
    _buffer: bytes = b""
    _ended: bool = False
    _closed: bool = False

    @staticmethod
    def start(spec: StarterSpec) -> RankStarter:
        """The starter, importing in the background (`ready` waits for it)."""
        read, write = os.pipe()
        env = {**spec.env, LAUNCHER_PID_ENV: str(os.getpid())}
        try:
            proc = subprocess.Popen([sys.executable, "-m", __name__, str(write), spec.module], stdin=subprocess.PIPE,
                                    pass_fds=(write,), env=env)
        finally:
            os.close(write)
        return RankStarter(proc, read)

    def ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until the starter has imported; StarterRefused when it cannot fork."""
        reply = self._next(timeout_s)
        if reply != "ready":
            raise _refusal(reply)

    def preload(self, modules: list[str]) -> None:
        """Have the starter import `modules` before the next fork: what every rank of this
        job imports beyond the starter's module (found once the job was checked), loaded
        once instead of once per rank. One that fails to import is left to the ranks,
        which report it as an executed rank would."""
        try:
            self.proc.stdin.write((json.dumps({"preload": list(modules)}) + "\n").encode())  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            pass  # the starter is gone: the fork says so

    def fork(self, argv: list[str], env: dict[str, str], *, out: str | None, err: str | None,
             pgid: int) -> ForkedRank:
        """A rank running `python -m <module> *argv` in `env`; its stdout goes to the file
        `out` (None: the launcher's stdout; "2": the launcher's stderr), its stderr to
        `err` (None: the launcher's); `pgid` 0: the leader of a new process group."""
        request = {"argv": argv, "env": env, "out": out, "err": err, "pgid": pgid}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError) as exc:
            raise StarterRefused(f"the rank starter is gone ({exc})") from None
        while True:  # a rank forked before may have ended meanwhile: its report comes first
            reply = self._next(READY_TIMEOUT_S)
            if isinstance(reply, dict) and "exit" in reply:
                self._record(reply)
                continue
            if not isinstance(reply, dict) or "pid" not in reply:
                raise _refusal(reply)
            break
        rank = ForkedRank(self, int(reply["pid"]))
        self.ranks[rank.pid] = rank
        return rank

    def collect(self, *, block: bool, timeout: float | None = None) -> None:
        """Read the starter's reports of ended ranks (waiting for one when `block`)."""
        reply = self._next(timeout if block else 0.0)
        while reply is not None:
            if reply == "ended":
                return
            self._record(reply)
            reply = self._next(0.0)

    def close(self, timeout_s: float = 10.0, *, kill: bool = False) -> None:
        """No more ranks: the starter leaves once its children have ended (killed after
        `timeout_s` more; at once with `kill`, for a job refused before any rank started:
        its imports are then work for nothing). Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        if kill:
            self.proc.kill()
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.collect(block=False)
        os.close(self.replies)

    def _record(self, reply: object) -> None:
        if isinstance(reply, dict) and "exit" in reply and reply["exit"] in self.ranks:
            self.ranks[reply["exit"]].returncode = int(reply["status"])

    def _next(self, timeout: float | None) -> object | None:
        """The next reply (None: none within `timeout`); "ended" once the pipe is closed,
        when every rank not reported has its end set (killed with the starter)."""
        while b"\n" not in self._buffer:
            if self._ended:
                return "ended"
            with selectors.DefaultSelector() as sel:
                sel.register(self.replies, selectors.EVENT_READ)
                if not sel.select(timeout):
                    return None
            chunk = os.read(self.replies, 65536)
            if not chunk:
                self._ended = True
                for rank in self.ranks.values():
                    if rank.returncode is None:
                        rank.returncode = -signal.SIGKILL
                continue
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)


def _refusal(reply: object) -> StarterRefused:
    """What a reply other than the one awaited says: the starter's refusal, or its end."""
    why = reply.get("refused") if isinstance(reply, dict) else None
    return StarterRefused(why or "the rank starter ended")


# --- the starter's side -------------------------------------------------------------


def _why_not_fork() -> str | None:
    """Why this process may not fork a rank (None: it may). A Python thread could hold a
    lock the child would wait on for ever; native threads started by imports are the
    libraries' to survive a fork (OpenBLAS's pool and torch's register fork handlers, as
    torch's DataLoader workers and the multiprocessing fork server rely on)."""
    if threading.active_count() > 1:
        return f"it runs {threading.active_count()} Python threads after its imports"
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            loaded = {os.path.basename(line.split()[-1]).split(".so")[0] for line in f if "/" in line}
    except OSError as exc:
        return f"procfs cannot be read ({exc})"
    if "libcuda" in loaded:
        return "the CUDA driver is loaded in it"
    if "libnvidia-ml" in loaded:
        return "NVML is loaded in it"
    return None


class _Server:
    """The starter's loop: fork a child per request, report each child's end."""

    def __init__(self, replies: int) -> None:
        self.replies = replies
        self.sel = selectors.DefaultSelector()
        self.sel.register(0, selectors.EVENT_READ)
        self.children: dict[int, int] = {}  # pidfd -> pid
        self.pending = b""
        self.open = True

    def send(self, reply: object) -> None:
        data = (json.dumps(reply) + "\n").encode()
        while data:
            data = data[os.write(self.replies, data):]

    def serve(self) -> dict | None:
        """Until the launcher is done and every child has ended (None); in a child, the
        request it was forked for."""
        while self.open or self.children:
            for key, _ in self.sel.select():
                if key.fd == 0:
                    request = self._read_requests()
                    if request is not None:
                        return request
                else:
                    pid = self.children.pop(key.fd)
                    self.sel.unregister(key.fd)
                    os.close(key.fd)
                    _, status = os.waitpid(pid, 0)
                    self.send({"exit": pid, "status": os.waitstatus_to_exitcode(status)})
        return None

    def _read_requests(self) -> dict | None:
        chunk = os.read(0, 65536)
        if not chunk:
            self.open = False
            self.sel.unregister(0)
            return None
        self.pending += chunk
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            request = json.loads(line)
            if "preload" in request:
                _preload(request["preload"])
                continue
            why = _why_not_fork()
            if why is not None:
                self.send({"refused": why})
                continue
            # the rank's lifeline: it checks that its parent is still this process (if
            # this one died before the child asked for the parent-death signal, the
            # child is re-parented and must not start)
            request["env"][LAUNCHER_PID_ENV] = str(os.getpid())
            # a signal the launcher sends the child before it has its own handlers stays
            # pending (blocked) rather than reaching the starter's, and acts once it has
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
            pid = os.fork()
            if pid == 0:
                self._leave()
                return request
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
            _set_group(pid, int(request["pgid"]))
            pidfd = os.pidfd_open(pid)
            self.children[pidfd] = pid
            self.sel.register(pidfd, selectors.EVENT_READ)
            self.send({"pid": pid})
        return None

    def _leave(self) -> None:
        """In a child: drop the starter's descriptors."""
        self.sel.close()
        for fd in self.children:
            os.close(fd)
        os.close(self.replies)


_STOPS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
"""The signals that stop a rank (the launcher's, or the terminal's Ctrl-C)."""


def _ignore(_signum: int, _frame: object) -> None:
    """The starter's handler of `_STOPS`: it outlives its ranks, the launcher ends it."""


def _run_rank(request: dict, module: str) -> None:
    """In a forked child: become the rank `request` describes, and run it as
    `python -m <module>` would (as `__main__`; its exit status and atexit handlers are
    the interpreter's, as for an executed rank)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)  # what came since the fork acts now
    _set_group(0, int(request["pgid"]))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if request["out"] == "2":
        os.dup2(2, 1)
    elif request["out"] is not None:
        _redirect(request["out"], 1)
    if request["err"] is not None:
        _redirect(request["err"], 2)
    os.environ.clear()
    os.environ.update(request["env"])
    _threads_from_env()
    die_with_parent()  # the starter (`LAUNCHER_PID_ENV`); it dies with the launcher
    sys.argv = [sys.argv[0], *request["argv"]]
    sys.modules.pop(module, None)  # as under `-m`: the module runs once, as `__main__` (its imports stay)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _preload(modules: list[str]) -> None:
    """Import `modules` here, for the ranks forked next (`RankStarter.preload`)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001, S110 - each rank imports it again and reports the error in full
            pass


def _threads_from_env() -> None:
    """torch, imported by the starter before the job's thread count was known, runs as
    many intra-op threads as the rank's OMP_NUM_THREADS says (torch reads the variable
    once; the launcher sets it per job, `launch.shared_env`)."""
    torch = sys.modules.get("torch")
    value = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


def _set_group(pid: int, pgid: int) -> None:
    """Put process `pid` (0: this one) in group `pgid` (0: a new group it leads).

    Both the starter and the child call it, as a shell does for a pipeline: whichever
    runs first makes the group, so it exists before the starter names the child's pid
    and the launcher asks for the next rank to join it."""
    try:
        os.setpgid(pid, pgid)
    except PermissionError:  # the group's leader (rank 0) has ended already: the launcher names it
        try:
            os.setpgid(pid, 0)
        except OSError:  # the starter's call, the child gone or already running alone: its own call decides
            pass
    except ProcessLookupError:  # the child has ended already (the starter's call)
        pass


def _redirect(path: str, fd: int) -> None:
    opened = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(opened, fd)
    os.close(opened)


def main(argv: list[str]) -> int:
    """`python -m mpress.launcher.rank_starter REPLY_FD MODULE` (the launcher runs it)."""
    replies, module = int(argv[0]), argv[1]
    die_with_parent()  # the launcher
    for sig in _STOPS:  # the launcher stops the ranks; a Ctrl-C reaches its group, this process too
        signal.signal(sig, _ignore)  # not SIG_IGN: a child would drop what is sent to it before its reset
    server = _Server(replies)
    try:
        importlib.import_module(module)
    except BaseException as exc:  # noqa: BLE001 - an executed rank shows it in full
        server.send({"refused": f"importing {module} failed: {type(exc).__name__}: {exc}"})
        return 0
    why = _why_not_fork()
    server.send("ready" if why is None else {"refused": why})
    if why is not None:
        return 0
    request = server.serve()
    if request is None:
        # every rank has ended and no more will come: leave without the interpreter's
        # finalisation of torch and mpress (about a second on this machine's cores, which
        # the launcher would wait for); nothing is buffered (replies go out by os.write)
        os._exit(0)
    _run_rank(request, module)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
