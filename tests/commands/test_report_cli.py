"""`mpress report RUN_DIR`: the PNG is written, the table shows first/last/min, and a
missing, empty or malformed metrics file is one line on stderr with exit status 2."""

from __future__ import annotations

import json
import math

import pytest

from mpress.cli import main
from mpress.commands.report import summary_rows


def _write_run(folder, steps=range(0, 50, 5)):
    folder.mkdir(exist_ok=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for s in steps:
            record = {"step": s, "loss": 5.0 * math.exp(-s / 20) + 1, "lr": 1e-3 * (1 - s / 50),
                      "samples_per_s": 100.0, "tokens_per_s": 3200.0, "mfu": 0.05, "peak_bytes": {"0": 1}}
            if s % 20 == 0:
                record["val_loss"] = record["loss"] + 0.1
            f.write(json.dumps(record) + "\n")


def test_report_writes_one_png_and_the_table(tmp_path, capsys):
    _write_run(tmp_path / "run")
    assert main(["report", str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "val loss" in out and "learning rate" in out and "MFU" in out
    assert main(["report", str(tmp_path / "run" / "metrics.jsonl"), "--out", str(tmp_path / "x" / "l.png")]) == 0
    assert (tmp_path / "x" / "l.png").is_file()


def test_summary_rows_first_last_min():
    records = [{"step": 0, "loss": 3.0}, {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0, "val_loss": 2.5}]
    assert summary_rows(records) == [("loss", "3.0000 (step 0)", "2.0000 (step 2)", "1.0000 (step 1)"),
                                     ("val loss", "2.5000 (step 2)", "2.5000 (step 2)", "2.5000 (step 2)")]


@pytest.mark.parametrize("content,message", [
    (None, "has no metrics.jsonl"),
    ("", "holds no step yet"),
    ("not json\n", "line 1 is not JSON"),
    ('{"loss": 1.0}\n', "line 1 has no integer step"),
    ('{"step": 0, "loss": "high"}\n', "loss is not a number"),
])
def test_bad_metrics_files_are_one_line(tmp_path, capsys, content, message):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("mpress report: error:")


def test_missing_run_dir_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "no such run directory or file" in capsys.readouterr().err
