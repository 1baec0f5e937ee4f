"""The host (CPU) Adam step's time: host DRAM traffic over its bandwidth."""

import pytest

from mpress.errors import UserError
from mpress.hardware import load_hardware
from mpress.static.host_adam import HOST_ADAM_BYTES_PER_PARAM, host_adam_step_s


def test_bytes_per_param_are_deepspeed_cpu_adams_loads_and_stores():
    # fp32 param, grad, exp_avg, exp_avg_sq read; param, exp_avg, exp_avg_sq written; fp16 copy written
    assert HOST_ADAM_BYTES_PER_PARAM == 4 * 4 + 3 * 4 + 2


def test_time_is_traffic_over_host_dram_bandwidth():
    hw = load_hardware("dgx1-v100")
    n = 1_000_000_000
    assert host_adam_step_s(n, hw) == pytest.approx(n * 30 / (hw.host_memory_gbps * 1e9))


def test_sharers_divide_the_bandwidth():
    hw = load_hardware("dgx-a100")
    one = host_adam_step_s(10**8, hw)
    assert host_adam_step_s(10**8, hw, sharers=8) == pytest.approx(8 * one)
    # 8 ranks each stepping 1/8 of the parameters at once take as long as one rank stepping all
    assert host_adam_step_s(10**8 // 8, hw, sharers=8) == pytest.approx(one)


def test_no_params_no_time():
    assert host_adam_step_s(0, load_hardware("dgx1-v100")) == 0.0


def test_hardware_without_host_bandwidth_is_refused_in_one_line():
    with pytest.raises(UserError, match="host_memory_gbps"):
        host_adam_step_s(10, load_hardware("cpu-local"))


def test_bad_arguments():
    hw = load_hardware("dgx1-v100")
    with pytest.raises(ValueError):
        host_adam_step_s(-1, hw)
    with pytest.raises(ValueError):
        host_adam_step_s(1, hw, sharers=0)
