"""Topology: bus-id mapping, NVML detection (with a fake NVML), comparison, `mpress topo`."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import yaml

from mpress import cli
from mpress.commands import topo as topo_cmd
from mpress.d2d.static import topology
from mpress.d2d.static.topology import (
    compare_topology,
    detect_local_hardware,
    link_matrix_from_remote_ids,
    normalize_bus_id,
    nvlink_gbps_per_link_for_version,
)
from mpress.errors import TopologyError
from mpress.hardware.server import load_hardware
from mpress.config.presets import HARDWARE_DIR
from tests.support.hardware import DGX1_LINKS  # the matrix as typed in from nvidia-smi topo -m

# A DGX-1-like machine written out by hand: each GPU's own bus id (NVML's 8-digit domain)
# and the far end of each of its 6 active links (legacy 4-digit domain, upper case,
# in link order rather than peer order).
DGX1_BUS_IDS = ["00000000:06:00.0", "00000000:07:00.0", "00000000:0A:00.0", "00000000:0B:00.0",
                "00000000:85:00.0", "00000000:86:00.0", "00000000:89:00.0", "00000000:8A:00.0"]
DGX1_REMOTES = [
    ["0000:0B:00.0", "0000:07:00.0", "0000:85:00.0", "0000:0A:00.0", "0000:0B:00.0", "0000:85:00.0"],
    ["0000:0A:00.0", "0000:06:00.0", "0000:86:00.0", "0000:0B:00.0", "0000:0A:00.0", "0000:86:00.0"],
    ["0000:07:00.0", "0000:0B:00.0", "0000:06:00.0", "0000:89:00.0", "0000:07:00.0", "0000:0B:00.0"],
    ["0000:0A:00.0", "0000:06:00.0", "0000:8A:00.0", "0000:07:00.0", "0000:06:00.0", "0000:0A:00.0"],
    ["0000:8A:00.0", "0000:06:00.0", "0000:86:00.0", "0000:06:00.0", "0000:89:00.0", "0000:8A:00.0"],
    ["0000:89:00.0", "0000:07:00.0", "0000:85:00.0", "0000:07:00.0", "0000:8A:00.0", "0000:89:00.0"],
    ["0000:86:00.0", "0000:0A:00.0", "0000:8A:00.0", "0000:85:00.0", "0000:86:00.0", "0000:8A:00.0"],
    ["0000:89:00.0", "0000:85:00.0", "0000:0B:00.0", "0000:89:00.0", "0000:86:00.0", "0000:85:00.0"],
]

# An NVSwitch machine: 8 GPUs, 12 links each, every link ending at one of 6 switches.
SWITCH_IDS = [f"00000000:{b:02X}:00.0" for b in (0xC5, 0xC6, 0xC7, 0xC8, 0xC9, 0xCA)]
A100_BUS_IDS = [f"00000000:{b:02X}:00.0" for b in (0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD)]
A100_REMOTES = [[SWITCH_IDS[k % 6] for k in range(12)] for _ in range(8)]


# -- bus ids and the link matrix ------------------------------------------------------------
@pytest.mark.parametrize("text", ["00000000:07:00.0", "0000:07:00.0", "07:00.0", b"00000000:07:00.0\x00",
                                  " 0000:07:00.0 "])
def test_normalize_bus_id_formats(text: str | bytes) -> None:
    assert normalize_bus_id(text) == "0000:07:00.0"


def test_normalize_bus_id_case_and_rejects_garbage() -> None:
    assert normalize_bus_id("00000000:8A:1F.3") == "0000:8a:1f.3"
    for bad in ("", "GPU-1234", "0000:07:00", "zz:07:00.0"):
        with pytest.raises(TopologyError):
            normalize_bus_id(bad)


def test_link_matrix_dgx1_literal() -> None:
    matrix, nvswitch = link_matrix_from_remote_ids(DGX1_BUS_IDS, DGX1_REMOTES)
    assert matrix == DGX1_LINKS
    assert nvswitch is False


def test_link_matrix_nvswitch_literal() -> None:
    matrix, nvswitch = link_matrix_from_remote_ids(A100_BUS_IDS, A100_REMOTES)
    assert nvswitch is True
    assert matrix == [[0] * 8 for _ in range(8)]


def test_link_matrix_small_cases() -> None:
    # two GPUs, no NVLink
    assert link_matrix_from_remote_ids(["0:01:00.0", "0:02:00.0"], [[], []]) == ([[0, 0], [0, 0]], False)
    # one-sided report stays one-sided: symmetry is the caller's check
    m, sw = link_matrix_from_remote_ids(["01:00.0", "02:00.0"], [["0000:02:00.0"], []])
    assert m == [[0, 1], [0, 0]] and not sw
    # a link to something that is not a GPU marks a switch, direct links still count
    m, sw = link_matrix_from_remote_ids(["01:00.0", "02:00.0"], [["02:00.0", "c5:00.0"], ["01:00.0", "c5:00.0"]])
    assert m == [[0, 1], [1, 0]] and sw


def test_link_matrix_rejects_bad_input() -> None:
    with pytest.raises(TopologyError, match="remote-id lists"):
        link_matrix_from_remote_ids(["01:00.0"], [[], []])
    with pytest.raises(TopologyError, match="same PCI bus id"):
        link_matrix_from_remote_ids(["0000:01:00.0", "00000000:01:00.0"], [[], []])


def test_nvlink_version_bandwidth() -> None:
    assert nvlink_gbps_per_link_for_version(1) == 20.0
    assert [nvlink_gbps_per_link_for_version(v) for v in (2, 3, 4)] == [25.0, 25.0, 25.0]
    assert nvlink_gbps_per_link_for_version(0) is None


# -- a fake NVML ------------------------------------------------------------------------------
class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """Just enough of pynvml for detect_local_hardware; handles are GPU indices."""

    NVMLError = FakeNVMLError
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_TOPOLOGY_SINGLE = 10
    NVML_TOPOLOGY_MULTIPLE = 20
    NVML_TOPOLOGY_NODE = 40
    NVML_TOPOLOGY_SYSTEM = 50

    def __init__(self, *, name: str, memory_bytes: int, bus_ids: list[str], remotes: list[list[str]],
                 version: int, switch_pairs: set[frozenset[int]] = frozenset(), pcie: tuple[int, int] = (3, 16),
                 init_error: str | None = None, down: set[tuple[int, int]] = frozenset(),
                 reserved_bytes: int | None = None, compute: tuple[int, int] | None = None) -> None:
        self.name, self.memory_bytes, self.bus_ids, self.remotes = name, memory_bytes, bus_ids, remotes
        self.reserved_bytes, self.compute = reserved_bytes, compute
        if reserved_bytes is not None:
            self.nvmlMemory_v2 = 0x02000028  # pynvml's version tag of memory info v2
        self.version, self.switch_pairs, self.pcie, self.init_error, self.down = (
            version, switch_pairs, pcie, init_error, down)
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.bus_ids)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return self.name

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> SimpleNamespace:
        if version is None:
            return SimpleNamespace(total=self.memory_bytes, free=self.memory_bytes, used=0)
        if self.reserved_bytes is None:  # a driver without v2
            raise FakeNVMLError("Function Not Found")
        return SimpleNamespace(total=self.memory_bytes, reserved=self.reserved_bytes, used=0,
                               free=self.memory_bytes - self.reserved_bytes)

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        if self.compute is None:
            raise FakeNVMLError("Not Supported")
        return self.compute

    def nvmlDeviceGetPciInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self.bus_ids[h].encode())  # old pynvml returns bytes

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= len(self.remotes[h]):
            raise FakeNVMLError("Not Supported")
        return 0 if (h, link) in self.down else 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self.remotes[h][link])

    def nvmlDeviceGetNvLinkVersion(self, h: int, link: int) -> int:
        return self.version

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        if frozenset((a, b)) in self.switch_pairs:
            return self.NVML_TOPOLOGY_SINGLE
        return self.NVML_TOPOLOGY_NODE if (a < 4) == (b < 4) else self.NVML_TOPOLOGY_SYSTEM

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return self.pcie[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return self.pcie[1]


def fake_dgx1(**kw: object) -> FakeNVML:
    pairs = {frozenset(p) for p in [(0, 1), (2, 3), (4, 5), (6, 7)]}
    args = dict(name="Tesla V100-SXM2-32GB", memory_bytes=32 * 1024**3, bus_ids=DGX1_BUS_IDS,
                remotes=DGX1_REMOTES, version=2, switch_pairs=pairs)
    args.update(kw)
    return FakeNVML(**args)  # type: ignore[arg-type]


def fake_a100(**kw: object) -> FakeNVML:
    pairs = {frozenset(p) for p in [(0, 1), (2, 3), (4, 5), (6, 7)]}
    args = dict(name="NVIDIA A100-SXM4-40GB", memory_bytes=40 * 1024**3, bus_ids=A100_BUS_IDS,
                remotes=A100_REMOTES, version=4, switch_pairs=pairs, pcie=(4, 16))
    args.update(kw)
    return FakeNVML(**args)  # type: ignore[arg-type]


# -- detection ----------------------------------------------------------------------------------
def test_detect_fake_dgx1_matches_preset() -> None:
    nvml = fake_dgx1()
    detected, reason = detect_local_hardware(nvml=nvml)
    assert reason == "" and detected is not None
    hw = detected.hardware
    assert detected.link_matrix == DGX1_LINKS and not detected.nvswitch
    assert hw.num_devices == 8 and hw.nvlink_links == DGX1_LINKS
    assert hw.nvlink_gbps_per_link == 25.0  # NVLink2
    assert sorted(hw.pcie_switches) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert hw.pcie_h2d_gbps == pytest.approx(16 * 8 * 128 / 130 / 8)  # gen3 x16
    assert hw.device.memory_bytes == 32 * 1024**3
    assert hw.peak_flops("fp16") == 125e12  # V100 datasheet, via the name
    assert hw.compute_efficiency == topology.DETECTED_COMPUTE_EFFICIENCY
    assert [g.pci_bus_id for g in detected.gpus][:2] == ["0000:06:00.0", "0000:07:00.0"]
    assert nvml.shutdowns == 1
    assert compare_topology(load_hardware("dgx1-v100"), hw) == []


def test_detect_fake_nvswitch_matches_preset() -> None:
    detected, _ = detect_local_hardware(nvml=fake_a100())
    assert detected is not None
    hw = detected.hardware
    assert hw.nvswitch and hw.nvlink_links_per_gpu == 12 and hw.nvlink_links is None
    assert hw.pcie_h2d_gbps == pytest.approx(16 * 16 * 128 / 130 / 8)  # gen4 x16
    assert compare_topology(load_hardware("dgx-a100"), hw) == []
    assert compare_topology(load_hardware("hgx-h100"), hw) == ["NVLink links per GPU: expected 18, found 12"]


def test_a_detected_gpu_reserves_what_its_preset_does() -> None:
    """`hardware: detect` holds back the same causes as the presets (mpress.hardware.gpu_reserve):
    with what NVML says the driver keeps (memory info v2) and the compute capability, a
    DGX A100 detected reserves exactly what the dgx-a100 preset reserves (before: 512 MiB
    and 5%, leaving NCCL's buffers and the driver's share out)."""
    preset = load_hardware("dgx-a100").device
    nvml = fake_a100(reserved_bytes=preset.reserve.unreported_bytes, compute=(8, 0))
    detected, _ = detect_local_hardware(nvml=nvml)
    assert detected is not None
    assert detected.hardware.device.reserve == preset.reserve
    assert detected.hardware.usable_memory_bytes == preset.memory_bytes - preset.reserve_bytes
    # a driver without memory info v2: nothing known as kept, the other causes stay
    older, _ = detect_local_hardware(nvml=fake_a100())
    assert older.hardware.device.reserve.unreported_bytes == 0
    assert older.hardware.device.reserve.nccl_bytes == preset.reserve.nccl_bytes


def test_detect_link_down_on_one_side_is_an_error() -> None:
    nvml = fake_dgx1(down={(0, 0)})  # GPU0's link 0 (to GPU3) reads inactive; GPU3 still sees 2
    with pytest.raises(TopologyError, match="GPU0 to GPU3"):
        detect_local_hardware(nvml=nvml)
    assert nvml.shutdowns == 1


def test_detect_reports_why_when_nvml_is_unusable() -> None:
    detected, reason = detect_local_hardware(nvml=fake_dgx1(init_error="Driver Not Loaded"))
    assert detected is None and "no NVIDIA GPU found" in reason and "Driver Not Loaded" in reason
    detected, reason = detect_local_hardware(nvml=fake_dgx1(bus_ids=[], remotes=[]))
    assert detected is None and "0 devices" in reason


def test_detect_on_this_machine_says_no_gpu() -> None:
    detected, reason = detect_local_hardware()
    if detected is not None:
        pytest.skip("this machine has an NVIDIA GPU")
    assert reason.startswith("no NVIDIA GPU found") and "\n" not in reason


# -- comparison ---------------------------------------------------------------------------------
def test_compare_identical_is_empty() -> None:
    for preset in ("dgx1-v100", "dgx-a100", "cpu-local"):
        assert compare_topology(load_hardware(preset), load_hardware(preset)) == []


def test_compare_lists_each_mismatch() -> None:
    dgx1 = load_hardware("dgx1-v100")
    links = [row[:] for row in DGX1_LINKS]
    links[0][3] = links[3][0] = 1
    links[1][5] = links[5][1] = 0
    degraded = dataclasses.replace(dgx1, nvlink_links=links)
    assert compare_topology(dgx1, degraded) == [
        "GPU0-GPU3: expected 2 NVLink link(s), found 1",
        "GPU1-GPU5: expected 2 NVLink link(s), found 0",
    ]
    problems = compare_topology(dgx1, load_hardware("dgx-a100"))
    assert len(problems) == 1 and "NVSwitch" in problems[0]
    problems = compare_topology(load_hardware("cpu-local"), load_hardware("cpu-local", num_devices=2))
    assert problems == ["device count: expected 4, found 2"]


# -- the command --------------------------------------------------------------------------------
def _matrix_rows(out: str, header: str) -> list[list[str]]:
    """Cells of the matrix printed after the line starting with `header`."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 1:]:
        cells = line.split()
        is_header = cells and all(re.fullmatch(r"GPU\d+", c) for c in cells)
        if cells and not is_header and re.fullmatch(r"GPU\d+", cells[0]):
            rows.append(cells[1:])
        elif rows and not cells:
            break
    return rows


