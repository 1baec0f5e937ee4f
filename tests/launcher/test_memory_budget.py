"""Memory budgets end to end on CPU ranks: under its plan every rank of every shipped
config (the main job's among them, through `mpress train`) keeps its measured peak
within its device's capacity and its predicted peak; without a plan the main job's
budget stops the run with the one-line out-of-memory error (through the documented
torchrun command, whose output has every rank's line)."""

from __future__ import annotations

import re

import pytest
import yaml

from mpress.config.units import parse_bytes
from tests.launcher.test_train_launcher import ROOT, launch

pytestmark = pytest.mark.slow

CONFIG = ROOT / "configs/train/gpt-tiny-mixed.yaml"
COLUMNS = ["rank", "stage", "plan", "need w/o mpress", "predicted peak", "measured peak", "measured / predicted",
           "measured peak during", "start-up peak", "CUDA reserved peak"]


def short_config(**kw: object) -> dict:
    """The main job config, a few steps only."""
    config = yaml.safe_load(CONFIG.read_text())
    config.update(steps=3, log_every=1, **kw)
    return config


def memory_rows(stdout: str) -> list[dict[str, str]]:
    """The end-of-run memory table, one dict per rank (column -> cell)."""
    table = stdout[stdout.index("per rank: device memory"):stdout.index("per rank: swaps and recompute")]
    # a header cell may wrap over several lines: join each column's pieces
    header_lines = [[c.strip() for c in line.strip("┃").split("┃")] for line in table.splitlines()
                    if line.startswith("┃")]
    header = [" ".join(p for p in column if p) for column in zip(*header_lines)]
    assert header == COLUMNS, header
    rows: list[list[str]] = []
    for line in table.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[0] or not rows:
            rows.append(cells)
        else:  # a row wrapped onto the next line: its cells' pieces join the row's
            rows[-1] = [" ".join(p for p in pair if p) for pair in zip(rows[-1], cells)]
    return [dict(zip(COLUMNS, row)) for row in rows]


def cell_bytes(cell: str) -> int:
    """`fmt_bytes`'s '2.37 MB' back in bytes (3 significant digits)."""
    return parse_bytes(cell.replace(" ", ""), "table cell")


def test_the_main_job_without_a_plan_runs_out_of_memory_naming_rank_action_and_residents(tmp_path):
    config = short_config(plan="none")
    budget = parse_bytes(config["device_memory"])
    res = launch(config, tmp_path, nproc=4, timeout=180)
    assert res.returncode != 0
    assert "step 0:" not in res.stdout  # no step finished
    lines = [x for x in res.stderr.splitlines() if x.startswith("mpress.train: rank")]
    oom = [x for x in lines if re.match(r"mpress\.train: rank \d+: DeviceOutOfMemory", x)]
    # stage 0 needs the most and runs first: rank 0 goes over first; the others are then
    # stopped by its failure, each saying so in its own line
    assert oom and oom[0].startswith("mpress.train: rank 0: DeviceOutOfMemory: "), res.stderr[-3000:]
    for line in oom:
        m = re.match(r"mpress\.train: rank (\d+): DeviceOutOfMemory: rank (\d+) (\S+): out of device memory: "
                     r".+ takes the live bytes to ([\d,]+) B, over the capacity of ([\d,]+) B; largest: (.+)$", line)
        assert m and m.group(1) == m.group(2), line
        # the action the rank was running: one of its stage's forwards or backwards
        assert re.fullmatch(rf"{m.group(1)}[FB]\d+", m.group(3)), line
        live, capacity = (int(m.group(i).replace(",", "")) for i in (4, 5))
        assert capacity == budget < live, line
        residents = m.group(6).split(", ")
        assert residents and all(re.fullmatch(r".+ [\d.]+ [KM]?B", x) for x in residents), line
    assert len({x.split(":")[1] for x in lines}) == len(lines)  # one line per rank


SHIPPED = sorted(p.stem for p in (ROOT / "configs/train").glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_peaks_within_its_prediction(name, tmp_path):
    """Each shipped config (the main job's among them), a few steps: on every rank the
    measured peak (every byte, the `report:` figures) is at most the emulator's prediction
    of the same program and at least 90% of it, and within the config's device budget; so
    is the rank's start-up peak (from its first allocation to its first step); the
    end-of-run table on rank 0's output says the same."""
    config = yaml.safe_load((ROOT / f"configs/train/{name}.yaml").read_text())
    config.update(steps=3, log_every=1, report=str(tmp_path / "report.json"))
    config.pop("checkpoint", None)
    stages = int(config.get("num_stages") or 4)
    res = launch(config, tmp_path, nproc=stages // 2 if config.get("schedule") == "interleaved" else stages,
                 torchrun=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 2:" in res.stdout
    rows = yaml.safe_load((tmp_path / "report.json").read_text())
    budget = parse_bytes(str(config["device_memory"])) if config.get("device_memory") else None
    for r in rows:
        assert 0.9 * r["predicted"] <= r["measured"] <= r["predicted"], (name, r)
        assert budget is None or r["measured"] <= budget, (name, r)
        assert 0 < r["startup"] <= r["predicted"], (name, r)
    table = memory_rows(res.stdout)
    assert [t["rank"] for t in table] == [str(r["rank"]) for r in rows]
    for t in table:
        # the run finishing already says live bytes never went over the budget (each
        # rank's stand-in device has it as its capacity); the table must say the same
        measured, predicted = cell_bytes(t["measured peak"]), cell_bytes(t["predicted peak"])
        assert 0 < measured <= predicted and (budget is None or predicted <= budget), (name, t)
        assert float(t["measured / predicted"].rstrip("%")) <= 100.0, (name, t)
        assert 0 < cell_bytes(t["start-up peak"]) <= predicted, (name, t)
        stages_of_rank = t["stage"].replace(" ", "").split(",")
        assert re.fullmatch(rf"({'|'.join(stages_of_rank)})[A-Z]+\S*", t["measured peak during"]), (name, t)
