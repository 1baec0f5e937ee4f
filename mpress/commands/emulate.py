"""`mpress emulate`: memory per stage and one emulated iteration of a pipeline.

    mpress emulate --model gpt-5.3b --hardware dgx1-v100 --schedule 1f1b \\
        --stages 8 --microbatch-size 2 --microbatches 16 --trace out/trace.json --plot out/memory.png
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from mpress.errors import UserError
from mpress.hardware import load_hardware
from mpress.plan import Plan
from mpress.static.evaluate import Evaluation, PipelineSetup, evaluate, setup_pipeline
from mpress.static.plan_eval import check_plan_for_setup, evaluate_plan
from mpress.static.profile import Profile, model_for_profile
from mpress import limits
from mpress.config import int_arg, output_path_arg
from mpress.ui import make_console
from mpress.units import fmt_bytes, fmt_seconds, parse_bytes
from mpress.vocabulary import ScheduleName, SwapInPolicy

DEFAULTS = {
    "model": "gpt-20.4b", "hardware": "dgx1-v100", "schedule": ScheduleName.ONE_F_ONE_B.value,
    "stages": 8, "microbatch_size": 2, "microbatches": 16,
}


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by the commands that lay a model out on a pipeline (unset flags take
    a plan's values, or the built-in defaults)."""
    p.add_argument("--model", help=f"model preset or YAML (default: {DEFAULTS['model']})")
    p.add_argument("--hardware", help=f"hardware preset or YAML (default: {DEFAULTS['hardware']})")
    p.add_argument("--schedule", choices=ScheduleName.words(),
                   help=f"pipeline schedule (default: {DEFAULTS['schedule']})")
    p.add_argument("--stages", type=int_arg(1, limits.MAX_STAGES), help=f"pipeline stages (default: {DEFAULTS['stages']})")
    p.add_argument("--ranks", type=int_arg(1, limits.MAX_STAGES), default=None,
                   help="pipeline ranks; only for interleaved (default: stages / 2)")
    p.add_argument("--microbatch-size", type=int_arg(1, limits.MAX_MICROBATCH_SIZE),
                   help=f"samples per microbatch (default: {DEFAULTS['microbatch_size']})")
    p.add_argument("--microbatches", type=int_arg(1, limits.MAX_MICROBATCHES), help=f"microbatches per iteration (default: {DEFAULTS['microbatches']})")
    p.add_argument("--profile", default=None, help="profile YAML/JSON from `mpress profile` (default: analytic)")
    p.add_argument("--balance", default="compute", choices=["compute", "memory"],
                   help="partition layers to balance compute (PipeDream/DAPPLE default) or memory")
    p.add_argument("--devices", type=int_arg(1, limits.MAX_DEVICES), default=None, help="override the device count (cpu-local)")
    p.add_argument("--device-memory", default=None, help="override device memory, e.g. 2GB (cpu-local)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("emulate", help="memory per stage and an emulated iteration of a pipeline (or a plan)",
                              description=__doc__)
    p.add_argument("plan", nargs="?", default=None,
                   help="a plan from `mpress plan` to re-evaluate (its model, hardware and shape are the defaults)")
    add_pipeline_args(p)
    p.add_argument("--policy", default=None, choices=SwapInPolicy.words(),
                   help="swap-in policy the plan's swap-ins are placed with (default: the plan's)")
    p.add_argument("--trace", type=output_path_arg(), default=None, help="write a Chrome/Perfetto trace JSON of the emulated streams")
    p.add_argument("--plot", type=output_path_arg(), default=None,
                   help="write a PNG of memory per device over time and of each device's peak by category")
    p.add_argument("--map", type=output_path_arg(), default=None,
                   help="with a plan: write a PNG of its stage x layer technique map")
    p.set_defaults(func=run)


def setup_from_args(args: argparse.Namespace, plan: Plan | None = None, profile: Profile | None = None) -> PipelineSetup:
    """Build the `PipelineSetup` the shared pipeline flags describe; flags left unset take
    the plan's values (when a plan is given) or the built-in defaults."""
    def pick(flag: str, from_plan: object) -> object:
        value = getattr(args, flag)
        if value is not None:
            return value
        return from_plan if plan is not None else DEFAULTS[flag]

    memory = parse_bytes(args.device_memory, "--device-memory") if args.device_memory else None
    devices = args.devices
    if plan is not None and args.hardware is None:
        devices = devices if devices is not None else plan.num_devices
        memory = memory if memory is not None else plan.device_memory_bytes
    hardware = load_hardware(str(pick("hardware", plan and plan.hardware)), num_devices=devices, memory_bytes=memory)
    profile = profile or (Profile.load(args.profile) if args.profile else None)  # a profile alone names its model
    model = model_for_profile(args.model or (plan.model if plan is not None else None), profile, DEFAULTS["model"])
    ranks = args.ranks if args.ranks is not None else (plan.num_ranks if plan and plan.schedule is ScheduleName.INTERLEAVED else None)
    return setup_pipeline(
        model, hardware, schedule=pick("schedule", plan and plan.schedule),  # type: ignore[arg-type]
        num_stages=int(pick("stages", plan and plan.num_stages)),  # type: ignore[arg-type]
        num_ranks=ranks,
        microbatch_size=int(pick("microbatch_size", plan and plan.microbatch_size)),  # type: ignore[arg-type]
        num_microbatches=int(pick("microbatches", plan and plan.num_microbatches)),  # type: ignore[arg-type]
        profile=profile, balance=args.balance,
    )


