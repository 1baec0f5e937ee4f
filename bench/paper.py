"""Benchmark: the MPress paper's setting (HPCA 2023; PAPERS.md section 1), five tables.

The setting comes from the setting presets (configs/settings/paper-bert.yaml: Bert under
PipeDream, fp32, microbatch 12; paper-gpt.yaml: GPT under DAPPLE's 1F1B, fp16 mixed,
microbatch 2; both 8 stages, 16 microbatches, on dgx1-v100 and dgx-a100). Everything is
computed in this run by the static half:

  a. per-stage memory demand without compaction (`StageMemory.total_bytes`): total over
     the 8 stages, max, min and max/min, per model and server;
  b. the mpress plan's saved bytes by technique (`PlanResult.saved_bytes`, summed over
     stages): recompute / host / d2d shares;
  c. the largest model of the family each strategy fits (`maxsize.find_max_size`), for
     every planner strategy and every ZeRO baseline the server supports, in the
     setting's precision, each search bounded by --time-budget seconds (a row bound by
     "time" is a lower bound);
  d. mpress's speedup over each baseline at equal model size: the baseline's emulated
     iteration over mpress's ("x": the baseline does not fit that model; "-": mpress
     does not); the baselines are the planner strategies (`Strategy`, less none and
     mpress) and the ZeRO baselines (`zero.plan_zero`);
  e. the ablations of the mpress plan (`ablation.ablate`: without D2D, identity device
     mapping, one peer per stage) and the slowdown of each.

Models (tables a, b, d, e): per setting and server, the paper's preset sizes that matter,
the largest preset each strategy of table c (but none) fits, by parameters: the distinct
picks no larger than mpress's, at most --max-models of them (mpress's, then those most
strategies pick, ties to the smaller); --models overrides the pick.

The default run takes about 5 minutes on the 2-core development machine (280 s alone,
366 s beside other work); no search reached its 60 s budget there, and the largest
planning of a case is under 20 s. The emulated PipeDream window keeps one fill/drain
bubble that PipeDream's steady state (no flush) does not have: with 16 microbatches on 8
stages its iterations are up to (S-1)/(M+S-1) = 30% longer than the steady state's
(`schedules.pipedream`), which table d's Bert ratios inherit.

Usage: PYTHONPATH=. python3 bench/paper.py [--settings paper-bert,paper-gpt] [--hardware dgx1-v100,dgx-a100]
       [--models bert-4b,gpt-20.4b] [--max-models 3] [--time-budget 60] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field

from rich.table import Table

from mpress.hardware.server import Hardware, load_hardware
from mpress.config.model_config import load_model_config
from mpress.models import num_parameters
from mpress.config.settings import Setting, load_setting
from mpress.static.studies.ablation import Ablation, ablate
from mpress.static.plan.evaluate import PipelineSetup, setup_pipeline
from mpress.static.studies.maxsize import MaxSize, find_max_size
from mpress.static.plan.planner import PlanResult, plan_strategy
from mpress.static.baselines.zero import BaselineResult, plan_zero, zero_variants
from mpress.ui import TaskProgress, make_console, print_json
from mpress.config.units import fmt_bytes, fmt_seconds
from mpress.config.vocabulary import Strategy, Technique

COMPACTING = (Technique.RECOMPUTE, Technique.HOST, Technique.D2D)


@dataclass
class Case:
    """One model of a setting on one server, planned by every strategy and baseline."""

    setting: Setting
    model: str
    setup: PipelineSetup
    plans: dict[str, PlanResult]
    baselines: dict[str, BaselineResult]
    ablations: list[Ablation]

    @property
    def mpress(self) -> PlanResult:
        return self.plans[Strategy.MPRESS.value]


@dataclass
class Server:
    """One setting on one server: its largest-model searches and its cases."""

    setting: Setting
    hardware: Hardware
    maxsize: list[MaxSize] = field(default_factory=list)
    cases: list[Case] = field(default_factory=list)


def baseline_names(hw: Hardware) -> list[str]:
    """Planner strategies other than none and mpress, then the server's ZeRO baselines."""
    planner = [s for s in Strategy.words() if s not in (Strategy.NONE.value, Strategy.MPRESS.value)]
    return planner + list(zero_variants(hw))