def test_topo_dgx1_link_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["topo", "--hardware", "dgx1-v100"]) == 0
    out = capsys.readouterr().out
    rows = _matrix_rows(out, "NVLink links per pair")
    expected = [["X" if i == j else f"NV{n}" if n else "PCIe" for j, n in enumerate(row)]
                for i, row in enumerate(DGX1_LINKS)]
    assert rows == expected
    assert rows[0][3] == "NV2" and rows[0][5] == "PCIe" and rows[0][1] == "NV1"
    assert "8 x Tesla V100-SXM2-32GB" in out and "34.4 GB each" in out  # 32 GiB, in GB as every table
    assert "fp16 125 TFLOP/s" in out and "fp32 15.7 TFLOP/s" in out
    assert "[GPU0 GPU1] [GPU2 GPU3] [GPU4 GPU5] [GPU6 GPU7]" in out
    assert "host memory 550 GB" in out  # 512 GiB


def test_topo_dgx1_bandwidth_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["topo", "--hardware", "dgx1-v100"]) == 0
    rows = _matrix_rows(capsys.readouterr().out, "Effective GB/s per pair")
    data = yaml.safe_load((HARDWARE_DIR / "dgx1-v100.yaml").read_text())
    per_link = float(data["nvlink_gbps_per_link"]) * float(data["nvlink_efficiency"])
    pcie = float(data["pcie_h2d_gbps"]) * float(data["pcie_efficiency"])
    assert rows[0][3] == f"{2 * per_link:.1f}"      # two links
    assert rows[0][1] == f"{per_link:.1f}"          # one link
    assert rows[0][5] == f"{pcie:.1f}p"             # no NVLink: the PCIe path
    assert rows[4][4] == "X"


