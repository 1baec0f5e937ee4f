"""The GPUs a job can see: NVML numbers every GPU of the machine, CUDA only those
CUDA_VISIBLE_DEVICES (SLURM, a container) leaves, in its own order. Detection restricted
to CUDA's devices maps them by PCI bus id and keeps NVML's links between them; the
launcher plans over them and puts each rank on the plan's GPU by its bus id."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mpress.d2d.static.topology import detect_local_hardware, normalize_bus_id
from mpress.errors import PlanError, TopologyError
from mpress.hardware.server import load_hardware
from mpress.launcher import startup
from mpress.launcher.devices import cuda_bus_ids
from mpress.runtime.train_config import TrainConfig
from tests.d2d.static.test_topology import A100_BUS_IDS, DGX1_BUS_IDS, fake_a100, fake_dgx1
from tests.support.hardware import DGX1_LINKS
from tests.support.plans import contract_plan


def _sub(matrix: list[list[int]], order: list[int]) -> list[list[int]]:
    return [[matrix[i][j] for j in order] for i in order]


def _visible(order: list[int]) -> list[str]:
    return [normalize_bus_id(DGX1_BUS_IDS[i]) for i in order]


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, nvml_indices: list[int], bus_ids: list[str] = DGX1_BUS_IDS) -> None:
    """This process's CUDA sees the GPUs NVML numbers `nvml_indices`, as cuda:0, cuda:1, ...
    (torch's device properties carry each one's PCI domain, bus and device numbers from
    `bus_ids`, NVML's list: a DGX-1's unless given)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, nvml_indices)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(nvml_indices))

    def properties(i: int) -> SimpleNamespace:
        domain, bus, rest = normalize_bus_id(bus_ids[nvml_indices[i]]).split(":")
        return SimpleNamespace(pci_domain_id=int(domain, 16), pci_bus_id=int(bus, 16),
                               pci_device_id=int(rest.split(".")[0], 16), name="Tesla V100-SXM2-32GB")

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)


# -- detection over the GPUs CUDA sees -------------------------------------------------------------
def test_detect_restricted_to_cuda_visible_gpus_keeps_their_nvml_links() -> None:
    detected, reason = detect_local_hardware(nvml=fake_dgx1(), visible_bus_ids=_visible([4, 5, 6, 7]))
    assert reason == "" and detected is not None
    hw = detected.hardware
    assert hw.num_devices == 4
    assert detected.link_matrix == hw.nvlink_links == _sub(DGX1_LINKS, [4, 5, 6, 7])
    assert not detected.nvswitch  # links to GPUs 0-3 end at GPUs the job does not see, not at a switch
    assert sorted(hw.pcie_switches) == [[0, 1], [2, 3]]
    assert [g.index for g in detected.gpus] == [4, 5, 6, 7]  # NVML's numbers, for the reader


def test_detect_follows_cuda_order_not_nvml_order() -> None:
    order = [6, 4, 7, 5]  # CUDA_VISIBLE_DEVICES=6,4,7,5 (or CUDA's fastest-first order)
    detected, _ = detect_local_hardware(nvml=fake_dgx1(), visible_bus_ids=_visible(order))
    assert detected is not None
    assert detected.link_matrix == _sub(DGX1_LINKS, order)
    assert sorted(detected.hardware.pcie_switches) == [[0, 2], [1, 3]]  # 6/7 and 4/5 share a switch


def test_detect_subset_of_an_nvswitch_machine_is_still_nvswitch() -> None:
    detected, _ = detect_local_hardware(nvml=fake_a100(), visible_bus_ids=A100_BUS_IDS[2:4])
    assert detected is not None and detected.nvswitch and detected.hardware.num_devices == 2
    assert detected.hardware.nvlink_links_per_gpu == 12


def test_a_link_down_between_gpus_the_job_does_not_see_is_not_its_problem() -> None:
    nvml = fake_dgx1(down={(0, 0)})  # GPU0's link to GPU3 reads inactive on GPU0's side only
    detected, _ = detect_local_hardware(nvml=nvml, visible_bus_ids=_visible([4, 5, 6, 7]))
    assert detected is not None and detected.link_matrix == _sub(DGX1_LINKS, [4, 5, 6, 7])
    with pytest.raises(TopologyError, match="GPU0 to GPU1"):  # the job's GPU0 is NVML's GPU0 again
        detect_local_hardware(nvml=fake_dgx1(down={(0, 0)}), visible_bus_ids=_visible([0, 3]))


def test_a_cuda_device_nvml_does_not_list_or_listed_twice_is_one_line() -> None:
    with pytest.raises(TopologyError, match=r"CUDA device 1 \(PCI 0000:3f:00\.0\) is not one of the 8 GPUs NVML"):
        detect_local_hardware(nvml=fake_dgx1(), visible_bus_ids=[DGX1_BUS_IDS[0], "0000:3f:00.0"])
    with pytest.raises(TopologyError, match=r"CUDA devices 0 and 1 are the same GPU \(PCI 0000:06:00\.0"):
        detect_local_hardware(nvml=fake_dgx1(), visible_bus_ids=[DGX1_BUS_IDS[0], DGX1_BUS_IDS[0]])