def searched_names(hw: Hardware) -> list[str]:
    """Table c's rows: every planner strategy, then the server's ZeRO baselines."""
    return list(Strategy.words()) + list(zero_variants(hw))


def pick_models(setting: Setting, rows: list[MaxSize], limit: int) -> list[str]:
    """Per strategy other than none, the largest preset of the setting no larger than the
    strategy's largest model (the size at which it stops fitting); of these picks, the
    ones no larger than mpress's, at most `limit`: mpress's, then those most strategies
    pick (ties: the smaller, where more baselines fit); smallest first."""
    sizes = {m: num_parameters(load_model_config(m)) for m in setting.models}
    votes: dict[str, int] = {}
    mine = None
    for r in rows:
        if r.strategy == Strategy.NONE.value or r.model is None:
            continue
        fitting = [m for m in setting.models if sizes[m] <= r.num_parameters]
        if not fitting:
            continue
        pick = max(fitting, key=sizes.__getitem__)
        votes[pick] = votes.get(pick, 0) + 1
        if r.strategy == Strategy.MPRESS.value:
            mine = pick
    picks = [m for m in votes if mine is None or sizes[m] <= sizes[mine]]
    ranked = ([mine] if mine is not None else []) + sorted(
        (m for m in picks if m != mine), key=lambda m: (-votes[m], sizes[m]))
    return sorted(ranked[:limit], key=sizes.__getitem__)


def make_setup(setting: Setting, model: str, hw: Hardware) -> PipelineSetup:
    return setup_pipeline(setting.apply(load_model_config(model)), hw, schedule=setting.schedule,
                          num_stages=setting.num_stages, microbatch_size=setting.microbatch_size,
                          num_microbatches=setting.num_microbatches)


def run_case(setting: Setting, model: str, hw: Hardware, progress: TaskProgress) -> Case:
    setup = make_setup(setting, model, hw)
    plans = {}
    for s in Strategy.words():
        progress.update(f"{setting.name} {hw.name} {model}: planning {s}")
        plans[s] = plan_strategy(setup, s)
    baselines = {z: plan_zero(setup, z) for z in zero_variants(hw)}
    progress.update(f"{setting.name} {hw.name} {model}: ablations")
    mp = plans[Strategy.MPRESS.value]
    ablations = ablate(setup, mp) if mp.fits else []
    return Case(setting=setting, model=model, setup=setup, plans=plans, baselines=baselines, ablations=ablations)


# ---- tables -------------------------------------------------------------------------

def demand_table(servers: list[Server]) -> Table:
    t = Table(title="a. per-stage memory demand without compaction (StageMemory.total_bytes; usable = what "
                    "plans may fill)")
    for col in ["server", "model", "precision", "total", "max stage", "min stage", "max / min",
                "usable per GPU", "stages over"]:
        t.add_column(col, justify="left" if col in ("server", "model") else "right")
    for sv in servers:
        for c in sv.cases:
            need = [m.total_bytes for m in c.setup.memory]
            hi, lo = max(need), min(need)
            usable = sv.hardware.usable_memory_bytes
            over = sum(n > usable for n in need)
            t.add_row(sv.hardware.name, c.model, c.setup.model.precision, fmt_bytes(sum(need)),
                      f"{fmt_bytes(hi)} (s{need.index(hi)})", f"{fmt_bytes(lo)} (s{need.index(lo)})",
                      f"{hi / lo:.2f}", fmt_bytes(usable), f"{over} of {len(need)}")
    return t


