"""Benchmark: the largest model per server and family for mpress (host tier, and with its
NVMe tier) beside ZeRO-Offload, ZeRO-Infinity and ZeRO-Infinity-NVMe, and the iteration
at equal size (issue 33).

Per server (dgx1-v100, dgx-a100, hgx-h100: the presets' drives, `nvme_bytes` and
`nvme_read_gbps`/`nvme_write_gbps`) and family, everything from the static half in this
run:

  - the largest model each of `mpress`, `mpress-nvme` (mpress allowed the drive for
    optimizer data, `planner_nvme`), zero-offload, zero-infinity and zero-infinity-nvme
    fits (`maxsize.find_max_size`, each search stopped after --time-budget seconds: a
    row bound by "time" is a lower bound), with what bounds it, and for the drive tiers
    what they keep on the drive and that traffic's time per iteration at the drive's
    bandwidth (`MaxSize.drive_bytes`, `drive_s`);
  - host vs host and NVMe vs NVMe: mpress's largest over the ZeRO tier's largest;
  - the iteration at equal size: at the smaller of the two largest models of a tier,
    mpress's emulated iteration and the ZeRO baseline's ("x": one of them does not fit);
  - per server, family and tier, a line on issue 33's goal: mpress's largest model at
    least every ZeRO baseline's of the tier (host: ZeRO-Offload and ZeRO-Infinity; NVMe:
    ZeRO-Infinity-NVMe), and mpress faster at the equal size.

Shapes: gpt and bert as the MPress paper's settings (configs/settings/paper-gpt.yaml,
paper-bert.yaml: 8 stages, 16 microbatches); llama (no paper setting) as paper-gpt: 1f1b,
8 stages, 16 microbatches of 2, fp16 mixed (the V100 has no bf16).

One run here (dgx1-v100 alone with --time-budget 120; the other servers three at once on
2 shared cores with 45 s, where mpress's rows stopped on time and are lower bounds):
mpress and mpress-nvme reach the same sizes (GPT 25.1B, bound by device memory; Bert
7.4B, bound by pinned host on dgx1-v100): the drive takes optimizer data only, and what
binds is the fp16 parameters and gradients on the devices (GPT, Llama) and the pinned
activations (Bert: 890 GB of pins at 8.1B, of which optimizer data is 88 GB). ZeRO's
largest are 21.5B/206.5B (GPT, Infinity/-NVMe) and 16.8B/78.2B (Bert). At equal size
mpress-nvme beats ZeRO-Infinity-NVMe (GPT 25.1B: 25.1 s vs 643 s; Bert 7.4B: 166 s vs
277 s); on the host tier GPT 21.5B is 19.6 s vs 21.2 s, Bert 7.4B 166 s vs 119 s.

Usage: PYTHONPATH=. python3 bench/nvme_tier.py [--hardware dgx1-v100,dgx-a100,hgx-h100]
       [--families gpt,bert,llama] [--time-budget 60] [--json]
"""

from __future__ import annotations

import argparse
import math

from rich.table import Table

from mpress.config.settings import load_setting
from mpress.config.units import fmt_bytes, fmt_seconds
from mpress.config.vocabulary import MPRESS_NVME, ScheduleName, Strategy
from mpress.hardware.server import Hardware, load_hardware
from mpress.static.baselines.zero import ZERO_INFINITY, ZERO_INFINITY_NVME, ZERO_OFFLOAD, plan_zero
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.planner import PlannerOptions, plan_strategy
from mpress.static.studies.maxsize import MaxSize, find_max_size
from mpress.ui import TaskProgress, make_console, print_json

SERVERS = ("dgx1-v100", "dgx-a100", "hgx-h100")
FAMILIES = ("gpt", "bert", "llama")
TIERS = {"host": (Strategy.MPRESS.value, ZERO_INFINITY), "nvme": (MPRESS_NVME, ZERO_INFINITY_NVME)}
"""Per tier: mpress's search and the ZeRO baseline it is set beside."""


