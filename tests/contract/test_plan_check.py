"""mpress.contract.plan_check: the one check of a plan against what it is used with (model,
hardware, shape, layers and tensors, what the runtime can execute). Every refusal is one
line naming the source."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpress.errors import PlanError
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.config.units import fmt_bytes
from mpress.contract.plan import PeerQuota, Plan, Stripe, TensorRule, hardware_fingerprint
from mpress.contract.plan_check import NVME_STAGING_BYTES, Shape, check_plan, host_bytes
from mpress.config.vocabulary import ScheduleName
from tests.support.plans import contract_plan as make_plan
from tests.support.plans import one_line, rule

GB = 10**9


# -- check_plan ---------------------------------------------------------------------------------

def test_check_plan_model_fingerprint() -> None:
    tiny, small = load_model_config("gpt-tiny"), load_model_config("gpt-small")
    plan = replace(make_plan(model_fp=tiny.fingerprint()), model="gpt-tiny")
    check_plan(plan, source="p.yaml", model=tiny)
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", model=small)
    msg = one_line(info.value)
    assert msg.startswith("p.yaml: model_fingerprint: ") and "made for model 'gpt-tiny'" in msg and "'gpt-small'" in msg
    assert "fingerprints differ" in msg
    # the name edited, the fingerprint kept: a fingerprint leaves the name out, so the name is compared too
    with pytest.raises(PlanError) as info:
        check_plan(replace(plan, model="toy"), source="p.yaml", model=tiny)
    assert one_line(info.value).startswith("p.yaml: model: made for 'toy', but this model is 'gpt-tiny'")


def test_check_plan_hardware_fingerprint() -> None:
    dgx1, a100 = load_hardware("dgx1-v100"), load_hardware("dgx-a100")
    plan = make_plan(hardware_fp=hardware_fingerprint(dgx1))
    check_plan(plan, source="p.yaml", hardware=dgx1)
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", hardware=a100)
    msg = one_line(info.value)
    assert msg.startswith("p.yaml: hardware_fingerprint: ") and "made for hardware 'dgx1-v100'" in msg
    assert "'dgx-a100'" in msg
    # a change of memory alone changes the fingerprint too
    smaller = load_hardware("dgx1-v100", memory_bytes=16 * GB)
    with pytest.raises(PlanError, match="made for hardware"):
        check_plan(plan, source="p.yaml", hardware=smaller)
    # the name edited, the fingerprint kept
    with pytest.raises(PlanError) as info:
        check_plan(replace(plan, hardware="dgx-a100"), source="p.yaml", hardware=dgx1)
    assert one_line(info.value).startswith("p.yaml: hardware: made for 'dgx-a100', not 'dgx1-v100'")


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
    assert msg.startswith("p.yaml: stages[0].rules[0].stripes[1].device: stage 0 rule 0 (layers.0.**)")
    assert f"stripes to device {peer}, which is not an NVLink neighbour of device 0" in msg
    assert msg.endswith("(its neighbours on dgx1-v100: 1, 2, 3, 4)")


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
    assert msg.startswith("p.yaml: stage_to_device[1]: ") and "stage 1 is mapped to device 8" in msg
    assert "devices 0..7" in msg
    plan, hw = dgx1_plan({0: [rule("layers.0.**", "d2d", stripes=[Stripe(device=9, fraction=1.0)])]})
    with pytest.raises(PlanError, match="stripes to device 9, which is not an NVLink neighbour"):
        check_plan(plan, source="p.yaml", hardware=hw)


def test_check_plan_pinned_host_memory() -> None:
    # DGX-1V host memory: 512 GiB = 549.8 GB, of which the preset lets plans pin 432 GiB
    # = 463.9 GB; two stages ask 250 GB each: within the memory, over what can be pinned
    plan, hw = dgx1_plan(s0={"pinned_host_bytes": 250 * GB}, s1={"pinned_host_bytes": 250 * GB})
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", hardware=hw)
    msg = one_line(info.value)
    assert msg.startswith("p.yaml: stages[0].pinned_host_bytes: pinned host pools need 500 GB (250 GB for stage 0)")
    assert msg.endswith("dgx1-v100 can pin 464 GB of its 550 GB of host memory")
    ok, hw = dgx1_plan(s0={"pinned_host_bytes": 250 * GB}, s1={"pinned_host_bytes": 200 * GB})
    check_plan(ok, source="p.yaml", hardware=hw)


def test_check_plan_counts_the_drive_stores_staging_beside_the_pools() -> None:
    """A stage with `nvme` rules pins its drive store's two staging buffers apart from its
    pool (`plan_check.drive_staging_bytes`): pools that fit alone but not with them are
    refused, naming the stage's first nvme rule; with room for them, the plan passes."""
    hw = load_hardware("dgx1-v100")
    staging = 2 * NVME_STAGING_BYTES
    drive = {1: [rule("layers.*.**"), rule("optim:*", "nvme")]}
    plan, hw = dgx1_plan(drive, s0={"pinned_host_bytes": hw.pinnable_bytes - staging + 1})
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", hardware=hw)
    assert one_line(info.value) == (
        f"p.yaml: stages[1].rules[1]: the drive's pinned staging buffers ({fmt_bytes(staging)}) and the pinned "
        f"pools ({fmt_bytes(hw.pinnable_bytes - staging + 1)}) need {fmt_bytes(hw.pinnable_bytes + 1)}; "
        f"dgx1-v100 can pin {fmt_bytes(hw.pinnable_bytes)}")
    ok, hw = dgx1_plan(drive, s0={"pinned_host_bytes": hw.pinnable_bytes - staging})
    check_plan(ok, source="p.yaml", hardware=hw)
    assert host_bytes(ok, {}).pinned == hw.pinnable_bytes


