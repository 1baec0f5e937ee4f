"""The emulator's copy channels hold the hardware's real limits: an NVSwitch GPU's port
bounds what it sends and what it receives (the device mapper's port model), and the
planner charges a host round trip exactly as the emulator runs it (one PCIe sharing
rule for both)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpress.contract.actions import Action
from mpress.d2d.static.mapping import MappingProblem
from mpress.d2d.static.ports import nvlink_port_gbps
from mpress.hardware.server import DeviceSpec, load_hardware
from mpress.config.model_config import load_model_config
from mpress.static.emulate.channels import build_channels, host_transfers, pcie_down, pcie_up, peer_transfers
from mpress.static.emulate.emulator import emulate
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.planner import PlannerOptions, _Planner
from mpress.static.emulate.program import Cost, Program, Task

A100 = load_hardware("dgx-a100")
DGX1 = load_hardware("dgx1-v100")
GB = 10**9


def _run(hw, ranks: list[list[Task]], devices: list[int]):
    """Emulate hand-made copy tasks (rank r on devices[r]) on `hw`'s channels."""
    return emulate(Program(ranks=tuple(tuple(r) for r in ranks), rank_device=tuple(devices),
                           device_capacity_bytes=(10**15,) * hw.num_devices, static_bytes=(0,) * len(ranks),
                           channels=build_channels(hw)))


def _duration(result, rank: int = 0, task: int = 0) -> float:
    return result.task_end_s[rank][task] - result.task_start_s[rank][task]


def _gather(hw, dst: int, peers: list[int], stripe_bytes: int) -> Task:
    """A D2D swap-in to `dst` gathered from `peers`, one stripe each (as lowering builds it)."""
    transfers = tuple(x for p in peers for x in peer_transfers(hw, p, dst, stripe_bytes))
    return Task(Action.parse("0DI0:x"), transfers=transfers, cost=Cost.D2D)


def test_nvswitch_gather_is_limited_by_the_destination_port():
    port = nvlink_port_gbps(A100)
    assert port == pytest.approx(12 * 25.0 * 0.9)  # 12 NVLink3 links x 25 GB/s x efficiency
    stripe = GB
    res = _run(A100, [[_gather(A100, 0, list(range(1, 8)), stripe)]], [0])
    rate_gbps = 7 * stripe / (_duration(res) - A100.nvlink_latency_s) / 1e9
    assert rate_gbps == pytest.approx(port, rel=1e-6)


def test_nvswitch_scatter_from_many_is_limited_by_the_lender_port():
    """Seven GPUs swap out to one lender at once: the lender's ingress is shared."""
    ranks = [[Task(Action.parse(f"{r}DO0:x"), transfers=peer_transfers(A100, r, 0, GB), cost=Cost.D2D)]
             for r in range(1, 8)]
    res = _run(A100, ranks, list(range(1, 8)))
    slowest = max(_duration(res, r) for r in range(7))
    assert 7 * GB / (slowest - A100.nvlink_latency_s) / 1e9 == pytest.approx(nvlink_port_gbps(A100), rel=1e-6)


def test_mesh_links_are_their_own_ports():
    """On the DGX-1 mesh each link is disjoint: a gather runs at the sum of its links."""
    assert nvlink_port_gbps(DGX1) is None
    peers = [p for p in range(8) if DGX1.links(0, p)]
    res = _run(DGX1, [[_gather(DGX1, 0, peers, GB)]], [0])
    # the slowest stripe (one link) bounds the gather
    slowest_link = min(DGX1.nvlink_gbps(p, 0) for p in peers)
    assert _duration(res) - DGX1.nvlink_latency_s == pytest.approx(GB / (slowest_link * 1e9), rel=1e-6)


def test_mapper_and_emulator_share_the_port():
    problem = MappingProblem.from_hardware(A100, [GB] + [0] * 7, [0] * 8)
    assert problem.port_gbps == (nvlink_port_gbps(A100),) * 8


# ---- PCIe: the planner charges what the emulator runs ----------------------------------------------

def _small_gpu(hw, memory_bytes: int):
    return replace(hw, device=DeviceSpec(name="small", memory_bytes=memory_bytes, peak_flops=hw.device.peak_flops))


