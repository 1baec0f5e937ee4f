"""Several data-parallel replicas of a pipeline on one GPU node, each on GPUs of its own.

Replica 0 trains on the plan's GPUs; every other replica on GPUs no other replica holds,
linked as the plan's are (`mpress.hardware.cluster.replica_devices`, the one function
that decides; the launcher's start-up check and each rank's device read its answer).
CUDA and NVML are faked (a DGX-1's eight V100s), so the ranks' devices are computed here
as a GPU machine would compute them."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import yaml

from mpress.commands.train import check_launch
from mpress.config.presets import HARDWARE_DIR, resolve_config
from mpress.config.units import fmt_bytes
from mpress.contract.plan import Plan, StagePlan, TensorRule, hardware_fingerprint
from mpress.d2d.static.topology import detect_local_hardware
from mpress.d2d.runtime.peer_store import peer_device
from mpress.errors import PlanError, UserError
from mpress.hardware.cluster import replica_devices
from mpress.hardware.server import load_hardware
from mpress.launcher import devices as devices_module
from mpress.launcher import startup
from mpress.launcher.devices import (
    check_distinct_devices,
    claim_for,
    cuda_bus_ids,
    join_replicas,
)
from mpress.runtime.train_config import TrainConfig, model_config
from mpress.static.emulate.dp_reduction import reduction_channels
from mpress.static.plan.evaluate import PipelineSetup, setup_pipeline
from mpress.static.plan.plan_eval import complete_plan
from mpress.static.plan.planner_layer_data import plan_host_bytes
from tests.d2d.static.test_topology import A100_BUS_IDS, fake_a100, fake_dgx1
from tests.d2d.static.test_visible_gpus import _fake_cuda
from tests.support.hardware import DGX1_LINKS
from tests.support.plans import contract_plan, d2d_rule, one_line

FOUR_STAGES = ((0, 1), (1, 2), (2, 3), (3, 4))


def _linked_alike(hw, node_devices: tuple[int, ...]) -> bool:
    """Whether `node_devices[d]` are linked to each other as devices d are (NVLink link
    counts, shared PCIe uplinks)."""
    return all(hw.links(node_devices[d], node_devices[e]) == hw.links(d, e)
               and (hw.pcie_group(node_devices[d]) == hw.pcie_group(node_devices[e]))
               == (hw.pcie_group(d) == hw.pcie_group(e))
               for d, e in itertools.combinations(range(len(node_devices)), 2))


# -- the one function that decides --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dgx1-v100", "hgx-h100"])
@pytest.mark.parametrize("stages, replicas", [(4, 2), (2, 2), (1, 8)])
def test_replicas_get_disjoint_gpus_linked_as_the_plans(name: str, stages: int, replicas: int) -> None:
    hw = load_hardware(name)
    maps = replica_devices(hw, stages, replicas)
    assert maps[0] == tuple(range(stages))  # the plan's stage-to-device map is replica 0's
    assert len(maps) == replicas and all(len(m) == stages for m in maps)
    every = [a for m in maps for a in m]
    assert len(set(every)) == len(every)  # no GPU is two replicas'
    assert all(_linked_alike(hw, m) for m in maps)


def test_on_a_dgx1_the_second_replica_of_four_stages_takes_the_other_quad() -> None:
    """GPUs 0-3 and 4-7 are the cube-mesh's two fully linked quads; 0-1 and 4-5 its only
    pairs with one link behind one PCIe switch (2-3 and 6-7 have two links)."""
    dgx1 = load_hardware("dgx1-v100")
    assert replica_devices(dgx1, 4, 2) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert replica_devices(dgx1, 2, 2) == ((0, 1), (4, 5))
    with pytest.raises(UserError, match=r"^dp: dgx1-v100 has no 4 disjoint sets of 2 GPUs linked as the plan's "
                                        r"GPUs 0-1 are \(NVLink links and shared PCIe uplinks\)"):
        replica_devices(dgx1, 2, 4)
    with pytest.raises(UserError, match=r"^dp: 3 replicas per node of a plan over 4 GPUs need 12 GPUs; dgx1-v100 "
                                        r"has 8: run fewer ranks per node, or plan over fewer GPUs$"):
        replica_devices(dgx1, 4, 3)


def test_every_replica_is_placed_not_each_one_first_fit() -> None:
    """Six GPUs, pairs 0-1, 2-3, 2-4 and 3-5 linked: the first pair for replica 1 (2, 3)
    would leave 4 and 5, unlinked; 2-4 and 3-5 hold replicas 1 and 2."""
    links = [[0] * 6 for _ in range(6)]
    for a, b in [(0, 1), (2, 3), (2, 4), (3, 5)]:
        links[a][b] = links[b][a] = 1
    node = dataclasses.replace(load_hardware("dgx1-v100"), name="six", num_devices=6, nvlink_links=links,
                               pcie_switches=[])
    assert replica_devices(node, 2, 3) == ((0, 1), (2, 4), (3, 5))


# -- the launcher: each rank's GPU, CUDA and NVML faked ------------------------------------------------
def test_each_replica_binds_its_own_gpus_whatever_order_cuda_numbers_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 replicas x 4 stages on a DGX-1 whose CUDA numbers NVML's GPUs 0,1,2,3,6,4,7,5:
    replica 1 is NVML 4-7 (not cuda:4-7 in order), its stage p on the GPU linked to its
    other stages as the plan's device p is to the plan's others."""
    order = [0, 1, 2, 3, 6, 4, 7, 5]
    _fake_cuda(monkeypatch, order)
    plan = dataclasses.replace(contract_plan(ranges=FOUR_STAGES, devices=[0, 1, 2, 3]), num_devices=4)
    maps = startup.replica_devices_for(plan, 4, 2, nvml=fake_dgx1())
    planned = cuda_bus_ids()  # rank 0's, when it planned
    nvml = {}
    claims = []
    for k, p in itertools.product(range(2), range(4)):
        device = startup.rank_device(plan, p, 4, True, plan_bus_ids=planned, node_devices=maps[k])
        nvml[k, p] = order[device.index]
        claims.append(dataclasses.replace(claim_for(k * 4 + p, device), host="node0"))
    assert [nvml[0, p] for p in range(4)] == [0, 1, 2, 3]
    assert sorted(nvml[1, p] for p in range(4)) == [4, 5, 6, 7]
    for k in range(2):
        for p, q in itertools.combinations(range(4), 2):
            assert DGX1_LINKS[nvml[k, p]][nvml[k, q]] == DGX1_LINKS[p][q], (k, p, q)
    check_distinct_devices(claims)  # the start-up check every rank makes passes


