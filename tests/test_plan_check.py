"""mpress.plan_check: the one check of a plan against what it is used with (model,
hardware, shape, layers and tensors, what the runtime can execute). Every refusal is one
line naming the source."""

from __future__ import annotations

import pytest

from mpress.errors import PlanError
from mpress.hardware import load_hardware
from mpress.model_config import load_model_config
from mpress.plan import Plan, Stripe, TensorRule, hardware_fingerprint
from mpress.plan_check import check_plan
from tests.support.plans import contract_plan as make_plan
from tests.support.plans import one_line, rule

GB = 10**9


# -- check_plan ---------------------------------------------------------------------------------

def test_check_plan_model_fingerprint() -> None:
    tiny, small = load_model_config("gpt-tiny"), load_model_config("gpt-small")
    plan = make_plan(model_fp=tiny.fingerprint())
    check_plan(plan, source="p.yaml", model=tiny)
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", model=small)
    msg = one_line(info.value)
    assert msg.startswith("p.yaml: ") and "made for model 'toy'" in msg and "'gpt-small'" in msg
    assert "fingerprints differ" in msg


def test_check_plan_hardware_fingerprint() -> None:
    dgx1, a100 = load_hardware("dgx1-v100"), load_hardware("dgx-a100")
    plan = make_plan(hardware_fp=hardware_fingerprint(dgx1))
    check_plan(plan, source="p.yaml", hardware=dgx1)
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", hardware=a100)
    msg = one_line(info.value)
    assert msg.startswith("p.yaml: ") and "made for hardware 'dgx1-v100'" in msg and "'dgx-a100'" in msg
    # a change of memory alone changes the fingerprint too
    smaller = load_hardware("dgx1-v100", memory_bytes=16 * GB)
    with pytest.raises(PlanError, match="made for hardware"):
        check_plan(plan, source="p.yaml", hardware=smaller)


def dgx1_plan(rules: dict[int, list[TensorRule]] | None = None, **kw: object) -> tuple[Plan, object]:
    hw = load_hardware("dgx1-v100")
    return make_plan(rules, hardware_fp=hardware_fingerprint(hw), **kw), hw  # type: ignore[arg-type]


@pytest.mark.parametrize("peer", [5, 6, 7])
def test_check_plan_refuses_stripes_without_nvlink(peer: int) -> None:
    # DGX-1V: GPU 0 has NVLink to 1, 2, 3, 4 and none to 5, 6, 7
    plan, hw = dgx1_plan({0: [rule("layers.0.**", "d2d", stripes=[Stripe(device=3, fraction=0.5),
                                                                  Stripe(device=peer, fraction=0.5)])]})
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", hardware=hw)
    msg = one_line(info.value)
    assert msg.startswith("p.yaml: stage 0 rule 0 (layers.0.**)")
    assert f"stripes to device {peer}, which is not an NVLink neighbour of device 0" in msg


def test_check_plan_accepts_stripes_to_nvlink_neighbours() -> None:
    plan, hw = dgx1_plan({
        0: [rule("layers.0.**", "d2d", stripes=[Stripe(device=d, fraction=0.25) for d in (1, 2, 3, 4)])],
        # stage 1 runs on GPU 5, whose neighbours are 1, 4, 6, 7
        1: [rule("optim:*", "d2d", stripes=[Stripe(device=4, fraction=0.5), Stripe(device=7, fraction=0.5)])],
    }, devices=[0, 5])
    check_plan(plan, source="p.yaml", hardware=hw)


def test_check_plan_device_ranges() -> None:
    plan, hw = dgx1_plan(devices=[0, 8])
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", hardware=hw)
    msg = one_line(info.value)
    assert msg.startswith("p.yaml: ") and "stage 1 is mapped to device 8" in msg and "devices 0..7" in msg
    plan, hw = dgx1_plan({0: [rule("layers.0.**", "d2d", stripes=[Stripe(device=9, fraction=1.0)])]})
    with pytest.raises(PlanError, match="stripes to device 9, which is not an NVLink neighbour"):
        check_plan(plan, source="p.yaml", hardware=hw)


