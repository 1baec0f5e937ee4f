"""What an idle lender (a GPU that runs no stage) may lend (issue 12, item 6): its usable
memory (device memory less the hardware reserve) less one CUDA context per exporter
process that opens its pool (`PEER_CONTEXT_BYTES`; the pool's holder is one of them), at
most one per NVLink peer. Before, `MappingProblem.from_hardware` lent the device's whole
nominal memory. Expected figures come from the hardware preset and the constant."""

from __future__ import annotations

import pytest

from mpress.d2d.static.mapper import map_devices
from mpress.d2d.static.mapping import PEER_CONTEXT_BYTES, Assignment, MappingProblem
from mpress.hardware.server import Hardware, load_hardware


def lent_bytes(a: Assignment, num_devices: int) -> list[int]:
    """Bytes each device receives from every overflowing stage's stripes."""
    lent = [0] * num_devices
    for stripes in a.stripes.values():
        for device, nbytes in stripes:
            lent[device] += nbytes
    return lent


def nvlink_peers(hw: Hardware, device: int) -> list[int]:
    return [e for e in range(hw.num_devices) if hw.nvlink_gbps(device, e) > 0]


@pytest.mark.parametrize("preset", ["dgx1-v100", "dgx-a100"])
def test_an_idle_lender_keeps_the_reserve_and_one_context_for_its_exporter(preset):
    hw = load_hardware(preset)
    # two stages: stage 0 overflows by more than every GPU holds, stage 1 lends nothing
    huge = hw.num_devices * hw.device.memory_bytes
    p = MappingProblem.from_hardware(hw, [huge, 0], [0, 0])
    a = map_devices(p).assignment
    lent = lent_bytes(a, hw.num_devices)
    idle_peers = [d for d in nvlink_peers(hw, a.mapping[0]) if d not in a.mapping]
    assert idle_peers, "stage 0 reaches idle lenders"
    for d in range(hw.num_devices):
        if d in idle_peers:  # overflow is left over, so every reachable lender is full
            assert hw.device.memory_bytes - lent[d] == hw.device.reserve_bytes + PEER_CONTEXT_BYTES
        else:
            assert lent[d] == 0
    assert a.unplaced_bytes == huge - sum(lent)


def test_idle_lenders_keep_a_context_per_exporter_that_can_reach_them():
    hw = load_hardware("dgx1-v100")
    huge = hw.num_devices * hw.device.memory_bytes
    p = MappingProblem.from_hardware(hw, [huge, huge, 0], [0, 0, 0])
    a = map_devices(p).assignment
    lent = lent_bytes(a, hw.num_devices)
    both = set(nvlink_peers(hw, a.mapping[0])) | set(nvlink_peers(hw, a.mapping[1]))
    for d in both - set(a.mapping):
        assert lent[d] == hw.usable_memory_bytes - 2 * PEER_CONTEXT_BYTES


@pytest.mark.parametrize("num_overflowing", [1, 2, 4, 6])
def test_an_idle_lender_keeps_at_most_one_context_per_nvlink_peer(num_overflowing):
    # DGX-1: each GPU has NVLinks to 4 others, so at most 4 exporters reach any lender
    hw = load_hardware("dgx1-v100")
    stages = num_overflowing + 1
    p = MappingProblem.from_hardware(hw, [1] * num_overflowing + [0], [0] * stages)
    for d in range(hw.num_devices):
        contexts = min(num_overflowing, len(nvlink_peers(hw, d)))
        assert p.idle_spare_bytes[d] == hw.usable_memory_bytes - contexts * PEER_CONTEXT_BYTES


def test_an_idle_lender_with_no_exporter_keeps_only_the_reserve():
    hw = load_hardware("dgx1-v100")
    p = MappingProblem.from_hardware(hw, [0, 0], [0, 0])
    assert p.idle_spare_bytes == (hw.usable_memory_bytes,) * hw.num_devices
