"""The ZeRO baselines' channel model (`mpress.static.baselines.zero_time`), on literal inputs (pure)."""

from dataclasses import replace

import pytest

from mpress.hardware.server import load_hardware
from mpress.static.baselines.zero_time import LayerStep, Load, Rates, load_s, pipelined_s, server_rates

RATES = Rates(h2d_gbps=1.0, d2h_gbps=2.0, ring_gbps=10.0, host_gbps=4.0, nvme_read_gbps=0.5, nvme_write_gbps=0.25)
GB = 1e9


def test_the_busiest_channel_bounds_a_load():
    assert load_s(Load(h2d=1 * GB, d2h=1 * GB, ring=5 * GB), RATES) == pytest.approx(1.0)
    assert load_s(Load(host=8 * GB), RATES) == pytest.approx(2.0)
    assert load_s(Load(nvme_write=1 * GB), RATES) == pytest.approx(4.0)


def test_drives_on_a_server_without_them_is_an_error():
    with pytest.raises(ValueError):
        load_s(Load(nvme_read=1), replace(RATES, nvme_read_gbps=None))


def test_a_pass_hides_fetches_and_drains_behind_compute_except_the_first_and_last():
    fetch, drain = Load(h2d=0.5 * GB), Load(d2h=1 * GB)  # 0.5 s each
    steps = [LayerStep(compute_s=1.0, fetch=fetch, drain=drain) for _ in range(3)]
    # exposed first fetch 0.5 + 3 x max(1.0, next fetch 0.5 + previous drain 0.5 on other channels) + last drain 0.5
    assert pipelined_s(steps, RATES) == pytest.approx(0.5 + 3 * 1.0 + 0.5)


def test_copies_longer_than_compute_bound_the_pass():
    steps = [LayerStep(compute_s=0.1, fetch=Load(h2d=1 * GB)) for _ in range(4)]
    assert pipelined_s(steps, RATES) == pytest.approx(4 * 1.0 + 0.1)  # 4 fetches, then the last compute
    assert pipelined_s([], RATES) == 0.0


def test_server_rates_share_pcie_between_a_switchs_gpus_and_use_every_nvlink():
    dgx1 = server_rates(load_hardware("dgx1-v100"))
    hw = load_hardware("dgx1-v100")
    assert dgx1.h2d_gbps == pytest.approx(hw.pcie_gbps("h2d") / 2)  # two GPUs per switch
    assert dgx1.ring_gbps == pytest.approx(6 * 25.0 * 0.9)  # six NVLink2 links per GPU
    h100 = load_hardware("hgx-h100")
    assert server_rates(h100).h2d_gbps == pytest.approx(h100.pcie_gbps("h2d"))  # an uplink each
    assert server_rates(h100).ring_gbps == pytest.approx(18 * 25.0 * 0.9)
