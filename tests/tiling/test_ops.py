"""Operator characterisation for fused-tiled execution: (scale, delta) per dimension and
direction, tileability, and the exactness of one operator run on a padded slice."""

from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mpress.tiling.networks import FrozenBatchNorm2d
from mpress.tiling.ops import Window, characterise_module, scale_delta_table


def _table(module):
    return {(i, o, d): (s, dl) for i, o, d, s, dl in scale_delta_table(characterise_module(module, (4,)))}


def test_conv_same_3x3_matches_sft_paper_values():
    t = _table(nn.Conv2d(4, 8, 3, padding=1))
    # batch (1, 0); H/W forward delta 2f, input-grad delta 2f, weight-grad delta 0; no channel link
    assert t[(0, 0, "forward")] == (1, 0)
    for d in (2, 3):
        assert t[(d, d, "forward")] == (1, 2)
        assert t[(d, d, "input_grad")] == (1, 2)
        assert t[(d, d, "weight_grad")] == (1, 0)
    assert not any(k[0] == 1 for k in t)


def test_strided_dilated_conv_and_pool_scales():
    t = _table(nn.Conv2d(2, 2, 5, stride=2, padding=3, dilation=2))
    # span = 2*(5-1)+1 = 9: forward (2, 7); input gradient (1/2, (9+2-2)/2)
    assert t[(2, 2, "forward")] == (2, 7)
    assert t[(3, 3, "input_grad")] == (Fraction(1, 2), Fraction(9, 2))
    p = _table(nn.MaxPool2d(3, stride=3))
    assert p[(2, 2, "forward")] == (3, 0)
    assert p[(1, 1, "forward")] == (1, 0)  # pooling keeps channels independent


@pytest.mark.parametrize("module", [nn.ReLU(), nn.GELU(), nn.LeakyReLU(0.2), nn.SiLU(), FrozenBatchNorm2d(3),
                                    nn.BatchNorm2d(3).eval(), nn.Dropout(0.5).eval()])
def test_elementwise_ops_tile_every_dimension(module):
    spec = characterise_module(module, (4,))
    assert spec.tileable
    assert {(link.in_dim, link.out_dim) for link in spec.links()} == {(d, d) for d in range(4)}
    assert all(link.window is None for link in spec.links())


@pytest.mark.parametrize("module,kept", [
    (nn.Linear(7, 5), {0, 1, 2}),            # on NCHW: acts on W only
    (nn.AdaptiveAvgPool2d(1), {0, 1}),
    (nn.AdaptiveMaxPool2d(3), {0, 1}),
    (nn.Flatten(), {0}),
    (nn.Softmax(dim=2), {0, 1, 3}),
    (nn.BatchNorm2d(3).train(), {1}),
    (nn.Dropout(0.5).train(), set()),
    (nn.AvgPool2d(3, 2, 1, count_include_pad=False), {0, 1, 2, 3}),
    (nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"), {0, 2, 3}),
])
def test_non_tileable_ops_say_why(module, kept):
    spec = characterise_module(module, (4,))
    assert not spec.tileable and spec.reason
    assert {link.out_dim for link in spec.links()} == kept


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 5), s=st.integers(1, 3), d=st.integers(1, 2), length=st.integers(6, 30), data=st.data())
def test_window_input_range_reproduces_a_slice_of_the_full_conv(k, s, d, length, data):
    p = data.draw(st.integers(0, d * (k - 1)))
    out_len = (length + 2 * p - d * (k - 1) - 1) // s + 1
    if out_len < 1:
        return
    lo = data.draw(st.integers(0, out_len - 1))
    hi = data.draw(st.integers(lo + 1, out_len))
    x = torch.randn(1, 2, length, 5, dtype=torch.float64)
    w = torch.randn(3, 2, k, 1, dtype=torch.float64)
    full = F.conv2d(x, w, stride=(s, 1), padding=(p, 0), dilation=(d, 1))
    win = Window(span=d * (k - 1) + 1, stride=s, pad_lo=p)
    a, b, pad_lo, pad_hi = win.input_range(lo, hi, length)
    assert 0 <= a <= b <= length and 0 <= pad_lo <= p and pad_hi >= 0
    assert b - a + pad_lo + pad_hi == win.forward_extent(hi - lo)
    tile = F.pad(x[:, :, a:b], (0, 0, pad_lo, pad_hi))
    got = F.conv2d(tile, w, stride=(s, 1), dilation=(d, 1))
    torch.testing.assert_close(got, full[:, :, lo:hi], rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 6), s=st.integers(1, 4), d=st.integers(1, 3), start=st.integers(0, 20), t=st.integers(1, 20))
def test_input_grad_extent_bounds_the_outputs_an_input_range_touches(k, s, d, start, t):
    win = Window(span=d * (k - 1) + 1, stride=s, pad_lo=0)
    # output positions whose window overlaps input positions [start, start + t)
    touched = [o for o in range(0, 60) if o * s < start + t and o * s + win.span > start]
    if touched:  # strides larger than the window skip some input positions entirely
        assert max(touched) - min(touched) + 1 <= win.input_grad_extent(t)
