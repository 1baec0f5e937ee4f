"""The README's commands, run one after another as a reader would, never overwrite each
other's files and never write into the example folders (issue 34): every file an `mpress`
command writes (`--out`, `--trace`, `--plot`, `--map`) is claimed by one command only,
resolved against the directory its code block `cd`s into, and no block works inside
`examples/` (the examples are copied to a run directory under `runs/` first)."""

from __future__ import annotations

import itertools
import posixpath
import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
WRITES = ("--out", "--trace", "--plot", "--map")
"""Flags whose value is a file a command writes."""


def blocks(text: str) -> list[list[str]]:
    """The README's bash code blocks, each as its commands (continuation lines joined,
    comments dropped)."""
    found = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    return [[line.split(" #")[0].strip() for line in block.replace("\\\n", " ").splitlines()
             if line.strip() and not line.strip().startswith("#")] for block in found]


def written(block: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(file written, command) for each output of the block's mpress commands, and the
    directories it changes into."""
    cwd, outputs, dirs = ".", [], []
    for line in block:
        for part in line.split("&&"):
            words = shlex.split(part)
            if words[:1] == ["cd"]:
                cwd = posixpath.normpath(posixpath.join(cwd, words[1]))
                dirs.append(cwd)
            elif "mpress" in words:
                for flag, value in itertools.pairwise(words):
                    if flag in WRITES:
                        outputs.append((posixpath.normpath(posixpath.join(cwd, value)), part.strip()))
    return outputs, dirs


def test_no_two_readme_commands_write_the_same_file():
    claimed: dict[str, str] = {}
    for block in blocks(README.read_text()):
        outputs, _dirs = written(block)
        for path, command in outputs:
            assert claimed.setdefault(path, command) == command, (
                f"{path} is written by both\n  {claimed[path]}\n  {command}")
    assert len(claimed) >= 10  # the walk-throughs' plans, profiles, traces and plots


def test_the_examples_run_in_a_run_directory_not_in_their_folder():
    all_dirs = [d for block in blocks(README.read_text()) for d in written(block)[1]]
    assert {"runs/own_model", "runs/hf"} <= set(all_dirs), all_dirs
    assert not [d for d in all_dirs if d.split("/")[0] == "examples"], all_dirs

