"""Live-bytes accounting, and the predicted peak of a training step against the measured
one (within 10%) for plain and tiled execution."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpress.tiling.execute import TiledSequential
from mpress.tiling.graph import from_sequential, meta_clone
from mpress.tiling.memory import LiveBytes, cuda_peak_bytes, live_peak_bytes
from mpress.tiling.networks import darknet19, vgg16
from mpress.tiling.peak import PeakModel
from tests.support.tiling import step_peak_bytes


def test_live_bytes_counts_new_storages_not_views_and_frees_them():
    a = torch.ones(1000)
    with LiveBytes() as tracker:
        b = torch.empty(250)          # 1000 B
        view = b[10:20]               # a view: nothing new
        a.add_(1)                     # in place on a tensor from before: nothing new
        c = a * 2                     # 4000 B
        assert tracker.live_bytes == 5000
        del c
        assert tracker.live_bytes == 1000
        d = torch.cat([b, b])         # 2000 B
        del view, b, d
    assert tracker.live_bytes == 0 and tracker.peak_bytes == 5000
    assert live_peak_bytes(lambda: torch.empty(10, dtype=torch.float64)) == 80


def test_live_bytes_sees_autograd_saved_tensors_and_gradients():
    w = torch.randn(8, 3, 3, 3, requires_grad=True)
    x = torch.randn(1, 3, 16, 16)
    with LiveBytes() as tracker:
        y = torch.relu(F.conv2d(x, w, padding=1))  # conv output freed (not saved), relu output saved
        assert tracker.live_bytes == 8 * 16 * 16 * 4
        y.sum().backward()
        del y
    assert tracker.live_bytes == w.numel() * 4  # only w.grad is left
    assert tracker.peak_bytes >= 2 * 8 * 16 * 16 * 4


CASES = [
    ("vgg16/8 plain", lambda: vgg16(width_div=8), 80, None, False),
    ("vgg16/8 1 tile", lambda: vgg16(width_div=8), 80, 1, False),
    ("vgg16/8 3x3 tiles", lambda: vgg16(width_div=8), 83, 3, False),
    ("vgg16/8 2x2, input grad", lambda: vgg16(width_div=8), 64, 2, True),
    ("darknet19/16 2x3 tiles", lambda: darknet19(width_div=16), 75, (2, 3), False),
    ("conv chain 4x4", lambda: nn.Sequential(nn.Conv2d(3, 8, 5, stride=2, padding=2), nn.GELU(),
                                             nn.AvgPool2d(3, 2, 1), nn.Conv2d(8, 4, 3, padding=1), nn.Flatten()),
     97, 4, False),
]


@pytest.mark.parametrize("name,make,size,tiles,input_grad", CASES, ids=[c[0] for c in CASES])
def test_predicted_peak_within_ten_percent_of_measured(name, make, size, tiles, input_grad):
    torch.manual_seed(0)
    net = make()
    x = torch.randn(1, 3, size, size, requires_grad=input_grad)
    with torch.no_grad():
        target = torch.randn_like(net(x))
    if tiles is None:
        predicted = PeakModel(from_sequential(net, tuple(x.shape)), input_requires_grad=input_grad).predict([])
        model = net
    else:
        model = TiledSequential(net, num_tiles=tiles)
        plan = model.plan(tuple(x.shape), torch.float32, input_grad)
        assert plan.segments
        predicted = plan.prediction
    measured = step_peak_bytes(model, x, target)
    assert abs(predicted.peak_bytes - measured) <= 0.1 * measured, (predicted.peak_bytes, measured)


@pytest.mark.cuda
def test_predicted_peak_against_cuda_max_memory_allocated():
    device = torch.device("cuda")
    torch.manual_seed(0)
    net = vgg16(width_div=4).to(device)
    x = torch.randn(1, 3, 512, 512, device=device)
    target = torch.randn(1, 10, device=device)
    model = TiledSequential(net, budget_bytes=64 * 2**20)
    plan = model.plan(tuple(x.shape))
    assert plan.segments

    def step():
        for p in net.parameters():
            p.grad = None
        F.mse_loss(model(x), target).backward()

    step()  # warm-up: cuDNN picks its algorithms
    measured = cuda_peak_bytes(step, device)
    assert abs(plan.prediction.peak_bytes - measured) <= 0.1 * measured, (plan.prediction.peak_bytes, measured)


def test_planning_inside_a_measured_step_is_not_counted():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 64)
    target = torch.randn(1, 10)
    model = TiledSequential(vgg16(width_div=16), num_tiles=2)
    first = step_peak_bytes(model, x, target)  # plans on the meta device inside the tracked step
    assert first == step_peak_bytes(model, x, target)
    assert abs(model.plan(tuple(x.shape)).prediction.peak_bytes - first) <= 0.1 * first


def test_a_meta_device_dry_run_measures_what_the_model_predicts():
    net = meta_clone(vgg16(width_div=8))  # no data, no compute: how bench/sft.py sizes giant images
    model = TiledSequential(net, num_tiles=3)
    x = torch.empty(1, 3, 200, 200, device="meta")
    measured = step_peak_bytes(model, x, torch.empty(1, 10, device="meta"))
    predicted = model.plan(tuple(x.shape)).prediction.peak_bytes
    assert abs(predicted - measured) <= 0.1 * measured
