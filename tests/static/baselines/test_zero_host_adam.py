"""The host (CPU) Adam step's time: host DRAM traffic over its bandwidth."""

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mpress.errors import UserError
from mpress.hardware.server import load_hardware
from mpress.static.emulate.host_adam import HOST_ADAM_BYTES_PER_PARAM, host_adam_step_s


class _Traffic(TorchDispatchMode):
    """Per-element bytes the ops run under it read and write, observed: every tensor argument
    of `numel` elements is read whole; what it holds after the op that differs from before
    was written (scalars such as Adam's step counters are left out)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.read, self.written = numel, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor) and t.numel() == self.numel]
        before = [t.clone() for t in flat]
        out = func(*args, **(kwargs or {}))
        for t, b in zip(flat, before):
            self.read += t.numel() * t.element_size()
            self.written += int((t != b).sum()) * t.element_size()
        return out


def test_bytes_per_param_are_a_fused_cpu_adams_observed_loads_and_stores_and_the_fp16_copy():
    """DeepSpeed's `Step_AVX` (csrc/includes/cpu_adam.h) is one pass per element: simd_load of
    grads, _exp_avg, _exp_avg_sq, _params and simd_store of _params, _exp_avg, _exp_avg_sq.
    torch's fused CPU Adam is the same kind of single-pass kernel, so its observed traffic
    per element is that pass's; the fp16 copy of the updated parameter (DeepSpeed's
    `param_buffer_of_bit16_for_cpu_offload_groups`) adds its store (`zero.py` counts the
    re-read of the fp32 parameter it takes)."""
    n = 4096
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.Adam([p], lr=1e-3, fused=True)
    opt.step()  # creates the moments (not part of a step's traffic)
    p.grad = torch.randn(n)
    adam = _Traffic(n)
    with adam:
        opt.step()
    copy = _Traffic(n)
    half = torch.zeros(n, dtype=torch.float16)
    with copy:
        half.copy_(p.detach())
    assert (adam.read // n, adam.written // n) == (4 * 4, 3 * 4)  # param, grad, moments in; param, moments out
    assert copy.written // n == 2
    assert HOST_ADAM_BYTES_PER_PARAM == (adam.read + adam.written + copy.written) // n


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
        host_adam_step_s(10, replace(load_hardware("cpu-local"), host_memory_gbps=None))


def test_bad_arguments():
    hw = load_hardware("dgx1-v100")
    with pytest.raises(ValueError):
        host_adam_step_s(-1, hw)
    with pytest.raises(ValueError):
        host_adam_step_s(1, hw, sharers=0)
