"""Benchmark: is a plan's memory promise kept? Predicted against measured peak, per rank.

Runs every shipped train config (`configs/train/*.yaml`) through the documented command
(`python -m torch.distributed.run ... -m mpress.train`) for a few steps on CPU ranks, and
the main job (`gpt-tiny-mixed`) once more with `plan: none`, and prints per rank: the
emulator's predicted peak of the same program, the measured peak (every byte on the
rank's stand-in device, `mpress.contract.live_bytes`), their ratio, and the configured
`device_memory` budget. A run that goes over its budget stops with the out-of-memory
error; that is a result too (the plain run of the main job must). Exit status 1 when a
measured peak is above its prediction.

Usage: python bench/memory_accuracy.py [--steps N] [--configs NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from mpress.config.units import fmt_bytes, parse_bytes

ROOT = Path(__file__).resolve().parent.parent
MAIN_JOB = "gpt-tiny-mixed"


def world_size(cfg: dict) -> int:
    """Ranks a config runs on: one per stage; interleaved runs two stages per rank."""
    stages = int(cfg.get("num_stages") or 4)
    return stages // 2 if cfg.get("schedule") == "interleaved" else stages


def run(name: str, cfg: dict, steps: int, tmp: Path) -> tuple[list[dict], str]:
    """Run one config; (per-rank report rows, the first error line or "")."""
    cfg = {**cfg, "steps": steps, "log_every": steps, "report": str(tmp / f"{name}.json")}
    cfg.pop("checkpoint", None)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(world_size(cfg)), "-m", "mpress.train", "--config", str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    report = tmp / f"{name}.json"
    rows = json.loads(report.read_text()) if proc.returncode == 0 and report.exists() else []
    error = next((line.split(": ", 1)[-1] for line in proc.stderr.splitlines()
                  if line.startswith("mpress.train: rank")), "" if proc.returncode == 0 else "failed")
    return rows, error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per run (default 3)")
    parser.add_argument("--configs", nargs="*", help="config names (default: every shipped one)")
    args = parser.parse_args()
    console = Console(width=None if sys.stdout.isatty() else 150)
    names = args.configs or sorted(p.stem for p in (ROOT / "configs/train").glob("*.yaml"))
    runs = [(n, yaml.safe_load((ROOT / f"configs/train/{n}.yaml").read_text())) for n in names]
    if MAIN_JOB in names:
        main_cfg = dict(runs[names.index(MAIN_JOB)][1])
        runs.append((f"{MAIN_JOB} (plan: none)", {**main_cfg, "plan": "none", "strategy": "mpress"}))
    table = Table(title=f"predicted vs measured peak per rank ({args.steps} steps; measured: every byte)")
    for c in ("config", "rank", "plan", "budget", "predicted", "measured", "measured / predicted", "during"):
        table.add_column(c, justify="right" if c not in ("config", "plan", "during") else "left")
    over, ratios, errors = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in runs:
            console.print(f"running {name} on {world_size(cfg)} ranks ...")
            rows, error = run(name.split(" ")[0] + ("-none" if "none" in name else ""), cfg, args.steps, Path(tmp))
            budget = fmt_bytes(parse_bytes(str(cfg["device_memory"]), "device_memory")) \
                if cfg.get("device_memory") else "-"
            if not rows:
                table.add_row(name, "-", str(cfg.get("plan")), budget, "-", "-", "-", "[red]stopped (below)[/]")
                errors.append(f"{name}: {error}")
                continue
            for r in rows:
                predicted, measured = r["predicted"], r["measured"]
                ratio = measured / predicted if predicted else float("nan")
                ratios.append(ratio)
                if measured > predicted:
                    over.append(f"{name} rank {r['rank']}")
                table.add_row(name, str(r["rank"]), str(r.get("rules", "none")), budget, fmt_bytes(predicted),
                              fmt_bytes(measured), f"{ratio:.1%}", str(r.get("at", "")))
    console.print(table)
    for line in errors:
        console.print(line, soft_wrap=True)
    if ratios:
        console.print(f"measured / predicted over {len(ratios)} ranks: min {min(ratios):.1%}, max {max(ratios):.1%}")
    if over:
        console.print(f"[red]measured above predicted: {', '.join(over)}[/]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
