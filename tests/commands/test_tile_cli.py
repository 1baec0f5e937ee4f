"""`mpress tile` end to end: segments and tile sizes for a giant image, and its bad input."""

import pytest

from mpress.cli import main
from mpress.tiling.graph import from_sequential
from mpress.tiling.networks import vgg16
from mpress.tiling.peak import PeakModel
from mpress.config.units import fmt_bytes


def test_tile_prints_segments_tile_sizes_and_predicted_peak(capsys):
    assert main(["tile", "--network", "vgg16", "--image-size", "2048", "--budget", "300MB", "--detail"]) == 0
    out = capsys.readouterr().out
    plain = PeakModel(from_sequential(vgg16(), (1, 3, 2048, 2048))).predict([]).peak_bytes
    assert f"plain training needs {fmt_bytes(plain)}" in out
    assert "features.0..features." in out and "halo overhead" in out
    assert "predicted peak" in out and "(in backward segment" in out
    assert "backward halo" in out  # the --detail table
    peak_mb = float(out.split("predicted peak ")[1].split(" MB")[0])
    assert peak_mb <= 300


def test_tile_fits_without_tiling(capsys):
    assert main(["tile", "--network", "vgg19", "--image-size", "128", "--budget", "2GiB"]) == 0
    assert "fits without tiling" in capsys.readouterr().out


def test_tile_fixed_tile_count(capsys):
    assert main(["tile", "--network", "darknet19", "--image-size", "1024", "--budget", "8GB", "--tiles", "4"]) == 0
    assert "4x4" in capsys.readouterr().out


@pytest.mark.parametrize("argv,expect", [
    (["--network", "resnet50"], "invalid choice"),
    (["--image-size", "0"], "--image-size: must be in [1, "),
    (["--image-size", "-5"], "--image-size: must be in [1, "),
    (["--budget", "lots"], "cannot read 'lots' as a size"),
    (["--image-size", "4096", "--budget", "20MB"], "does not fit: budget 20 MB, plain training needs"),
])
def test_tile_bad_input_is_one_line_and_exit_2(capsys, argv, expect):
    assert main(["tile", *argv]) == 2
    err = capsys.readouterr().err
    assert expect in err and len(err.strip().splitlines()) == 1
