"""mpress.d2d.runtime.pool_layout: how `plan_quotas` lays each stage's quota out in the
peer pools of the devices it stripes to, and the plans it refuses (pure: no pools made)."""

from __future__ import annotations

import pytest

from mpress.d2d.runtime.pool_layout import Quota, plan_quotas
from mpress.errors import PlanError
from mpress.config.units import ALIGNMENT_BYTES
from tests.support.peers import KiB
from tests.support.plans import d2d_plan


def test_explicit_quotas_first_then_equal_share_of_the_rest():
    plan = d2d_plan([0, 1, 2], stripes={0: {2: 1.0}, 1: {2: 1.0}}, pools={2: 10 * KiB},
                    quotas={0: {2: 1000}})
    assert plan_quotas(plan) == {2: [
        Quota(stage=0, device=2, offset_bytes=0, nbytes=1024),        # 1000 rounded up
        Quota(stage=1, device=2, offset_bytes=1024, nbytes=9 * KiB),  # what is left
    ]}


def test_equal_shares_are_aligned_and_fit():
    plan = d2d_plan([0, 1, 2, 3], stripes={0: {3: 1.0}, 1: {3: 1.0}, 2: {3: 1.0}}, pools={3: 10_000})
    quotas = plan_quotas(plan)[3]
    assert [q.stage for q in quotas] == [0, 1, 2]
    share = 10_000 // 3 // ALIGNMENT_BYTES * ALIGNMENT_BYTES
    assert [(q.offset_bytes, q.nbytes) for q in quotas] == [(0, share), (share, share), (2 * share, share)]


def test_quotas_per_device_and_pools_summed_over_the_stages_of_a_device():
    # stage 0 stripes to devices 1 and 2; device 1 runs stages 1 and 3, whose pools add up
    plan = d2d_plan([0, 1, 2, 1], stripes={0: {1: 0.5, 2: 0.5}}, pools={1: 4 * KiB, 2: 2 * KiB, 3: 4 * KiB},
                    quotas={0: {2: 1 * KiB}})
    assert plan_quotas(plan) == {1: [Quota(stage=0, device=1, offset_bytes=0, nbytes=8 * KiB)],
                                 2: [Quota(stage=0, device=2, offset_bytes=0, nbytes=1 * KiB)]}
    # the override replaces every pool's size
    assert plan_quotas(plan, pool_override_bytes=3 * KiB)[1][0].nbytes == 3 * KiB


def test_a_pool_too_small_for_its_quotas_is_refused_with_the_numbers():
    plan = d2d_plan([0, 1, 2], stripes={0: {2: 1.0}, 1: {2: 1.0}}, pools={2: 10_000},
                    quotas={0: {2: 8192}, 1: {2: 4000}})
    with pytest.raises(PlanError) as info:
        plan_quotas(plan)
    message = str(info.value)
    assert message.startswith("peer pool of device 2 is too small: 10000 bytes")
    assert "stage 0 needs 8192 bytes" in message and "stage 1 needs 4096 bytes" in message
    assert "total 12288" in message


def test_a_pool_with_no_room_for_an_equal_share_is_refused():
    plan = d2d_plan([0, 1, 2], stripes={0: {2: 1.0}, 1: {2: 1.0}}, pools={2: 1000})
    with pytest.raises(PlanError, match="peer pool of device 2 is too small: 1000 bytes"):
        plan_quotas(plan)


def test_fixed_quotas_over_the_pool_leave_no_negative_numbers_in_the_message():
    plan = d2d_plan([0, 1, 2], stripes={0: {2: 1.0}, 1: {2: 1.0}}, pools={2: 4096}, quotas={0: {2: 8192}})
    with pytest.raises(PlanError) as info:
        plan_quotas(plan)
    message = str(info.value)
    assert "4096 bytes" in message and "stage 0 needs 8192 bytes" in message
    assert "-" not in message.replace("-byte", "")


def test_striping_to_a_device_without_a_pool_is_refused():
    plan = d2d_plan([0, 1, 2], stripes={0: {1: 0.5, 2: 0.5}, 1: {2: 1.0}}, pools={1: 4 * KiB})
    with pytest.raises(PlanError, match=r"stage\(s\) 0, 1 stripe to device 2, which reserves no peer pool"):
        plan_quotas(plan)


def test_no_d2d_no_quotas():
    assert plan_quotas(d2d_plan([0, 1], pools={1: 4 * KiB})) == {}
