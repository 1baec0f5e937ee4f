"""Benchmark: the largest model on one server, mpress against ZeRO, per memory tier (issue 33).

Per server (dgx1-v100, dgx-a100, hgx-h100 by default) and family (gpt, bert, llama),
everything computed in this run by the static half (`maxsize.find_max_size`, the search
`mpress maxsize` runs, with its default shape: 1F1B, one stage per device, 2
microbatches per rank of 1 sample, the family's presets' precision):

  - the host tier: the largest model mpress fits (optimizer data, parameters and
    gradients may go to pinned host memory) beside ZeRO-Offload's and ZeRO-Infinity's;
  - the NVMe tier, where the server states drives: mpress-nvme (mpress with optimizer
    data on the drive where the host cannot pin it) beside ZeRO-Infinity-NVMe;
  - speed at equal size: each baseline's largest model, where mpress fits it too, planned
    by mpress (`plan_strategy`, the full search) and emulated; "x" is the baseline's
    iteration over mpress's (> 1: mpress faster);
  - per tier a verdict on the issue's goal: mpress's largest >= every baseline's of the
    tier, and mpress faster at each baseline's largest size.

Each search stops trying larger sizes after --time-budget seconds; a row bound by
"time" is a lower bound (and its verdict says so). The default run searches 39 times;
with the 60 s budget it takes about 25 minutes on the 2-core development machine.

Usage: PYTHONPATH=. python3 bench/largest.py [--hardware dgx-a100,...] [--families gpt,bert]
       [--time-budget 60] [--json]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from rich.table import Table

from mpress.config.units import fmt_seconds
from mpress.config.vocabulary import MPRESS_NVME, ScheduleName, Strategy
from mpress.errors import UserError
from mpress.hardware.server import Hardware, load_hardware
from mpress.static.baselines.zero import ZERO_INFINITY, ZERO_INFINITY_NVME, ZERO_OFFLOAD
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.planner import plan_strategy
from mpress.static.studies.maxsize import Bound, MaxSize, find_max_size
from mpress.ui import TaskProgress, make_console, print_json

SERVERS = "dgx1-v100,dgx-a100,hgx-h100"
FAMILIES = "gpt,bert,llama"
TIERS = {"host": (Strategy.MPRESS.value, (ZERO_OFFLOAD, ZERO_INFINITY)),
         "nvme": (MPRESS_NVME, (ZERO_INFINITY_NVME,))}
"""Per tier: mpress's strategy and the ZeRO baselines it is held against."""