def stage_table(ev: Evaluation) -> Table:
    """Per-stage memory need (model) and emulated peak/stalls."""
    setup, res = ev.setup, ev.result
    stash = setup.schedule.weight_stashing
    t = Table(title=f"{setup.model.name} on {setup.hardware.name}: {setup.schedule.name}, "
                    f"{setup.schedule.num_stages} stages, {setup.schedule.num_microbatches} x {setup.microbatch_size}")
    for col in ["stage", "dev", "layers", "model states", *(["stash"] if stash else []), "activations",
                "need", "capacity", "emulated peak", "busy", "stall"]:
        t.add_column(col, justify="left" if col in ("layers",) else "right")
    names = setup.profile.layer_names()
    for m, (start, end) in zip(setup.memory, setup.ranges):
        rank = setup.schedule.stage_to_rank[m.stage]
        need_style = "green" if m.fits else "bold red"
        t.add_row(
            str(m.stage), str(m.device), f"{names[start]}..{names[end - 1]}" if end - start > 1 else names[start],
            fmt_bytes(m.model_state_bytes), *([fmt_bytes(m.stash_bytes)] if stash else []),
            f"{m.max_in_flight} x {fmt_bytes(m.activation_bytes_per_microbatch)}",
            f"[{need_style}]{fmt_bytes(m.total_bytes)}[/]", fmt_bytes(m.capacity_bytes),
            fmt_bytes(res.peak_bytes[m.device]),
            fmt_seconds(res.busy_s_by_rank[rank]), fmt_seconds(res.stall_s_by_rank[rank]),
        )
    return t


def device_needs(ev: Evaluation) -> dict[int, int]:
    """Memory-model need per device (stages sharing a device, as in interleaved, add up)."""
    needs: dict[int, int] = {}
    for m in ev.setup.memory:
        needs[m.device] = needs.get(m.device, 0) + m.total_bytes
    return needs


def print_summary(console: Console, ev: Evaluation, planned: bool = False) -> None:
    """Headline figures and the verdict: without a plan, the memory model's need decides
    too; with a plan, only the emulated peaks (the plan is what sheds the need)."""
    res, setup = ev.result, ev.setup
    needs = device_needs(ev)
    capacity = setup.hardware.device.memory_bytes
    console.print(
        f"iteration {fmt_seconds(res.iteration_s)}  |  {res.samples_per_s:.3g} samples/s  |  "
        f"{res.model_tflops:.3g} model TFLOP/s  |  memory need, most/least loaded device "
        f"{max(needs.values()) / max(min(needs.values()), 1):.2f}x"
    )
    over = {} if planned else {d: n for d, n in needs.items() if n > capacity}
    oom = [d for d, flag in enumerate(res.oom) if flag]
    if over or oom:
        worst = max(over or {d: res.peak_bytes[d] for d in oom},
                    key=lambda d: max(over.get(d, 0), res.peak_bytes[d]))
        need = max(over.get(worst, 0), res.peak_bytes[worst])
        console.print(f"[bold red]does not fit[/]: {len(set(over) | set(oom))} of {len(needs)} devices exceed "
                      f"device memory (device {worst} needs {fmt_bytes(need)} of {fmt_bytes(capacity)})")
    else:
        console.print("[green]fits[/]: every device is within its memory")


def run(args: argparse.Namespace) -> int:
    console = make_console()
    if args.plan:
        plan = Plan.load(args.plan)
        setup = setup_from_args(args, plan)
        check_plan_for_setup(plan, setup, source=args.plan)
        if args.policy:
            plan = replace(plan, swap_in_policy=args.policy, actions=[])  # the program is placed anew
        ev = evaluate_plan(setup, plan)
        console.print(f"plan {args.plan}: {plan.strategy} strategy, predicted iteration "
                      f"{fmt_seconds(plan.predicted_iteration_s)} when planned")
    else:
        setup = setup_from_args(args)
        ev = evaluate(setup)  # no memory actions: the swap-in policy has nothing to place
    console.print(stage_table(ev))
    print_summary(console, ev, planned=bool(args.plan))
    if args.trace:
        from mpress.static.trace import write_trace
        names = setup.profile.layer_names()
        write_trace(ev.result, args.trace, layer_names=[names[a:b] for a, b in setup.ranges])
        console.print(f"trace written to {args.trace} (open in https://ui.perfetto.dev)")
    strategy = plan.strategy if args.plan else "no compaction"
    what = f"{setup.model.name} on {setup.hardware.name}, {setup.schedule.name}, {strategy}"
    if args.plot:
        from mpress.static.memory_breakdown import peak_breakdown
        from mpress.static.plots import plot_memory
        breakdown = peak_breakdown(ev.result, setup.costs, weight_stashing=setup.schedule.weight_stashing)
        plot_memory(ev.result, args.plot, title=f"memory of {what}, iteration {fmt_seconds(ev.result.iteration_s)}",
                    breakdown=breakdown)
        console.print(f"memory plot written to {args.plot}")
    if args.map:
        if not args.plan:
            raise UserError("--map: needs a plan (mpress emulate PLAN --map map.png); without one every layer is kept")
        from mpress.static.technique_map import plot_technique_map, technique_map
        plot_technique_map(technique_map(plan, setup), args.map, title=f"techniques of {what}")
        console.print(f"technique map written to {args.map}")
    return 0