def test_check_plan_peer_pool_within_device_memory() -> None:
    # V100-32GB: 34.4 GB, of which the reserve leaves 30.1 GB usable
    plan, hw = dgx1_plan(s1={"peer_pool_bytes": 31 * GB})
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", hardware=hw)
    msg = one_line(info.value)
    assert msg == ("p.yaml: stages[1].peer_pool_bytes: device 1 peer pool of 31 GB exceeds its memory: "
                   "a dgx1-v100 device has 30.1 GB usable (34.4 GB less its reserve)")
    plan, hw = dgx1_plan(s1={"peer_pool_bytes": 10**15})  # 1 PB
    with pytest.raises(PlanError, match=r"^p\.yaml: stages\[1\]\.peer_pool_bytes: device 1 peer pool of 1e\+03 TB"):
        check_plan(plan, source="p.yaml", hardware=hw)
    ok, hw = dgx1_plan(s1={"peer_pool_bytes": 20 * GB})
    check_plan(ok, source="p.yaml", hardware=hw)


def test_check_plan_peer_quotas_name_neighbours_within_memory() -> None:
    # stage 0 on GPU 0 (NVLink to 1, 2, 3, 4); quotas on an idle GPU's pool add up there
    quota = {"peer_quotas": [PeerQuota(device=4, quota_bytes=20 * GB)]}
    ok, hw = dgx1_plan(s0=quota)
    check_plan(ok, source="p.yaml", hardware=hw)
    for device in (5, 9):
        plan, hw = dgx1_plan(s0={"peer_quotas": [PeerQuota(device=device, quota_bytes=GB)]})
        with pytest.raises(PlanError) as info:
            check_plan(plan, source="p.yaml", hardware=hw)
        assert one_line(info.value) == (
            f"p.yaml: stages[0].peer_quotas[0].device: stage 0 holds a quota on device {device}, which is not an "
            "NVLink neighbour of device 0 (its neighbours on dgx1-v100: 1, 2, 3, 4)")
    # stage 1 on GPU 5 (NVLink to 1, 4, 6, 7) also holds 20 GB of GPU 4's pool: 40 GB > 30.1 GB usable
    plan, hw = dgx1_plan(s0=quota, s1={"peer_quotas": [PeerQuota(device=4, quota_bytes=20 * GB)]}, devices=[0, 5])
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", hardware=hw)
    assert one_line(info.value).startswith(
        "p.yaml: stages[1].peer_quotas[0].quota_bytes: quotas on device 4's peer pool total 40 GB, more than its memory")


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
    assert msg.startswith(f"p.yaml: stages[{stage}].rules[0].tensor: stage {stage} rule 0 names {bad!r}, which the "
                          "profile does not have in that stage: it matches ")
    layers = ", ".join(STAGE_LAYERS[stage])
    assert (f"none of its layers {layers} (optim:LAYER" if ":" in bad else f"no tensor saved in its layers {layers}") in msg


