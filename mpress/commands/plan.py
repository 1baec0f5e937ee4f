"""`mpress plan`: plan memory compaction for a model on a server, compare strategies.

    mpress plan --model gpt-20.4b --hardware dgx1-v100 --schedule 1f1b --num-stages 8 \\
        --microbatch-size 2 --num-microbatches 16 --strategy mpress --out plan.yaml
    mpress plan --profile my.yaml --hardware hgx-h100 --out plan.yaml
    mpress plan --module mymodel:make --layers "embed,blocks.*,head" --out plan.yaml
    mpress plan --model gpt-tiny --hardware cpu-local --device-memory 3MB --json > plan-figures.json

A profile names its model (by a fingerprint of its structure), so `--profile` alone is
enough; `--model`, if given, must be the profile's. `--module pkg.mod:factory` profiles
the user's module first (on fake tensors when it does not fit this machine, or with
`--fake`; times then come from `--hardware`). Flags left unset derive from the inputs:
one stage per device, 2 microbatches per rank, microbatch size 1 (the profile's with
--profile or --module); the line `settings: ...` says what was used. Every strategy is
planned and compared; `--out` writes the plan of `--strategy` (without it nothing is
written). --json prints the tables' figures as JSON (bytes as integers, times in
seconds) instead of the tables.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from mpress.commands.flags import add_command, add_flag
from mpress.commands.pipeline_args import (
    DEFAULT_HARDWARE,
    PipelineShape,
    add_pipeline_args,
    cluster_line,
    settings_json,
    settings_line,
    setup_from_args,
)
from mpress.errors import UserError
from mpress.hardware.server import load_hardware
from mpress.static.profile.profile import Profile
from mpress.config.loader import output_path_arg
from mpress.ui import TaskProgress, make_console, print_json
from mpress.config.units import fmt_bytes, fmt_seconds
from mpress.config.vocabulary import ScheduleName, Strategy, SwapInPolicy, Technique

if TYPE_CHECKING:  # the planner loads torch (through the analytic profile): imported when the command runs
    from mpress.static.baselines.zero import BaselineResult
    from mpress.static.plan.evaluate import PipelineSetup
    from mpress.static.plan.planner import PlanResult
    from mpress.static.studies.ablation import Ablation


AUTO = "auto"
"""`--schedule auto`: the schedule is part of the search (`static/plan/schedule_choice.py`)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "plan", help="plan recompute / host swap / D2D swap per tensor and compare strategies",
                    description=__doc__)
    add_pipeline_args(p)
    schedule = p._option_string_actions["--schedule"]  # plan alone may search the schedules
    schedule.choices = (*ScheduleName.words(), AUTO)
    schedule.help = f"pipeline schedule, or {AUTO}: plan each candidate and take the fastest that fits"
    add_flag(p, "strategy", default=Strategy.MPRESS.value,
             help="strategy whose plan is written (default: %(default)s); all are compared")
    add_flag(p, "swap_in_policy", default=SwapInPolicy.CAPACITY.value,
             help="swap-in policy the plan is emulated with (default: %(default)s)")
    p.add_argument("--out", type=output_path_arg(suffixes=(".yaml", ".yml", ".json")), default=None, metavar="FILE",
                   help="write the plan (YAML, or JSON for .json); without it no plan file is written")
    add_flag(p, "module", default=None, help="plan a user module: profile it first (see `mpress profile --module`)")
    add_flag(p, "layers", default=None)
    p.add_argument("--fake", action="store_true",
                   help="profile --module on fake tensors even if it fits here (the default for one that does not)")
    p.add_argument("--ablate", action="store_true",
                   help="emulate the mpress plan without D2D, with the identity device mapping and with one peer "
                        "per stage (no striping), and print each one's slowdown")
    p.add_argument("--layer-data", action="store_true",
                   help="mpress may also keep layers' working parameters and gradients in pinned host memory "
                        "(param:/grad: host rules, on stages stepping the optimizer on the host) when nothing else "
                        "fits")
    add_flag(p, "json")
    p.set_defaults(func=run)


def ablation_table(r: PlanResult, ablations: list[Ablation]) -> Table:
    """Each ablation of the mpress plan: fits, iteration, slowdown, D2D bytes left on the device."""
    t = Table(title="ablations of the mpress plan (each emulated with one D2D ingredient taken away)")
    for col in ["variant", "fits", "iteration", "vs plan", "D2D bytes left on the device"]:
        t.add_column(col, justify="left" if col == "variant" else "right")
    base = r.evaluation.result.iteration_s
    t.add_row("the plan", "yes" if r.fits else "no", fmt_seconds(base), "1.000x", "-")
    for a in ablations:
        t.add_row(a.name, "yes" if a.fits else "[bold red]no[/]", fmt_seconds(a.iteration_s),
                  f"{a.iteration_s / base:.3f}x", fmt_bytes(a.unplaced_bytes) if a.unplaced_bytes else "-")
    return t


