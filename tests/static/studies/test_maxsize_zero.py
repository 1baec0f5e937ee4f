"""`find_max_size` for the ZeRO baselines (`mpress.static.baselines.zero.plan_zero`): the largest
model each variant fits stays within the server's limits, the next size up fails, and
the bound it reports is that failure's (`zero_bound`), as for the planner strategies."""

from __future__ import annotations

import math

import pytest

from mpress.hardware.server import load_hardware
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.studies.maxsize import Bound, family_rule, find_max_size, zero_bound
from mpress.static.baselines.zero import ZERO_INFINITY, ZERO_OFFLOAD, plan_zero

A100 = load_hardware("dgx-a100")
SHAPE = dict(schedule="1f1b", num_stages=8, microbatch_size=2, num_microbatches=16)


@pytest.mark.parametrize("variant", [ZERO_OFFLOAD, ZERO_INFINITY])
def test_zero_maxsize_fits_within_the_limits_and_the_next_size_up_does_not(variant):
    row = find_max_size("gpt", A100, variant, **SHAPE)
    assert row.model is not None and row.result is None
    base = row.baseline
    assert base is not None and base.fits and base.strategy == variant
    assert base.peak_bytes <= A100.usable_memory_bytes and base.host_bytes <= A100.pinnable_bytes
    assert row.iteration_s == base.iteration_s and math.isfinite(row.iteration_s)
    assert row.samples_per_s == base.samples_per_s
    rule = family_rule("gpt")
    assert row.model.num_layers == rule.depth(row.model.hidden_size)
    bigger = rule.model(row.model.hidden_size + rule.head_dim)
    nxt = plan_zero(setup_pipeline(bigger, A100, **SHAPE), variant)
    assert not nxt.fits
    if row.bound is not Bound.LARGEST_SHAPE:
        assert row.bound is zero_bound(A100, nxt)


def test_zero_offload_is_bound_by_device_memory_and_infinity_goes_further():
    """ZeRO-Offload replicates the fp16 parameters on every GPU, so device memory bounds it;
    ZeRO-Infinity partitions them over the host, so it fits a larger model."""
    offload = find_max_size("gpt", A100, ZERO_OFFLOAD, **SHAPE)
    infinity = find_max_size("gpt", A100, ZERO_INFINITY, **SHAPE)
    assert offload.bound is Bound.DEVICE_MEMORY
    assert infinity.num_parameters > offload.num_parameters


def test_zero_bound_names_the_limit_the_result_exceeds():
    setup = setup_pipeline(family_rule("gpt").model(128 * 96), A100, **SHAPE)
    res = plan_zero(setup, ZERO_OFFLOAD)
    assert not res.fits and res.peak_bytes > A100.usable_memory_bytes
    assert zero_bound(A100, res) is Bound.DEVICE_MEMORY
