"""More device memory never turns a fitting plan into no plan (issue 28).

On the README's GPT-2 profile (`mpress profile --hf-config gpt2-tiny --microbatch-size 2
--fake --hardware cpu-local`, kept in `data/gpt2-tiny-profile.yaml`), 2 stages and 4
microbatches, 1,017,000 B and 1,024,000 B fitted but 1,019,000-1,022,000 B did not:
there the memory model found every stage within the budget, so nothing was shed, while
the emulated peak was above it, and the search stopped because its first round had shed
nothing. The planner now goes on to the emulated excess.
"""

from __future__ import annotations

import argparse
from functools import cache
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mpress.commands.pipeline_args import setup_from_args
from mpress.cli import build_parser
from mpress.config.vocabulary import Strategy
from mpress.static.plan.plan_cache import PlanCache
from mpress.static.plan.planner import plan_strategy
from mpress.static.profile.profile import Profile

PROFILE = Path(__file__).parent / "data" / "gpt2-tiny-profile.yaml"


@cache
def _profile() -> Profile:
    return Profile.load(PROFILE)


@cache
def fitting(device_memory_bytes: int) -> frozenset[str]:
    """The strategies that fit GPT-2 tiny on `device_memory_bytes` (README's plan command)."""
    args: argparse.Namespace = build_parser().parse_args(
        ["plan", "--profile", str(PROFILE), "--hardware", "cpu-local", "--num-stages", "2",
         "--num-microbatches", "4", "--device-memory", str(device_memory_bytes)])
    setup, _shape = setup_from_args(args, profile=_profile())
    cache_ = PlanCache(setup)
    return frozenset(s for s in Strategy.words() if plan_strategy(setup, s, cache=cache_).fits)


@pytest.mark.parametrize("device_memory_bytes", range(1_017_000, 1_025_000, 1_000))
def test_gpt2_fits_between_budgets_that_fit(device_memory_bytes: int) -> None:
    assert Strategy.MPRESS.value in fitting(device_memory_bytes)


@settings(max_examples=12, deadline=None)
@given(st.integers(600_000, 1_100_000), st.integers(0, 200_000))
@example(1_017_000, 3_000)  # issue 28's case
def test_more_memory_keeps_every_fitting_strategy(device_memory_bytes: int, more_bytes: int) -> None:
    less, more = fitting(device_memory_bytes), fitting(device_memory_bytes + more_bytes)
    assert less <= more, f"{sorted(less - more)} fit {device_memory_bytes} B but not {device_memory_bytes + more_bytes} B"
