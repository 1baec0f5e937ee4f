"""Tiled execution equals untiled training: outputs, input gradients and weight gradients,
for random conv/pool pipelines, odd image sizes and tile counts, and for budget plans."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from mpress.errors import TilingError
from mpress.tiling.execute import TiledSequential
from mpress.tiling.networks import FrozenBatchNorm2d, darknet19, vgg16
from tests.support.tiling import step_peak_bytes


def _grads(model, x, target_seed=0):
    """Output, input gradient and parameter gradients of a random linear loss."""
    x = x.detach().clone().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    y = model(x)
    w = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(target_seed))
    (y * w).sum().backward()
    return y.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def _assert_same(ref, got, rtol, atol=1e-12):
    """Max difference within rtol of the tensor's largest value (atol: for gradients that
    are zero up to rounding, such as a bias in front of training-mode BatchNorm)."""
    (y0, gx0, gp0), (y1, gx1, gp1) = ref, got
    for a, b in [(y0, y1), (gx0, gx1)] + list(zip(gp0, gp1)):
        scale = a.abs().max().item() or 1.0
        assert (a - b).abs().max().item() <= rtol * scale + atol


@st.composite
def conv_pipelines(draw):
    """A random chain of convolutions, pools and activations with valid shapes."""
    channels = draw(st.integers(1, 3))
    c = channels
    layers = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["conv", "conv", "conv", "max", "avg"]))
        k = draw(st.integers(1, 4))
        s = draw(st.integers(1, 3))
        if kind == "conv":
            d = draw(st.integers(1, 2))
            out = draw(st.integers(1, 3))
            layers.append(nn.Conv2d(c, out, k, stride=s, padding=draw(st.integers(0, d * (k - 1))), dilation=d,
                                    bias=draw(st.booleans())))
            c = out
        elif kind == "max":
            layers.append(nn.MaxPool2d(k, stride=s, padding=draw(st.integers(0, k // 2)),
                                       ceil_mode=draw(st.booleans())))
        else:
            layers.append(nn.AvgPool2d(k, stride=s, padding=draw(st.integers(0, k // 2))))
        act = draw(st.sampled_from([None, nn.ReLU(), nn.GELU(), nn.LeakyReLU(0.1)]))
        if act is not None:
            layers.append(act)
    return channels, nn.Sequential(*layers)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(net=conv_pipelines(), h=st.integers(9, 40), w=st.integers(9, 40), nh=st.integers(1, 5),
       nw=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_random_pipelines_match_untiled_in_float64(net, h, w, nh, nw, seed):
    channels, model = net
    model = model.double()
    torch.manual_seed(seed)
    x = torch.randn(2, channels, h, w, dtype=torch.float64)
    try:
        with torch.no_grad():
            model(x)
    except RuntimeError:
        assume(False)  # the image is too small for this pipeline
    ref = _grads(model, x)
    got = _grads(TiledSequential(model, num_tiles=(nh, nw)), x)
    _assert_same(ref, got, rtol=1e-10)


def test_vgg_style_float32_allclose_and_really_tiled():
    torch.manual_seed(0)
    model = vgg16(width_div=16)
    x = torch.randn(1, 3, 101, 77)  # 3 x 2 after five pools: odd sizes, uneven tiles
    tiled = TiledSequential(model, num_tiles=3)
    plan = tiled.plan(tuple(x.shape), torch.float32, True)
    assert [s.num_tiles for s in plan.segments] == [(3, 2)]
    ref = _grads(model, x)
    got = _grads(tiled, x)
    y0, gx0, gp0 = ref
    y1, gx1, gp1 = got
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-5)
    for a, b in zip(gp0, gp1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_frozen_and_eval_batchnorm_tile_training_batchnorm_ends_segments():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(4, 4, 3, padding=1), FrozenBatchNorm2d(4), nn.ReLU()).double()
    with torch.no_grad():  # non-trivial frozen statistics
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
        model[5].running_mean.uniform_(-1, 1)
    x = torch.randn(2, 2, 21, 19, dtype=torch.float64)
    model[1].eval()
    tiled = TiledSequential(model, num_tiles=3)
    assert [s.segment.positions for s in tiled.plan(tuple(x.shape), torch.float64, True).segments] == [
        tuple(range(7))]
    _assert_same(_grads(model, x), _grads(tiled, x), rtol=1e-10)
    model[1].train()  # batch statistics: the plan changes, BatchNorm runs untiled between two segments
    plan = tiled.plan(tuple(x.shape), torch.float64, True)
    assert [s.segment.positions for s in plan.segments] == [(0,), (2, 3, 4, 5, 6)]
    assert "training mode" in plan.graph.nodes[1].spec.reason
    ref_model = copy.deepcopy(model)
    _assert_same(_grads(ref_model, x), _grads(tiled, x), rtol=1e-10)


def test_budget_plan_trains_like_plain_and_stays_under_its_budget():
    torch.manual_seed(2)
    model = vgg16(width_div=16)
    x = torch.randn(1, 3, 96, 96)
    target = torch.randn(1, 10)
    plain_peak = step_peak_bytes(model, x, target)
    budget = plain_peak // 2
    tiled = TiledSequential(model, budget_bytes=budget)
    plan = tiled.plan(tuple(x.shape))
    assert plan.segments and plan.prediction.peak_bytes <= budget
    ref = [p.detach().clone() for p in _sgd_steps(copy.deepcopy(model), x, target)]
    got = _sgd_steps(tiled, x, target)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    measured = step_peak_bytes(tiled, x, target)
    assert measured <= budget
    assert abs(plan.prediction.peak_bytes - measured) <= 0.1 * measured


def _sgd_steps(model, x, target, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), target).backward()
        opt.step()
    return list(model.parameters())


def test_darknet_with_leaky_relu_and_frozen_bn_matches():
    torch.manual_seed(3)
    model = darknet19(width_div=32).double()
    x = torch.randn(1, 3, 70, 70, dtype=torch.float64)
    _assert_same(_grads(model, x), _grads(TiledSequential(model, num_tiles=(2, 3)), x), rtol=1e-10)


def test_autocast_state_is_replayed_in_the_recompute():
    torch.manual_seed(4)
    model = vgg16(width_div=16)
    ref = copy.deepcopy(model)
    x = torch.randn(1, 3, 96, 96)
    losses = []
    for m in (ref, TiledSequential(model, num_tiles=2)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
            loss = F.mse_loss(y.float(), torch.zeros(1, 10))
        assert y.dtype == torch.bfloat16
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
    for a, b in zip(ref.parameters(), model.parameters()):
        # bf16 rounding differs between whole images and tiles; fp32 recompute would be far off
        assert (a.grad - b.grad).abs().max() <= 0.05 * a.grad.abs().max()


def test_options_are_checked():
    with pytest.raises(TilingError):
        TiledSequential(nn.Sequential(nn.ReLU()))
    with pytest.raises(TilingError):
        TiledSequential(nn.Sequential(nn.ReLU()), budget_bytes=10, num_tiles=2)
    with pytest.raises(TilingError):
        TiledSequential(nn.Sequential(nn.ReLU()), budget_bytes=0)
    tiny = TiledSequential(vgg16(width_div=16), budget_bytes=1000)
    with pytest.raises(TilingError, match="does not fit: budget 1 KB, plain training needs"):
        tiny(torch.randn(1, 3, 64, 64))
