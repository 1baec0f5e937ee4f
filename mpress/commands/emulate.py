"""`mpress emulate`: memory per stage and one emulated iteration of a pipeline.

    mpress emulate --model gpt-5.3b --hardware dgx1-v100 --schedule 1f1b \\
        --num-stages 8 --microbatch-size 2 --num-microbatches 16 --trace out/trace.json --plot out/memory.png
    mpress emulate plan.yaml --plot memory.png --map techniques.png
    mpress emulate --model gpt-tiny --hardware cpu-local --json

Flags left unset take a plan's values, else derive from the inputs: one stage per
device, 2 microbatches per rank of microbatch size 1 (the profile's with --profile); the
line `settings: ...` says what was used. --json prints the table's figures and the
verdict as JSON (bytes as integers, times in seconds) instead of the tables.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from mpress.commands.flags import add_command, add_flag
from mpress.commands.pipeline_args import (
    PipelineShape,
    add_pipeline_args,
    cluster_line,
    settings_json,
    settings_line,
    setup_from_args,
)
from mpress.errors import PlanError, UserError
from mpress.contract.plan import Plan
from mpress.config.loader import output_path_arg
from mpress.ui import make_console, print_json
from mpress.config.units import fmt_bytes, fmt_seconds

if TYPE_CHECKING:  # emulation loads torch (the analytic profile): imported when the command runs
    from mpress.static.plan.evaluate import Evaluation


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "emulate", help="memory per stage and an emulated iteration of a pipeline (or a plan)",
                    description=__doc__)
    p.add_argument("plan", nargs="?", default=None,
                   help="a plan from `mpress plan` to re-evaluate (its model, hardware and shape are the defaults)")
    add_pipeline_args(p)
    add_flag(p, "swap_in_policy", default=None,
             help="swap-in policy the plan's swap-ins are placed with (default: the plan's)")
    p.add_argument("--trace", type=output_path_arg(), default=None, help="write a Chrome/Perfetto trace JSON of the emulated streams")
    p.add_argument("--plot", type=output_path_arg(), default=None,
                   help="write a PNG of memory per device over time and of each device's peak by category")
    p.add_argument("--map", type=output_path_arg(), default=None,
                   help="with a plan: write a PNG of its stage x layer technique map")
    add_flag(p, "json")
    p.set_defaults(func=run)


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


@dataclass(frozen=True)
class Verdict:
    """Whether a pipeline fits: without a plan, the memory model's need decides too; with a
    plan, only the emulated peaks (the plan is what sheds the need)."""

    fits: bool
    over: tuple[int, ...]
    """Devices that exceed their memory (need or emulated peak)."""
    worst_device: int | None
    worst_bytes: int
    capacity_bytes: int
    imbalance: float
    """Memory need of the most over the least loaded device."""


def verdict(ev: Evaluation, planned: bool = False) -> Verdict:
    """The verdict `print_summary` prints and `--json` carries."""
    res = ev.result
    needs = device_needs(ev)
    capacity = ev.setup.hardware.device.memory_bytes
    over = {} if planned else {d: n for d, n in needs.items() if n > capacity}
    oom = [d for d, flag in enumerate(res.oom) if flag]
    imbalance = max(needs.values()) / max(min(needs.values()), 1)
    if not (over or oom):
        return Verdict(fits=True, over=(), worst_device=None, worst_bytes=0, capacity_bytes=capacity,
                       imbalance=imbalance)
    worst = max(over or {d: res.peak_bytes[d] for d in oom}, key=lambda d: max(over.get(d, 0), res.peak_bytes[d]))
    return Verdict(fits=False, over=tuple(sorted(set(over) | set(oom))), worst_device=worst,
                   worst_bytes=max(over.get(worst, 0), res.peak_bytes[worst]), capacity_bytes=capacity,
                   imbalance=imbalance)


def print_summary(console: Console, ev: Evaluation, planned: bool = False) -> None:
    """Headline figures and the verdict (`verdict`)."""
    res, v = ev.result, verdict(ev, planned)
    console.print(
        f"iteration {fmt_seconds(res.iteration_s)}  |  {res.samples_per_s:.3g} samples/s  |  "
        f"{res.model_tflops:.3g} model TFLOP/s  |  memory need, most/least loaded device {v.imbalance:.2f}x"
    )
    if v.fits:
        console.print("[green]fits[/]: every device is within its memory")
    else:
        console.print(f"[bold red]does not fit[/]: {len(v.over)} of {len(device_needs(ev))} devices exceed "
                      f"device memory (device {v.worst_device} needs {fmt_bytes(v.worst_bytes)} of "
                      f"{fmt_bytes(v.capacity_bytes)})")


def emulation_json(ev: Evaluation, shape: PipelineShape, planned: bool) -> dict[str, object]:
    """The figures of `stage_table` and `print_summary` (bytes as integers, times in seconds)."""
    setup, res, v = ev.setup, ev.result, verdict(ev, planned)
    names = setup.profile.layer_names()
    stages = []
    for m, (start, end) in zip(setup.memory, setup.ranges):
        rank = setup.schedule.stage_to_rank[m.stage]
        stages.append({
            "stage": m.stage, "device": m.device, "layers": names[start:end],
            "model_state_bytes": m.model_state_bytes, "stash_bytes": m.stash_bytes,
            "max_in_flight": m.max_in_flight, "activation_bytes_per_microbatch": m.activation_bytes_per_microbatch,
            "need_bytes": m.total_bytes, "capacity_bytes": m.capacity_bytes,
            "emulated_peak_bytes": res.peak_bytes[m.device], "busy_s": res.busy_s_by_rank[rank],
            "stall_s": res.stall_s_by_rank[rank]})
    return {"settings": settings_json(setup, shape), "stages": stages, "iteration_s": res.iteration_s,
            "samples_per_s": res.samples_per_s, "model_tflops": res.model_tflops,
            "memory_imbalance": v.imbalance, "fits": v.fits, "devices_over": list(v.over),
            "peak_bytes_by_device": list(res.peak_bytes)}


def run(args: argparse.Namespace) -> int:
    from mpress.static.plan.evaluate import evaluate
    from mpress.static.plan.plan_eval import check_plan_for_setup, evaluate_plan

    console = make_console(stderr=args.json)
    plan: Plan | None = None
    if args.plan:
        plan = Plan.load(args.plan)
        setup, shape = setup_from_args(args, plan)
        check_plan_for_setup(plan, setup, source=args.plan)
        if args.swap_in_policy:
            plan = replace(plan, swap_in_policy=args.swap_in_policy, actions=[])  # the program is placed anew
        try:
            ev = evaluate_plan(setup, plan)
        except PlanError as exc:  # its rules, read against the profile: name the file
            raise PlanError(f"{args.plan}: {exc}") from None
        console.print(f"plan {args.plan}: {plan.strategy} strategy, predicted iteration "
                      f"{fmt_seconds(plan.predicted_iteration_s)} when planned")
    else:
        setup, shape = setup_from_args(args)
        ev = evaluate(setup)  # no memory actions: the swap-in policy has nothing to place
    console.print(settings_line(setup, shape), markup=False, soft_wrap=True)
    if not args.json:
        console.print(stage_table(ev))
        print_summary(console, ev, planned=plan is not None)
        if (line := cluster_line(setup, ev.result)) is not None:
            console.print(line, markup=False, soft_wrap=True)
    written: dict[str, str] = {}
    if args.trace:
        from mpress.static.emulate.trace import write_trace
        names = setup.profile.layer_names()
        write_trace(ev.result, args.trace, layer_names=[names[a:b] for a, b in setup.ranges])
        written["trace"] = args.trace
        console.print(f"trace written to {args.trace} (open in https://ui.perfetto.dev)")
    strategy = plan.strategy if plan is not None else "no compaction"
    what = f"{setup.model.name} on {setup.hardware.name}, {setup.schedule.name}, {strategy}"
    if args.plot:
        from mpress.static.emulate.breakdown import peak_breakdown
        from mpress.static.studies.plots import plot_memory
        breakdown = peak_breakdown(ev.result, setup.costs, weight_stashing=setup.schedule.weight_stashing)
        plot_memory(ev.result, args.plot, title=f"memory of {what}, iteration {fmt_seconds(ev.result.iteration_s)}",
                    breakdown=breakdown)
        written["plot"] = args.plot
        console.print(f"memory plot written to {args.plot}")
    if args.map:
        if plan is None:
            raise UserError("--map: needs a plan (mpress emulate PLAN --map map.png); without one every layer is kept")
        from mpress.static.studies.technique_map import plot_technique_map, technique_map
        plot_technique_map(technique_map(plan, setup), args.map, title=f"techniques of {what}")
        written["map"] = args.map
        console.print(f"technique map written to {args.map}")
    if args.json:
        print_json({**emulation_json(ev, shape, planned=plan is not None), "plan": args.plan,
                    "strategy": str(strategy), "files": written})
    return 0
