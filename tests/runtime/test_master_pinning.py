"""Host copies of accelerator parameters (`optimizer_step: host`): only what crosses PCIe
is page-locked. The staging buffer (the parameter's dtype) carries gradients device ->
host and rounded parameters host -> device, so it is pinned; the fp32 master the CPU's
Adam steps never leaves the host, so pinning it would only take page-locked memory from
the machine. The staging buffers of a group (a stage) are views of one slab pinned in
place to the pool alignment (`PinnedHostPool`), not one buffer each through torch's
pinned allocator, which rounds every allocation up to a power of two.

The CPU test fakes "this parameter is on an accelerator" and CUDA's runtime, recording
what is page-locked (a CPU-only torch cannot pin); the CUDA test checks the real buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpress.errors import UserError
from mpress.runtime import master_weights
from mpress.runtime.master_weights import MasterWeights
from mpress.config.units import ALIGNMENT_BYTES, round_up
from tests.support.cuda_fakes import FakeCudart, FakeEvent as _Event, as_if_cuda

SHAPES = {"w": (512, 257), "b": (257,)}


def adam(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(tensors, lr=1e-2)


def params(dtype: torch.dtype, device: str = "cpu") -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return {n: nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for n, s in SHAPES.items()}


@pytest.fixture
def pinning(monkeypatch):
    """(fake CUDA runtime recording what `cudaHostRegister` page-locks, storage data pointer
    -> bytes of every buffer asked of torch's pinned allocator: `torch.empty(...,
    pin_memory=True)` or `Tensor.pin_memory()`, made unpinned), as on a GPU."""
    cudart = FakeCudart()
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
    as_if_cuda(monkeypatch, cudart)
    return cudart, pinned


def staging_bytes(ps: dict[str, nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in ps.values())


def test_host_copies_of_accelerator_parameters_pin_one_slab_of_staging_buffers(monkeypatch, pinning):
    cudart, torch_pinned = pinning
    monkeypatch.setattr(master_weights, "_on_accelerator", lambda p: True)
    ps = params(torch.bfloat16)
    mw = MasterWeights(ps, adam, host=list(ps))
    for name, p in ps.items():
        target = mw.target(name)
        assert target.dtype == torch.float32 and target.device.type == "cpu"
        assert not target.untyped_storage().data_ptr() in torch_pinned, f"master {name} is pinned"
    # nothing through torch's pinned allocator: one slab, the staging bytes (parameters'
    # dtype: half the masters') up to the pool alignment, page-locked in place
    assert torch_pinned == {}
    assert list(cudart.registered.values()) == [round_up(staging_bytes(ps), ALIGNMENT_BYTES)]
    slab = mw.slabs[0].buffer
    for name, p in ps.items():  # a view of the slab each, its own bytes
        staging = mw._entry(name).staging
        assert staging.dtype == p.dtype and staging.shape == p.shape and staging.is_contiguous()
        assert staging.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()
    spans = sorted((mw._entry(n).staging.data_ptr(), p.numel() * p.element_size()) for n, p in ps.items())
    assert all(a + n <= b for (a, n), (b, _m) in zip(spans, spans[1:]))  # disjoint
    # a step runs through them: the parameters are the rounded masters
    for p in ps.values():
        p.grad = torch.ones_like(p)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    _Event.made = []
    mw.step()
    assert all(torch.equal(p, mw.target(n).to(p.dtype)) for n, p in ps.items())
    # the host waits for the gradients' copies on a blocking-sync event: it sleeps in
    # cudaEventSynchronize rather than spinning on a core the host Adam needs
    assert _Event.made == [{"blocking": True}]
    mw.close()
    assert cudart.registered == {}


def test_each_slab_is_one_group_of_parameters(monkeypatch, pinning):
    cudart, _torch_pinned = pinning
    monkeypatch.setattr(master_weights, "_on_accelerator", lambda p: True)
    ps = {**{f"a.{n}": p for n, p in params(torch.bfloat16).items()},
          **{f"b.{n}": p for n, p in params(torch.float32).items()}}
    mw = MasterWeights(ps, adam, host=list(ps), slabs=[["a.w", "a.b"], ["b.w", "b.b"]])
    assert len(mw.slabs) == 2
    a, b = ({n: ps[n] for n in ps if n.startswith(x)} for x in ("a.", "b."))
    assert sorted(cudart.registered.values()) == sorted(round_up(staging_bytes(g), ALIGNMENT_BYTES)
                                                        for g in (a, b))
    with pytest.raises(UserError, match="staging slabs: a.w"):
        MasterWeights(ps, adam, host=["b.w"], slabs=[["a.w"]])


def test_host_copies_of_cpu_parameters_pin_nothing(pinning):
    cudart, torch_pinned = pinning
    ps = params(torch.bfloat16)
    mw = MasterWeights(ps, adam, host=list(ps))
    assert torch_pinned == {} and cudart.registered == {} and mw.slabs == []


@pytest.mark.cuda
def test_cuda_host_copies_pin_the_staging_buffers_not_the_master():
    ps = params(torch.bfloat16, "cuda")
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    mw = MasterWeights(ps, adam, host=list(ps))
    # nothing through torch's pinned allocator; the slab pinned in place, to the byte
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    assert [slab.pinned_bytes for slab in mw.slabs] == [round_up(staging_bytes(ps), ALIGNMENT_BYTES)]
    for name in ps:
        assert not mw.target(name).is_pinned(), name
        assert mw._entry(name).staging.is_pinned(), name
    mw.close()
