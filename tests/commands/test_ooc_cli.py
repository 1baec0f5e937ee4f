"""`mpress ooc` end to end: one batch, both sweeps (tables, PNGs, --json, progress lines off
a terminal), and bad input in one line with exit status 2."""

import json

import pytest

from mpress.cli import main
from mpress.hardware.server import load_hardware
from mpress.static.studies.ooc_model import load_ooc_model, single_device
from mpress.static.studies.ooc_sweeps import footprint_bytes
from tests.support.user_model import SKIPNET

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def capacity() -> str:
    """A cpu-local capacity between the footprints of 2 and 4 gpt-tiny microbatches of 2."""
    hw = single_device(load_hardware("cpu-local"))
    model = load_ooc_model(model="gpt-tiny", module=None, hardware=hw, microbatch_size=2)
    return str((footprint_bytes(model, hw, 4) + footprint_bytes(model, hw, 8)) // 2)


def _tiny(capacity: str) -> list[str]:
    return ["ooc", "--model", "gpt-tiny", "--hardware", "cpu-local", "--capacity", capacity, "--microbatch-size", "2"]


def test_one_batch_shows_both_policies_and_where_the_stalls_are(capacity, capsys):
    assert main([*_tiny(capacity), "--batch-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "settings: model gpt-tiny" in out
    for row in ("in memory", "layer-ahead", "capacity"):
        assert row in out
    assert "stalls blamed on" in out and "0:layers." in out  # a swapped unit is named


def test_batch_sweep_json_and_plot(capacity, capsys, tmp_path):
    png = tmp_path / "batch.png"
    assert main([*_tiny(capacity), "--sweep", "batch", "--batch-sizes", "2,4,8,16,32", "--plot", str(png),
                 "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["sweep"] == "batch" and data["knee_batch_size"] == 8
    assert [p["batch_size"] for p in data["points"]] == [2, 4, 8, 16, 32]
    for p in data["points"]:
        for run in p["policies"].values():
            assert run["normalised_time"] >= 1.0 - 1e-12
            assert (run["normalised_time"] == 1.0) == (not p["over_capacity"])
    assert png.read_bytes().startswith(PNG)
    # off a terminal: plain progress lines, one per batch, on stderr beside --json
    assert "[5/5] batch 32" in captured.err


def test_bandwidth_sweep_table_and_plot(capacity, capsys, tmp_path):
    png = tmp_path / "bw.png"
    assert main([*_tiny(capacity), "--sweep", "bandwidth", "--batch-size", "32", "--bandwidths", "1,4,450",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "host link GB/s" in out and "[3/3] 450 GB/s" in out
    assert png.read_bytes().startswith(PNG)


def test_default_batch_is_said(capacity, capsys):
    assert main([*_tiny(capacity), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch_size"] == 8 and data["over_capacity"]  # the first power-of-two batch past memory
    assert data["settings"]["defaults"]["batch_size"].startswith("the first power-of-two batch")


def test_conv_net_runs(capsys):
    assert main(["ooc", "--model", "vgg16", "--width-div", "16", "--image-size", "32", "--microbatch-size", "2",
                 "--hardware", "cpu-local", "--capacity", "20MB", "--batch-size", "16"]) == 0
    assert "vgg16@32px/16" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--batch-size", "3"], "not a multiple of"),
    (["--plot", "x.png"], "--plot draws a sweep"),
    (["--sweep", "bandwidth", "--bandwidths", "0,4"], "--bandwidths"),
    (["--sweep", "batch", "--batch-sizes", "2,x"], "--batch-sizes"),
    (["--sweep", "batch", "--batch-size", "4"], "--batch-sizes, not --batch-size"),
    (["--capacity", "lots"], "--capacity"),
    (["--image-size", "64"], "conv nets"),
    (["--sweep", "sideways"], "--sweep"),
])
def test_bad_input_is_one_line_and_exit_2(capacity, capsys, argv, words):
    assert main([*_tiny(capacity), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_unknown_model_is_one_line(capsys):
    assert main(["ooc", "--model", "resnet9000", "--hardware", "cpu-local"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "resnet9000" in err


def test_user_module_runs(capsys):
    # README's own-model example (a non-chain module named by its layers), on fake tensors
    assert main(["ooc", "--module", SKIPNET, "--layers", "embed,blocks.*,head", "--hardware", "cpu-local",
                 "--capacity", "3MB", "--batch-size", "512", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["model_kind"] == "module" and data["over_capacity"]
    for run in data["policies"].values():
        assert run["fits"] and run["swapped"] and run["normalised_time"] >= 1.0