def shape(family: str) -> dict[str, object]:
    """The pipeline shape and precision of `family` (see the module docstring)."""
    setting = load_setting("paper-bert" if family == "bert" else "paper-gpt")
    return {"schedule": ScheduleName(setting.schedule), "num_stages": setting.num_stages,
            "microbatch_size": setting.microbatch_size, "num_microbatches": setting.num_microbatches,
            "precision": setting.precision}


def searches(hw: Hardware) -> list[str]:
    return [Strategy.MPRESS.value, *((MPRESS_NVME,) if hw.has_nvme else ()), ZERO_OFFLOAD, ZERO_INFINITY,
            *((ZERO_INFINITY_NVME,) if hw.has_nvme else ())]


def equal_size(rows: dict[str, MaxSize], ours: str, theirs: str, hw: Hardware, family: str) -> dict[str, object]:
    """Both tiers' iteration at the smaller of their largest models."""
    a, b = rows.get(ours), rows.get(theirs)
    if a is None or b is None or a.model is None or b.model is None:
        return {"model": None}
    row = a if a.num_parameters <= b.num_parameters else b
    cfg = row.model
    s = shape(family)
    setup = setup_pipeline(cfg, hw, schedule=s["schedule"], num_stages=s["num_stages"],
                           microbatch_size=s["microbatch_size"], num_microbatches=s["num_microbatches"])
    mine = plan_strategy(setup, Strategy.MPRESS.value, PlannerOptions(drive=ours == MPRESS_NVME, layer_data=True))
    zero = plan_zero(setup, theirs)
    return {"model": cfg.name, "num_parameters": row.num_parameters,
            "mpress_s": mine.evaluation.result.iteration_s if mine.fits else None,
            "zero_s": zero.iteration_s if zero.fits else None}


def run(servers: list[str], families: list[str], budget: float | None, console) -> list[dict]:
    out = []
    jobs = [(h, f) for h in servers for f in families]
    with TaskProgress(console, len(jobs), "searching") as progress:
        for name, family in jobs:
            hw = load_hardware(name)
            s = shape(family)
            rows: dict[str, MaxSize] = {}
            for strategy in searches(hw):
                progress.update(f"{name} {family}: {strategy}")
                rows[strategy] = find_max_size(family, hw, strategy, schedule=s["schedule"],
                                               num_stages=s["num_stages"], microbatch_size=s["microbatch_size"],
                                               num_microbatches=s["num_microbatches"], precision=s["precision"],
                                               time_budget_s=budget, progress=progress.update)
            tiers = {tier: equal_size(rows, ours, theirs, hw, family) for tier, (ours, theirs) in TIERS.items()
                     if ours in rows}
            res = {"hardware": name, "family": family, "rows": {k: _row(r, hw) for k, r in rows.items()},
                   "equal_size": tiers}
            res["goal"] = {tier: verdict(res, tier) for tier in tiers}
            out.append(res)
            progress.advance(f"{name} {family}: done")
    return out


TIER_BASELINES = {"host": (ZERO_OFFLOAD, ZERO_INFINITY), "nvme": (ZERO_INFINITY_NVME,)}
"""Per tier, every ZeRO baseline mpress's largest model is held against (issue 33's goal)."""


def verdict(res: dict, tier: str) -> str:
    """Issue 33's goal for one tier of one server and family: mpress's largest model at
    least every baseline's of the tier, and mpress faster at the equal size."""
    rows, ours = res["rows"], rows_of(res, tier)
    if not ours["num_parameters"] and not any(rows[z]["num_parameters"] for z in TIER_BASELINES[tier] if z in rows):
        return "not judged (no strategy fits any size)"
    beaten = [z for z in TIER_BASELINES[tier] if z in rows and rows[z]["num_parameters"] > ours["num_parameters"]]
    lower = " (mpress's row is a lower bound: out of time)" if ours["bound"] == "time" else ""
    size = "met" if not beaten else f"not met ({', '.join(beaten)} fit larger)"
    eq = res["equal_size"][tier]
    if eq["model"] is None or not eq["mpress_s"] or not eq["zero_s"]:
        speed = "not judged (no size both fit)"
    else:
        ratio = eq["zero_s"] / eq["mpress_s"]
        speed = f"{'met' if ratio >= 1 else 'not met'} ({ratio:.2f}x at {eq['model']})"
    return f"size {size}{lower}; speed {speed}"


