"""`mpress train`: train a model with pipeline parallelism on this machine, launching
the ranks itself.

The config is loaded, overridden and checked here, before any rank starts: bad input is
one line and exit status 2 with no rank launched. Then `mpress/launcher/launch.py` runs
the ranks and reduces how they ended to one line.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpress.commands.flags import HelpFormatter, add_flag
from mpress.config.loader import int_arg
from mpress.config.presets import train_presets
from mpress.errors import UserError
from mpress.hardware.cluster import MAX_NODES
from mpress.launcher.rendezvous import RDZV_TIMEOUT_S
from mpress.ui import START_TIME_ENV, phase_line

if TYPE_CHECKING:
    from mpress.launcher.launch import Nodes
    from mpress.launcher.rank_starter import RankStarter
    from mpress.runtime.train_config import TrainConfig

DEFAULT_CPU_RANKS = 4
"""Ranks of a CPU run whose config sets no num_stages: the shipped CPU examples' four."""

EXAMPLES = """\
examples:
  mpress train --config configs/train/gpt-tiny-mixed.yaml
  mpress train --config configs/train/gpt-tiny-mixed.yaml --nproc-per-node 4 --steps 10 --optimizer.lr 1e-3
  mpress train --config gpt-tiny-interleaved --nproc-per-node 2 --checkpoint.dir ckpt --checkpoint.every-steps 10
  mpress train --config gpt-tiny-plain --steps 5 --json > report.json
  mpress train --config gpt-tiny-plain --dp 2 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500   # on node0
  mpress train --config gpt-tiny-plain --dp 2 --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29500   # on node1

overrides:
  --KEY VALUE sets any key of the YAML config before it is checked: its name as in the
  file (- and _ are the same), dotted for nested keys (--optimizer.lr, --data.kind);
  VALUE is read as YAML (10, 1e-3, null, [0.9, 0.95]). The ranks get the same overrides.

ranks:
  --nproc-per-node defaults to the config's num_stages (interleaved: num_stages / 2, two
  stages per rank) times the config's dp (replicas of the pipeline) over --nnodes, else
  on CUDA the number of visible GPUs, else {cpu}. Rank 0's output
  (progress lines, report tables) is this command's output; every rank's other output
  goes to RUN_DIR/rank<N>.log; each logged step is a line of RUN_DIR/metrics.jsonl
  (`mpress report RUN_DIR` plots it; the config's metrics key moves it). Off a terminal the progress bar becomes a line per logged
  step (log_every) with loss, samples/s and each rank's peak. With --json, rank 0's
  output goes to stderr and stdout gets only the end-of-run report: one JSON object per
  rank (bytes as integers, times in seconds), as the config's report key writes it. The
  torchrun form works too:
    python3 -m torch.distributed.run --standalone --nproc-per-node 4 -m mpress.train \\
        --config configs/train/gpt-tiny-mixed.yaml --steps 10

nodes:
  --nnodes N --node-rank K --rdzv-endpoint HOST:PORT run one mpress train per machine
  (torchrun's static rendezvous): node K runs global ranks K*nproc .. (K+1)*nproc - 1,
  node 0 hosts the job's store at HOST:PORT. The job's ranks are dp x pp: replica k of
  the pipeline on ranks k*pp .. (k+1)*pp - 1, so with --nnodes dp each node holds one
  replica; a replica's stages never span two nodes (host pools and D2D peers stay inside
  a node). Each node's launcher prints the one line of how its ranks ended.

exit status:
  0    every rank finished
  1    a runtime failure (one line on stderr naming the rank and the cause: a rank's own
       error with its stage, microbatch and tensor, a rank killed or stalled, ...)
  2    bad input: config, override, flag, plan (one line on stderr; no rank started,
       unless a rank found it: then one line too)
  128+N  mpress train got signal N (Ctrl-C: 130); the ranks were stopped (a Ctrl-C while
       the job trains: after their step, a checkpoint saved first when checkpoint.dir is set)

presets: {presets}
""".format(cpu=DEFAULT_CPU_RANKS, presets="{presets}")


