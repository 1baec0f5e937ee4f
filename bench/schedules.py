"""Benchmark: mpress under the pipeline schedules, against the ZeRO baselines, emulated.

Per model (default: GPT-20.4B and Llama-2-70B, and the MPress paper's Bert-6.2B and
GPT-25.5B, all on dgx-a100) and per schedule (1F1B, interleaved 1F1B, ZB-H1 =
torch's interleaved zero bubble with one stage per rank, ZB-V, DualPipeV), everything
computed in this run by the static half:

  - plain: the schedule without memory actions (`evaluate`): iteration and peak (the
    peak may exceed the device: plain does not fit then);
  - mpress: the mpress strategy's plan under that schedule (`plan_strategy`), its
    emulated iteration and peak, or why it does not fit;
  - ratios: mpress-under-1F1B's iteration over this one ("x 1F1B": > 1 is faster), and
    the fastest fitting ZeRO baseline's iteration over this one ("x ZeRO": > 1 is mpress
    faster);
  - the ZeRO baselines (`zero.plan_zero`, every variant the server supports) on the
    same model, global batch and server, one row each;
  - per model, a verdict on each of issue 32's goals, from the table's rows (`verdicts`):
    the fastest fitting mpress schedule at least `SPEEDUP_GOAL` x mpress-under-1F1B
    where 1F1B has a bubble, and no slower than the fastest fitting ZeRO baseline.

Shapes: 8 ranks (one per GPU); one stage per rank for 1F1B and ZB-H1, two for the
others (interleaved's stages round-robin, the V schedules' in a V); the same layers,
microbatch size and microbatches per iteration (16 by default, each setting's) for all.
A model of a setting (the paper's) trains in the setting's precision and microbatch
size; the others in their preset's precision with microbatch 2.

Usage: PYTHONPATH=. python3 bench/schedules.py [--models gpt-20.4b,llama-2-70b,...]
       [--hardware dgx-a100] [--schedules 1f1b,zbv] [--microbatches 16] [--json]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

from rich.table import Table

from mpress.config.model_config import ModelConfig, load_model_config
from mpress.config.settings import load_setting
from mpress.config.units import fmt_bytes, fmt_seconds
from mpress.config.vocabulary import ScheduleName, Strategy
from mpress.errors import UserError
from mpress.hardware.server import Hardware, load_hardware
from mpress.static.baselines.zero import plan_zero, zero_variants
from mpress.static.plan.evaluate import evaluate, setup_pipeline
from mpress.static.plan.planner import plan_strategy
from mpress.ui import TaskProgress, make_console, print_json

NUM_RANKS = 8
SCHEDULES: dict[str, tuple[ScheduleName, int]] = {
    "1F1B": (ScheduleName.ONE_F_ONE_B, 1),
    "interleaved": (ScheduleName.INTERLEAVED, 2),
    "ZB-H1": (ScheduleName.INTERLEAVED_ZB, 1),
    "ZB-V": (ScheduleName.ZBV, 2),
    "DualPipeV": (ScheduleName.DUALPIPEV, 2),
}
"""Row label -> (schedule, stages per rank)."""
SETTING_OF = {"bert-6.2b": "paper-bert", "gpt-25.5b": "paper-gpt", "gpt-20.4b": "paper-gpt"}
"""Models trained as a paper setting trains them (precision, microbatch size)."""
DEFAULT_MODELS = "gpt-20.4b,llama-2-70b,bert-6.2b,gpt-25.5b"
DEFAULT_MICROBATCH_SIZE = 2
SPEEDUP_GOAL = 1.15
"""The best mpress schedule over mpress under 1F1B that issue 32 asks for where a bubble exists."""


@dataclass
class Row:
    model: str
    schedule: str
    fits: bool
    reason: str
    iteration_s: float
    peak_bytes: int
    plain_iteration_s: float
    plain_peak_bytes: int
    plan_s: float
    vs_1f1b: float = math.nan
    vs_zero: float = math.nan


@dataclass
class ZeroRow:
    model: str
    variant: str
    fits: bool
    reason: str
    iteration_s: float
    peak_bytes: int


def model_for(name: str) -> tuple[ModelConfig, int]:
    """The model as the bench trains it, and its microbatch size (module docstring)."""
    cfg = load_model_config(name)
    setting = SETTING_OF.get(name)
    if setting is None:
        return cfg, DEFAULT_MICROBATCH_SIZE
    s = load_setting(setting)
    return s.apply(cfg), s.microbatch_size


def run_case(name: str, hw: Hardware, labels: list[str], microbatches: int,
             progress: TaskProgress) -> tuple[list[Row], list[ZeroRow]]:
    cfg, mb = model_for(name)
    rows: list[Row] = []
    zero: list[ZeroRow] = []
    for label in labels:
        schedule, per_rank = SCHEDULES[label]
        progress.update(f"{name} {label}: planning", say=True)
        start = time.perf_counter()
        try:
            setup = setup_pipeline(cfg, hw, schedule=schedule, num_stages=NUM_RANKS * per_rank, microbatch_size=mb,
                                   num_microbatches=microbatches,
                                   num_ranks=None if schedule in (ScheduleName.ONE_F_ONE_B, ScheduleName.ZBV,
                                                                  ScheduleName.DUALPIPEV) else NUM_RANKS)
        except UserError as e:
            rows.append(Row(name, label, False, str(e), math.nan, 0, math.nan, 0, 0.0))
            progress.advance(f"{name} {label}: {e}")
            continue
        plain = evaluate(setup).result
        plan = plan_strategy(setup, Strategy.MPRESS)
        res = plan.evaluation.result
        rows.append(Row(name, label, plan.fits, plan.reason, res.iteration_s if plan.fits else math.nan,
                        max(res.peak_bytes), plain.iteration_s, max(plain.peak_bytes), time.perf_counter() - start))
        if label == "1F1B":
            zero = [ZeroRow(name, z, b.fits, b.reason, b.iteration_s if b.fits else math.nan, b.peak_bytes)
                    for z in zero_variants(hw) for b in [plan_zero(setup, z)]]
        progress.advance(f"{name} {label}: {'fits' if plan.fits else 'does not fit'}")
    base = next((r.iteration_s for r in rows if r.schedule == "1F1B"), math.nan)
    best_zero = min((z.iteration_s for z in zero if z.fits), default=math.nan)
    for r in rows:
        r.vs_1f1b = base / r.iteration_s
        r.vs_zero = best_zero / r.iteration_s
    return rows, zero


def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}x"


def _time(x: float) -> str:
    return "-" if math.isnan(x) else fmt_seconds(x)


def table(hw: Hardware, rows: list[Row], zero: list[ZeroRow]) -> Table:
    t = Table(title=f"mpress under each schedule vs ZeRO, emulated on {hw.name} ({NUM_RANKS} GPUs, "
                    f"{fmt_bytes(hw.usable_memory_bytes)} usable each)")
    for col in ("model", "schedule", "plain iter", "plain peak", "mpress iter", "mpress peak",
                "x 1F1B", "x ZeRO", "note"):
        t.add_column(col, justify="left" if col in ("model", "schedule", "note") else "right")
    models = list(dict.fromkeys(r.model for r in rows))
    for m in models:
        mine = [r for r in rows if r.model == m]
        best = min((r.iteration_s for r in mine if r.fits), default=math.nan)
        for r in mine:
            star = " *" if r.iteration_s == best else ""
            t.add_row(m, r.schedule, _time(r.plain_iteration_s), fmt_bytes(r.plain_peak_bytes),
                      _time(r.iteration_s) + star, fmt_bytes(r.peak_bytes) if r.fits else "-",
                      _ratio(r.vs_1f1b), _ratio(r.vs_zero),
                      r.reason[:90] if not r.fits else f"planned in {r.plan_s:.1f} s")
        for z in (z for z in zero if z.model == m):
            t.add_row(m, z.variant, "", "", _time(z.iteration_s), fmt_bytes(z.peak_bytes) if z.fits else "-",
                      "", "", z.reason[:90] if not z.fits else "ZeRO baseline", style="dim")
        t.add_section()
    return t


def bubble_fraction(microbatches: int) -> float:
    """The idle share of a stage's slots under 1F1B with one stage per rank ((p-1)/(m+p-1));
    above 0 with `NUM_RANKS` > 1, so the speedup goal always applies."""
    return (NUM_RANKS - 1) / (microbatches + NUM_RANKS - 1)


def verdicts(rows: list[Row], zero: list[ZeroRow], microbatches: int) -> list[str]:
    """Per model, one line per goal (module docstring), each met / not met with its ratio,
    or why it cannot be judged; computed from the rows alone."""
    out = []
    bubble = bubble_fraction(microbatches)
    for m in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == m and r.fits]
        best = min(mine, key=lambda r: r.iteration_s, default=None)
        base = next((r for r in mine if r.schedule == "1F1B"), None)
        if best is None:
            out.append(f"{m}: speedup goal: not judged (no mpress schedule fits)")
        elif base is None:
            out.append(f"{m}: speedup goal: not judged (mpress under 1F1B does not fit or was not run)")
        else:  # the ratios are the table's (`Row.vs_1f1b`, `Row.vs_zero`)
            met = "met" if best.vs_1f1b >= SPEEDUP_GOAL else "not met"
            out.append(f"{m}: speedup goal: {met}: best mpress schedule {best.schedule} is {best.vs_1f1b:.2f}x "
                       f"mpress under 1F1B (goal >= {SPEEDUP_GOAL:.2f}x; 1F1B bubble {bubble:.0%} of the slots)")
        fitting = [z for z in zero if z.model == m and z.fits]
        if best is None or not fitting:
            what = "no mpress schedule fits" if best is None else "no ZeRO baseline fits"
            out.append(f"{m}: ZeRO goal: not judged ({what})")
            continue
        fastest = min(fitting, key=lambda z: z.iteration_s)
        met = "met" if best.vs_zero >= 1.0 else "not met"
        out.append(f"{m}: ZeRO goal: {met}: best mpress schedule {best.schedule} is {best.vs_zero:.2f}x the fastest "
                   f"fitting ZeRO baseline {fastest.variant} (goal >= 1.00x; {len(fitting)} of "
                   f"{sum(z.model == m for z in zero)} baselines fit)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--hardware", default="dgx-a100")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"of {', '.join(SCHEDULES)}")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    labels = args.schedules.split(",")
    unknown = [x for x in labels if x not in SCHEDULES]
    if unknown:
        raise SystemExit(f"--schedules: unknown {', '.join(unknown)} (allowed: {', '.join(SCHEDULES)})")
    hw = load_hardware(args.hardware)
    models = args.models.split(",")
    console = make_console(stderr=args.json)
    rows: list[Row] = []
    zero: list[ZeroRow] = []
    with TaskProgress(console, len(models) * len(labels), "schedules", keep=False) as progress:
        for name in models:
            r, z = run_case(name, hw, labels, args.microbatches, progress)
            rows += r
            zero += z
    if args.json:
        print_json({"hardware": hw.name, "rows": [r.__dict__ for r in rows], "zero": [z.__dict__ for z in zero],
                    "verdicts": verdicts(rows, zero, args.microbatches)})
        return
    console.print(table(hw, rows, zero))
    console.print("x 1F1B: mpress-under-1F1B's iteration / this one; x ZeRO: the fastest fitting ZeRO "
                  "baseline's iteration / this one; *: the fastest mpress schedule of the model.")
    for line in verdicts(rows, zero, args.microbatches):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


if __name__ == "__main__":
    main()