def test_check_plan_pinned_host_memory() -> None:
    # DGX-1V host memory: 512 GiB = 549.8 GB; two stages ask 300 GB each
    plan, hw = dgx1_plan(s0={"pinned_host_bytes": 300 * GB}, s1={"pinned_host_bytes": 300 * GB})
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", hardware=hw)
    msg = one_line(info.value)
    assert msg.startswith("p.yaml: ") and "pinned host pools need 600.0 GB" in msg and "549.8 GB of host memory" in msg
    ok, hw = dgx1_plan(s0={"pinned_host_bytes": 300 * GB}, s1={"pinned_host_bytes": 200 * GB})
    check_plan(ok, source="p.yaml", hardware=hw)


def test_check_plan_peer_pool_within_device_memory() -> None:
    # V100-32GB: 34.4 GB
    plan, hw = dgx1_plan(s1={"peer_pool_bytes": 40 * GB})
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", hardware=hw)
    msg = one_line(info.value)
    assert msg.startswith("p.yaml: ") and "device 1 peer pool of 40.0 GB exceeds its 34.4 GB" in msg
    ok, hw = dgx1_plan(s1={"peer_pool_bytes": 20 * GB})
    check_plan(ok, source="p.yaml", hardware=hw)


STAGE_TENSORS = dict(enumerate([
    ["layers.0.fc#0", "layers.0.act#0", "layers.1.fc#0", "layers.1.act#0"],
    ["layers.2.fc#0", "layers.2.act#0", "layers.3.fc#0", "layers.3.act#0"],
]))
STAGE_LAYERS = {0: ["layers.0", "layers.1"], 1: ["layers.2", "layers.3"]}


def test_check_plan_names_accepts_what_the_profile_has() -> None:
    plan = make_plan({
        0: [rule("layers.0.**"), rule("layers.*.act#0", "recompute"), rule("optim:*"), rule("stash:layers.1")],
        1: [rule("layers.3.fc#0"), rule("optim:layers.2")],
    })
    check_plan(plan, source="p.yaml", stage_tensors=STAGE_TENSORS, stage_layers=STAGE_LAYERS)


@pytest.mark.parametrize("stage, bad", [
    (0, "layers.2.**"),          # block 2 lives on stage 1
    (1, "layers.3.fc#1"),        # no such saved index
    (1, "layers.3.mlp.**"),      # no such module
    (0, "optim:layers.2"),       # optimizer states of another stage's layer
    (1, "stash:layers.0"),
])
def test_check_plan_names_refuses_what_the_profile_lacks(stage: int, bad: str) -> None:
    plan = make_plan({stage: [rule(bad)]})
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", stage_tensors=STAGE_TENSORS, stage_layers=STAGE_LAYERS)
    msg = one_line(info.value)
    assert msg == (f"p.yaml: stage {stage} rule 0 names {bad!r}, which the profile does not have in that stage")


def test_check_plan_names_checks_only_what_it_is_given() -> None:
    # without layer names, model-data rules cannot be checked; without tensor ids, activation rules
    plan = make_plan({0: [rule("optim:nowhere")]})
    check_plan(plan, stage_tensors=STAGE_TENSORS)
    with pytest.raises(PlanError, match="'optim:nowhere'"):
        check_plan(plan, stage_layers=STAGE_LAYERS)
    plan = make_plan({0: [rule("nowhere.**")]})
    check_plan(plan, stage_layers=STAGE_LAYERS)
    with pytest.raises(PlanError, match=r"^plan: stage 0 rule 0 names 'nowhere\.\*\*'"):
        check_plan(plan, stage_tensors=STAGE_TENSORS)  # default source is "plan"