RANKS_PER_CORE = 4
"""Ranks one machine may start per CPU core it lets this process use: every rank is a
process with its own torch (hundreds of MB); four CPU ranks on two cores is a shipped
example's setup, a thousand would exhaust the machine before any check in a rank ran."""


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
    parser.add_argument("--nnodes", type=int_arg(1, MAX_NODES), default=1, metavar="N",
                        help="machines the job runs on, one mpress train each (default 1; see 'nodes' below)")
    parser.add_argument("--node-rank", type=int_arg(0, MAX_NODES - 1), default=0, metavar="K",
                        help="this machine's place among them, 0 .. N-1 (default 0)")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="node 0's address and a free port there, the same on every node (needed with --nnodes > 1)")
    parser.add_argument("--rdzv-timeout", type=_seconds, default=RDZV_TIMEOUT_S, metavar="S",
                        help="how long each node waits for the endpoint before it gives up with one line "
                             f"(default {RDZV_TIMEOUT_S:.0f})")
    parser.add_argument("--run-dir", default=None, metavar="DIR",
                        help="where the ranks' logs go, one run at a time (default: a new mpress-train-<id> "
                             f"directory under {tempfile.gettempdir()})")
    add_flag(parser, "json", help="print the end-of-run report (per rank) as JSON on stdout; rank 0's output "
                                  "goes to stderr")
    parser.set_defaults(func=run, takes_overrides=True)


def _seconds(text: str) -> float:
    """argparse `type=` for --rdzv-timeout: seconds in [0.5, 3600]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0.5 <= value <= 3600:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be in [0.5, 3600] seconds, got {text}")
    return value


def default_nproc(cfg: TrainConfig, num_gpus: int, nnodes: int = 1) -> int:
    """Ranks per machine when --nproc-per-node is not given: what the config asks for
    (num_stages; for interleaved two stages per rank; times dp, over `nnodes` machines),
    else one rank per visible GPU, else `DEFAULT_CPU_RANKS` (see EXAMPLES)."""
    from mpress.config.vocabulary import ScheduleName

    if cfg.num_stages is not None:
        if cfg.schedule is ScheduleName.INTERLEAVED:
            pp = max(1, cfg.num_stages // 2) if cfg.num_stages % 2 == 0 else cfg.num_stages
        else:
            pp = cfg.num_stages
        return max(1, pp * cfg.dp // nnodes)
    return num_gpus if num_gpus > 0 else DEFAULT_CPU_RANKS


def check_launch(cfg: TrainConfig, nproc: int, nnodes: int = 1) -> str:
    """Everything about the job that can be checked before a rank starts, `nproc` ranks
    on each of `nnodes` machines; returns the backend. Raises `UserError` naming the key
    or flag to change."""
    import torch

    from mpress.config.units import pool_override
    from mpress.contract.plan import Plan
    from mpress.runtime.train_config import (
        PLAN_AUTO,
        PLAN_NONE,
        check_world_size,
        pipeline_ranks,
        resolve_backend,
    )

    if nproc < 1:
        raise UserError(f"--nproc-per-node: must be >= 1, got {nproc}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nproc > RANKS_PER_CORE * cores:  # before anything starts: each rank is a process with its own torch
        raise UserError(f"--nproc-per-node: {nproc} ranks on this machine's {cores} cores; at most "
                        f"{RANKS_PER_CORE * cores} ({RANKS_PER_CORE} per core)")
    check_world_size(cfg, nproc * nnodes)
    pp = pipeline_ranks(cfg, nproc * nnodes)
    if nnodes > 1 and nproc % pp:
        raise UserError(f"--nproc-per-node: {nproc} ranks per node would split a replica's {pp} pipeline ranks over "
                        f"two nodes (host pools and D2D peers stay inside a node): give a multiple of {pp}")
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
    """Check the job, then launch it; the exit status as EXAMPLES lists it. The job's
    modules (torch among them) are imported here: a flag error has none to wait for. The
    first line comes before them (loading torch and checking the job take seconds); with
    --json, whose stderr is for one-line errors and rank 0's output, it is left out."""
    started = time.time()  # the ranks' start-up lines count from here
    if not args.json:
        print(f"mpress train: {args.config}: loading torch and checking the job", flush=True)
    from mpress.config.overrides import parse_override_args
    from mpress.launcher.rank_starter import start_starter

    overrides = parse_override_args(list(getattr(args, "extra", [])), args.config)
    # the ranks' process imports torch and mpress while this one checks the job
    run_id = secrets.token_hex(6)
    starter = start_starter(run_id)
    try:
        return _check_and_launch(args, overrides, started, run_id, starter)
    finally:
        if starter is not None:
            starter.close(kill=True)  # launch closed it already; else the job was refused