def test_check_plan_names_checks_only_what_it_is_given() -> None:
    # without layer names, model-data rules cannot be checked; without tensor ids, activation rules
    plan = make_plan({0: [rule("optim:nowhere")]})
    check_plan(plan, stage_tensors=STAGE_TENSORS)
    with pytest.raises(PlanError, match="'optim:nowhere'"):
        check_plan(plan, stage_layers=STAGE_LAYERS)
    plan = make_plan({0: [rule("nowhere.**")]})
    check_plan(plan, stage_layers=STAGE_LAYERS)
    with pytest.raises(PlanError, match=r"^plan: stages\[0\]\.rules\[0\]\.tensor: stage 0 rule 0 names 'nowhere\.\*\*'"):
        check_plan(plan, stage_tensors=STAGE_TENSORS)  # default source is "plan"


# -- the job: ranks, devices per rank, shape, the model's layers ---------------------------------

def test_check_plan_ranks_of_the_job() -> None:
    plan = make_plan()
    check_plan(plan, source="p.yaml", world_size=2)
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", world_size=4)
    assert one_line(info.value) == "p.yaml: num_ranks: made for 2 ranks, this job has 4"
    # two ranks on one device: no rank may share its device (two ranks never train on one GPU)
    with pytest.raises(PlanError) as info:
        check_plan(make_plan(devices=[3, 3]), source="p.yaml", world_size=2)
    assert one_line(info.value) == ("p.yaml: stage_to_device[1]: device 3 is rank 0's already (stage 1 runs on "
                                    "rank 1); one rank per device")


def test_check_plan_a_rank_has_one_device() -> None:
    # interleaved: 4 stages on 2 ranks, stage s on rank s % 2; stage 3 (rank 1) must share stage 1's device
    plan = replace(make_plan(ranges=((0, 1), (1, 2), (2, 3), (3, 4)), devices=[0, 1, 0, 2]),
                   schedule="interleaved", num_ranks=2)
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", world_size=2)
    assert one_line(info.value) == ("p.yaml: stage_to_device[3]: must be 1: stage 3 runs on rank 1, whose stage 1 "
                                    "is on device 1 (a rank has one device)")
    check_plan(replace(plan, stage_to_device=[0, 1, 0, 1], stages=[replace(sp, device=d) for sp, d in
                                                                   zip(plan.stages, [0, 1, 0, 1])]), world_size=2)


@pytest.mark.parametrize("field, value, key", [
    ("schedule", ScheduleName.GPIPE, "schedule"), ("num_stages", 3, "num_stages"),
    ("num_microbatches", 8, "num_microbatches"), ("microbatch_size", 4, "microbatch_size"),
])
def test_check_plan_shape_names_the_key(field: str, value: object, key: str) -> None:
    plan = make_plan()
    shape = Shape(ScheduleName.ONE_F_ONE_B, 2, 4, 2)
    check_plan(plan, source="p.yaml", shape=shape)
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", shape=replace(shape, **{field: value}))
    assert one_line(info.value).startswith(f"p.yaml: {key}: made for 1f1b, 2 stages, 4 x 2 microbatches; "
                                           "this pipeline is ")


def test_check_plan_last_stage_ends_at_the_models_last_layer() -> None:
    plan = make_plan()  # layers 0..3
    check_plan(plan, source="p.yaml", num_layers=4)
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", num_layers=6)
    assert one_line(info.value) == ("p.yaml: stages[1].end_layer: must be 6: the last stage ends at the model's "
                                    "last layer (the model has 6 layers)")


def test_check_plan_dtype() -> None:
    """A plan made for the model in another precision says so by its `dtype`; a plan from
    before plans recorded one (None) is told apart by its fingerprint alone."""
    tiny = load_model_config("gpt-tiny")
    half = replace(tiny, precision="bf16")
    plan = replace(make_plan(model_fp=half.fingerprint()), model=tiny.name, dtype="bf16")
    check_plan(plan, source="p.yaml", model=half)
    with pytest.raises(PlanError) as info:
        check_plan(plan, source="p.yaml", model=tiny)
    msg = one_line(info.value)
    assert msg.startswith("p.yaml: dtype: ") and "in bf16" in msg and "trains in fp32" in msg
    with pytest.raises(PlanError, match="model_fingerprint: "):
        check_plan(replace(plan, dtype=None), source="p.yaml", model=tiny)
