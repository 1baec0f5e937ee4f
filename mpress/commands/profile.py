"""`mpress profile`: per-layer costs of one microbatch, measured or analytic.

Measured (default): runs the reference model of a preset (`--model`) or a user module
(`--module package.module:factory`, imported with the current directory importable) on
the local device in training mode and records times (medians and spread of `--iters`
steps), FLOPs and every tensor saved for backward. A model that does not fit this machine,
or any model with `--fake`, is profiled on fake tensors (`mpress.static.profile.fake_profile`):
the same saved tensors and FLOPs, nothing allocated, times from hardware preset
`--hardware`. Analytic (`--analytic --hardware H`): closed-form costs of a GPT/BERT preset.
Prints one row per layer and totals; `--out` writes the profile (YAML, or JSON for .json).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from mpress.commands.flags import EXIT_STATUS, add_command, add_flag
from mpress.commands.pipeline_args import DEFAULT_HARDWARE, DEFAULT_MICROBATCH_SIZE
from mpress.errors import UserError
from mpress.hardware.server import load_hardware
from mpress.config.presets import hardware_presets
from mpress.config.model_config import load_model_config, model_presets
from mpress.static.profile.profile import Profile
from mpress.config import limits
from mpress.config.loader import int_arg, output_path_arg
from mpress.ui import TaskProgress, make_console
from mpress.config.units import fmt_bytes

EPILOG = """\
Examples:
  mpress profile --model gpt-tiny --microbatch-size 4 --out gpt-tiny.yaml
  mpress profile --model gpt-25.5b --microbatch-size 2 --analytic --hardware dgx1-v100
  mpress profile --module mypkg.models:make_model --device cuda --out my.json
  mpress profile --module mymodel:make --layers "embed,blocks.*,head" --fake --hardware hgx-h100 --out my.yaml
  mpress profile --hf-config llama-tiny --microbatch-size 2 --out llama.yaml
  mpress profile --hf-config path/to/config.json --seq-len 512 --fake --hardware hgx-h100 --out hf.yaml
  mpress profile --hf-config llama-2-7b --seq-len 1024 --dtype bf16 --fake --hardware dgx-a100 --out 7b.yaml
  mpress plan --profile my.yaml --hardware hgx-h100
A --module factory takes no arguments and returns (module, example_input) or
(module, example_input, loss_fn); the microbatch size is the example input's first
dimension. --layers names the split points as module paths (* = one name segment); a
forward that is not a plain chain of its children needs them. --hf-config builds a
Hugging Face transformers model from a config (never downloaded); its layers are
embed, blocks.N and head.

