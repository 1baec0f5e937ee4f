"""`mpress plan`: plan memory compaction for a model on a server, compare strategies.

    mpress plan --model gpt-20.4b --hardware dgx1-v100 --schedule 1f1b --stages 8 \\
        --microbatch-size 2 --microbatches 16 --strategy mpress --out plan.yaml
    mpress plan --profile my.yaml --hardware hgx-h100 --out plan.yaml
    mpress plan --module mymodel:make --layers "embed,blocks.*,head" --out plan.yaml

A profile names its model (by a fingerprint of its structure), so `--profile` alone is
enough; `--model`, if given, must be the profile's. `--module pkg.mod:factory` profiles
the user's module first (on fake tensors when it does not fit this machine, or with
`--fake`; times then come from `--hardware`). The microbatch size defaults to the
profile's.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from mpress.commands.emulate import DEFAULTS, add_pipeline_args, setup_from_args
from mpress.errors import UserError
from mpress.hardware import load_hardware
from mpress.static.evaluate import PipelineSetup
from mpress.static.planner import PlannerOptions, PlanResult, check_fits_at_all, plan_strategy
from mpress.static.profile import Profile
from mpress.config import output_path_arg
from mpress.ui import make_console
from mpress.units import fmt_bytes, fmt_seconds
from mpress.vocabulary import Strategy, SwapInPolicy, Technique


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="plan recompute / host swap / D2D swap per tensor and compare strategies",
                              description=__doc__)
    add_pipeline_args(p)
    p.add_argument("--strategy", default=Strategy.MPRESS.value, choices=Strategy.words(),
                   help="strategy whose plan is written (default: %(default)s); all are compared")
    p.add_argument("--policy", default=SwapInPolicy.CAPACITY.value, choices=SwapInPolicy.words(),
                   help="swap-in policy the plan is emulated with (default: %(default)s)")
    p.add_argument("--out", type=output_path_arg(), default=None, help="write the plan (YAML, or JSON for .json)")
    p.add_argument("--module", metavar="PKG.MOD:FACTORY", default=None,
                   help="plan a user module: profile it first (see `mpress profile --module`)")
    p.add_argument("--layers", metavar="NAMES", default=None,
                   help="split points of --module: comma-separated module paths or patterns, e.g. 'embed,blocks.*,head'")
    p.add_argument("--fake", action="store_true",
                   help="profile --module on fake tensors even if it fits here (the default for one that does not)")
    p.set_defaults(func=run)


def profile_for_args(args: argparse.Namespace) -> Profile | None:
    """The profile to plan from: `--module` profiled now, `--profile` read, or None
    (the analytic profile of `--model`); the microbatch size defaults to its."""
    if args.layers is not None and not args.module:
        raise UserError("--layers names split points of a --module")
    if args.fake and not args.module:
        raise UserError("--fake profiles a --module; for a preset use mpress profile --fake and --profile")
    if args.module and args.profile:
        raise UserError("give --module (profiled now) or --profile (made before), not both")
    profile = None
    if args.module:
        from mpress.static.fake_profile import profile_user_module
        from mpress.models.user_module import parse_layers

        hardware = load_hardware(args.hardware or DEFAULTS["hardware"])
        profile = profile_user_module(args.module, hardware=hardware, fake=True if args.fake else None,
                                      layers=parse_layers(args.layers))
    elif args.profile:
        profile = Profile.load(args.profile)
    if profile is not None and args.microbatch_size is None:
        args.microbatch_size = profile.microbatch_size
    return profile


def plan_all(setup: PipelineSetup, policy: str, console: Console) -> dict[str, PlanResult]:
    """Plan every strategy with a progress display; results by strategy name."""
    options = PlannerOptions(swap_in_policy=SwapInPolicy(policy))
    results: dict[str, PlanResult] = {}
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("planning", total=len(Strategy))
        for name in Strategy.words():
            progress.update(task, description=f"planning {name}")
            results[name] = plan_strategy(setup, name, options,
                                          progress=lambda msg: progress.update(task, description=msg))
            progress.advance(task)
    return results


def stage_table(r: PlanResult) -> Table:
    """Per stage: need vs capacity, planned peak, bytes each technique saves and its share."""
    setup = r.evaluation.setup
    t = Table(title=f"{r.strategy} plan: {setup.model.name} on {setup.hardware.name}, {setup.schedule.name}, "
                    f"{setup.schedule.num_stages} stages, {setup.schedule.num_microbatches} x {setup.microbatch_size}")
    compacting = [t for t in Technique if t is not Technique.KEEP]
    for col in ["stage", "device", "need", "capacity", "planned peak", *compacting,
                "pinned host", "peers"]:
        t.add_column(col, justify="right")
    res = r.evaluation.result
    for sp, saved, peers in zip(r.plan.stages, r.saved_bytes, r.peers):
        total = sum(saved.values())
        cells = []
        for tech in compacting:
            b = saved.get(tech, 0)
            cells.append(f"{fmt_bytes(b)} ({100 * b / total:.0f}%)" if b else "-")
        peak = res.peak_bytes[sp.device]
        style = "green" if peak <= setup.hardware.device.memory_bytes else "bold red"
        t.add_row(str(sp.stage), str(sp.device), fmt_bytes(sp.need_bytes), fmt_bytes(setup.hardware.device.memory_bytes),
                  f"[{style}]{fmt_bytes(peak)}[/]", *cells, fmt_bytes(sp.pinned_host_bytes),
                  ",".join(map(str, peers)) or "-")
    return t


def comparison_table(results: dict[str, PlanResult]) -> Table:
    """Every strategy: fits, emulated iteration, throughput, and time ratio to mpress."""
    ref = results.get(Strategy.MPRESS)
    t = Table(title="strategies (emulated)")
    for col in ["strategy", "fits", "iteration", "samples/s", "TFLOP/s", "time / mpress", "pinned host",
                "plan time", "why not"]:
        t.add_column(col, justify="left" if col in ("strategy", "why not") else "right")
    for name, r in results.items():
        res = r.evaluation.result
        ratio = res.iteration_s / ref.evaluation.result.iteration_s if ref else float("nan")
        t.add_row(name, "[green]yes[/]" if r.fits else "[red]no[/]", fmt_seconds(res.iteration_s),
                  f"{res.samples_per_s:.3g}", f"{res.model_tflops:.3g}", f"{ratio:.2f}x",
                  fmt_bytes(r.host_bytes), fmt_seconds(r.plan_s), r.reason)
    return t


def run(args: argparse.Namespace) -> int:
    setup = setup_from_args(args, profile=profile_for_args(args))
    check_fits_at_all(setup)
    console = make_console()
    results = plan_all(setup, args.policy, console)
    chosen = results[args.strategy]
    console.print(stage_table(chosen))
    console.print(comparison_table(results))
    if not any(r.fits for r in results.values()):
        raise UserError(f"no strategy fits {setup.model.name} on {setup.hardware.name}: {results['mpress'].reason}")
    if not chosen.fits:
        console.print(f"[bold red]{args.strategy} does not fit[/]: {chosen.reason}; no plan written")
        return 1
    if args.out:
        chosen.plan.save(args.out)
        console.print(f"plan written to {args.out} (planning {fmt_seconds(chosen.plan_s)}, "
                      f"device mapping {fmt_seconds(chosen.mapping_s)})")
    return 0