def saved_by_technique(r: PlanResult) -> dict[str, int]:
    return {str(tech): sum(stage.get(tech, 0) for stage in r.saved_bytes) for tech in COMPACTING}


def saved_table(servers: list[Server]) -> Table:
    t = Table(title="b. memory the mpress plan saves, by technique (PlanResult.saved_bytes, summed over stages)")
    for col in ["server", "model", "fits", "saved", *map(str, COMPACTING), "pinned host"]:
        t.add_column(col, justify="left" if col in ("server", "model") else "right")
    for sv in servers:
        for c in sv.cases:
            saved = saved_by_technique(c.mpress)
            total = sum(saved.values())
            shares = [f"{fmt_bytes(b)} ({100 * b / total:.0f}%)" if b else "-" for b in saved.values()]
            t.add_row(sv.hardware.name, c.model, "yes" if c.mpress.fits else "[red]no[/]",
                      fmt_bytes(total), *shares, fmt_bytes(c.mpress.host_bytes))
    return t


def maxsize_table(servers: list[Server], budget_s: float) -> Table:
    t = Table(title=f"c. largest model per strategy (maxsize.find_max_size; each search stops trying larger "
                    f"sizes after {budget_s:g} s: a 'time' bound is a lower bound)")
    for col in ["server", "strategy", "largest model", "parameters", "iteration", "size / mpress",
                "bound"]:
        t.add_column(col, justify="left" if col in ("server", "strategy", "largest model") else "right")
    for sv in servers:
        ref = next((r for r in sv.maxsize if r.strategy == Strategy.MPRESS.value and r.model), None)
        for r in sv.maxsize:
            if r.model is None:
                t.add_row(sv.hardware.name, r.strategy, "[red]nothing fits[/]", "-", "-", "-",
                          r.bound.value if r.bound else "-")
                continue
            t.add_row(sv.hardware.name, r.strategy, r.model.name,
                      f"{r.num_parameters / 1e9:.2f} B", fmt_seconds(r.iteration_s),
                      f"{r.num_parameters / ref.num_parameters:.2f}x" if ref else "-",
                      r.bound.value if r.bound else "-")
    return t


def baseline_iteration(c: Case, name: str) -> tuple[bool, float]:
    """(fits, iteration) of a baseline of the case: a planner strategy or a ZeRO variant."""
    if name in c.plans:
        r = c.plans[name]
        return r.fits, r.evaluation.result.iteration_s
    b = c.baselines[name]
    return b.fits, b.iteration_s


def speedup(c: Case, name: str) -> float | None:
    """Baseline iteration / mpress iteration; None where either does not fit."""
    fits, it = baseline_iteration(c, name)
    if not (fits and c.mpress.fits) or not math.isfinite(it):
        return None
    return it / c.mpress.evaluation.result.iteration_s


def speedup_table(servers: list[Server]) -> Table:
    names = list(dict.fromkeys(n for sv in servers for n in baseline_names(sv.hardware)))
    t = Table(title="d. mpress speedup at equal model size: baseline iteration / mpress iteration "
                    "(x: the baseline does not fit; -: mpress does not fit)")
    for col in ["server", "model", "mpress iteration", *names]:
        t.add_column(col, justify="left" if col in ("server", "model") else "right")
    for sv in servers:
        for c in sv.cases:
            cells = []
            for n in names:
                if n not in c.plans and n not in c.baselines:
                    cells.append("n/a")  # a ZeRO variant this server has no drives for
                    continue
                ratio = speedup(c, n)
                cells.append(f"{ratio:.2f}" if ratio is not None else "-" if not c.mpress.fits else "x")
            it = c.mpress.evaluation.result.iteration_s
            t.add_row(sv.hardware.name, c.model, fmt_seconds(it) if c.mpress.fits else "no fit",
                      *cells)
    return t