def test_each_replica_of_a_d2d_plan_lends_and_borrows_on_its_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas of a 2-stage D2D plan over 4 GPUs on a DGX-1 whose CUDA numbers NVML's
    GPUs 0,1,2,3,6,4,7,5: stage 0 stripes to stage 1's GPU and to the idle GPUs 2 and 3.
    Each replica's ranks and the peers they stripe to (`peer_device`, through the
    replica's slot) are GPUs of its own quad, linked to the rank's as the plan's peers
    are to device 0; no GPU is two replicas'."""
    order = [0, 1, 2, 3, 6, 4, 7, 5]
    _fake_cuda(monkeypatch, order)
    plan = dataclasses.replace(contract_plan({0: [d2d_rule("layers.0.**", {1: 0.5, 2: 0.25, 3: 0.25})]},
                                             ranges=((0, 1), (1, 2)), devices=[0, 1], s1={"peer_pool_bytes": 1 << 20}),
                               num_devices=4)
    assert plan.uses_peer_pools
    maps = startup.replica_devices_for(plan, 2, 2, nvml=fake_dgx1())
    planned = cuda_bus_ids()
    used: list[set[int]] = []
    for k in range(2):
        rank0 = startup.rank_device(plan, 0, 2, True, plan_bus_ids=planned, node_devices=maps[k])
        peers = {d: peer_device(rank0, d, maps[k]) for d in (1, 2, 3)}
        nvml = {d: order[peers[d].index] for d in peers} | {0: order[rank0.index]}
        assert nvml[1] == order[startup.rank_device(plan, 1, 2, True, plan_bus_ids=planned,
                                                    node_devices=maps[k]).index]  # stage 1's GPU lends its pool
        assert all(DGX1_LINKS[nvml[0]][nvml[d]] == DGX1_LINKS[0][d] for d in (1, 2, 3)), (k, nvml)
        used.append(set(nvml.values()))
    assert used == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    assert peer_device(torch.device("cpu"), 3, maps[1]) == torch.device("cpu")  # CPU pools: shared memory
    with pytest.raises(PlanError, match=r"^the plan stripes to its device 4; this replica has GPUs for devices 0-3$"):
        peer_device(torch.device("cuda", 4), 4, maps[1])


