"""Long commands print plain progress lines when their output is not a terminal (a pipe,
a log file), where a progress bar would show nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from mpress.cli import main
from mpress.config.vocabulary import Strategy

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "gpt-tiny", "--hardware", "cpu-local", "--device-memory", "3MB", "--num-stages", "2"]


def _piped(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpress", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_plan_piped_prints_a_line_per_strategy():
    res = _piped("plan", *TINY)
    assert res.returncode == 0, res.stderr
    planned = re.findall(r"^\[(\d)/(\d)\] planned (\S+): ", res.stdout, re.M)
    n = len(Strategy)
    order = ["mpress", *(s for s in Strategy.words() if s != "mpress")]  # the strategy to write first
    assert planned == [(str(i + 1), str(n), s) for i, s in enumerate(order)], res.stdout


def test_plan_json_piped_keeps_progress_off_stdout():
    res = _piped("plan", *TINY, "--json")
    assert res.returncode == 0, res.stderr
    json.loads(res.stdout)  # nothing but the document
    assert len(re.findall(r"^\[\d/\d\] planned ", res.stderr, re.M)) == len(Strategy)


def test_maxsize_and_profile_off_a_terminal_print_progress(capsys):
    assert main(["maxsize", "--model", "gpt", "--hardware", "dgx-a100", "--strategy", "none,recompute"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^\[(\d)/2\] (\S+): largest ", out, re.M) == [("1", "none"), ("2", "recompute")], out
    assert main(["profile", "--model", "gpt-tiny", "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\[0/1\] profiling gpt-tiny: measured on cpu ", out, re.M), out  # before it starts
    assert re.search(r"^\[1/1\] profiled gpt-tiny: \d+ layers, measured profile \(\d+:\d\d:\d\d\)$", out, re.M), out
