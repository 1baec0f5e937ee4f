"""`mpress maxsize` searches the ZeRO baselines beside the planner's strategies: its row
is `find_max_size`'s for the variant, and an unknown name is one line, exit 2."""

from __future__ import annotations

import json

from mpress.cli import main
from mpress.hardware.server import load_hardware
from mpress.static.studies.maxsize import find_max_size
from tests.support.documented import one_line_error

SHAPE = ["--num-stages", "8", "--microbatch-size", "2", "--num-microbatches", "16"]


def test_maxsize_row_of_a_zero_baseline(capsys):
    assert main(["maxsize", "--model", "gpt", "--hardware", "dgx-a100", *SHAPE, "--strategy",
                 "zero-offload,zero-infinity", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["strategies"]
    assert [r["strategy"] for r in rows] == ["zero-offload", "zero-infinity"]
    expected = find_max_size("gpt", load_hardware("dgx-a100"), "zero-offload", schedule="1f1b", num_stages=8,
                             microbatch_size=2, num_microbatches=16)
    assert rows[0]["largest_model"] == expected.model.name
    assert rows[0]["iteration_s"] == expected.baseline.iteration_s
    assert rows[0]["bound"] == expected.bound.value == "device memory"


def test_an_unknown_strategy_names_the_zero_baselines_too(capsys):
    code = main(["maxsize", "--strategy", "zero-magic"])
    one_line_error(code, capsys.readouterr().err, "--strategy", "zero-magic", "zero-offload", "mpress")
