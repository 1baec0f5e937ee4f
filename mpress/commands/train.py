"""`mpress train`: train a model with pipeline parallelism on this machine, launching
the ranks itself.

The config is loaded, overridden and checked here, before any rank starts: bad input is
one line and exit status 2 with no rank launched. Then `mpress/launcher/launch.py` runs
the ranks and reduces how they ended to one line.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from mpress.commands.flags import HelpFormatter, add_flag
from mpress.errors import UserError
from mpress.launcher.launch import LaunchSpec, launch
from mpress.launcher.startup import pool_override
from mpress.overrides import parse_override_args
from mpress.plan import Plan
from mpress.runtime.train_config import (
    PLAN_AUTO,
    PLAN_NONE,
    TrainConfig,
    check_world_size,
    load_train_config,
    resolve_backend,
    train_presets,
)
from mpress.vocabulary import ScheduleName

DEFAULT_CPU_RANKS = 4
"""Ranks of a CPU run whose config sets no num_stages: the shipped CPU examples' four."""

EXAMPLES = """\
examples:
  mpress train --config configs/train/gpt-tiny-mixed.yaml
  mpress train --config configs/train/gpt-tiny-mixed.yaml --nproc-per-node 4 --steps 10 --optimizer.lr 1e-3
  mpress train --config gpt-tiny-interleaved --nproc-per-node 2 --checkpoint.dir ckpt --checkpoint.every-steps 10
  mpress train --config gpt-tiny-plain --steps 5 --json > report.json

overrides:
  --KEY VALUE sets any key of the YAML config before it is checked: its name as in the
  file (- and _ are the same), dotted for nested keys (--optimizer.lr, --data.kind);
  VALUE is read as YAML (10, 1e-3, null, [0.9, 0.95]). The ranks get the same overrides.

ranks:
  --nproc-per-node defaults to the config's num_stages (interleaved: num_stages / 2, two
  stages per rank), else on CUDA the number of visible GPUs, else {cpu}. Rank 0's output
  (progress lines, report tables) is this command's output; every rank's other output
  goes to RUN_DIR/rank<N>.log. Off a terminal the progress bar becomes a line per logged
  step (log_every) with loss, samples/s and each rank's peak. With --json, rank 0's
  output goes to stderr and stdout gets only the end-of-run report: one JSON object per
  rank (bytes as integers, times in seconds), as the config's report key writes it. The
  torchrun form works too:
    python3 -m torch.distributed.run --standalone --nproc-per-node 4 -m mpress.train \\
        --config configs/train/gpt-tiny-mixed.yaml --steps 10

exit status:
  0    every rank finished
  1    a runtime failure (one line on stderr naming the rank and the cause: a rank's own
       error with its stage, microbatch and tensor, a rank killed or stalled, ...)
  2    bad input: config, override, flag, plan (one line on stderr; no rank started,
       unless a rank found it: then one line too)
  128+N  mpress train got signal N (Ctrl-C: 130); the ranks were stopped

presets: {presets}
""".format(cpu=DEFAULT_CPU_RANKS, presets="{presets}")


def register(subparsers: Any) -> None:
    """Add the `train` subcommand to the `mpress` parser."""
    parser = subparsers.add_parser(
        "train", help="train with pipeline parallelism, launching the ranks (one per stage)",
        description="Train a model with pipeline parallelism on this machine, launching the ranks itself.",
        epilog=EXAMPLES.replace("{presets}", ", ".join(train_presets())),
        formatter_class=HelpFormatter, allow_abbrev=False)
    parser.add_argument("--config", required=True, metavar="CFG",
                        help="training config: a YAML path or a preset name (configs/train/)")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="ranks to start on this machine (default: see 'ranks' below)")
    parser.add_argument("--run-dir", default=None, metavar="DIR",
                        help="where the ranks' logs go (default: a new mpress-train-<id> directory under "
                             f"{tempfile.gettempdir()})")
    add_flag(parser, "json", help="print the end-of-run report (per rank) as JSON on stdout; rank 0's output "
                                  "goes to stderr")
    parser.set_defaults(func=run, takes_overrides=True)


def default_nproc(cfg: TrainConfig, num_gpus: int) -> int:
    """Ranks when --nproc-per-node is not given: what the config asks for (num_stages; for
    interleaved two stages per rank), else one rank per visible GPU, else
    `DEFAULT_CPU_RANKS` (see EXAMPLES)."""
    if cfg.num_stages is not None:
        if cfg.schedule is ScheduleName.INTERLEAVED:
            return max(1, cfg.num_stages // 2) if cfg.num_stages % 2 == 0 else cfg.num_stages
        return cfg.num_stages
    return num_gpus if num_gpus > 0 else DEFAULT_CPU_RANKS


def check_launch(cfg: TrainConfig, nproc: int) -> str:
    """Everything about the job that can be checked before a rank starts; returns the
    backend. Raises `UserError` naming the key or flag to change."""
    if nproc < 1:
        raise UserError(f"--nproc-per-node: must be >= 1, got {nproc}")
    check_world_size(cfg, nproc)
    backend = resolve_backend(cfg)
    if backend == "nccl" and nproc > torch.cuda.device_count():
        raise UserError(f"--nproc-per-node: {nproc} ranks on nccl need as many GPUs; this machine shows "
                        f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES)")
    pool_override("MPRESS_HOST_POOL_BYTES")
    pool_override("MPRESS_PEER_POOL_BYTES")
    if cfg.plan not in (PLAN_AUTO, PLAN_NONE):
        Plan.load(cfg.plan)
    return backend


def run(args: argparse.Namespace) -> int:
    """Check the job, then launch it; the exit status as EXAMPLES lists it."""
    overrides = parse_override_args(list(getattr(args, "extra", [])), args.config)
    cfg = load_train_config(args.config, overrides)
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = args.nproc_per_node if args.nproc_per_node is not None else default_nproc(cfg, num_gpus)
    backend = check_launch(cfg, nproc)
    run_id = secrets.token_hex(6)
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.gettempdir()) / f"mpress-train-{run_id}"
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir: {run_dir} is a file, not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--run-dir: cannot create {run_dir}: {exc.strerror}") from None
    report: Path | None = None
    if args.json:  # rank 0 writes the report where the config says, or into the run directory
        report = Path(cfg.report) if cfg.report is not None else run_dir / "report.json"
        if cfg.report is None:
            overrides = [*overrides, ("report", str(report))]
    print(f"mpress train: {nproc} ranks ({backend}); rank 0's output follows, every rank's log is in {run_dir}",
          file=sys.stderr if args.json else sys.stdout, flush=True)
    return launch(LaunchSpec(config=args.config, overrides=overrides, nproc=nproc, run_dir=run_dir, run_id=run_id,
                             json_report=report))
