"""The `mpress` console command.

Each subcommand lives in `mpress/commands/<name>.py` and exposes
`register(subparsers) -> None` (adds its parser, sets `func`) and a `run(args) -> int`.
Flags are named as the train config's keys (`mpress/commands/flags.py`); `mpress --help`
lists the commands, the presets and the exit status. A subcommand that sets `takes_overrides=True` gets the flags it does not declare in
`args.extra` (`mpress train`'s `--<dotted.key> VALUE` overrides); elsewhere they are errors.
User mistakes (`UserError`) end in one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

from mpress import __version__
from mpress.errors import UserError

SUBCOMMANDS: dict[str, str] = {
    "topo": "show the GPU/NVLink/PCIe topology of a preset or of this machine",
    "profile": "profile a model per layer (measured on this machine, or analytic)",
    "emulate": "memory per stage and an emulated iteration of a pipeline (or a plan)",
    "plan": "plan recompute / host swap / D2D swap per tensor and compare strategies",
    "maxsize": "largest model of a family each strategy fits",
    "ooc": "out-of-core model of one device: swap-in policies, batch and bandwidth sweeps",
    "tile": "plan fused-tiled (SFT) execution of a conv network for a giant image",
    "train": "train with pipeline parallelism, launching the ranks (one per stage)",
    "report": "plot a run's loss, validation loss and learning rate; print first/last/min",
    "export": "write a checkpoint's model as safetensors (transformers' layout for HF models)",
    "tokenizer": "train a byte-level BPE tokenizer from local text files",
}
"""Each subcommand and its line in `mpress --help` (the one its module registers; a test
checks they agree). Only the command being run imports its module: `mpress --help`,
`--version` and a mistyped command name load no torch."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in one line with exit status 2 (its default)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


DESCRIPTION = """\
mpress: train models larger than GPU memory with pipeline parallelism, compacting memory
per tensor (recompute, host swap, D2D swap over NVLink) as a plan says.

    mpress topo --hardware dgx1-v100
    mpress profile --model gpt-tiny --out gpt-tiny.yaml
    mpress plan --model gpt-20.4b --hardware dgx1-v100 --out plan.yaml
    mpress emulate plan.yaml --plot memory.png
    mpress train --config gpt-tiny-mixed --steps 10

`mpress COMMAND --help` shows a command's flags and examples. Flags are named as the
train config's keys (--num-stages, --num-microbatches, --microbatch-size,
--device-memory, ...); sizes take a unit (2GB = 2e9 bytes, 512MiB; a bare number is
bytes), times are in seconds."""


def _epilog() -> str:
    """Presets and exit status, listed from the config directories."""
    from mpress.commands.flags import EXIT_STATUS
    from mpress.config.presets import hardware_presets, train_presets
    from mpress.config.model_config import model_presets

    width = 88
    lines = ["presets (a name, or a YAML path instead):"]
    for what, names in (("model (--model)", model_presets()), ("hardware (--hardware)", hardware_presets()),
                        ("train configs (mpress train --config)", train_presets())):
        lines += textwrap.wrap(", ".join(names), width, initial_indent=f"  {what}: ", subsequent_indent="    ",
                               break_on_hyphens=False)
    return "\n".join(lines) + "\n\n" + EXIT_STATUS


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `mpress` parser. command: the one subcommand whose module is imported and
    whose flags are registered (the others are listed by name and help line only); None:
    every subcommand's."""
    from mpress.commands.flags import HelpFormatter

    parser = _Parser(prog="mpress", description=DESCRIPTION, epilog=_epilog(), formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"mpress {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser,
                                       title="commands")
    for name, help_line in SUBCOMMANDS.items():
        if command is None or name == command:
            importlib.import_module(f"mpress.commands.{name}").register(subparsers)
        else:
            subparsers.add_parser(name, help=help_line)
    return parser


def command_of(argv: list[str]) -> str:
    """The subcommand `argv` runs: its first word that is not a flag (the top level's
    flags take no value), or "" when there is none or it names no subcommand."""
    word = next((a for a in argv if not a.startswith("-")), "")
    return word if word in SUBCOMMANDS else ""


def main(argv: list[str] | None = None) -> int:
    try:  # Ctrl-C at any moment (importing a subcommand's torch included): one line, 130
        return _main(argv)
    except KeyboardInterrupt:
        print("mpress: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(command_of(argv))
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and not getattr(args, "takes_overrides", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # bad flags (already reported in one line) or --help
        return int(exc.code or 0)
    args.extra = extra
    if not getattr(args, "func", None):  # a short usage: `--help` has the rest
        print(f"usage: mpress COMMAND [flags]   (commands: {', '.join(SUBCOMMANDS)})\n"
              "mpress: error: give a command; `mpress --help` describes each, `mpress COMMAND --help` its flags",
              file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"mpress {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
