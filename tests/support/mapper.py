"""Mapper fixtures for tests and bench/mapper.py (fixtures stay out of the package): the
optimum by enumeration, as the MPress paper finds it, and a hypothetical 16-GPU topology."""

from __future__ import annotations

import itertools
import random

# byte_rates and reaches are the mapper's own: brute_force must rate mappings and settle ties
# exactly as map_devices does, so it imports them rather than keep copies.
from mpress.d2d.static.mapping import (
    Assignment,
    MappingProblem,
    assign_spare,
    byte_rates,
    mapping_value,
    reaches,
)


def brute_force(problem: MappingProblem) -> Assignment:
    """The optimum by trying every mapping (the paper's method; small N only: N!/(N-S)!).

    Ties: the identity if it is optimal, else the lexicographically smallest optimal mapping.
    """
    n, s = problem.num_devices, problem.num_stages
    rates = byte_rates(problem)
    values = [(m, mapping_value(problem, m, rates=rates)) for m in itertools.permutations(range(n), s)]
    best = min((v for _, v in values), key=lambda v: (v[0], v[1]))
    identity = tuple(range(s))
    chosen = next(m for m, v in ([(identity, dict(values)[identity])] + values) if reaches(v, best))
    return assign_spare(problem, chosen)


def mesh16(seed: int = 1) -> list[list[float]]:
    """A hypothetical 16-GPU server for scaling studies of the search: two 8-GPU boards,
    dense inside, sparse across (1 or 2 NVLink2 links per pair, 22.5 GB/s effective each).
    Link GB/s per directed pair, 0 = no NVLink."""
    rng = random.Random(seed)
    link = [[0.0] * 16 for _ in range(16)]
    for i, j in itertools.combinations(range(16), 2):
        if rng.random() < (0.5 if i // 8 == j // 8 else 0.12):
            link[i][j] = link[j][i] = 22.5 * rng.choice([1, 2])
    return link
