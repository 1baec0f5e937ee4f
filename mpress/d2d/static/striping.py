"""Striping a tensor over peer GPUs: how many bytes go to which peer.

A tensor D2D-swapped out is cut into contiguous byte ranges ("stripes"), one per peer,
whose sizes are proportional to the plan's stripe fractions (which the planner took
from the link bandwidth to each peer), so every link finishes at about the same time.
Stripe boundaries are multiples of `align_bytes` (the last stripe takes the remainder),
so every stripe starts on an aligned address in the tensor as in the pool.

Small tensors are not cut: a stripe under `min_stripe_bytes` costs more in per-copy
overhead than its link time saves. A tensor too small for all peers gets fewer stripes,
on the peers that are furthest behind their share (`StripeSpreader`), so that over many
small tensors each peer still receives bytes in proportion to its fraction.

The stripes a swap got are recorded by the run-time part (`mpress/d2d/runtime/
stripe_table.py`). Everything here is pure and thread safe; units are bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from mpress.errors import PlanError
from mpress.config.units import ALIGNMENT_BYTES

DEFAULT_MIN_STRIPE_BYTES = 1 << 20
"""Smallest stripe worth its own copy (NVLink copies reach full rate around 1 MiB)."""


def normalize_weights(stripes: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """(peer, fraction) pairs with fractions scaled to sum to 1; refuses empty, repeated
    peers and non-positive fractions."""
    if not stripes:
        raise PlanError("a D2D tensor needs at least one stripe")
    peers = [p for p, _ in stripes]
    if len(set(peers)) != len(peers):
        raise PlanError(f"stripes name a peer twice: {peers}")
    if any(f <= 0 for _, f in stripes):
        raise PlanError(f"stripe fractions must be > 0: {list(stripes)}")
    total = sum(f for _, f in stripes)
    return [(p, f / total) for p, f in stripes]


def stripe_sizes(nbytes: int, weights: Sequence[tuple[int, float]], *, align_bytes: int = ALIGNMENT_BYTES) -> list[tuple[int, int]]:
    """Split `nbytes` over `weights` ((peer, fraction), normalised): (peer, size) per
    stripe in the given order, sizes proportional to the fractions, every boundary a
    multiple of `align_bytes`; stripes that round to nothing are left out."""
    if nbytes < 0:
        raise PlanError(f"cannot stripe a negative size ({nbytes} bytes)")
    weights = normalize_weights(weights)
    out: list[tuple[int, int]] = []
    start = 0
    cumulative = 0.0
    for i, (peer, fraction) in enumerate(weights):
        cumulative += fraction
        if i == len(weights) - 1:
            end = nbytes
        else:
            end = min(nbytes, int(round(nbytes * cumulative / align_bytes)) * align_bytes)
        if end > start:
            out.append((peer, end - start))
            start = end
    if not out:  # a zero-byte tensor still needs a home (one empty stripe)
        out.append((weights[0][0], 0))
    return out


class StripeSpreader:
    """Decides the stripes of each tensor for one exporter: all peers for large tensors,
    the most under-served peers for small ones (see the module docstring)."""

    def __init__(self, weights: Sequence[tuple[int, float]], *, min_stripe_bytes: int = DEFAULT_MIN_STRIPE_BYTES,
                 align_bytes: int = ALIGNMENT_BYTES) -> None:
        self.weights = normalize_weights(weights)
        self.min_stripe_bytes = max(1, min_stripe_bytes)
        self.align_bytes = align_bytes
        self._lock = threading.Lock()
        self._sent = {p: 0 for p, _ in self.weights}
        """Bytes assigned to each peer so far (by this spreader)."""

    def split(self, nbytes: int) -> list[tuple[int, int]]:
        """(peer, size) stripes for a tensor of `nbytes`."""
        count = max(1, min(len(self.weights), nbytes // self.min_stripe_bytes))
        with self._lock:
            total = sum(self._sent.values()) + nbytes
            # furthest behind its share first; ties: larger fraction, then lower device
            behind = sorted(self.weights, key=lambda w: (self._sent[w[0]] - w[1] * total, -w[1], w[0]))
            chosen = set(p for p, _ in behind[:count])
            stripes = stripe_sizes(nbytes, [w for w in self.weights if w[0] in chosen], align_bytes=self.align_bytes)
            for peer, size in stripes:
                self._sent[peer] += size
        return stripes

    def undo(self, stripes: list[tuple[int, int]]) -> None:
        """Forget a `split` whose reservation failed, so later tensors are spread as if it
        never happened."""
        with self._lock:
            for peer, size in stripes:
                self._sent[peer] -= size
