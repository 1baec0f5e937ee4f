"""A malformed-input case: files to write, a documented command to run, the words its
one line must hold. `params(cases)` makes readable pytest ids; `check(case, dir)` runs it
(in process unless the case asks for a real subprocess) and asserts one line, exit 2."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml

from tests.support.documented import one_line_error, run_documented

Files = dict[str, "str | bytes | Callable[[Path], str | bytes]"]


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    """The documented command's arguments; `{d}` stands for the case's directory."""
    files: Files = field(default_factory=dict)
    """name -> content (text, bytes, or a function of the directory giving either)."""
    words: tuple[str, ...] = ()
    """Each must appear in the one stderr line."""
    env: dict[str, str] = field(default_factory=dict)
    subprocess: bool = False
    """Run as a real `python3 -m mpress` process (else `mpress.cli.main` in process)."""
    xfail: str | None = None
    """Fails today for a reason outside this suite's files (strict: must start passing)."""
    mkdirs: tuple[str, ...] = ()


def params(cases: list[Case]) -> list:
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else [])
            for c in cases]


def check(case: Case, directory: Path) -> str:
    for name in case.mkdirs:
        (directory / name).mkdir(parents=True, exist_ok=True)
    for name, content in case.files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        value = content(directory) if callable(content) else content
        if isinstance(value, bytes):
            path.write_bytes(value)
        else:
            path.write_text(value)
    argv = [a.replace("{d}", str(directory)) for a in case.argv]
    env = {k: v.replace("{d}", str(directory)) for k, v in case.env.items()}
    code, _out, err = run_documented(argv, env=env, cwd=directory, in_process=not case.subprocess)
    return one_line_error(code, err, *(w.replace("{d}", str(directory)) for w in case.words))


def mutated(base: str, change: Callable[[dict], object]) -> str:
    """`base` YAML with `change` applied to its data (in place), dumped again."""
    data = yaml.safe_load(base)
    change(data)
    return yaml.safe_dump(data, sort_keys=False)


def put(path: str, value: object) -> Callable[[dict], None]:
    """A change that sets the dotted `path` (list indices as numbers) to `value`."""
    def change(data: dict) -> None:
        *parents, last = path.split(".")
        node: object = data
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]  # type: ignore[index]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value  # type: ignore[index]
    return change


def laughs(levels: int = 9) -> str:
    """A YAML "billion laughs": `levels` levels of nine aliases each."""
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


DEEP = "[" * 20_000 + "]" * 20_000
"""A document nested deeper than any parser recursion allows."""
