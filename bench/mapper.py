"""Benchmark: D2D device mapping search versus enumerating every mapping (the paper's way).

Cases: DGX-1 (V100, asymmetric hybrid cube-mesh) with several overflow/spare patterns,
DGX A100 (NVSwitch, symmetric: the search is skipped), and a hypothetical 16-GPU server
(two dense 8-GPU boards with a few links across; exact search is out of reach, so the
search runs to a time budget and reports its optimality gap). For the DGX-1 the same run
also enumerates all 8! = 40320 mappings, each solved exactly by max-flow, and prints the
speed-up. (The paper's enumeration also enumerates spare splits per mapping, so it is
slower still: 47 s on its worst case.)

Usage: PYTHONPATH=. python bench/mapper.py [--repeats N] [--budget S] [--enumerate first|all|none]
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from mpress.d2d.static.mapper import map_devices
from mpress.d2d.static.mapping import MapperResult, MappingProblem, mapping_value
from mpress.hardware.server import load_hardware
from mpress.config.units import fmt_bytes, fmt_seconds
from tests.support.mapper import brute_force, mesh16  # test fixtures, not package code: needs PYTHONPATH=.

GB = 10**9

DGX1_PATTERNS = {
    "decreasing": ([8, 6, 4, 2, 0, 0, 0, 0], [0, 0, 0, 0, 3, 6, 9, 12]),
    "linear": ([7, 6, 5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7]),
    "two heavy": ([16, 12, 0, 0, 0, 0, 0, 0], [0, 0, 2, 4, 6, 8, 10, 12]),
    "tight": ([9, 7, 5, 3, 0, 0, 0, 0], [0, 0, 0, 0, 3, 5, 7, 9]),
    "scarce": ([8, 6, 4, 2, 0, 0, 0, 0], [0, 0, 0, 0, 1, 2, 3, 4]),
}
"""Per stage, GB: (overflow, spare). Early stages overflow, late stages lend."""




def timed(problem: MappingProblem, repeats: int, budget: float | None) -> tuple[MapperResult, float]:
    """Last result and median wall time over `repeats` runs."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = map_devices(problem, time_budget_s=budget)
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def describe(value: tuple[int, float]) -> str:
    unplaced, slowest = value
    text = fmt_seconds(slowest)
    return text if unplaced == 0 else f"{text}, {fmt_bytes(unplaced)} unplaced"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="search runs per case (median time)")
    parser.add_argument("--budget", type=float, default=5.0, help="time budget of the 16-GPU search, s")
    parser.add_argument("--enumerate", choices=("first", "all", "none"), default="first",
                        help="which DGX-1 patterns also get the full 8! enumeration")
    args = parser.parse_args()

    dgx1, a100 = load_hardware("dgx1-v100"), load_hardware("dgx-a100")
    cases: list[tuple[str, MappingProblem, float | None, bool]] = []
    for k, (name, (overflow, spare)) in enumerate(DGX1_PATTERNS.items()):
        p = MappingProblem.from_hardware(dgx1, [x * GB for x in overflow], [x * GB for x in spare])
        cases.append((f"dgx1-v100 {name}", p, None, args.enumerate == "all" or (args.enumerate == "first" and k == 0)))
    overflow, spare = DGX1_PATTERNS["decreasing"]
    cases.append(("dgx-a100 decreasing", MappingProblem.from_hardware(
        a100, [x * GB for x in overflow], [x * GB for x in spare]), None, False))
    cases.append(("16-GPU mesh", MappingProblem(
        link_gbps=mesh16(), overflow_bytes=[x * GB for x in (10, 9, 8, 7, 6, 5, 4, 3)] + [0] * 8,
        spare_bytes=[0] * 8 + [x * GB for x in (4, 5, 6, 7, 8, 9, 10, 11)]), args.budget, False))

    table = Table(title="D2D device mapping: exact search vs enumeration (one core)")
    for col in ("case", "GPUs", "search", "mappings", "nodes", "optimality", "slowest D2D swap",
                "identity mapping", "enumerate 8!", "speed-up"):
        table.add_column(col, justify="left" if col in ("case", "optimality") else "right")
    console = Console(width=200)
    for name, p, budget, enumerate_all in cases:
        result, search_s = timed(p, 1 if budget else args.repeats, budget)  # a budgeted run takes its budget
        a = result.assignment
        if result.skipped_symmetric:
            optimality = "exact (symmetric, skipped)"
        elif result.exact:
            optimality = f"exact ({result.num_automorphisms} symmetries)"
        else:
            optimality = f"gap {result.gap:.1%} (bound {fmt_seconds(result.lower_bound_s)})"
        enum_text = speedup = "-"
        if enumerate_all:
            start = time.perf_counter()
            best = brute_force(p)
            enum_s = time.perf_counter() - start
            agree = best.mapping == a.mapping
            enum_text = f"{enum_s:.2f} s" + ("" if agree else " (DIFFERS)")
            speedup = f"{enum_s / search_s:,.0f}x"
        table.add_row(name, f"{p.num_devices}", f"{search_s * 1e3:.1f} ms", f"{result.mappings_examined:,}",
                      f"{result.nodes_visited:,}", optimality, describe((a.unplaced_bytes, a.slowest_swap_s)),
                      describe(mapping_value(p, range(p.num_stages))), enum_text, speedup)
    console.print(table)
    console.print("search = map_devices wall time (median of runs; one run for a budgeted case); mappings = complete mappings evaluated "
                  "(greedy, swaps, search); identity mapping = stage s on GPU s with the best striping.")


if __name__ == "__main__":
    main()
