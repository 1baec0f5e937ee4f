"""Split a model's layers into contiguous pipeline stages.

A partition is a list of `num_stages` half-open layer ranges `[start, end)`, in stage
order, non-empty, covering layers 0..N-1 without gaps. `partition_layers` minimises
the largest stage cost exactly (the bottleneck of a balanced pipeline: PipeDream and
DAPPLE balance compute this way); `partition_profile` takes the per-layer costs from
a `Profile`.
"""

from __future__ import annotations

import math
from typing import Literal

from mpress.errors import ScheduleError
from mpress.static.profile.profile import Profile


def partition_layers(costs: list[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous split of `len(costs)` layers into `num_stages` non-empty ranges
    `[start, end)` that minimises the maximum per-stage sum of `costs` (any unit, each
    cost finite and >= 0).

    Exact: the optimal bottleneck is the sum of some run of consecutive layers; binary
    search over those sums with a greedy feasibility test finds the least feasible one.

    Ties: among the splits that reach that bottleneck, the one whose last stage has as
    many layers as possible, then the second-to-last, and so on. Why: earlier stages of
    a 1F1B/PipeDream pipeline keep more microbatches in flight, so a balanced split
    that leaves them the fewest layers needs the least memory.

    Raises `ScheduleError` ("cannot split N layers into M stages") when M < 1 or
    M > N, and for a negative or non-finite cost.
    """
    n = len(costs)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1 or num_stages > n:
        raise ScheduleError(
            f"cannot split {n} layers into {num_stages} stages (need 1 <= stages <= layers)")
    for i, c in enumerate(costs):
        if not math.isfinite(c) or c < 0:
            raise ScheduleError(f"layer {i} has cost {c!r}; layer costs must be finite and >= 0")
    # prefix[i] = sum of costs[:i]; with costs >= 0 it never decreases, even rounded,
    # and every run sum is taken as a difference of two prefixes, so the bottleneck
    # found and the feasibility test agree exactly
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1  # the largest candidate (all layers) is always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if _stages_needed(prefix, candidates[mid]) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    return _split_from_back(prefix, num_stages, candidates[lo])


def _stages_needed(prefix: list[float], limit: float) -> int:
    """Fewest contiguous ranges with sums <= limit covering all layers (greedy from
    the front is optimal for this); a number above the layer count if a single layer
    exceeds `limit`."""
    n = len(prefix) - 1
    count, start = 0, 0
    while start < n:
        end = start
        while end < n and prefix[end + 1] - prefix[start] <= limit:
            end += 1
        if end == start:
            return n + 1
        count += 1
        start = end
    return count


def _split_from_back(prefix: list[float], num_stages: int, limit: float) -> list[tuple[int, int]]:
    """From the last stage back, give each stage the most layers whose sum stays within
    `limit` while leaving at least one layer for each earlier stage. With `limit` >=
    the optimal bottleneck this yields exactly `num_stages` ranges within `limit`."""
    ranges: list[tuple[int, int]] = []
    end = len(prefix) - 1
    for stages_before in range(num_stages - 1, -1, -1):
        start = end - 1
        while start > stages_before and prefix[end] - prefix[start - 1] <= limit:
            start -= 1
        if stages_before == 0:
            start = 0  # the first stage takes what is left (within limit by construction)
        ranges.append((start, end))
        end = start
    ranges.reverse()
    return ranges


def layer_costs(profile: Profile, balance: Literal["compute", "memory"] = "compute") -> list[float]:
    """Per-layer cost `partition_profile` balances.

    compute: forward + backward time of one microbatch (s).
    memory: saved activation bytes of one microbatch + parameter, gradient, optimizer
    and master-weight bytes (B).
    """
    if balance == "compute":
        return [layer.forward_time_s + layer.backward_time_s for layer in profile.layers]
    if balance == "memory":
        return [float(layer.saved_bytes + layer.model_state_bytes) for layer in profile.layers]
    raise ScheduleError(f"unknown balance {balance!r}; choose compute or memory")


def partition_profile(profile: Profile, num_stages: int,
                      balance: Literal["compute", "memory"] = "compute") -> list[tuple[int, int]]:
    """Split the profile's layers into `num_stages` contiguous stages balancing
    `layer_costs(profile, balance)` (see `partition_layers`)."""
    return partition_layers(layer_costs(profile, balance), num_stages)