def ablation_table(servers: list[Server]) -> Table:
    t = Table(title="e. ablations of the mpress plan (ablation.ablate): iteration and slowdown over the plan")
    variants = ["without D2D (host swap instead)", "identity device mapping", "one peer per stage (no striping)"]
    for col in ["server", "model", "plan", "D2D saved", *variants]:
        t.add_column(col, justify="left" if col in ("server", "model") else "right")
    for sv in servers:
        for c in sv.cases:
            base = c.mpress.evaluation.result.iteration_s
            d2d = saved_by_technique(c.mpress)[str(Technique.D2D)]
            by_name = {a.name: a for a in c.ablations}
            cells = []
            for v in variants:
                a = by_name.get(v)
                if a is None:
                    cells.append("no D2D" if c.mpress.fits else "-")
                else:
                    left = f", {fmt_bytes(a.unplaced_bytes)} left on device" if a.unplaced_bytes else ""
                    cells.append(f"{fmt_seconds(a.iteration_s)} ({a.iteration_s / base:.3f}x{left})"
                                 + ("" if a.fits else " [red]OOM[/]"))
            t.add_row(sv.hardware.name, c.model,
                      fmt_seconds(base) if c.mpress.fits else "no fit", fmt_bytes(d2d), *cells)
    return t


def d2d_lines(servers: list[Server]) -> list[str]:
    """Per case whose mpress plan uses D2D: each stage's device and the peers its stripes
    go to (what the ablations take away)."""
    lines = []
    for sv in servers:
        for c in sv.cases:
            if not c.ablations:
                continue
            stages = [f"s{sp.stage}@{sp.device}" + (f"->{','.join(map(str, peers))}" if peers else "")
                      for sp, peers in zip(c.mpress.plan.stages, c.mpress.peers)]
            lines.append(f"{sv.hardware.name} {c.model}: mpress stage@device->D2D peers: {' '.join(stages)}")
    return lines


# ---- JSON ---------------------------------------------------------------------------

def to_json(servers: list[Server], budget_s: float, elapsed_s: float) -> dict[str, object]:
    out = []
    for sv in servers:
        cases = []
        for c in sv.cases:
            cases.append({
                "model": c.model, "precision": c.setup.model.precision,
                "stage_need_bytes": [m.total_bytes for m in c.setup.memory],
                "mpress": {"fits": c.mpress.fits, "iteration_s": c.mpress.evaluation.result.iteration_s,
                           "saved_bytes_by_stage": [{str(k): v for k, v in s.items()} for s in c.mpress.saved_bytes],
                           "saved_bytes": saved_by_technique(c.mpress), "pinned_host_bytes": c.mpress.host_bytes},
                "baselines": {n: {"fits": baseline_iteration(c, n)[0], "iteration_s": baseline_iteration(c, n)[1],
                                  "speedup": speedup(c, n)} for n in baseline_names(sv.hardware)},
                "stage_to_device": [sp.device for sp in c.mpress.plan.stages],
                "d2d_peers": [list(p) for p in c.mpress.peers],
                "ablations": [{"variant": a.name, "fits": a.fits, "iteration_s": a.iteration_s,
                               "slowdown": a.iteration_s / c.mpress.evaluation.result.iteration_s,
                               "unplaced_bytes": a.unplaced_bytes} for a in c.ablations],
            })
        out.append({
            "setting": sv.setting.name, "hardware": sv.hardware.name,
            "maxsize": [{"strategy": r.strategy, "largest_model": r.model.name if r.model else None,
                         "num_parameters": r.num_parameters if r.model else None,
                         "iteration_s": r.iteration_s if r.model else None,
                         "bound": r.bound.value if r.bound else None, "bound_detail": r.bound_detail}
                        for r in sv.maxsize],
            "cases": cases})
    return {"time_budget_s": budget_s, "elapsed_s": elapsed_s, "servers": out}