def profile_for_args(args: argparse.Namespace) -> Profile | None:
    """The profile to plan from: `--module` profiled now, `--profile` read, or None (the
    analytic profile of `--model`); the microbatch size then defaults to its
    (`pipeline_args.resolve_shape`)."""
    if args.layers is not None and not (args.module or args.hf_config):
        raise UserError("--layers names split points of a --module")
    if args.fake and not args.module:
        raise UserError("--fake profiles a --module; for a preset use mpress profile --fake and --profile")
    if args.module and args.profile:
        raise UserError("give --module (profiled now) or --profile (made before), not both")
    if args.module:
        from mpress.static.profile.fake_profile import profile_user_module
        from mpress.models.user_module import parse_layers

        hardware = load_hardware(args.hardware or DEFAULT_HARDWARE)
        return profile_user_module(args.module, hardware=hardware, fake=True if args.fake else None,
                                   layers=parse_layers(args.layers))
    if args.profile:
        return Profile.load(args.profile)
    return None


class Planning:
    """The strategies planned for one laid-out pipeline, sharing one `PlanCache` (the
    strategies often emulate the same drafts), so that a strategy planned first (to choose
    the layers' split) is neither planned again nor planned apart from the others."""

    def __init__(self, setup: PipelineSetup, shape: PipelineShape, policy: str, layer_data: bool = False) -> None:
        from mpress.static.plan.plan_cache import PlanCache
        from mpress.static.plan.planner import PlannerOptions

        self.setup, self.shape = setup, shape
        self.options = PlannerOptions(swap_in_policy=SwapInPolicy(policy), layer_data=layer_data)
        self.cache = PlanCache(setup)
        self.results: dict[str, PlanResult] = {}

    def plan(self, names: list[str], progress: TaskProgress) -> dict[str, PlanResult]:
        """Plan the strategies `names` not planned yet, reporting to `progress`; every
        result so far, in `Strategy` order."""
        from mpress.static.plan.planner import plan_strategy

        for name in names:
            if name in self.results:
                continue
            progress.update(f"planning {name}")
            r = plan_strategy(self.setup, name, self.options, progress=progress.update, cache=self.cache)
            self.results[name] = r
            progress.advance(f"planned {name}: " + (f"fits, iteration {fmt_seconds(r.evaluation.result.iteration_s)}"
                                                    if r.fits else "does not fit")
                             + f" (planning {fmt_seconds(r.plan_s)})")
        return {n: self.results[n] for n in Strategy.words() if n in self.results}


def choose_balance(args: argparse.Namespace, console: Console) -> Planning:
    """The layers' split, decided once before the comparison, with what deciding planned.

    With --balance, that split. Without it, the memory model says up front which split
    the strategy to write (--strategy) is planned on
    (`mpress.static.plan.balance_choice`): stages balanced for compute, unless that
    model rules them out for the strategy and not stages balanced for memory (the first
    stage, with the most microbatches in flight, holds the most; a memory split evens
    that out). Only where the model cannot tell and compute does not fit is the strategy
    planned on memory too. Where it fits neither split, the split where any strategy
    fits, compute first.
    """
    from mpress.static.plan.balance_choice import choose_balance as choose
    from mpress.static.plan.balance_choice import check_fits_at_all

    profile = profile_for_args(args)
    by_compute = Planning(*setup_from_args(args, profile=profile), args.swap_in_policy, args.layer_data)
    check_fits_at_all(by_compute.setup)
    console.print(settings_line(by_compute.setup, by_compute.shape), markup=False, soft_wrap=True)
    if args.balance is not None:
        return by_compute
    planning = {"compute": by_compute}

    def by_memory() -> PipelineSetup:  # laid out once, where the choice needs it
        if "memory" not in planning:
            args.balance = "memory"
            planning["memory"] = Planning(*setup_from_args(args, profile=profile), args.swap_in_policy, args.layer_data)
            args.balance = None
        return planning["memory"].setup

    def plan(balance: str, names: list[str]) -> dict[str, PlanResult]:
        on = planning[balance]
        with TaskProgress(console, len(Strategy), "planning", completed=len(on.results)) as progress:
            return on.plan(names, progress)

    chosen = choose(by_compute.setup, by_memory, args.strategy, plan,
                    lambda line: console.print(line, markup=False, soft_wrap=True))
    if chosen == "compute":
        return by_compute
    args.balance = chosen
    console.print(settings_line(planning["memory"].setup, planning["memory"].shape), markup=False, soft_wrap=True)
    return planning["memory"]


