"""Striping (pure): stripe sizes follow the plan's fractions to within one alignment unit
and cover the tensor exactly; the spreader sends large tensors to every peer and small
ones whole, keeping each peer's bytes near its share. (The metadata table that records
what striping decided is run-time: tests/d2d/runtime/test_stripe_table.py.)
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpress.d2d.static.striping import StripeSpreader, normalize_weights, stripe_sizes
from mpress.errors import PlanError

MiB = 1 << 20

weight_lists = st.lists(st.floats(min_value=0.01, max_value=100.0, allow_nan=False), min_size=1, max_size=6).map(
    lambda fs: [(peer, f) for peer, f in enumerate(fs, start=1)])
aligns = st.sampled_from([16, 64, 512, 4096])


# ---- stripe_sizes --------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(nbytes=st.integers(min_value=0, max_value=1 << 34), weights=weight_lists, align=aligns)
def test_stripe_sizes_cover_the_tensor_in_aligned_proportional_pieces(nbytes, weights, align):
    stripes = stripe_sizes(nbytes, weights, align_bytes=align)
    assert sum(size for _, size in stripes) == nbytes
    total = sum(f for _, f in weights)
    share = {p: f / total for p, f in weights}
    # order kept, each peer at most once, no empty stripe unless the tensor is empty
    order = [p for p, _ in weights]
    peers = [p for p, _ in stripes]
    assert peers == sorted(peers, key=order.index) and len(set(peers)) == len(peers)
    assert all(size > 0 for _, size in stripes) or (nbytes == 0 and len(stripes) == 1)
    # every stripe but the last ends on an aligned boundary (so every stripe starts on one)
    end = 0
    for _, size in stripes[:-1]:
        end += size
        assert end % align == 0
    # proportional to within one alignment unit; peers left out would have got under one
    got = dict(stripes)
    for peer, fraction in share.items():
        assert abs(got.get(peer, 0) - fraction * nbytes) <= align + 1e-12 * nbytes  # (float rounding)


@pytest.mark.parametrize(("nbytes", "weights", "expected"), [
    (4 * MiB, [(1, 0.75), (2, 0.25)], [(1, 3 * MiB), (2, MiB)]),
    (3 * MiB, [(5, 1.0), (6, 1.0), (7, 1.0)], [(5, MiB), (6, MiB), (7, MiB)]),
    (1000, [(1, 0.5), (2, 0.5)], [(1, 512), (2, 488)]),      # the last stripe takes the remainder
    (100, [(1, 0.75), (2, 0.25)], [(2, 100)]),               # the first rounds to nothing
    (0, [(3, 0.4), (1, 0.6)], [(3, 0)]),                     # an empty tensor still gets a home
    (2048, [(2, 3.0), (1, 1.0)], [(2, 1536), (1, 512)]),     # fractions are normalised
])
def test_stripe_sizes_examples(nbytes, weights, expected):
    assert stripe_sizes(nbytes, weights, align_bytes=512) == expected


@pytest.mark.parametrize(("weights", "words"), [
    ([], "at least one stripe"),
    ([(1, 0.5), (1, 0.5)], "a peer twice"),
    ([(1, 1.0), (2, 0.0)], "must be > 0"),
    ([(1, 1.5), (2, -0.5)], "must be > 0"),
])
def test_bad_weights_are_refused(weights, words):
    with pytest.raises(PlanError, match=words):
        stripe_sizes(4096, weights)
    with pytest.raises(PlanError, match=words):
        StripeSpreader(weights)


def test_negative_size_is_refused():
    with pytest.raises(PlanError, match="negative size"):
        stripe_sizes(-1, [(1, 1.0)])


def test_normalize_weights_sums_to_one():
    weights = normalize_weights([(4, 2.0), (2, 6.0)])
    assert weights == [(4, 0.25), (2, 0.75)]


# ---- StripeSpreader ------------------------------------------------------------------------

def test_large_tensors_use_every_peer_in_proportion():
    weights = [(1, 0.5), (2, 0.3), (3, 0.2)]
    spreader = StripeSpreader(weights, min_stripe_bytes=MiB, align_bytes=512)
    for nbytes in (3 * MiB, 10 * MiB + 123, 64 * MiB):
        stripes = spreader.split(nbytes)
        assert [p for p, _ in stripes] == [1, 2, 3]
        assert stripes == stripe_sizes(nbytes, weights, align_bytes=512)


def test_small_tensors_go_whole_to_one_peer():
    spreader = StripeSpreader([(1, 0.5), (2, 0.5)], min_stripe_bytes=MiB)
    for nbytes in (0, 1, 4096, MiB - 1, 2 * MiB - 1):
        stripes = spreader.split(nbytes)
        assert len(stripes) == 1 and stripes[0][1] == nbytes


def test_a_middle_size_gets_as_many_stripes_as_it_has_minimum_stripes():
    spreader = StripeSpreader([(1, 0.4), (2, 0.3), (3, 0.3)], min_stripe_bytes=MiB)
    stripes = spreader.split(2 * MiB)  # two stripes' worth, three peers
    assert len(stripes) == 2 and sum(s for _, s in stripes) == 2 * MiB
    # the first goes to the largest share (all are equally behind before any bytes went)
    assert stripes[0][0] == 1


def sent_bytes(splits: list[list[tuple[int, int]]]) -> dict[int, int]:
    """Bytes each peer received over several splits (0 for peers that got none)."""
    out: dict[int, int] = {peer: 0 for stripes in splits for peer, _ in stripes}
    for stripes in splits:
        for peer, size in stripes:
            out[peer] = out.get(peer, 0) + size
    return out


def test_small_tensors_start_on_the_largest_share_and_then_rotate_by_deficit():
    spreader = StripeSpreader([(1, 0.25), (2, 0.75)], min_stripe_bytes=MiB)
    splits = [spreader.split(1000) for _ in range(8)]
    peers = [stripes[0][0] for stripes in splits]
    # after each tensor the peer furthest below its share gets the next: 3 of 4 to peer 2
    assert peers.count(2) == 6 and peers.count(1) == 2
    assert peers[0] == 2
    assert sent_bytes(splits) == {1: 2000, 2: 6000}


@settings(max_examples=100, deadline=None)
@given(fractions=st.lists(st.floats(min_value=0.05, max_value=1.0), min_size=1, max_size=5),
       sizes=st.lists(st.integers(min_value=0, max_value=MiB - 1), min_size=1, max_size=300))
def test_small_tensors_keep_every_peer_near_its_share(fractions, sizes):
    weights = [(peer, f) for peer, f in enumerate(fractions)]
    spreader = StripeSpreader(weights, min_stripe_bytes=MiB)
    splits = [spreader.split(nbytes) for nbytes in sizes]
    for nbytes, stripes in zip(sizes, splits):
        (stripe,) = stripes
        assert stripe[1] == nbytes
    sent = {peer: 0 for peer, _ in weights} | sent_bytes(splits)
    total, largest, k = sum(sizes), max(sizes), len(weights)
    assert sum(sent.values()) == total
    for peer, fraction in normalize_weights(weights):
        # a peer only gets a tensor while it is at or below its share, so it is never
        # more than one tensor ahead; the others' lead bounds how far behind it can be
        assert sent[peer] <= fraction * total + largest + 1e-6 * total
        assert sent[peer] >= fraction * total - (k - 1) * largest - 1e-6 * total


def test_spreader_is_thread_safe():
    spreader = StripeSpreader([(1, 0.5), (2, 0.5)], min_stripe_bytes=MiB)
    splits: list[list[tuple[int, int]]] = []
    threads = [threading.Thread(target=lambda: splits.extend(spreader.split(1024) for _ in range(500)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the spreader's own count decides the next split: an even split of the next pair
    # shows that no concurrent update was lost
    sent = sent_bytes(splits)
    assert sent[1] + sent[2] == 4 * 500 * 1024
    assert abs(sent[1] - sent[2]) <= 1024