# ---- main ---------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="paper-bert,paper-gpt", help="setting presets (default: %(default)s)")
    ap.add_argument("--hardware", default=None, help="servers (default: each setting's own list)")
    ap.add_argument("--models", default=None,
                    help="model presets for tables a, b, d, e (default: picked from table c, see above)")
    ap.add_argument("--max-models", type=int, default=3, help="models per setting and server (default: %(default)s)")
    ap.add_argument("--time-budget", type=float, default=60.0,
                    help="seconds per largest-model search before it stops trying larger sizes "
                         "(default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="1 model per setting and server, 15 s per search")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON on stdout instead of the tables")
    args = ap.parse_args()
    if args.quick:
        args.max_models, args.time_budget = 1, 15.0
    console = make_console(stderr=args.json)
    t0 = time.perf_counter()
    servers = []
    for name in args.settings.split(","):
        setting = load_setting(name)
        for hw_name in (args.hardware.split(",") if args.hardware else setting.hardware):
            servers.append(Server(setting=setting, hardware=load_hardware(hw_name)))
    searches = sum(len(searched_names(sv.hardware)) for sv in servers)
    with TaskProgress(console, searches, "largest models") as progress:
        for sv in servers:
            s = sv.setting
            for strategy in searched_names(sv.hardware):
                progress.update(f"{s.name} {sv.hardware.name}: searching {strategy}")
                row = find_max_size(s.family, sv.hardware, strategy, schedule=s.schedule, num_stages=s.num_stages,
                                    microbatch_size=s.microbatch_size, num_microbatches=s.num_microbatches,
                                    precision=s.precision, time_budget_s=args.time_budget,
                                    progress=progress.update)
                sv.maxsize.append(row)
                progress.advance(f"{s.name} {sv.hardware.name} {strategy}: largest "
                                 f"{row.model.name if row.model else 'none'} ({row.bound})")
    picks = {}
    for sv in servers:
        if args.models:
            family = [m for m in args.models.split(",") if load_model_config(m).family == sv.setting.family]
        else:
            family = pick_models(sv.setting, sv.maxsize, args.max_models)
        picks[(sv.setting.name, sv.hardware.name)] = family
    with TaskProgress(console, sum(map(len, picks.values())), "models") as progress:
        for sv in servers:
            for model in picks[(sv.setting.name, sv.hardware.name)]:
                sv.cases.append(run_case(sv.setting, model, sv.hardware, progress))
                progress.advance(f"{sv.setting.name} {sv.hardware.name} {model}: planned")
    elapsed = time.perf_counter() - t0
    if args.json:
        print_json(to_json(servers, args.time_budget, elapsed))
        return
    for st in {sv.setting.name: sv.setting for sv in servers}.values():
        console.print(f"setting {st.name}: {st.family} in {st.precision}, {st.schedule}, {st.num_stages} stages, "
                      f"{st.num_microbatches} microbatches of {st.microbatch_size}; source: {st.source}",
                      markup=False, soft_wrap=True)
    for table in (demand_table(servers), saved_table(servers), maxsize_table(servers, args.time_budget),
                  speedup_table(servers), ablation_table(servers)):
        console.print(table)
    for line in d2d_lines(servers):
        console.print(line, markup=False, soft_wrap=True)
    for sv in servers:
        for r in sv.maxsize:
            if r.bound_detail:
                console.print(f"{sv.setting.name} {sv.hardware.name} {r.strategy}: bound by {r.bound}: "
                              f"{r.bound_detail}", markup=False, soft_wrap=True)
        for c in sv.cases:
            for n in baseline_names(sv.hardware):
                reason = c.plans[n].reason if n in c.plans else c.baselines[n].reason
                if reason:
                    console.print(f"{sv.setting.name} {sv.hardware.name} {c.model} {n} does not fit: {reason}",
                                  markup=False, soft_wrap=True)
    console.print(f"(ran in {elapsed:.0f} s)")


if __name__ == "__main__":
    main()
