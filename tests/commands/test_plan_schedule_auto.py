"""`mpress plan --schedule auto`: each candidate schedule planned on the same ranks, the
fastest that fits chosen, one line per candidate saying why; and the V schedules laid
out by the pipeline flags."""

from __future__ import annotations

import json
import re

from mpress.cli import main
from mpress.config.model_config import load_model_config
from mpress.config.vocabulary import ScheduleName
from mpress.contract.plan import Plan
from mpress.hardware.server import load_hardware
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.schedule_choice import CANDIDATES, choose_schedule


def test_auto_picks_the_fastest_fitting_schedule_and_says_why(tmp_path, capsys):
    path = tmp_path / "auto.yaml"
    code = main(["plan", "--model", "gpt-20.4b", "--hardware", "dgx-a100", "--schedule", "auto",
                 "--microbatches", "16", "--out", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [x for x in out.splitlines() if x.startswith("schedule ")]
    assert [x.split()[1] for x in lines] == [label for label, _s, _k in CANDIDATES]
    chosen = [x for x in lines if ": chosen, the fastest that fits" in x]
    assert len(chosen) == 1
    # every other fitting candidate is slower by the ratio it names
    assert all(re.search(r"is \d+\.\d\dx the chosen one's", x) for x in lines if x not in chosen and ": fits" in x)
    name = re.match(r"schedule \S+ \((\S+), (\d+) stages\)", chosen[0])
    plan = Plan.load(path)
    assert (str(plan.schedule), plan.num_stages, plan.num_ranks) == (name.group(1), int(name.group(2)), 8)
    assert main(["emulate", str(path)]) == 0, capsys.readouterr().err


def test_choice_is_the_minimum_over_what_fits():
    cfg, hw = load_model_config("gpt-10.3b"), load_hardware("dgx-a100", memory_bytes=30 * 10**9)

    def make(schedule: ScheduleName, stages: int, ranks: int):
        return setup_pipeline(cfg, hw, schedule=schedule, num_stages=stages, num_ranks=ranks, microbatch_size=1,
                              num_microbatches=6)

    choice = choose_schedule(make, 4, "mpress")
    by_label = {c.label: c for c in choice.candidates}
    # DualPipeV needs 2R = 8 microbatches: ruled out by the shape, with torch's rule
    assert by_label["dualpipev"].result is None and ">= 8" in by_label["dualpipev"].error
    fitting = [c for c in choice.candidates if c.fits]
    assert fitting and choice.chosen in fitting
    assert choice.chosen.iteration_s == min(c.iteration_s for c in fitting)
    lines = choice.lines()
    assert len(lines) == len(CANDIDATES)
    assert any("cannot be laid out" in x for x in lines)


def test_auto_refuses_a_stage_count(capsys):
    code = main(["plan", "--model", "gpt-tiny", "--hardware", "cpu-local", "--schedule", "auto", "--stages", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "--num-ranks, not --num-stages" in err[0]


def test_v_schedule_flags_lay_out_two_stages_per_rank(tmp_path, capsys):
    path = tmp_path / "zbv.yaml"
    code = main(["plan", "--model", "gpt-tiny", "--hardware", "cpu-local", "--devices", "2", "--device-memory", "3.4MB",
                 "--schedule", "zbv", "--microbatch-size", "2", "--microbatches", "4", "--out", str(path)])
    _out, err = capsys.readouterr()
    assert code == 0, err
    plan = Plan.load(path)
    assert (plan.schedule, plan.num_stages, plan.num_ranks, plan.stage_to_device) == ("zbv", 4, 2, [0, 1, 1, 0])
    # the program holds the split backward
    assert "0I0" in plan.actions[0].split() and "0W0" in plan.actions[0].split()


def test_auto_with_json_says_why_on_stderr(capsys):
    code = main(["plan", "--model", "gpt-tiny", "--hardware", "cpu-local", "--devices", "2", "--device-memory", "3MB",
                 "--schedule", "auto", "--microbatch-size", "2", "--microbatches", "3", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    figures = json.loads(out)  # stdout is the JSON alone
    why = [x for x in err.splitlines() if x.startswith("schedule ")]
    assert len(why) == len(CANDIDATES)
    # 3 microbatches on 2 ranks: DualPipeV (4 stages) cannot run them
    assert "schedule dualpipev (dualpipev, 4 stages): cannot be laid out" in err
    chosen = next(x for x in why if ": chosen" in x)
    assert figures["settings"]["schedule"] == re.match(r"schedule \S+ \((\S+),", chosen).group(1)