def test_replicas_whose_lenders_would_collide_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A D2D plan over all eight GPUs of a DGX-1 (two stages, six idle lenders): a second
    replica would share the first's lenders, so two per node are refused in one line;
    one per node is the plan's own."""
    _fake_cuda(monkeypatch, list(range(8)))
    plan = contract_plan(ranges=((0, 1), (1, 2)), devices=[0, 1], s1={"peer_pool_bytes": 1 << 20})
    assert plan.num_devices == 8 and plan.uses_peer_pools
    with pytest.raises(UserError, match=r"^dp: 2 replicas per node of a plan over 8 GPUs need 16 GPUs; local has 8"):
        startup.replica_devices_for(plan, 2, 2, nvml=fake_dgx1())
    assert startup.replica_devices_for(plan, 2, 1, nvml=fake_dgx1()) is None


def _quad_hardware(path, **host: int) -> str:
    """A hardware file: one quad of a DGX-1 (GPUs 0-3 and their links), with the preset's
    other figures but those in `host` (`pinnable_host_bytes`, `host_memory_bytes`); its path."""
    data = yaml.safe_load(resolve_config("dgx1-v100", HARDWARE_DIR, "hardware").read_text())
    data.update(num_devices=4, nvlink_links=[row[:4] for row in data["nvlink_links"][:4]],
                pcie_switches=[[0, 1], [2, 3]], **host)
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _slab_plan(cfg: TrainConfig, hardware: str) -> tuple[Plan, PipelineSetup]:
    """gpt-tiny in 4 stages on `hardware`, stage 0's first block swapped to its pinned
    pool and stage 3's optimizer stepping on the host (its staging slabs pinned apart from
    the pool), completed as the launcher completes a plan file, and its pipeline."""
    model = model_config(cfg)
    hw = load_hardware(hardware)
    setup = setup_pipeline(model, hw, schedule="1f1b", num_stages=4, microbatch_size=cfg.microbatch_size,
                           num_microbatches=cfg.num_microbatches, num_ranks=4, ranges=list(FOUR_STAGES_TINY))
    stages = [StagePlan(stage=s, device=s, first_layer=a, end_layer=b, optimizer_step="host" if s == 3 else "device",
                        rules=[TensorRule(tensor="layers.0.**", technique="host")] if s == 0 else [])
              for s, (a, b) in enumerate(FOUR_STAGES_TINY)]
    plan = Plan(strategy="test", model=model.name, model_fingerprint=model.fingerprint(), dtype=model.precision,
                profile_fingerprint="test", hardware=hw.name, hardware_fingerprint=hardware_fingerprint(hw),
                num_devices=4, device_memory_bytes=hw.device.memory_bytes, schedule="1f1b", num_stages=4,
                num_ranks=4, num_microbatches=cfg.num_microbatches, microbatch_size=cfg.microbatch_size,
                stage_to_device=[0, 1, 2, 3], stages=stages, fits=True)
    return complete_plan(setup, plan)[0], setup


FOUR_STAGES_TINY = ((0, 2), (2, 3), (3, 4), (4, 6))


