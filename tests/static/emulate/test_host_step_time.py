"""The host step's CPU time (`static/emulate/host_step_time.py`) counts the host memory traffic of
what the runtime runs: `MasterWeights.step` over host copies (`runtime/master_weights.py`
HOST_COPY, torch's Adam as the trainer builds it), as on a GPU run (pinned staging
buffers). Every operator the step dispatches is counted with a dispatch mode: bytes of
the tensors it reads and of those it writes, views free, the DMA copies between the
staging buffers and the device (the step's transfers, timed apart) left out."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mpress.errors import UserError
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.models.transformer import build_stage
from mpress.runtime import master_weights
from mpress.runtime.master_weights import MasterWeights
from mpress.static.emulate.host_adam import HOST_ADAM_BYTES_PER_PARAM
from mpress.static.emulate.host_step_time import host_step_bytes, host_step_s
from tests.support.cuda_fakes import FakeCudart, FakeEvent as _Event, as_if_cuda
from tests.support.tiny_pipeline import MODEL, RANGES


class _Traffic(TorchDispatchMode):
    """Bytes read and written by the operators dispatched inside it: an operator reads
    its distinct tensor arguments (a copy_ not its destination) and writes its outputs;
    views move nothing; scalars (0-dim: Adam's step counter) are not counted. Copies
    into or out of a tensor of `device` (their data pointers) are the DMA's: skipped."""

    def __init__(self, device: set[int]) -> None:
        super().__init__()
        self.device = device
        self.read = self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
        if func is torch.ops.aten.copy_.default:
            if {inputs[0].data_ptr(), inputs[1].data_ptr()} & self.device:
                return out
            inputs = inputs[1:]  # copy_ does not read its destination
        seen = {t.data_ptr(): t for t in inputs}
        self.read += sum(t.numel() * t.element_size() for t in seen.values())
        self.written += sum(t.numel() * t.element_size() for t in outputs)
        return out


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """Host copies get their staging buffers (pinned by a fake CUDA runtime: no CUDA
    here), as on a GPU run."""
    as_if_cuda(monkeypatch, FakeCudart())
    monkeypatch.setattr(master_weights, "_on_accelerator", lambda p: True)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_host_step_costs_the_bytes_the_runtimes_step_moves(as_on_a_gpu, precision):
    cfg = dataclasses.replace(load_model_config(MODEL), precision=precision)
    module = build_stage(cfg, *RANGES[2][0], seed=0)
    params = dict(module.named_parameters())
    mw = MasterWeights(params, lambda ts: torch.optim.Adam(ts, lr=1e-3), host=list(params))  # the trainer's Adam

    def step() -> _Traffic:
        for p in params.values():
            p.grad = torch.randn_like(p)
        device = {p.data_ptr() for p in params.values()} | {p.grad.data_ptr() for p in params.values()}
        with _Traffic(device) as traffic:
            mw.step()
        return traffic

    step()  # Adam makes its states at its first step
    traffic = step()
    num_params = sum(p.numel() for p in params.values())
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    assert traffic.read + traffic.written == host_step_bytes(num_params, param_bytes)
    # far more than DeepSpeed's fused cpu_adam moves (the ZeRO baselines' step)
    assert host_step_bytes(num_params, param_bytes) > 2 * HOST_ADAM_BYTES_PER_PARAM * num_params


def test_the_step_takes_its_bytes_over_the_shared_host_memory_bandwidth():
    hw = dataclasses.replace(load_hardware("dgx1-v100"), host_memory_gbps=100.0)
    n = 1_000_000
    assert host_step_s(n, 2 * n, hw) == pytest.approx(host_step_bytes(n, 2 * n) / 100e9)
    assert host_step_s(n, 2 * n, hw, sharers=4) == pytest.approx(4 * host_step_s(n, 2 * n, hw))
    assert host_step_s(0, 0, hw) == 0.0


def test_hardware_without_a_host_memory_bandwidth_cannot_time_it():
    hw = dataclasses.replace(load_hardware("dgx1-v100"), host_memory_gbps=None)
    with pytest.raises(UserError, match="dgx1-v100.*host_memory_gbps") as err:
        host_step_s(10, 20, hw)
    assert "\n" not in str(err.value)