@dataclass
class Case:
    hardware: Hardware
    family: str
    rows: dict[str, MaxSize] = field(default_factory=dict)
    skipped: str = ""
    """Why the case was not searched (the family cannot train on the server)."""
    speed: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    """Per baseline: (its iteration, mpress's) at the baseline's largest model; None:
    mpress does not fit it (or the baseline fits nothing)."""

    def shape(self) -> dict:
        n = self.hardware.num_devices
        return {"schedule": ScheduleName.ONE_F_ONE_B, "num_stages": n, "microbatch_size": 1, "num_microbatches": 2 * n}

    def tiers(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        return {t: v for t, v in TIERS.items() if t == "host" or self.hardware.has_nvme}

    def verdict(self, tier: str) -> str:
        ours, theirs = self.tiers()[tier]
        mine = self.rows[ours]
        lower = " (a lower bound: out of time)" if mine.bound is Bound.TIME else ""
        beaten = [z for z in theirs if self.rows[z].num_parameters > mine.num_parameters]
        judged = [z for z in theirs if self.speed.get(z) is not None]
        slower = [z for z in judged if self.speed[z][1] > self.speed[z][0]]  # type: ignore[index]
        size = ("met" if not beaten else f"not met: {', '.join(beaten)} fit larger") + lower
        if not judged:
            return f"size {size}; speed not judged (mpress fits no baseline's largest model)"
        speed = "met" if not slower else f"not met: slower than {', '.join(slower)} at its largest size"
        return f"size {size}; speed {speed} at {len(judged)} of {len(theirs)} baselines' largest models"


def search(case: Case, budget: float, progress: TaskProgress) -> None:
    for ours, theirs in case.tiers().values():
        for strategy in (ours, *theirs):
            progress.update(f"{case.hardware.name} {case.family}: searching {strategy}")
            try:
                case.rows[strategy] = find_max_size(case.family, case.hardware, strategy, **case.shape(),
                                                    time_budget_s=budget, progress=progress.update)
            except UserError as exc:  # e.g. a bf16 family on a server without bf16
                case.skipped, case.rows = str(exc), {}
                progress.advance(f"{case.hardware.name} {case.family}: not searched: {exc}")
                return
            row = case.rows[strategy]
            progress.advance(f"{case.hardware.name} {case.family} {strategy}: "
                             f"{row.model.name if row.model else 'none'} ({row.bound})")
        mine = case.rows[ours]
        for z in theirs:
            base = case.rows[z]
            case.speed[z] = None
            if base.model is None or base.baseline is None or mine.num_parameters < base.num_parameters:
                continue
            progress.update(f"{case.hardware.name} {case.family}: mpress on {base.model.name}")
            plan = plan_strategy(setup_pipeline(base.model, case.hardware, **case.shape()), Strategy.MPRESS)
            if plan.fits:
                case.speed[z] = (base.baseline.iteration_s, plan.evaluation.result.iteration_s)


def table(cases: list[Case], budget: float) -> Table:
    t = Table(title=f"largest model per tier, mpress against ZeRO (emulated; each search stops after {budget:g} s)")
    for col in ("server", "family", "tier", "strategy", "largest", "params", "bound", "iteration",
                "baseline / mpress at its size"):
        t.add_column(col, justify="right" if col in ("params", "iteration", "baseline / mpress at its size")
                     else "left")
    for c in cases:
        if c.skipped:
            t.add_row(c.hardware.name, c.family, "-", "-", "not searched", "", "", "", "")
            continue
        for tier, (ours, theirs) in c.tiers().items():
            for strategy in (ours, *theirs):
                r = c.rows[strategy]
                it = (r.result.evaluation.result.iteration_s if r.result is not None and r.result.fits else
                      r.baseline.iteration_s if r.baseline is not None else None)
                s = c.speed.get(strategy)
                ratio = "" if strategy == ours else "-" if s is None else f"{s[0] / s[1]:.2f}x"
                t.add_row(c.hardware.name, c.family, tier, strategy, r.model.name if r.model else "none",
                          f"{r.num_parameters / 1e9:.2f} B", str(r.bound), fmt_seconds(it) if it else "-", ratio)
    return t


def to_json(cases: list[Case], budget: float, elapsed: float) -> dict:
    return {"time_budget_s": budget, "elapsed_s": elapsed, "cases": [
        {"hardware": c.hardware.name, "family": c.family, "skipped": c.skipped or None,
         "rows": {k: {"model": r.model.name if r.model else None, "num_parameters": r.num_parameters,
                      "bound": str(r.bound), "bound_detail": r.bound_detail} for k, r in c.rows.items()},
         "speed": {k: None if s is None else {"baseline_iteration_s": s[0], "mpress_iteration_s": s[1]}
                   for k, s in c.speed.items()},
         "verdicts": {} if c.skipped else {tier: c.verdict(tier) for tier in c.tiers()}} for c in cases]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default=SERVERS)
    ap.add_argument("--families", default=FAMILIES)
    ap.add_argument("--time-budget", type=float, default=60.0, help="seconds per search (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON on stdout instead of the table")
    args = ap.parse_args()
    console = make_console(stderr=args.json)
    cases = [Case(load_hardware(h), f) for h in args.hardware.split(",") for f in args.families.split(",")]
    t0 = time.perf_counter()
    searches = sum(1 + len(theirs) for c in cases for _ours, theirs in c.tiers().values())
    with TaskProgress(console, searches, "largest models") as progress:
        for c in cases:
            search(c, args.time_budget, progress)
    elapsed = time.perf_counter() - t0
    if args.json:
        print_json(to_json(cases, args.time_budget, elapsed))
        return
    console.print(table(cases, args.time_budget))
    for c in cases:
        if c.skipped:
            console.print(f"{c.hardware.name} {c.family}: not searched: {c.skipped}", markup=False, soft_wrap=True)
            continue
        for tier in c.tiers():
            console.print(f"{c.hardware.name} {c.family} {tier} tier: {c.verdict(tier)}", markup=False, soft_wrap=True)
        for strategy, r in c.rows.items():
            if r.bound_detail:
                console.print(f"{c.hardware.name} {c.family} {strategy}: bound by {r.bound}: {r.bound_detail}",
                              markup=False, soft_wrap=True)
    console.print(f"(ran in {elapsed:.0f} s)")


if __name__ == "__main__":
    main()
