"""The `mpress` console command.

Each subcommand lives in `mpress/commands/<name>.py` and exposes
`register(subparsers) -> None` (adds its parser, sets `func`) and a `run(args) -> int`.
A subcommand that sets `takes_overrides=True` gets the flags it does not declare in
`args.extra` (`mpress train`'s `--<dotted.key> VALUE` overrides); elsewhere they are errors.
User mistakes (`UserError`) end in one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mpress import __version__
from mpress.errors import UserError

SUBCOMMANDS = ["topo", "profile", "emulate", "plan", "maxsize", "tile", "train"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in one line with exit status 2 (its default)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpress", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"mpress {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"mpress.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and not getattr(args, "takes_overrides", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # bad flags (already reported in one line) or --help
        return int(exc.code or 0)
    args.extra = extra
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"mpress {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mpress: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
