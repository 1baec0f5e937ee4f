"""The flags of the `mpress` subcommands: one flag per concept, named as the train
config's YAML key (`num_stages` -> `--num-stages`), and the help layout they share.

Every subcommand adds its flags with `add_flag(parser, CONCEPT, ...)`, so a concept has
one name, one type and one range everywhere. A flag's first name is the one help shows;
the names after it are older spellings (`--stages`, `--microbatches`, `--strategies`,
`--budget`, `--family`, `--network`, ...), still accepted so that scripts keep working,
and left out of help by `HelpFormatter`. argparse names every spelling in its one-line
errors (`argument --num-stages/--stages: ...`), so an error names the flag as typed.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field
from typing import Any

from mpress.config import limits
from mpress.hardware.cluster import MAX_NODES, Sharding
from mpress.config.loader import int_arg
from mpress.errors import UserError
from mpress.config.units import parse_bytes
from mpress.config.vocabulary import ScheduleName, Strategy, SwapInPolicy

EXIT_STATUS = """\
exit status:
  0    done
  1    a runtime failure (one line on stderr)
  2    bad input: a flag, file or key (one line on stderr naming it and what is allowed)
  130  interrupted (Ctrl-C)"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Description and epilog verbatim (examples keep their lines and `\\`), and each flag
    shown by its short names and its first long name only: the later long names are the
    old spellings, accepted but not advertised."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if len(longs) > 1:
            action = copy.copy(action)
            action.option_strings = [s for s in action.option_strings if not s.startswith("--")] + longs[:1]
        return super()._format_action_invocation(action)


def bytes_arg(text: str) -> int:
    """argparse `type=` for a size flag: `2GB`, `512MiB`, `1e9` -> bytes (GB = 1e9)."""
    try:
        return parse_bytes(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None


bytes_arg.__name__ = "size"


def strategies_arg(text: str) -> list[str]:
    """argparse `type=` for a comma-separated list of strategies (at least one)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in Strategy.words()]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown strategy {unknown[0] if unknown else '(none)'!r} "
                                         f"(allowed: {', '.join(Strategy.words())}, comma-separated)")
    return names


strategies_arg.__name__ = "strategies"


@dataclass(frozen=True)
class Flag:
    """One concept's flag: its names (the first shown, the others old spellings) and the
    `add_argument` keywords every command uses unless it overrides one."""

    names: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


FLAGS: dict[str, Flag] = {
    "model": Flag(("--model",), dict(metavar="PRESET_OR_YAML", help="model preset or model YAML path")),
    "module": Flag(("--module",), dict(metavar="PKG.MOD:FACTORY",
                                       help="your own model: a factory returning (module, example_input[, loss_fn])")),
    "hf_config": Flag(("--hf-config",), dict(metavar="NAME_OR_PATH",
                                             help="a Hugging Face transformers model: a built-in config "
                                                  "(gpt2-tiny, llama-tiny, bert-tiny, llama-2-7b), a config.json "
                                                  "(random weights) or a directory with local weights; never "
                                                  "downloaded")),
    "seq_len": Flag(("--seq-len",), dict(type=int_arg(1, 1 << 20), metavar="T",
                                         help="tokens per sequence of --hf-config (default: its maximum positions)")),
    "dtype": Flag(("--dtype",), dict(choices=["fp32", "bf16", "fp16"], default=None,
                                     help="parameters and activations of --hf-config: fp32, or bf16/fp16 mixed "
                                          "precision with fp32 master weights (default fp32)")),
    "layers": Flag(("--layers",), dict(metavar="NAMES", help="split points of a --module: comma-separated module "
                                                             "paths or patterns, e.g. 'embed,blocks.*,head'")),
    "hardware": Flag(("--hardware",), dict(metavar="PRESET_OR_YAML", help="hardware preset or YAML path")),
    "setting": Flag(("--setting",), dict(metavar="NAME_OR_YAML",
                                         help="a published training setting (configs/settings/, e.g. paper-bert): "
                                              "its precision replaces the model's, its schedule, stages and "
                                              "microbatches are the defaults of those flags")),
    "schedule": Flag(("--schedule",), dict(choices=ScheduleName.words(), help="pipeline schedule")),
    "num_stages": Flag(("--num-stages", "--stages"), dict(type=int_arg(1, limits.MAX_STAGES), metavar="N",
                                                          help="pipeline stages")),
    "num_ranks": Flag(("--num-ranks", "--ranks"), dict(type=int_arg(1, limits.MAX_STAGES), metavar="N",
                                                       help="pipeline ranks; schedules with several stages per rank only")),
    "microbatch_size": Flag(("--microbatch-size",), dict(type=int_arg(1, limits.MAX_MICROBATCH_SIZE), metavar="B",
                                                         help="samples per microbatch")),
    "num_microbatches": Flag(("--num-microbatches", "--microbatches"),
                             dict(type=int_arg(1, limits.MAX_MICROBATCHES), metavar="M",
                                  help="microbatches per iteration")),
    "num_nodes": Flag(("--nodes",), dict(dest="num_nodes", type=int_arg(1, MAX_NODES), metavar="N",
                                                       help="nodes, each running one replica of the pipeline "
                                                            "(data parallelism across nodes)")),
    "replicas_per_node": Flag(("--replicas-per-node",), dict(type=int_arg(1, limits.MAX_DEVICES), metavar="R",
                                                         help="replicas of the pipeline sharing each node, each on "
                                                              "GPUs of its own linked alike, gradients reduced over "
                                                              "the node's links first")),
    "dp_sharding": Flag(("--dp-sharding",), dict(choices=Sharding.words(),
                                                 help="how replicas across nodes hold model states: ddp (all, "
                                                      "gradients all-reduced) or fsdp (optimizer states sharded, "
                                                      "gradients reduce-scattered)")),
    "num_devices": Flag(("--num-devices", "--devices"), dict(type=int_arg(1, limits.MAX_DEVICES), metavar="N",
                                                             help="the hardware's device count, overridden")),
    "device_memory": Flag(("--device-memory",), dict(type=bytes_arg, metavar="SIZE",
                                                     help="memory per device, overridden, e.g. 2GB (GB = 1e9 bytes)")),
    "strategy": Flag(("--strategy",), dict(choices=Strategy.words(), help="planner strategy")),
    "swap_in_policy": Flag(("--swap-in-policy", "--policy"), dict(choices=SwapInPolicy.words(),
                                                                  help="swap-in policy")),
    "profile": Flag(("--profile",), dict(metavar="FILE", help="profile YAML/JSON from `mpress profile`")),
    "json": Flag(("--json",), dict(action="store_true", help="print the figures as JSON on stdout (bytes as "
                                                             "integers, times in seconds) instead of the tables")),
}


def add_flag(target: Any, concept: str, *, aliases: tuple[str, ...] = (), **kwargs: Any) -> argparse.Action:
    """Add `concept`'s flag to a parser or group; `aliases` are old spellings this command
    also accepts, `kwargs` override the shared keywords (help, default, choices, ...)."""
    flag = FLAGS[concept]
    return target.add_argument(*flag.names, *aliases, **{**flag.kwargs, **kwargs})


def add_command(subparsers: Any, name: str, *, help: str, description: str | None,
                epilog: str | None = EXIT_STATUS, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand's parser with the shared help layout (`HelpFormatter`)."""
    return subparsers.add_parser(name, help=help, description=description, epilog=epilog,
                                 formatter_class=HelpFormatter, **kwargs)