def _planner(hw, stage_to_device: list[int]) -> _Planner:
    model = load_model_config("gpt-tiny")
    setup = setup_pipeline(model, hw, schedule="1f1b", num_stages=2, microbatch_size=1, num_microbatches=4,
                           stage_to_device=stage_to_device)
    return _Planner(setup, "host-swap", PlannerOptions(), None)


def _emulated_roundtrip_s(hw, devices: list[int], nbytes: int) -> float:
    """Swap-out then swap-in of nbytes on each of `devices` at once; device 0's time."""
    out = _run(hw, [[Task(Action.parse(f"{r}SO0:x"), transfers=host_transfers(hw, d, "d2h", nbytes))]
                    for r, d in enumerate(devices)], devices)
    back = _run(hw, [[Task(Action.parse(f"{r}SI0:x"), transfers=host_transfers(hw, d, "h2d", nbytes))]
                     for r, d in enumerate(devices)], devices)
    return _duration(out) + _duration(back)


def test_host_roundtrip_alone_behind_a_switch():
    """Stage 0's switch-mate (GPU 1) runs no stage: nothing shares the uplink."""
    hw = _small_gpu(DGX1, 10**12)
    planner = _planner(hw, [0, 2])
    nbytes = 3 * GB
    assert planner._host_roundtrip_s(nbytes, 0) == pytest.approx(_emulated_roundtrip_s(hw, [0], nbytes), rel=1e-9)


def test_host_roundtrip_shared_by_two_swapping_gpus():
    """Both GPUs behind one switch overflow (both swap): each gets half of the uplink."""
    tiny = _planner(_small_gpu(DGX1, 10**12), [0, 1])
    need = min(m.total_bytes for m in tiny.setup.memory)
    hw = _small_gpu(DGX1, need // 2)
    planner = _planner(hw, [0, 1])
    nbytes = 3 * GB
    assert planner._host_roundtrip_s(nbytes, 0) == pytest.approx(_emulated_roundtrip_s(hw, [0, 1], nbytes),
                                                                 rel=1e-9)
    assert pcie_up(hw, 0) == pcie_up(hw, 1) and pcie_down(hw, 0) == pcie_down(hw, 1)


def test_host_roundtrip_not_shared_when_the_mate_fits():
    """GPU 1 runs a stage that fits (it never swaps): GPU 0 has the uplink to itself."""
    tiny = _planner(_small_gpu(DGX1, 10**12), [0, 1])
    needs = [m.total_bytes for m in tiny.setup.memory]
    if needs[0] <= needs[1]:
        pytest.skip("gpt-tiny's first stage needs no more than its second")
    hw = _small_gpu(DGX1, (needs[0] + needs[1]) // 2)
    planner = _planner(hw, [0, 1])
    nbytes = 3 * GB
    assert planner._host_roundtrip_s(nbytes, 0) == pytest.approx(_emulated_roundtrip_s(hw, [0], nbytes), rel=1e-9)


# ---- host DRAM ---------------------------------------------------------------------------------

def test_host_memory_bounds_many_gpus_copying_at_once():
    """Eight GPUs swap out at once through a host whose DRAM is narrower than their
    uplinks together: DRAM bounds them, each at its fair share."""
    hw = replace(DGX1, pcie_switches=[], host_memory_gbps=20.0)
    ranks = [[Task(Action.parse(f"{r}SO0:x"), transfers=host_transfers(hw, r, "d2h", GB))] for r in range(8)]
    res = _run(hw, ranks, list(range(8)))
    assert max(_duration(res, r) for r in range(8)) == pytest.approx(8 * GB / 20e9, rel=1e-6)
    # one GPU alone: its uplink bounds it, not DRAM
    alone = _run(hw, ranks[:1], [0])
    assert _duration(alone) == pytest.approx(hw.pcie_latency_s + GB / (hw.pcie_gbps("d2h") * 1e9), rel=1e-6)


def test_presets_state_pinnable_host_memory_below_ram():
    for name in ("dgx1-v100", "dgx-a100", "hgx-h100"):
        hw = load_hardware(name)
        assert hw.pinnable_host_bytes is not None and hw.pinnable_bytes < hw.host_memory_bytes
        assert hw.host_memory_gbps is not None


def test_pinnable_above_ram_is_refused():
    from mpress.errors import ConfigError
    with pytest.raises(ConfigError, match="pinnable_host_bytes"):
        replace(DGX1, pinnable_host_bytes=DGX1.host_memory_bytes + 1)
