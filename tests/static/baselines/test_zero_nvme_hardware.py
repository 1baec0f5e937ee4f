"""The local drive array (`nvme_*`) of the hardware model: presets and validation."""

import pytest
import yaml

from mpress.errors import ConfigError, UserError
from mpress.hardware.server import load_hardware
from mpress.config.presets import HARDWARE_DIR


@pytest.mark.parametrize("preset", ["dgx1-v100", "dgx-a100", "hgx-h100"])
def test_gpu_presets_state_their_drives(preset):
    hw = load_hardware(preset)
    assert hw.has_nvme and hw.nvme_bytes > 1e12
    assert 0 < hw.nvme_gbps("write") <= hw.nvme_gbps("read")


def test_dgx1_drives_are_slower_than_one_pcie_uplink_and_a100s_faster():
    dgx1, a100 = load_hardware("dgx1-v100"), load_hardware("dgx-a100")
    assert dgx1.nvme_gbps("read") < dgx1.pcie_gbps("h2d")
    assert a100.nvme_gbps("read") > dgx1.nvme_gbps("read")


def test_cpu_local_has_none_and_asking_for_it_is_one_line():
    hw = load_hardware("cpu-local")
    assert not hw.has_nvme
    with pytest.raises(UserError, match="nvme"):
        hw.nvme_gbps("read")


def _write(tmp_path, **changes):
    data = yaml.safe_load((HARDWARE_DIR / "dgx-a100.yaml").read_text())
    data.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del data[k]
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("changes", "key"), [
    ({"nvme_read_gbps": None, "nvme_write_gbps": None}, "nvme_read_gbps"),
    ({"nvme_bytes": None, "nvme_write_gbps": None}, "nvme_bytes"),
    ({"nvme_bytes": -1}, "nvme_bytes"),
    ({"nvme_read_gbps": 0}, "nvme_read_gbps"),
])
def test_bad_drive_figures_name_the_key(tmp_path, changes, key):
    with pytest.raises(ConfigError, match=key):
        load_hardware(_write(tmp_path, **changes))
