"""Tile sizes: balanced splits, exact spans against the propagated (scale, delta) sizes,
backward halos, halo overhead."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mpress.tiling.graph import from_sequential
from mpress.tiling.networks import vgg16
from mpress.tiling.segments import maximal_segments
from mpress.tiling.tiles import halo_overhead, propagate, split, tile_dim


@given(length=st.integers(1, 200), n=st.integers(1, 40))
def test_split_covers_the_length_with_near_equal_tiles(length, n):
    ranges = split(length, n)
    assert ranges[0][0] == 0 and ranges[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [hi - lo for lo, hi in ranges]
    assert len(ranges) == min(n, length) and max(sizes) - min(sizes) <= 1


def _chain(k1=3, s1=1, p1=1, pool=2, k2=5, s2=2, p2=2):
    return nn.Sequential(nn.Conv2d(2, 3, k1, stride=s1, padding=p1), nn.ReLU(), nn.MaxPool2d(pool),
                         nn.Conv2d(3, 2, k2, stride=s2, padding=p2))


@settings(max_examples=40, deadline=None)
@given(size=st.integers(20, 90), n=st.integers(1, 6), k1=st.integers(1, 4), s1=st.integers(1, 2),
       k2=st.integers(1, 5), s2=st.integers(1, 3))
def test_exact_spans_never_exceed_the_propagated_tile_and_interior_tiles_reach_it(size, n, k1, s1, k2, s2):
    g = from_sequential(_chain(k1, s1, k1 // 2, 2, k2, s2, k2 // 2), (1, 2, size, size))
    if min(g.tensors[g.output].shape[2:]) < 1:
        return
    positions = list(range(len(g.nodes)))
    dim = tile_dim(g, positions, 2, n)
    largest = max(hi - lo for lo, hi in dim.ranges)
    sizes = propagate(g, positions, (2, 3), {2: largest, 3: largest})
    for k, op in enumerate(sizes.ops):
        extents = [spans[k].in_extent for spans in dim.spans]
        assert max(extents) <= op.inputs[0][2]  # (scale, delta) bounds every tile's padded input
        for spans in dim.spans:
            assert spans[k].in_extent == (spans[k].in_hi - spans[k].in_lo) + spans[k].pad_lo + spans[k].pad_hi
        # a largest tile clipped nowhere from operator k to the output reaches the bound exactly
        for (lo, hi), spans in zip(dim.ranges, dim.spans):
            if hi - lo == largest and all(s.pad_lo == s.pad_hi == 0 for s in spans[k:]):
                assert spans[k].in_extent == op.inputs[0][2]


def test_vgg_tile_sizes_and_backward_halos():
    g = from_sequential(vgg16(), (1, 3, 2048, 2048))
    seg = maximal_segments(g)[0]
    positions = list(seg.positions)[:17]  # block 1-3, ending at pool3 (stride 8)
    sizes = propagate(g, positions, (2, 3), {2: 32, 3: 32})
    ops = {op.name: op for op in sizes.ops}
    # pool3 32 <- conv 64 <- 66 <- 68 <- pool2 70 <- 140 <- 142 <- 144 <- pool1 288 <- 290 <- 292 (the paper's 66-for-64)
    assert ops["features.16"].inputs[0][2] == 64
    assert ops["features.14"].inputs[0][2] == 66
    assert ops["features.0"].inputs[0][2] == 292
    # a 3x3 convolution's input gradient reads 2 more output-gradient rows than the forward's tile
    assert ops["features.14"].grad_output[2] == 68 and ops["features.14"].backward_halo[2] == 4
    assert ops["features.15"].backward_halo[2] == 0  # element-wise: none


def test_halo_overhead_is_zero_untiled_and_grows_with_tiles():
    g = from_sequential(vgg16(width_div=16), (1, 3, 256, 256))
    positions = list(maximal_segments(g)[0].positions)
    over = []
    for n in (1, 2, 4, 8):
        tl = [tile_dim(g, positions, d, n) for d in (2, 3)]
        over.append(halo_overhead(g, positions, tl))
    assert over[0] == pytest.approx(0.0)
    assert over == sorted(over) and over[-1] > 1.0  # 8x8 tiles of a 212-pixel receptive field on 256 pixels
