"""A rank's one line reaches a stream shared with other ranks whole."""

from __future__ import annotations

import os
import subprocess
import sys

from mpress.ui import say_line


class Recorder:
    """A stream that records each write call (what an unbuffered stderr passes to the OS)."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_line_is_one_write():
    # print() would make two calls ("...(SwapError)", "\n"): under PYTHONUNBUFFERED each is
    # a system call, and another rank's line can land between them
    out = Recorder()
    say_line("mpress.train: rank 2: stopping: rank 0 failed (SwapError)", out)
    assert out.writes == ["mpress.train: rank 2: stopping: rank 0 failed (SwapError)\n"]


def test_ranks_writing_at_once_never_run_their_lines_together():
    # 4 processes share one unbuffered stderr pipe, as torchrun's ranks do, and each writes
    # 300 lines as fast as it can
    code = ("import sys; from mpress.ui import say_line\n"
            "r = sys.argv[1]\n"
            "for i in range(300): say_line(f'mpress.train: rank {r}: stopping: rank 0 failed (SwapError) {i}')\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stderr=write, env=env) for r in range(4)]
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    for p in procs:
        assert p.wait() == 0
    lines = text.splitlines()
    assert len(lines) == 4 * 300
    assert all(line.count("mpress.train:") == 1 for line in lines), [x for x in lines if x.count("mpress.train:") != 1][:3]
