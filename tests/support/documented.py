"""Run mpress as its README documents it and capture what the user sees.

`run_documented(argv, env=..., cwd=...)` runs the `mpress` console command (`python3 -m
mpress ARGV...` in a fresh process, the repository on its path) and returns
`(exit status, stdout, stderr)`. With `in_process=True` it calls `mpress.cli.main(argv)`
in this process instead, with stdout/stderr captured and `env`/`cwd` applied for the
call only: the same argv, far cheaper, for inputs refused before any rank starts. An
exception escaping `main` comes back as status 1 with its traceback on stderr, as a
user would see it.

Training goes through `mpress train`; `TRAIN_MODULE` routes it to a module's own entry
instead (the single-process `python3 -m mpress.train --config X` that preceded the
command): switching is that one line.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TRAIN_MODULE: str | None = None
"""None: `train ...` runs as `mpress train ...`; "mpress.train": as `python3 -m mpress.train ...`."""

TIMEOUT_S = 300
"""Bound on one subprocess run (a liveness bound, not a timing threshold)."""


def _command(argv: Sequence[str]) -> tuple[str, list[str]]:
    """(module to run with -m, its argv)."""
    if TRAIN_MODULE is not None and argv and argv[0] == "train":
        return TRAIN_MODULE, list(argv[1:])
    return "mpress", list(argv)


def run_documented(argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                   in_process: bool = False) -> tuple[int, str, str]:
    """Run `mpress ARGV` and return (exit status, stdout, stderr); see the module docstring.

    env: variables set on top of this process's environment (a value of None unsets it).
    """
    module, args = _command(argv)
    if in_process:  # ranks that `mpress train` starts import mpress too
        return _in_process(module, args, {"PYTHONPATH": _pythonpath(), **(env or {})}, cwd)
    full_env = {k: v for k, v in os.environ.items()}
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    full_env["PYTHONPATH"] = _pythonpath()
    done = subprocess.run([sys.executable, "-m", module, *args], env=full_env, cwd=cwd, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    return done.returncode, done.stdout, done.stderr


def _pythonpath() -> str:
    """This checkout first, so the command runs the code under test installed or not."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


@contextlib.contextmanager
def _environment(env: Mapping[str, str | None], cwd: str | Path | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    old_cwd = os.getcwd()
    try:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if cwd is not None:
            os.chdir(cwd)
        yield
    finally:
        os.chdir(old_cwd)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _in_process(module: str, args: list[str], env: Mapping[str, str | None],
                cwd: str | Path | None) -> tuple[int, str, str]:
    import importlib

    main = importlib.import_module("mpress.cli" if module == "mpress" else module).main
    out, err = io.StringIO(), io.StringIO()
    with _environment(env, cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:  # what the user would see: a traceback, status 1
            traceback.print_exc(file=err)
            code = 1
    return int(code or 0), out.getvalue(), err.getvalue()


def one_line_error(code: int, stderr: str, *words: str, status: int = 2) -> str:
    """Assert the documented promise for bad input: exit `status`, exactly one line on
    stderr, no traceback, containing every one of `words`; returns the line."""
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr, stderr
    assert code == status, f"exit status {code}, not {status}; stderr:\n{stderr}"
    assert len(lines) == 1, f"{len(lines)} lines on stderr, not one:\n{stderr}"
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]