def test_replicas_on_one_node_share_what_the_plan_pins(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Each replica pins what the plan pins: its pools, its host optimizer steps' staging
    slabs (and a drive's staging buffers): the sum the plan check reads (`host_bytes`).
    Two replicas of a plan whose pools alone fit twice, but not with the slabs, are
    refused at start-up (rank 0's `plan_for`, on a node of fake CUDA GPUs) in one line, a
    `UserError` (`mpress.train` says it once and every rank exits 2)."""
    _fake_cuda(monkeypatch, list(range(8)))
    monkeypatch.setattr(startup, "detect_local_hardware",
                        lambda **kw: detect_local_hardware(**{**kw, "nvml": fake_dgx1()}))
    monkeypatch.setattr(startup.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(startup.dist, "get_backend", lambda *_a: "nccl")
    # 2 replicas of the 4-rank pipeline on this node (the node's ranks say it; the config's
    # dp costs the replicas' reduction, which a one-quad hardware file has no network for)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = TrainConfig(model="gpt-tiny", num_stages=4, microbatch_size=2, num_microbatches=4,
                      hardware=_quad_hardware(tmp_path / "quad.yaml"), plan=str(tmp_path / "plan.yaml"))
    model = model_config(cfg)
    plan, setup = _slab_plan(cfg, cfg.hardware)
    one = plan_host_bytes(plan, setup.costs)
    assert one.pools == sum(sp.pinned_host_bytes for sp in plan.stages) > 0 and one.slabs > 0 and one.drive == 0

    def start(**host: int) -> startup.StartPlan:
        """Rank 0's start-up with the plan made for the quad with `host`."""
        hardware = _quad_hardware(tmp_path / "quad.yaml", **host)
        plan, setup = _slab_plan(cfg, hardware)
        assert plan_host_bytes(plan, setup.costs) == one
        plan.save(cfg.plan)
        return startup.plan_for(dataclasses.replace(cfg, hardware=hardware), model, 4, 4)

    # what the host can pin: the pools of both replicas, and half of their slabs
    with pytest.raises(UserError) as info:
        start(pinnable_host_bytes=2 * one.pools + one.slabs)
    assert one_line(info.value) == (
        f"dp: 2 replicas per node pin {fmt_bytes(2 * one.pinned)} of host memory (2 x the plan's "
        f"{fmt_bytes(one.pinned)}: pools {fmt_bytes(one.pools)}, host optimizer steps' staging slabs "
        f"{fmt_bytes(one.slabs)}); dgx1-v100 can pin {fmt_bytes(2 * one.pools + one.slabs)}: run fewer replicas "
        "per node or plan for a share of the host")
    # room to pin both replicas' slabs, not for both host steps' fp32 copies and Adam states
    assert one.pageable > 0
    with pytest.raises(UserError) as info:
        start(pinnable_host_bytes=2 * one.pinned, host_memory_bytes=2 * one.pinned + one.pageable)
    assert one_line(info.value).startswith(
        f"dp: 2 replicas per node keep {fmt_bytes(2 * one.total)} in host memory (2 x the plan's "
        f"{fmt_bytes(one.total)}: pools {fmt_bytes(one.pools)}, host optimizer steps' staging slabs "
        f"{fmt_bytes(one.slabs)} pinned, {fmt_bytes(one.pageable)} of the host steps' fp32 copies and Adam states); "
        f"dgx1-v100 has {fmt_bytes(2 * one.pinned + one.pageable)}: run fewer"), info.value
    # room for both: each replica on GPUs of its own, the second on the other quad
    assert start(pinnable_host_bytes=2 * one.pinned, host_memory_bytes=2 * one.total).replica_devices == \
        ((0, 1, 2, 3), (4, 5, 6, 7))


def test_hardware_detect_plans_over_replica_0s_share_of_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hardware: detect` with two replicas of four ranks on a DGX-1 plans for four GPUs
    linked as NVML 0-3 are, and the second replica is placed on the other four."""
    _fake_cuda(monkeypatch, list(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = TrainConfig(model="gpt-tiny", hardware="detect", plan="auto", num_stages=4, num_microbatches=4, dp=2)
    hw = startup.hardware_for(cfg, 4, True, nvml=fake_dgx1())
    assert hw.num_devices == 4 and hw.nvlink_links == [row[:4] for row in DGX1_LINKS[:4]]
    plan = dataclasses.replace(contract_plan(ranges=FOUR_STAGES, devices=[0, 1, 2, 3]), num_devices=hw.num_devices)
    assert startup.replica_devices_for(plan, 4, startup.replicas_per_node(4), nvml=fake_dgx1()) == \
        ((0, 1, 2, 3), (4, 5, 6, 7))


def _fake_a100_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of a job on a DGX A100 whose CUDA and NVML see its eight GPUs, NCCL up."""
    _fake_cuda(monkeypatch, list(range(8)), A100_BUS_IDS)
    monkeypatch.setattr(startup, "detect_local_hardware",
                        lambda **kw: detect_local_hardware(**{**kw, "nvml": fake_a100()}))
    monkeypatch.setattr(startup.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(startup.dist, "get_backend", lambda *_a: "nccl")


@pytest.mark.parametrize("hardware, dp", [("detect", 2), ("dgx-a100", 2), ("dgx-a100", 4)])
def test_replicas_on_half_a_node_each_start(monkeypatch: pytest.MonkeyPatch, hardware: str, dp: int) -> None:
    """Two replicas of a 4-rank pipeline on one DGX A100 (dp 2), or on each of two (dp 4):
    rank 0's start-up plans for 4 of the node's 8 GPUs and costs the replicas. Refused
    before: the network preset's 8 NICs against the pipeline's 4 GPUs ("nic_of_device
    names 8 devices"), or a network asked of detected hardware with all replicas on one
    node, which needs none."""
    _fake_a100_node(monkeypatch)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = TrainConfig(model="gpt-tiny", num_stages=4, microbatch_size=2, num_microbatches=4, dp=dp,
                      hardware=hardware, plan="none")
    reads: list[int] = []
    detect = startup.detect_local_hardware
    monkeypatch.setattr(startup, "detect_local_hardware", lambda **kw: reads.append(1) or detect(**kw))
    start = startup.plan_for(cfg, model_config(cfg), 4, 4)
    assert start.replica_devices == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert len(start.predicted_peak_bytes) == 4
    # NVML is read once for the replicas' placement (the costing's and the ranks' one answer; it was
    # read again for the ranks), once to detect the hardware or check the preset against the GPUs
    assert len(reads) == 2


def test_the_replicas_reduction_is_costed_on_their_gpus_with_the_presets_link_figures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a DGX A100 (NVSwitch, 12 links per GPU), two replicas of a 4-GPU plan: GPU d and
    its twin d + 4 ring over their 12 links at the preset's 25 GB/s x 0.9 = 270 GB/s
    (NVML would give the default efficiency, 0.8: 240 GB/s), 2 steps of 5 us; dp 2 needs
    no network, dp 4 adds two nodes' NICs (25 GB/s x 0.9, 2 steps of 5 us)."""
    _fake_a100_node(monkeypatch)
    hw = load_hardware("dgx-a100", num_devices=4)
    local = startup.node_replicas_for(4, 2, hardware=hw)
    assert local.devices == ((0, 1, 2, 3), (4, 5, 6, 7)) and local.node.name == "dgx-a100"
    one_node = startup.data_parallel_for(TrainConfig(model="gpt-tiny", dp=2, hardware="dgx-a100"), hw, local)
    assert one_node is not None and one_node.cluster is None and one_node.degree == 2
    channels = reduction_channels(one_node)
    assert sorted(channels) == [f"dp-link:{d}" for d in range(4)]
    assert channels["dp-link:3"].gbps == pytest.approx(270.0) and channels["dp-link:3"].latency_s == pytest.approx(1e-5)
    two_nodes = startup.data_parallel_for(TrainConfig(model="gpt-tiny", dp=4, hardware="dgx-a100"), hw, local)
    assert two_nodes is not None and (two_nodes.nodes, two_nodes.per_node) == (2, 2)
    channels = reduction_channels(two_nodes)
    assert len(channels) == 8 + 4 and channels["nic:7"].gbps == pytest.approx(22.5)
    assert channels["nic:7"].latency_s == pytest.approx(1e-5)
    with pytest.raises(UserError, match=r"^dp: 3 replicas cannot run 2 on each node .*: make dp a multiple of 2, or run"):
        startup.data_parallel_for(TrainConfig(model="gpt-tiny", dp=3, hardware="dgx-a100"), hw, local)


def test_replicas_per_node_are_the_nodes_ranks_over_the_pipelines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert startup.replicas_per_node(4) == 2 and startup.replicas_per_node(8) == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert startup.replicas_per_node(4) == 1  # a single process


def test_two_replicas_on_one_gpu_node_are_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before (one replica per node on NCCL); the GPU count still bounds it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    cfg = TrainConfig(model="gpt-tiny", num_stages=4, num_microbatches=4, dp=2, backend="nccl", plan="none")
    assert check_launch(cfg, 8) == "nccl"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 6)
    with pytest.raises(UserError, match=r"^--nproc-per-node: 8 ranks on nccl need as many GPUs; this machine "
                                        r"shows 6"):
        check_launch(cfg, 8)


def test_a_rank_makes_its_gpu_current_before_the_mesh_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's init_device_mesh sets LOCAL_RANK's GPU when none is current: the plan's
    GPU is made current first, then the mesh, then the pipeline group's warm-up."""
    calls: list[object] = []
    pp_group, dp_group = object(), object()
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(devices_module, "make_replicas", lambda dp, kind: calls.append(("mesh", dp, kind)) or
                        dataclasses.replace(_REPLICAS, pp_group=pp_group, dp_group=dp_group))
    monkeypatch.setattr(devices_module, "bind_device", lambda d, group: calls.append(("bind", d, group)))
    replicas = join_replicas(torch.device("cuda", 5), 2)
    assert calls == [("set_device", torch.device("cuda", 5)), ("mesh", 2, "cuda"),
                     ("bind", torch.device("cuda", 5), pp_group)]
    assert replicas is not None and replicas.dp_group is dp_group


_REPLICAS = devices_module.Replicas(mesh=None, dp_size=2, pp_size=4, dp_rank=1, pp_rank=1,  # type: ignore[arg-type]
                                    pp_group=None, dp_group=None)  # type: ignore[arg-type]