""" + EXIT_STATUS

OUT_SUFFIXES = (".yaml", ".yml", ".json")


def register(subparsers: Any) -> None:
    """Add the `profile` subcommand to the `mpress` parser."""
    parser = add_command(
        subparsers, "profile", help="profile a model per layer (measured on this machine, or analytic)",
        description="Per-layer forward/backward time, FLOPs, saved tensors and model state of one microbatch.",
        epilog=EPILOG)
    source = parser.add_mutually_exclusive_group(required=True)
    add_flag(source, "model", help=f"model preset ({', '.join(model_presets())}) or a model YAML path")
    add_flag(source, "module")
    add_flag(source, "hf_config")
    add_flag(parser, "microbatch_size",
             help="samples per microbatch (default 1 for --model; the example input's for --module)")
    add_flag(parser, "layers", help="split points of a --module: comma-separated module paths or patterns, "
                                    "e.g. 'embed,blocks.*,head' (default: the module's chain of children); of "
                                    "an --hf-config of a family mpress does not know: EMBED,BLOCKS,NORM,HEAD")
    add_flag(parser, "seq_len")
    add_flag(parser, "dtype")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--analytic", action="store_true",
                      help="closed-form profile of a GPT/BERT preset (needs --hardware); runs nothing")
    mode.add_argument("--fake", action="store_true",
                      help="profile on fake tensors, even if the model fits here (the default for one that "
                           "does not): exact saved tensors and FLOPs, times from --hardware")
    add_flag(parser, "hardware", help="hardware whose model gives the times of --analytic and fake-tensor profiles "
                                      f"({', '.join(hardware_presets())}) or a YAML path (default: {DEFAULT_HARDWARE})")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to measure (default cpu)")
    parser.add_argument("--warmup", type=int_arg(0, limits.MAX_ITERS), default=2, metavar="N", help="untimed steps first (default 2)")
    parser.add_argument("--iters", type=int_arg(1, limits.MAX_ITERS), default=10, metavar="N",
                        help="timed steps; times are their medians, with the interquartile range (default 10)")
    parser.add_argument("--out", type=output_path_arg(), metavar="FILE", help="write the profile to FILE (.yaml, .yml or .json)")
    parser.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    if args.microbatch_size is not None and args.microbatch_size < 1:
        raise UserError(f"--microbatch-size must be >= 1, got {args.microbatch_size}")
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    if args.iters < 1:
        raise UserError(f"--iters must be >= 1, got {args.iters}")
    if args.out and Path(args.out).suffix not in OUT_SUFFIXES:
        raise UserError(f"--out {args.out}: unknown format (use a name ending in {', '.join(OUT_SUFFIXES)})")
    if args.analytic:
        if args.module:
            raise UserError("--analytic works for GPT/BERT presets (--model) only; use --fake for a --module")
        if not args.hardware:
            raise UserError(f"--analytic needs --hardware (presets: {', '.join(hardware_presets())})")
    if args.layers is not None and not (args.module or args.hf_config):
        raise UserError("--layers names split points of a --module or --hf-config (presets have theirs)")
    if args.seq_len is not None and not args.hf_config:
        raise UserError("--seq-len is the sequence length of an --hf-config (a preset has its own)")
    if args.dtype is not None and not args.hf_config:
        raise UserError("--dtype is the precision of an --hf-config (a preset has its own; a --module "
                        "its parameters')")
    if args.analytic and args.hf_config:
        raise UserError("--analytic works for GPT/BERT presets (--model) only; use --fake for an --hf-config")


def make_profile(args: argparse.Namespace) -> Profile:
    """Build the profile the arguments ask for (see the module docstring)."""
    _check_args(args)
    hardware = load_hardware(args.hardware or DEFAULT_HARDWARE)
    fake = True if args.fake else None
    if args.model:
        cfg = load_model_config(args.model)
        batch = args.microbatch_size or DEFAULT_MICROBATCH_SIZE
        if args.analytic:
            from mpress.static.profile.analytic import analytic_profile

            return analytic_profile(cfg, hardware, batch)
        from mpress.static.profile.fake_profile import profile_model

        return profile_model(cfg, batch, hardware=hardware, fake=fake, device=args.device,
                             warmup=args.warmup, iters=args.iters)

    from mpress.static.profile.fake_profile import profile_hf_model, profile_user_module
    from mpress.models.user_module import parse_layers

    if args.hf_config:
        return profile_hf_model(args.hf_config, microbatch_size=args.microbatch_size or DEFAULT_MICROBATCH_SIZE,
                                hardware=hardware, fake=fake, seq_len=args.seq_len, layers=parse_layers(args.layers),
                                device=args.device, warmup=args.warmup, iters=args.iters,
                                dtype=args.dtype or "fp32")

    profile = profile_user_module(args.module, hardware=hardware, fake=fake, layers=parse_layers(args.layers),
                                  device=args.device, warmup=args.warmup, iters=args.iters)
    if args.microbatch_size is not None and args.microbatch_size != profile.microbatch_size:
        raise UserError(f"--microbatch-size {args.microbatch_size} does not match the example input "
                        f"of {args.module} (first dimension {profile.microbatch_size}); leave it out for --module")
    return profile


def _what(args: argparse.Namespace) -> str:
    """What `make_profile` is about to do, for the progress line."""
    name = args.model or args.module or f"hf:{args.hf_config}"
    if args.analytic:
        return f"profiling {name}: analytic, times from {args.hardware}"
    if args.fake:
        return f"profiling {name}: on fake tensors, times from {args.hardware or DEFAULT_HARDWARE}"
    return (f"profiling {name}: measured on {args.device} ({args.warmup} untimed + {args.iters} timed steps; "
            "on fake tensors if it does not fit)")


def run(args: argparse.Namespace) -> int:
    """Profile, print the table, write `--out`; 0 on success."""
    console = _console()
    _check_args(args)
    with TaskProgress(console, 1, "profiling") as progress:
        progress.update(_what(args), say=True)
        profile = make_profile(args)
        progress.advance(f"profiled {profile.model}: {len(profile.layers)} layers, {profile.source} profile")
    render_profile(profile, console)
    if profile.source == "fake" and not args.fake:
        console.print(f"{profile.model} does not fit this machine's {args.device} memory: profiled on fake tensors, "
                      f"times from {profile.device}")
    if args.out:
        profile.save(args.out)
        print(f"wrote {args.out}")
    return 0


def _console() -> Console:
    return make_console()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _time(seconds: float, iqr_s: float, profile: Profile) -> str:
    """A median time in ms, with its interquartile range when measured."""
    return f"{_ms(seconds)} ±{_ms(iqr_s)}" if profile.time_samples > 1 else _ms(seconds)


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.2f}"


def _gflop(flops: float) -> str:
    return f"{flops / 1e9:.3f}"


def render_profile(profile: Profile, console: Console) -> None:
    """Print one row per layer and a totals row (times in ms, FLOPs in GFLOP, MB = 1e6 B)."""
    timing = (f"medians of {profile.time_samples} timed steps" if profile.time_samples
              else "times from the hardware model")
    title = (f"{profile.model}: {profile.source} profile on {profile.device}, "
             f"{profile.dtype}, microbatch {profile.microbatch_size}, {timing}")
    table = Table(title=title, box=box.SIMPLE_HEAD, show_footer=True)
    layers = profile.layers
    totals = {
        "fwd": sum(x.forward_time_s for x in layers), "bwd": sum(x.backward_time_s for x in layers),
        "ff": sum(x.forward_flops for x in layers), "bf": sum(x.backward_flops for x in layers),
        "saved": sum(x.saved_bytes for x in layers), "num": sum(len(x.saved) for x in layers),
        "params": sum(x.param_bytes for x in layers), "state": sum(x.model_state_bytes for x in layers),
    }
    columns = [
        ("layer", "total", "left"), ("fwd ms (IQR)" if profile.time_samples > 1 else "fwd ms", _ms(totals["fwd"]), "right"),
        ("bwd ms", _ms(totals["bwd"]), "right"), ("fwd GFLOP", _gflop(totals["ff"]), "right"),
        ("bwd GFLOP", _gflop(totals["bf"]), "right"), ("saved", str(totals["num"]), "right"),
        ("saved MB", _mb(totals["saved"]), "right"), ("params MB", _mb(totals["params"]), "right"),
        ("model state MB", _mb(totals["state"]), "right"), ("output MB", "", "right"),
        ("fwd keeps MB", "", "right"), ("fwd peak MB", "", "right"), ("bwd peak MB", "", "right"),
    ]
    for header, footer, justify in columns:
        table.add_column(header, footer=footer, justify=justify)  # type: ignore[arg-type]
    for x in layers:
        table.add_row(x.name or "(whole module)", _time(x.forward_time_s, x.forward_time_iqr_s, profile),
                      _time(x.backward_time_s, x.backward_time_iqr_s, profile),
                      _gflop(x.forward_flops), _gflop(x.backward_flops), str(len(x.saved)),
                      _mb(x.saved_bytes), _mb(x.param_bytes), _mb(x.model_state_bytes), _mb(x.output_bytes),
                      _mb(x.memory.kept_bytes), _mb(x.memory.forward_peak_bytes), _mb(x.memory.backward_peak_bytes))
    console.print(table)
    notes = [f"saved activations {fmt_bytes(totals['saved'])} per microbatch",
             f"model state {fmt_bytes(totals['state'])} (params + grads + Adam states + master weights)"]
    console.print("; ".join(notes))
