"""`mpress --help`, `--version` and argument errors answer without importing torch.

torch takes seconds to import; a command that only prints its help or refuses a flag
must not pay for it. Each case runs in a fresh interpreter (modules a test process has
imported already would hide an import).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from mpress.cli import SUBCOMMANDS, build_parser, command_of

TORCH_FREE = [
    ["--help"],
    ["--version"],
    [],
    ["no-such-command"],
    ["--no-such-flag"],
    ["plan", "--no-such-flag"],
    ["plan", "--num-stages", "x"],
    ["emulate", "--no-such-flag"],
    ["profile", "--no-such-flag"],
    ["topo", "--no-such-flag"],
    ["maxsize", "--no-such-flag"],
    ["ooc", "--no-such-flag"],
    ["ooc", "--model", "vgg16", "--image-size", "3"],
    ["ooc", "--help"],
    ["tile", "--no-such-flag"],
    ["tile", "--dtype", "int8"],
    ["tile", "--help"],
    ["train", "--nproc-per-node", "x", "--config", "gpt-tiny-plain"],
    ["train", "--nnodes", "0", "--config", "gpt-tiny-plain"],
    ["train", "--help"],
]
"""Invocations that print help, the version or a one-line error (exit 0 or 2): every
command's flags, choices and defaults come from modules that do not import torch."""


@pytest.mark.parametrize("argv", TORCH_FREE, ids=lambda a: " ".join(a) or "(none)")
def test_answers_without_torch(argv: list[str]) -> None:
    code = ("import sys\nfrom mpress.cli import main\n"
            f"status = main({argv!r})\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', status)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded, status = done.stdout.split()[-2:]
    assert status in ("0", "2")
    assert loaded == "NO-TORCH", f"mpress {' '.join(argv)} imported torch"


def test_top_level_help_lists_what_each_command_registers() -> None:
    """The help lines `SUBCOMMANDS` lists without importing a command are the ones the
    commands register."""
    assert build_parser().format_help() == build_parser("").format_help()


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_a_command_gets_its_own_flags(name: str) -> None:
    assert build_parser(name).format_help() == build_parser().format_help()
    sub = build_parser(name)._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr]
    assert sub.format_help() == build_parser()._subparsers._group_actions[0].choices[name].format_help()  # type: ignore[union-attr]


def test_command_of() -> None:
    assert command_of(["--version"]) == ""
    assert command_of(["plan", "--model", "gpt-20.4b"]) == "plan"
    assert command_of(["-h", "train", "--config", "x"]) == "train"
    assert command_of(["gpt-20.4b"]) == ""


def test_default_microbatch_size_is_the_train_configs() -> None:
    from dataclasses import fields

    from mpress.commands.pipeline_args import DEFAULT_MICROBATCH_SIZE
    from mpress.runtime.train_config import TrainConfig

    assert DEFAULT_MICROBATCH_SIZE == next(f.default for f in fields(TrainConfig) if f.name == "microbatch_size")