def _check_and_launch(args: argparse.Namespace, overrides: list, started: float, run_id: str,
                      starter: RankStarter | None) -> int:
    """`run` once the starter imports: the job checked, then launched (`starter`, its
    `run_id`)."""
    import torch

    from mpress.launcher.checkpoints.directories import claim_run
    from mpress.launcher.launch import LaunchSpec, launch
    from mpress.launcher.metrics_log import METRICS_FILE
    from mpress.models.hf_config import RANK_IMPORTS
    from mpress.runtime.train_config import load_train_config

    cfg = load_train_config(args.config, overrides)
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nodes = nodes_of(args)
    nnodes = nodes.nnodes if nodes is not None else 1
    nproc = args.nproc_per_node if args.nproc_per_node is not None else default_nproc(cfg, num_gpus, nnodes)
    backend = check_launch(cfg, nproc, nnodes)
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.gettempdir()) / f"mpress-train-{run_id}"
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir: {run_dir} is a file, not a directory")
    # one run per directory: refused here, before a rank starts, while the other run lives
    with claim_run(cfg, run_dir, node_rank=nodes.node_rank if nodes is not None else 0, run_id=run_id):
        report: Path | None = None
        if args.json:  # rank 0 writes the report where the config says, or into the run directory
            report = Path(cfg.report) if cfg.report is not None else run_dir / "report.json"
            if cfg.report is None:
                overrides = [*overrides, ("report", str(report))]
        if cfg.metrics is None and (nodes is None or nodes.node_rank == 0):  # rank 0's node keeps the run's metrics
            overrides = [*overrides, ("metrics", str((run_dir / METRICS_FILE).resolve()))]
        where = "" if nodes is None else f" on node {nodes.node_rank} of {nodes.nnodes}"
        print(f"mpress train: {nproc} ranks{where} ({backend}); rank 0's output follows, every rank's log is in {run_dir}",
              file=sys.stderr if args.json else sys.stdout, flush=True)
        phase_line(f"starting {nproc} ranks: they load torch and mpress, then they meet",
                   sys.stderr if args.json else sys.stdout)
        return launch(LaunchSpec(config=args.config, overrides=overrides, nproc=nproc, run_dir=run_dir,
                                 run_id=run_id, json_report=report, nodes=nodes,
                                 env={START_TIME_ENV: repr(started)},
                                 preload=RANK_IMPORTS if cfg.hf_config is not None else ()), starter=starter)


def nodes_of(args: argparse.Namespace) -> Nodes | None:
    """The machines of the job from --nnodes/--node-rank/--rdzv-endpoint (None: this
    machine only). A `UserError` naming the flag when they do not fit together."""
    from mpress.launcher.launch import Nodes

    if args.nnodes == 1:
        if args.node_rank != 0:
            raise UserError(f"--node-rank: {args.node_rank} needs --nnodes > {args.node_rank}")
        if args.rdzv_endpoint is not None:  # ignored, it would hide a forgotten --nnodes
            raise UserError(f"--rdzv-endpoint: {args.rdzv_endpoint} joins machines, and --nnodes is 1: give --nnodes "
                            "N for a job over N machines, or drop --rdzv-endpoint to train on this one")
        return None
    if args.node_rank >= args.nnodes:
        raise UserError(f"--node-rank: must be in 0..{args.nnodes - 1} with --nnodes {args.nnodes}, got {args.node_rank}")
    if args.rdzv_endpoint is None:
        raise UserError("--rdzv-endpoint: needed with --nnodes > 1: node 0's HOST:PORT, the same on every node")
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--rdzv-endpoint: expected HOST:PORT with a port in 1..65535, got {args.rdzv_endpoint!r}")
    return Nodes(nnodes=args.nnodes, node_rank=args.node_rank, host=host.strip("[]"), port=int(port),
                 timeout_s=args.rdzv_timeout)