def plan_baselines(setup: PipelineSetup) -> dict[str, BaselineResult]:
    """The ZeRO baselines (`mpress.static.baselines.zero`) for the setup's model, batch and server;
    none for a pipeline replicated over nodes (they are modelled on one server)."""
    from mpress.static.baselines.zero import plan_zero, zero_variants

    if setup.data_parallel is not None and setup.data_parallel.degree > 1:
        return {}
    return {v: plan_zero(setup, v) for v in zero_variants(setup.hardware)}


def stage_table(r: PlanResult) -> Table:
    """Per stage: need vs usable memory (what plans fit: nominal less the reserve), planned
    peak, bytes each technique saves and its share."""
    setup = r.evaluation.setup
    t = Table(title=f"{r.strategy} plan: {setup.model.name} on {setup.hardware.name}, {setup.schedule.name}, "
                    f"{setup.schedule.num_stages} stages, {setup.schedule.num_microbatches} x {setup.microbatch_size}")
    compacting = [t for t in Technique if t is not Technique.KEEP]
    for col in ["stage", "device", "need", "usable", "planned peak", *compacting,
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
        usable = setup.hardware.usable_memory_bytes  # what the planner fits (nominal less the reserve)
        style = "green" if peak <= usable else "bold red"
        t.add_row(str(sp.stage), str(sp.device), fmt_bytes(sp.need_bytes), fmt_bytes(usable),
                  f"[{style}]{fmt_bytes(peak)}[/]", *cells, fmt_bytes(sp.pinned_host_bytes),
                  ",".join(map(str, peers)) or "-")
    return t


def comparison_table(results: dict[str, PlanResult], baselines: dict[str, BaselineResult] | None = None) -> Table:
    """Every strategy: fits, emulated iteration, throughput, and time ratio to mpress; then
    the ZeRO baselines (modelled, no plan: "-" for plan time)."""
    ref = results.get(Strategy.MPRESS)
    t = Table(title="strategies (emulated; zero-* modelled by mpress.static.baselines.zero)")
    for col in ["strategy", "fits", "iteration", "samples/s", "TFLOP/s", "time / mpress", "pinned host",
                "plan time", "why not"]:
        t.add_column(col, justify="left" if col in ("strategy", "why not") else "right")
    for name, r in results.items():
        res = r.evaluation.result
        ratio = res.iteration_s / ref.evaluation.result.iteration_s if ref else float("nan")
        t.add_row(name, "[green]yes[/]" if r.fits else "[red]no[/]", fmt_seconds(res.iteration_s),
                  f"{res.samples_per_s:.3g}", f"{res.model_tflops:.3g}", f"{ratio:.2f}x",
                  fmt_bytes(r.host_bytes), fmt_seconds(r.plan_s), r.reason)
    for name, b in (baselines or {}).items():
        ratio = b.iteration_s / ref.evaluation.result.iteration_s if ref else float("nan")
        t.add_row(name, "[green]yes[/]" if b.fits else "[red]no[/]", fmt_seconds(b.iteration_s),
                  f"{b.samples_per_s:.3g}", f"{b.model_tflops:.3g}", f"{ratio:.2f}x", fmt_bytes(b.host_bytes),
                  "-", b.reason)
    return t


def plan_json(results: dict[str, PlanResult], chosen: str, shape: PipelineShape,
              baselines: dict[str, BaselineResult] | None = None) -> dict[str, object]:
    """The figures of `stage_table` (the chosen strategy) and `comparison_table` (bytes
    as integers, times in seconds); `baselines`: the ZeRO rows, with their per-GPU peak,
    host and drive bytes and time by phase."""
    r = results[chosen]
    setup, res = r.evaluation.setup, r.evaluation.result
    stages = [{"stage": sp.stage, "device": sp.device, "need_bytes": sp.need_bytes,
               "capacity_bytes": setup.hardware.usable_memory_bytes,
               "device_memory_bytes": setup.hardware.device.memory_bytes, "planned_peak_bytes": res.peak_bytes[sp.device],
               "saved_bytes": {str(t): b for t, b in saved.items()}, "pinned_host_bytes": sp.pinned_host_bytes,
               "peers": list(peers)}
              for sp, saved, peers in zip(r.plan.stages, r.saved_bytes, r.peers)]
    ref = results.get(Strategy.MPRESS)
    strategies = []
    for name, x in results.items():
        xres = x.evaluation.result
        strategies.append({"strategy": name, "fits": x.fits, "iteration_s": xres.iteration_s,
                           "samples_per_s": xres.samples_per_s, "model_tflops": xres.model_tflops,
                           "time_over_mpress": xres.iteration_s / ref.evaluation.result.iteration_s if ref else None,
                           "pinned_host_bytes": x.host_bytes, "plan_s": x.plan_s, "why_not": x.reason})
    zero = [{"strategy": name, "fits": b.fits, "iteration_s": b.iteration_s, "samples_per_s": b.samples_per_s,
             "model_tflops": b.model_tflops,
             "time_over_mpress": b.iteration_s / ref.evaluation.result.iteration_s if ref else None,
             "peak_bytes": b.peak_bytes, "host_bytes": b.host_bytes, "nvme_bytes": b.nvme_bytes,
             "micro_steps": b.micro_steps, "why_not": b.reason,
             "times": {k: getattr(b.times, k) for k in ("compute_s", "forward_s", "backward_s", "optimizer_s",
                                                        "param_update_s")}}
            for name, b in (baselines or {}).items()]
    return {"settings": {**settings_json(setup, shape), "strategy": chosen,
                         "swap_in_policy": str(r.plan.swap_in_policy)},
            "stages": stages, "strategies": strategies, "baselines": zero}


def auto_schedule(args: argparse.Namespace, console: Console) -> None:
    """`--schedule auto`: plan `--strategy` under each candidate schedule on the same ranks
    and set `args` to the fastest that fits, one line per candidate saying why."""
    from mpress.static.plan.planner import PlannerOptions
    from mpress.static.plan.schedule_choice import choose_schedule

    if args.num_stages is not None:
        raise UserError("--schedule auto lays out each candidate on the same ranks: give --num-ranks, "
                        "not --num-stages")
    profile = profile_for_args(args)
    args.schedule = str(ScheduleName.ONE_F_ONE_B)  # one stage per rank: the ranks every candidate gets
    base, _shape = setup_from_args(args, profile=profile)
    ranks = base.schedule.num_ranks

    def make(schedule: ScheduleName, stages: int, num_ranks: int) -> PipelineSetup:
        args.schedule, args.num_stages, args.num_ranks = str(schedule), stages, num_ranks
        return setup_from_args(args, profile=profile)[0]

    with TaskProgress(console, 1, "choosing the schedule") as progress:
        choice = choose_schedule(make, ranks, args.strategy,
                                 PlannerOptions(swap_in_policy=SwapInPolicy(args.swap_in_policy)), progress.update)
    for line in choice.lines():
        console.print(line, markup=False, soft_wrap=True)
    if choice.chosen is None:
        raise UserError(f"--schedule auto: no candidate schedule fits {base.model.name} on {base.hardware.name} "
                        f"with {args.strategy} ({len(choice.candidates)} tried, each line above says why)")
    args.schedule, args.num_stages, args.num_ranks = str(choice.chosen.schedule), choice.chosen.num_stages, ranks


def run(args: argparse.Namespace) -> int:
    from mpress.static.studies.ablation import ablate

    console = make_console(stderr=args.json)
    if args.schedule == AUTO:
        auto_schedule(args, console)
    planning = choose_balance(args, console)
    setup, shape = planning.setup, planning.shape
    with TaskProgress(console, len(Strategy), "planning", completed=len(planning.results)) as progress:
        results = planning.plan(Strategy.words(), progress)
    chosen = results[args.strategy]
    baselines = plan_baselines(setup)
    ablations = ablate(setup, results[Strategy.MPRESS.value]) if args.ablate else []
    written = args.out if chosen.fits and args.out else None
    if written:
        chosen.plan.save(written)
    if args.json:
        extra = {"ablations": [{"variant": a.name, "fits": a.fits, "iteration_s": a.iteration_s,
                                "unplaced_bytes": a.unplaced_bytes} for a in ablations]} if args.ablate else {}
        print_json({**plan_json(results, args.strategy, shape, baselines), "plan_file": written, **extra})
    else:
        console.print(stage_table(chosen))
        console.print(comparison_table(results, baselines))
        if args.ablate:
            if ablations:
                console.print(ablation_table(results[Strategy.MPRESS.value], ablations))
            else:
                console.print("ablations: the mpress plan swaps nothing to peers, so there is no D2D to take away")
        if (line := cluster_line(chosen.evaluation.setup, chosen.evaluation.result)) is not None:
            console.print(f"{args.strategy} plan on the {line}", markup=False, soft_wrap=True)
    if not any(r.fits for r in results.values()):
        raise UserError(f"no strategy fits {setup.model.name} on {setup.hardware.name}: {results['mpress'].reason}")
    if not chosen.fits:
        console.print(f"[bold red]{args.strategy} does not fit[/]: {chosen.reason}; no plan written")
        return 1
    if written:
        console.print(f"plan written to {written} (planning {fmt_seconds(chosen.plan_s)}, "
                      f"device mapping {fmt_seconds(chosen.mapping_s)})")
    else:
        console.print(f"no plan file written: add --out plan.yaml to write the {args.strategy} plan "
                      "(mpress emulate plan.yaml re-evaluates it, a train config's plan: key runs it)")
    return 0
