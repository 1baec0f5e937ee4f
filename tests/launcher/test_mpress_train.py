"""`mpress train` end to end: it trains on 4 CPU ranks with the overrides it was given,
and refuses bad input in one line with exit status 2 before any rank starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.faults.run import ROOT, WORLD, TrainRun, tiny_config


def _mpress_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpress", "train", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_trains_on_four_ranks_with_the_overrides_it_was_given(tmp_path):
    run = TrainRun.start(tiny_config(tmp_path), tmp_path, "--nproc-per-node", str(WORLD), "--steps", "3",
                         "--optimizer.lr", "1e-2", "--log-every=1")
    assert run.finish(timeout_s=300) == 0, run.stderr()
    out = "".join(run.stdout)
    assert run.stderr() == ""
    assert [int(s) for s in re.findall(r"^step (\d+): loss", out, re.M)] == [0, 1, 2]  # steps: 1000 in the file
    assert "4 stages x 4 microbatches" in out and "per rank" in out
    given, metrics = run.info()["overrides"][:3], run.info()["overrides"][3:]
    assert given == [["steps", "3"], ["optimizer.lr", "1e-2"], ["log_every", "1"]]
    assert [key for key, _ in metrics] == ["metrics"] and metrics[0][1].endswith("metrics.jsonl")  # mpress train's
    for r in range(1, WORLD):  # the other ranks' output is in their logs, not in the user's
        assert "mpress.train:" not in run.log(r)


def test_json_prints_the_report_alone_and_progress_lines_go_to_stderr(tmp_path):
    config = tiny_config(tmp_path, num_stages=2, steps=2)
    res = _mpress_train("--config", str(config), "--run-dir", str(tmp_path / "run"), "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)  # stdout is the report and nothing else
    assert rows == json.loads((tmp_path / "run" / "report.json").read_text())
    assert [r["rank"] for r in rows] == [0, 1] and all(isinstance(r["measured"], int) and r["measured"] > 0
                                                       for r in rows)
    # piped, rank 0 has no bar to show: each logged step is a line with the bar's figures
    steps = re.findall(r"^step (\d+): loss \S+  \S+ tokens/s  \S+ samples/s  MFU \S+%  "
                       r"peak/rank \S+ \w?B \S+ \w?B  \(\d+/2, \d+:\d\d:\d\d\)$", res.stderr, re.M)
    assert steps == ["0", "1"], res.stderr


@pytest.mark.parametrize("args, expected", [
    (["--optimizer.lrr", "1"], r"train\.yaml: --optimizer\.lrr: no such key under optimizer \(allowed: betas, "
                               r"clip_grad_norm, eps, lr, max_skipped_steps, min_lr, name, no_decay, schedule, "
                               r"warmup_steps, weight_decay\)"),
    (["--stepz", "3"], r"train\.yaml: --stepz: no such key \(allowed: .*steps.*\)"),
    (["--steps", "0"], r"train\.yaml: --steps: must be >= 1, got 0"),
    (["--steps"], r"train\.yaml: --steps: needs a value"),
    (["--nproc-per-node", "3"], r"num_stages: 1f1b runs one stage per rank, so num_stages \(4\) must equal the "
                                r"world size \(3\)"),
])
def test_bad_input_is_one_line_exit_2_and_no_rank_starts(tmp_path, args, expected):
    config = tiny_config(tmp_path)
    res = _mpress_train("--config", str(config), "--run-dir", str(tmp_path / "run"), *args)
    assert res.returncode == 2, res.stderr
    # only the first line, said before the job is checked; "mpress train: N ranks ..." comes
    # just before the ranks start
    assert res.stdout.splitlines() == [f"mpress train: {config}: loading torch and checking the job"]
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and re.match(r"mpress train: error: " + "(.*/)?" + expected, lines[0]), res.stderr
    assert not (tmp_path / "run").exists()


def test_a_bad_config_file_is_one_line_exit_2(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"model": "gpt-tiny", "stepz": 3}))
    res = _mpress_train("--config", str(path), "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 2
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mpress train: error: {path}: stepz: unknown key (allowed: ")
    assert not (tmp_path / "run").exists()
