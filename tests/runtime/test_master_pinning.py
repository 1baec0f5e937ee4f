"""Host copies of accelerator parameters (`optimizer_step: host`): only what crosses PCIe
is page-locked. The staging buffer (the parameter's dtype) carries gradients device ->
host and rounded parameters host -> device, so it is pinned; the fp32 master the CPU's
Adam steps never leaves the host, so pinning it would only take page-locked memory from
the machine (and, through torch's pinned allocator, round it up to a power of two).

The CPU test fakes "this parameter is on an accelerator" and records what is asked to be
pinned (a CPU-only torch cannot pin); the CUDA test checks the real buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpress.runtime import master_weights
from mpress.runtime.master_weights import MasterWeights

SHAPES = {"w": (512, 257), "b": (257,)}


def adam(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(tensors, lr=1e-2)


def params(dtype: torch.dtype, device: str = "cpu") -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return {n: nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for n, s in SHAPES.items()}


@pytest.fixture
def pin_requests(monkeypatch):
    """Storage data pointer -> bytes of every buffer asked to be pinned (`torch.empty(...,
    pin_memory=True)` or `Tensor.pin_memory()`), made unpinned (no CUDA here)."""
    pinned: dict[int, int] = {}
    real_empty = torch.empty

    def empty(*args, pin_memory: bool = False, **kwargs):
        t = real_empty(*args, **kwargs)
        if pin_memory:
            pinned[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def pin_memory(self, *args, **kwargs):
        t = self.clone()
        pinned[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return pinned


def test_host_copies_of_accelerator_parameters_pin_only_the_staging_buffers(monkeypatch, pin_requests):
    monkeypatch.setattr(master_weights, "_on_accelerator", lambda p: True)
    ps = params(torch.bfloat16)
    mw = MasterWeights(ps, adam, host=list(ps))
    for name, p in ps.items():
        target = mw.target(name)
        assert target.dtype == torch.float32 and target.device.type == "cpu"
        pinned = target.untyped_storage().data_ptr() in pin_requests
        assert not pinned, f"master {name} is pinned though it never crosses PCIe"
    # one pinned staging buffer per parameter, in the parameter's dtype (half the master's bytes)
    assert sorted(pin_requests.values()) == sorted(p.numel() * p.element_size() for p in ps.values())


def test_host_copies_of_cpu_parameters_pin_nothing(pin_requests):
    ps = params(torch.bfloat16)
    MasterWeights(ps, adam, host=list(ps))
    assert pin_requests == {}


@pytest.mark.cuda
def test_cuda_host_copies_pin_the_staging_buffer_not_the_master():
    ps = params(torch.bfloat16, "cuda")
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    mw = MasterWeights(ps, adam, host=list(ps))
    pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before
    staging = sum(p.numel() * p.element_size() for p in ps.values())
    masters = sum(p.numel() * 4 for p in ps.values())
    for name in ps:
        assert not mw.target(name).is_pinned(), name
    # torch's pinned allocator rounds each block up to a power of two (and may reuse a
    # cached one): at most twice the staging bytes, below staging + masters
    assert pinned <= 2 * staging < staging + masters
