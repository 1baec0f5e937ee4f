"""MasterWeights on one process: what the optimizer steps (parameters, fp32 masters on the
device, host copies), the copies around the step, checkpoints, release/restore."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpress.errors import SwapError, UserError
from mpress.runtime.master_weights import Kind, MasterWeights

SHAPES = {"w": (8, 5), "b": (5,), "ln": (3, 4)}


def adam(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(tensors, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def make_params(dtype: torch.dtype, device: str = "cpu") -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return {n: nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for n, s in SHAPES.items()}


def grads(step: int, params: dict[str, nn.Parameter], skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Deterministic gradients of step `step` in each parameter's dtype and device."""
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)
            for n, p in params.items() if n not in skip}


def train(mw: MasterWeights, params: dict[str, nn.Parameter], steps: range, skip: tuple[str, ...] = ()) -> None:
    for step in steps:
        for n, g in grads(step, params, skip).items():
            params[n].grad = g.clone()
        mw.step()


def reference_fp32(dtype: torch.dtype, steps: range, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Adam on fp32 tensors (upcast from the `dtype` initial values) with the upcast
    gradients: what a master-weight step must compute, written out independently."""
    half = make_params(dtype)
    ref = {n: p.detach().float().clone() for n, p in half.items()}
    opt = adam(list(ref.values()))
    for step in steps:
        for n, g in grads(step, half, skip).items():
            ref[n].grad = g.float()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ref


def test_fp32_parameters_are_stepped_in_place_like_plain_adam():
    params = make_params(torch.float32)
    mw = MasterWeights(params, adam)
    assert all(mw.kind(n) is Kind.PARAM and mw.target(n) is params[n] for n in params)
    train(mw, params, range(3))
    ref = reference_fp32(torch.float32, range(3))
    for n, p in params.items():
        assert torch.equal(p.detach(), ref[n]), n
        assert p.grad is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_parameters_get_fp32_masters_rounded_into_them(dtype):
    params = make_params(dtype)
    mw = MasterWeights(params, adam)
    assert all(mw.kind(n) is Kind.DEVICE_MASTER and mw.target(n).dtype == torch.float32 for n in params)
    train(mw, params, range(4))
    ref = reference_fp32(dtype, range(4))
    for n, p in params.items():
        assert torch.equal(mw.target(n), ref[n]), n
        assert torch.equal(p.detach(), ref[n].to(dtype)), n
        assert p.dtype == dtype and p.grad is None and mw.target(n).grad is None
    # the masters hold more than their rounding: they are not the parameters upcast
    assert any(not torch.equal(mw.target(n), p.detach().float()) for n, p in params.items())


def test_masters_keep_updates_too_small_for_bf16():
    """A step of 1e-3 on 1.0 is under half a bf16 ulp (2^-8): Adam on the bf16 parameter
    itself never moves it, the fp32 master accumulates the steps until the rounded value does."""
    def run(with_masters: bool) -> torch.Tensor:
        p = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        make = lambda ts: torch.optim.Adam(ts, lr=1e-3)  # noqa: E731
        mw = MasterWeights({"p": p}, make) if with_masters else None
        opt = None if with_masters else make([p])
        for _ in range(6):
            p.grad = torch.ones(4, dtype=torch.bfloat16)
            if mw is not None:
                mw.step()
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return p.detach()

    assert torch.equal(run(False), torch.ones(4, dtype=torch.bfloat16))
    assert (run(True) < 1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_copies_are_separate_tensors_and_step_identically(dtype):
    device_params, host_params = make_params(dtype), make_params(dtype)
    on_device = MasterWeights(device_params, adam)
    on_host = MasterWeights(host_params, adam, host=list(host_params))
    for n, p in host_params.items():
        target = on_host.target(n)
        assert on_host.kind(n) is Kind.HOST_COPY and target.device.type == "cpu"
        assert target.dtype == torch.float32 and target.data_ptr() != p.data_ptr()
    train(on_device, device_params, range(3))
    train(on_host, host_params, range(3))
    for n in SHAPES:
        assert torch.equal(host_params[n].detach(), device_params[n].detach()), n
        assert torch.equal(on_host.target(n), on_device.target(n).float()), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(on_host.optimizer.state[on_host.target(n)][k],
                               on_device.optimizer.state[on_device.target(n)][k]), (n, k)


@pytest.mark.parametrize("host", [False, True])
def test_a_parameter_without_gradient_is_skipped(host):
    params = make_params(torch.bfloat16)
    before = params["b"].detach().clone()
    mw = MasterWeights(params, adam, host=list(params) if host else ())
    train(mw, params, range(2), skip=("b",))
    assert torch.equal(params["b"].detach(), before)
    assert mw.target("b") not in mw.optimizer.state
    ref = reference_fp32(torch.bfloat16, range(2), skip=("b",))
    assert torch.equal(mw.target("w"), ref["w"])


@pytest.mark.parametrize("host", [False, True])
def test_checkpoint_with_masters_continues_identically(host):
    params = make_params(torch.bfloat16)
    mw = MasterWeights(params, adam, host=list(params) if host else ())
    train(mw, params, range(2))
    saved = {"params": {n: p.detach().clone() for n, p in params.items()}, "masters": mw.state_dict(),
             "optimizer": copy.deepcopy(mw.optimizer.state_dict())}  # it shares the live states
    assert set(saved["masters"]) == set(SHAPES)
    assert all(t.dtype == torch.float32 for t in saved["masters"].values())

    def resumed(masters: dict) -> dict[str, nn.Parameter]:
        fresh = make_params(torch.bfloat16)
        with torch.no_grad():
            for n, p in fresh.items():
                p.copy_(saved["params"][n])
        other = MasterWeights(fresh, adam, host=list(fresh) if host else ())
        other.load_state_dict(masters)
        other.optimizer.load_state_dict(saved["optimizer"])
        train(other, fresh, range(2, 4))
        return fresh

    train(mw, params, range(2, 4))
    with_masters, without = resumed(saved["masters"]), resumed({})
    assert all(torch.equal(with_masters[n].detach(), params[n].detach()) for n in SHAPES)
    # masters re-made from the rounded parameters lose what rounding dropped
    assert not all(torch.equal(without[n].detach(), params[n].detach()) for n in SHAPES)


def test_released_masters_keep_their_identity_and_come_back():
    params = make_params(torch.bfloat16)
    mw = MasterWeights(params, adam)
    train(mw, params, range(1))
    master = mw.target("w")
    value = master.clone()
    data = mw.release("w")
    assert master.numel() == 0 and torch.equal(data, value)
    mw.restore("w", data.clone())  # a copy, as a swap-in would bring back
    assert mw.target("w") is master and torch.equal(master, value)
    train(mw, params, range(1, 3))
    ref = reference_fp32(torch.bfloat16, range(3))
    assert torch.equal(mw.target("w"), ref["w"])


def test_wrong_uses_are_refused():
    params = make_params(torch.float32)
    with pytest.raises(UserError, match="unknown parameters: nope"):
        MasterWeights(params, adam, host=["nope"])
    mw = MasterWeights(params, adam)
    with pytest.raises(UserError, match="only a device master"):
        mw.release("w")
    with pytest.raises(UserError, match="unknown parameters: x"):
        mw.load_state_dict({"x": torch.zeros(1)})
    half_params = make_params(torch.bfloat16)
    half = MasterWeights(half_params, adam)
    with pytest.raises(UserError, match="not released"):
        half.restore("w", torch.zeros(SHAPES["w"]))
    data = half.release("w")
    with pytest.raises(UserError, match="cannot restore"):
        half.restore("w", torch.zeros(3))
    with pytest.raises(UserError, match="released"):
        half.release("w")
    for action in (half.step, half.state_dict, lambda: half.load_state_dict({})):
        with pytest.raises(SwapError, match="master weights of w are off the device"):
            action()
    half.restore("w", data)
    half.state_dict()


@pytest.mark.cuda
def test_cuda_host_step_equals_the_cpu_step():
    gpu = make_params(torch.bfloat16, "cuda")
    mw = MasterWeights(gpu, adam, host=list(gpu))
    # the masters are pageable host memory (only staging crosses PCIe: test_master_pinning.py)
    assert all(not mw.target(n).is_pinned() and mw.target(n).device.type == "cpu" for n in gpu)
    train(mw, gpu, range(3))
    cpu = make_params(torch.bfloat16)
    ref = MasterWeights(cpu, adam, host=list(cpu))
    train(ref, cpu, range(3))
    for n in SHAPES:
        assert gpu[n].device.type == "cuda"
        assert torch.equal(gpu[n].detach().cpu(), cpu[n].detach()), n
        assert torch.equal(mw.target(n), ref.target(n)), n