# -- the launcher: plan over the GPUs the job sees --------------------------------------------------
def test_cuda_bus_ids_come_from_torch_device_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, [4, 5, 6, 7])
    assert cuda_bus_ids() == _visible([4, 5, 6, 7])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert cuda_bus_ids() is None  # no CUDA device: nothing to restrict NVML's view to


def test_hardware_detect_with_cuda_visible_devices_4_to_7(monkeypatch: pytest.MonkeyPatch) -> None:
    """The review's case: a DGX-1 whose job sees NVML 4-7 as cuda:0-3 plans for 4 GPUs
    linked as NVML 4-7 are, not for 8 (or for NVML 0-3's links)."""
    _fake_cuda(monkeypatch, [4, 5, 6, 7])
    cfg = TrainConfig(model="gpt-tiny", hardware="detect", plan="auto")
    hw = startup.hardware_for(cfg, 4, True, nvml=fake_dgx1())
    assert hw.num_devices == 4 and hw.nvlink_links == _sub(DGX1_LINKS, [4, 5, 6, 7])


def test_the_plans_hardware_is_checked_against_the_gpus_the_job_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    dgx1 = load_hardware("dgx1-v100")  # half of it: one socket's four GPUs
    half = dataclasses.replace(dgx1, num_devices=4, nvlink_links=_sub(DGX1_LINKS, [0, 1, 2, 3]),
                               pcie_switches=[[0, 1], [2, 3]])
    # NVML 0, 1, 4, 5 are not linked as NVML 0-3 are (NVML 0-4 has 2 links, 0-5 none)
    _fake_cuda(monkeypatch, [0, 1, 4, 5])
    with pytest.raises(TopologyError, match=r"GPU0-GPU2: expected 1 NVLink link\(s\), found 2"):
        startup.check_topology(half, nvml=fake_dgx1())
    _fake_cuda(monkeypatch, [4, 5, 6, 7])  # the other socket's four, linked as NVML 0-3 are: the plan fits
    startup.check_topology(half, nvml=fake_dgx1())


def test_each_rank_takes_the_plans_gpu_by_bus_id(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = contract_plan(ranges=((0, 1), (1, 2), (2, 3), (3, 4)), devices=[0, 1, 2, 3])
    planned = _visible([4, 5, 6, 7])  # what rank 0 saw when it planned: plan device d = cuda:d there
    _fake_cuda(monkeypatch, [4, 5, 6, 7])
    assert startup.rank_device(plan, 2, 4, True, plan_bus_ids=planned) == torch.device("cuda", 2)
    _fake_cuda(monkeypatch, [6, 7])  # this rank's launcher left it NVML 6 and 7 only (e.g. SLURM per task)
    assert startup.rank_device(plan, 2, 4, True, plan_bus_ids=planned) == torch.device("cuda", 0)
    assert startup.rank_device(plan, 3, 4, True, plan_bus_ids=planned) == torch.device("cuda", 1)
    with pytest.raises(PlanError, match=r"^rank 1: the plan's GPU 1 \(PCI 0000:86:00\.0\) is not visible to this "
                                        r"process \(it sees 0000:89:00\.0, 0000:8a:00\.0; CUDA_VISIBLE_DEVICES=6,7\)$"):
        startup.rank_device(plan, 1, 4, True, plan_bus_ids=planned)


def test_a_d2d_plan_needs_every_rank_to_number_the_gpus_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = contract_plan(ranges=((0, 1), (1, 2)), devices=[0, 1], s1={"peer_pool_bytes": 1 << 20})
    assert plan.uses_peer_pools
    planned = _visible([4, 5])
    _fake_cuda(monkeypatch, [5, 4])
    with pytest.raises(PlanError, match=r"rank 0: the plan's GPU 0 \(PCI 0000:85:00\.0\) is cuda:1 here.+D2D"):
        startup.rank_device(plan, 0, 2, True, plan_bus_ids=planned)


@pytest.mark.cuda
def test_on_a_gpu_machine_cuda_bus_ids_are_gpus_nvml_lists() -> None:
    """torch's PCI numbers for each CUDA device, written as NVML's bus ids are, name GPUs
    NVML lists; detection over them describes exactly this process's CUDA devices."""
    pytest.importorskip("pynvml")
    ids = cuda_bus_ids()
    assert ids is not None and len(ids) == torch.cuda.device_count()
    detected, why = detect_local_hardware(visible_bus_ids=ids)
    assert detected is not None, why
    assert [g.pci_bus_id for g in detected.gpus] == ids
    assert detected.hardware.num_devices == torch.cuda.device_count()
