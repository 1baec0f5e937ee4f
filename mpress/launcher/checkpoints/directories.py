"""One run per directory: the lock a run holds on its run directory and on its
`checkpoint.dir` while it lives.

Two runs on one `checkpoint.dir` would prune each other's steps and temporary folders
(one run's save deleted under it by the other's clean-up), and would mix two runs'
numbering; two runs on one run directory would truncate each other's rank logs and
overwrite `run.json`. So a run *claims* each directory before it writes anything there:

- the directory is made if missing; a path that is, or runs through, a symbolic link to
  nothing is refused (it would be made wherever the link points, or fail later);
- an exclusive `fcntl.flock` is taken on `<dir>/.mpress.lock` (a file: flock on a file
  opened for writing also holds on NFS, where it is emulated with a POSIX lock), and the
  holder's pid, host and run id are written into it for the refusal line of the next;
- a second claim while the first run lives is refused in one line naming the directory
  and the holder (`UserError`: exit status 2, before any rank starts);
- the lock goes with the process: released on exit, on an error, and when the process
  is killed (-9 included: the kernel drops a dead process's flocks), so a killed run
  never leaves a directory locked. The file itself stays, unlocked.

Who claims: `mpress train` claims its run directory and, on node 0 (the node whose rank 0
saves the manifests and prunes), the checkpoint directory, before it starts a rank; the
torchrun form (`python -m mpress.train` under torchrun, no `mpress train` launcher
around it) has rank 0 claim the checkpoint directory itself (`claim_for_rank`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import IO, Self

from mpress.config.loader import check_output_path
from mpress.d2d.runtime.liveness import LAUNCHER_PID_ENV
from mpress.errors import UserError
from mpress.runtime.train_config import TrainConfig

LOCK_FILE = ".mpress.lock"
"""The file a run's lock is taken on, in the directory it claims."""


def check_no_dangling_link(path: Path, what: str) -> None:
    """A `UserError` when `path` or one of its missing ancestors is a symbolic link whose
    target does not exist (a directory made there would land wherever it points)."""
    for p in (path, *path.parents):
        if p.is_symlink() and not p.exists():
            raise UserError(f"{what}: {p} is a symbolic link to {os.readlink(p)}, which does not exist: "
                            "create its target or give another directory")
        if p.exists():
            return


class DirectoryLock:
    """This process's claim on one directory (see the module docstring); `release` or
    leaving its `with` block ends it, as does the process's end."""

    def __init__(self, directory: Path, what: str, *, run_id: str = "") -> None:
        """Make `directory` if needed and lock it; a `UserError` naming `what` (the key or
        flag that gave the directory) when it is in use by another run or cannot be made."""
        self.directory = directory
        check_no_dangling_link(directory, what)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"{what}: cannot create {directory}: {exc.strerror}") from None
        path = directory / LOCK_FILE
        try:
            f: IO[str] = open(path, "a+")  # noqa: SIM115 -- held open: the lock lasts as long as the file
        except OSError as exc:
            raise UserError(f"{what}: cannot write {path}: {exc.strerror}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            if isinstance(exc, BlockingIOError):
                raise UserError(f"{what}: {directory} is in use by another run ({holder or 'holder unknown'}); "
                                "wait for it to end or give another directory") from None
            raise UserError(f"{what}: cannot lock {path}: {exc.strerror}") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, run {run_id or '?'}, "
                f"since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self._file: IO[str] | None = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the last descriptor drops the flock
            self._file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_run(cfg: TrainConfig, run_dir: Path, *, node_rank: int, run_id: str) -> contextlib.ExitStack:
    """`mpress train`'s claims, before a rank starts: `--run-dir`, and on node 0 the
    config's `checkpoint.dir` (checked as an output directory first). Held until the
    returned stack is closed."""
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(DirectoryLock(run_dir, "--run-dir", run_id=run_id))
        if cfg.checkpoint.dir is not None and node_rank == 0:
            root = Path(cfg.checkpoint.dir)
            check_output_path(root, "", "checkpoint.dir", "dir")
            stack.enter_context(DirectoryLock(root, "checkpoint.dir", run_id=run_id))
    except BaseException:
        stack.close()
        raise
    return stack


def claim_for_rank(cfg: TrainConfig, rank: int) -> DirectoryLock | None:
    """A rank's claim on `checkpoint.dir`: rank 0's when no `mpress train` launcher claimed
    it (torchrun, or one process without a launcher); None otherwise. The lock lasts as
    long as the returned object (or the process)."""
    if cfg.checkpoint.dir is None or rank != 0 or os.environ.get(LAUNCHER_PID_ENV):
        return None
    return DirectoryLock(Path(cfg.checkpoint.dir), "checkpoint.dir", run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""))