def test_topo_nvswitch_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["topo", "--hardware", "hgx-h100"]) == 0
    out = capsys.readouterr().out
    rows = _matrix_rows(out, "NVLink links per pair")
    assert len(rows) == 8
    assert all(cell == ("X" if i == j else "NV18") for i, row in enumerate(rows) for j, cell in enumerate(row))
    assert "NVSwitch" in out and "none shared" in out


def test_topo_yaml_path(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "mine.yaml"
    path.write_text((HARDWARE_DIR / "cpu-local.yaml").read_text())
    assert cli.main(["topo", "--hardware", str(path)]) == 0
    assert "4 x CPU (stand-in)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["topo"], ["topo", "--local"]])
def test_topo_local_without_gpu_prints_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    if detect_local_hardware()[0] is not None:
        pytest.skip("this machine has an NVIDIA GPU")
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert "no NVIDIA GPU found" in lines[0] and "--hardware PRESET" in lines[0]


def test_topo_local_with_a_detected_machine(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake = fake_dgx1()
    monkeypatch.setattr(topology, "detect_local_hardware", lambda: detect_local_hardware(nvml=fake))
    assert cli.main(["topo", "--local"]) == 0
    out = capsys.readouterr().out
    assert "local machine" in out
    assert _matrix_rows(out, "NVLink links per pair")[0] == ["X", "NV1", "NV1", "NV2", "NV2", "PCIe", "PCIe", "PCIe"]


def test_topo_flags_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["topo", "--local", "--hardware", "dgx1-v100"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_link_label_and_pair_gbps() -> None:
    hw = load_hardware("dgx1-v100")
    assert topo_cmd.link_label(hw, 2, 2) == "X"
    assert topo_cmd.link_label(hw, 2, 3) == "NV2"
    assert topo_cmd.link_label(hw, 2, 4) == "PCIe"
    assert topo_cmd.pair_gbps(hw, 2, 3) == (hw.nvlink_gbps(2, 3), True)
    assert topo_cmd.pair_gbps(hw, 2, 4) == (min(hw.pcie_gbps("h2d"), hw.pcie_gbps("d2h")), False)


# -- the launcher's check before training --------------------------------------------------------
def test_launcher_refuses_a_plan_for_another_topology() -> None:
    from mpress.errors import TopologyError
    from mpress.launcher.startup import check_topology

    check_topology(load_hardware("dgx1-v100"), nvml=fake_dgx1())  # the machine the preset describes
    check_topology(load_hardware("dgx-a100", num_devices=4), nvml=fake_a100())  # a subset of its GPUs
    with pytest.raises(TopologyError, match=r"the plan's hardware dgx-a100 does not match this machine: NVSwitch"):
        check_topology(load_hardware("dgx-a100"), nvml=fake_dgx1())
    with pytest.raises(TopologyError, match="cannot check the topology of dgx1-v100 against this machine"):
        check_topology(load_hardware("dgx1-v100"), nvml=fake_dgx1(init_error="driver not loaded"))