def rows_of(res: dict, tier: str) -> dict:
    return res["rows"][TIERS[tier][0]]


def _row(r: MaxSize, hw: Hardware) -> dict[str, object]:
    return {"model": r.model.name if r.model else None, "num_parameters": r.num_parameters,
            "iteration_s": r.iteration_s if r.model else None, "bound": r.bound.value if r.bound else None,
            "bound_detail": r.bound_detail, "drive_bytes": r.drive_bytes if r.model else 0,
            "drive_s": r.drive_s(hw) if r.model else 0.0}


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['num_parameters'] / 1e9:.1f} ({r['bound']})" if r["model"] else f"none ({r['bound']})"


def _ratio(rows: dict, a: str, b: str) -> str:
    ra, rb = rows.get(a), rows.get(b)
    if not ra or not rb or not rb["num_parameters"]:
        return "-"
    return f"{ra['num_parameters'] / rb['num_parameters']:.2f}x"


def tables(results: list[dict]) -> list[Table]:
    size = Table(title="largest model (B parameters; bound)")
    for col in ["server", "family", *searches(load_hardware(SERVERS[0])), "host: mpress/ZeRO-Inf",
                "nvme: mpress/ZeRO-Inf-NVMe"]:
        size.add_column(col, justify="left" if col in ("server", "family") else "right")
    speed = Table(title="iteration at equal size (mpress vs ZeRO, same tier)")
    for col in ["server", "family", "tier", "model", "mpress", "ZeRO", "ZeRO / mpress", "mpress on drive",
                "its drive s/iter"]:
        speed.add_column(col, justify="left" if col in ("server", "family", "tier", "model") else "right")
    for res in results:
        rows = res["rows"]
        size.add_row(res["hardware"], res["family"],
                     *[_cell(rows.get(k)) for k in searches(load_hardware(res["hardware"]))],
                     _ratio(rows, Strategy.MPRESS.value, ZERO_INFINITY), _ratio(rows, MPRESS_NVME, ZERO_INFINITY_NVME))
        for tier, eq in res["equal_size"].items():
            ours = rows.get(TIERS[tier][0]) or {}
            if eq["model"] is None:
                speed.add_row(res["hardware"], res["family"], tier, "x", "-", "-", "-", "-", "-")
                continue
            m, z = eq["mpress_s"], eq["zero_s"]
            speed.add_row(res["hardware"], res["family"], tier, eq["model"],
                          fmt_seconds(m) if m else "x", fmt_seconds(z) if z else "x",
                          f"{z / m:.2f}x" if m and z else "-",
                          fmt_bytes(ours.get("drive_bytes", 0)) if ours.get("drive_bytes") else "-",
                          fmt_seconds(ours["drive_s"]) if ours.get("drive_bytes") else "-")
    return [size, speed]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", default=",".join(SERVERS))
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--time-budget", type=float, default=60.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    console = make_console(stderr=args.json)
    results = run(args.hardware.split(","), args.families.split(","),
                  args.time_budget if args.time_budget > 0 and math.isfinite(args.time_budget) else None, console)
    if args.json:
        print_json({"results": results})
        return
    for t in tables(results):
        console.print(t)
    for res in results:
        for tier, line in res["goal"].items():
            console.print(f"{res['hardware']} {res['family']} {tier} tier: {line}", markup=False, soft_wrap=True)


if __name__ == "__main__":
    main()
