"""Hardware presets and `load_hardware`: figures, topology, overrides, bad input (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mpress import cli
from mpress.errors import ConfigError, UserError
from mpress.hardware.gpu_reserve import gpu_reserve
from mpress.hardware.server import Hardware, load_hardware
from mpress.config.presets import HARDWARE_DIR, hardware_presets
from tests.support.hardware import DGX1_LINKS  # the DGX-1V matrix as typed in from nvidia-smi topo -m


def raw(preset: str) -> dict:
    """The preset file as plain YAML data (no mpress code involved)."""
    return yaml.safe_load((HARDWARE_DIR / f"{preset}.yaml").read_text())


def write(tmp_path: Path, data: dict, name: str = "hw.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_four_presets_ship() -> None:
    assert {"dgx1-v100", "dgx-a100", "hgx-h100", "cpu-local"} <= set(hardware_presets())


@pytest.mark.parametrize("preset", hardware_presets())
def test_every_preset_loads_and_is_consistent(preset: str) -> None:
    hw = load_hardware(preset)
    assert isinstance(hw, Hardware) and hw.name == preset
    assert hw.source, "each preset says where its figures come from"
    assert 0 < hw.compute_efficiency <= 1
    assert hw.peak_flops("fp32") > 0
    for i in range(hw.num_devices):
        for j in range(hw.num_devices):
            assert hw.links(i, j) == hw.links(j, i)
            assert hw.nvlink_gbps(i, j) == hw.nvlink_gbps(j, i)
        assert hw.links(i, i) == 0
    # a preset name and its path give the same object
    assert load_hardware(HARDWARE_DIR / f"{preset}.yaml") == hw


def test_dgx1_matrix_is_the_hybrid_cube_mesh() -> None:
    hw = load_hardware("dgx1-v100")
    assert hw.num_devices == 8 and not hw.nvswitch and not hw.symmetric
    assert hw.nvlink_links == DGX1_LINKS
    for i in range(8):
        assert sum(hw.links(i, j) for j in range(8)) == 6, f"GPU{i} must have 6 NVLink links"
    assert hw.links(0, 3) == 2 and hw.links(0, 1) == 1 and hw.links(0, 5) == 0


def test_dgx1_device_and_host_figures() -> None:
    hw = load_hardware("dgx1-v100")
    assert hw.device.name == "Tesla V100-SXM2-32GB"
    assert hw.device.memory_bytes == 32 * 1024**3
    assert hw.peak_flops("fp32") == 15.7e12 and hw.peak_flops("fp16") == 125e12
    assert hw.host_memory_bytes == 512 * 1024**3
    assert hw.nvlink_gbps_per_link == 25.0


def test_dgx1_pcie_switch_pairs() -> None:
    hw = load_hardware("dgx1-v100")
    for a, b in [(0, 1), (2, 3), (4, 5), (6, 7)]:
        assert hw.pcie_group(a) == hw.pcie_group(b)
    groups = {hw.pcie_group(d) for d in range(8)}
    assert len(groups) == 4
    assert hw.pcie_group(1) != hw.pcie_group(2)


@pytest.mark.parametrize("preset, links, memory_gib, fp16", [
    ("dgx-a100", 12, 40, 312e12),
    ("hgx-h100", 18, 80, 989e12),
])
def test_nvswitch_presets(preset: str, links: int, memory_gib: int, fp16: float) -> None:
    hw = load_hardware(preset)
    assert hw.nvswitch and hw.symmetric and hw.num_devices == 8
    assert hw.nvlink_links_per_gpu == links
    assert all(hw.links(i, j) == links for i in range(8) for j in range(8) if i != j)
    assert hw.device.memory_bytes == memory_gib * 1024**3
    assert hw.peak_flops("fp16") == fp16 and hw.peak_flops("bf16") == fp16
    assert hw.nvlink_gbps_per_link == 25.0


def test_dgx_a100_pcie_pairs_and_h100_own_uplinks() -> None:
    a100 = load_hardware("dgx-a100")
    assert a100.pcie_group(0) == a100.pcie_group(1) != a100.pcie_group(2)
    h100 = load_hardware("hgx-h100")
    assert len({h100.pcie_group(d) for d in range(8)}) == 8


@pytest.mark.parametrize("preset", ["dgx1-v100", "dgx-a100", "hgx-h100", "cpu-local"])
def test_bandwidths_derive_from_yaml_figures(preset: str) -> None:
    data = raw(preset)
    hw = load_hardware(preset)
    per_link = float(data["nvlink_gbps_per_link"]) * float(data["nvlink_efficiency"])
    for i in range(hw.num_devices):
        for j in range(hw.num_devices):
            if i == j:
                continue
            n = data["nvlink_links_per_gpu"] if data["nvswitch"] else data["nvlink_links"][i][j]
            assert hw.nvlink_gbps(i, j) == pytest.approx(n * per_link)
    eff = float(data["pcie_efficiency"])
    assert hw.pcie_gbps("h2d") == pytest.approx(float(data["pcie_h2d_gbps"]) * eff)
    assert hw.pcie_gbps("d2h") == pytest.approx(float(data["pcie_d2h_gbps"]) * eff)


def test_dgx1_bandwidth_by_hand() -> None:
    # PCIe gen3 x16: 8 GT/s x 16 lanes x 128/130 / 8 = 15.75 GB/s nominal per direction.
    hw = load_hardware("dgx1-v100")
    assert hw.pcie_h2d_gbps == pytest.approx(8 * 16 * 128 / 130 / 8, rel=1e-3)
    # a 2-link pair moves twice what a 1-link pair does; an unlinked pair nothing over NVLink
    assert hw.nvlink_gbps(0, 3) == pytest.approx(2 * hw.nvlink_gbps(0, 1))
    assert hw.nvlink_gbps(0, 5) == 0.0


GPU_PRESETS = ["dgx1-v100", "dgx-a100", "hgx-h100"]


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_gpu_preset_states_its_reserve_by_cause_with_sources(preset: str) -> None:
    """The reserve covers what CUDA does not report, the context, cuBLAS, NCCL and the
    allocator's fragmentation, each figure with a comment saying where it comes from,
    and they are the figures the reserve model derives for that GPU."""
    hw = load_hardware(preset)
    reserve = hw.device.reserve
    assert reserve is not None, f"{preset}: device.reserve (the reserve by cause) is missing"
    assert reserve.total_bytes == hw.device.reserve_bytes
    assert hw.usable_memory_bytes == hw.device.memory_bytes - reserve.total_bytes
    hopper = "H100" in hw.device.name
    expected = gpu_reserve(memory_bytes=hw.device.memory_bytes,
                           cuda_total_bytes=hw.device.memory_bytes - reserve.unreported_bytes, hopper=hopper,
                           nvswitch_gpus=hw.num_devices if hw.nvswitch else 0)
    assert reserve == expected
    assert all(value > 0 for value in vars(reserve).values())
    lines = (HARDWARE_DIR / f"{preset}.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "reserve:")
    block = [line for line in lines[start + 1:start + 40] if line.startswith(" " * 4) and "_bytes:" in line]
    assert {line.split(":")[0].strip() for line in block} == set(vars(reserve))
    # the line, or the comment lines right above it, say where the figure comes from
    for line in block:
        i = lines.index(line)
        said = " ".join([line] + [c for c in lines[max(0, i - 4):i] if c.strip().startswith("#")])
        assert "#" in said, f"{preset}: {line.strip()} has no source"


def test_a_reserve_that_is_not_the_sum_of_its_causes_is_refused(tmp_path: Path) -> None:
    data = raw("dgx1-v100")
    data["device"]["reserve"]["nccl_bytes"] += 1
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_hardware(path)
    assert info.value.key == "device.reserve_bytes" and "sum of reserve" in info.value.problem


def test_cpu_local_defaults_and_overrides() -> None:
    hw = load_hardware("cpu-local")
    assert hw.num_devices == 4 and hw.nvswitch and "stand-in" in hw.source
    big = load_hardware("cpu-local", num_devices=6, memory_bytes=123_456)
    assert big.num_devices == 6 and big.device.memory_bytes == 123_456
    assert big.links(0, 5) == hw.links(0, 1) > 0
    assert big.device.name == hw.device.name and big.peak_flops("fp32") == hw.peak_flops("fp32")


def test_override_trims_pcie_groups() -> None:
    hw = load_hardware("dgx-a100", num_devices=3)
    assert hw.pcie_group(0) == hw.pcie_group(1) != hw.pcie_group(2)
    assert all(d < 3 for g in hw.pcie_switches for d in g)


@pytest.mark.parametrize("kwargs, words", [
    ({"num_devices": 0}, ">= 1"),
    ({"memory_bytes": 0}, "> 0"),
    ({"memory_bytes": -1}, "> 0"),
])
def test_bad_overrides(kwargs: dict, words: str) -> None:
    with pytest.raises(UserError, match=words):
        load_hardware("cpu-local", **kwargs)


def test_mesh_cannot_be_resized() -> None:
    with pytest.raises(UserError, match="link matrix"):
        load_hardware("dgx1-v100", num_devices=4)


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(UserError) as info:
        load_hardware("dgx-9000")
    assert "dgx-9000" in str(info.value) and "dgx1-v100" in str(info.value)


def test_missing_yaml_path(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file"):
        load_hardware(tmp_path / "absent.yaml")


def _dgx1_with(change) -> dict:  # type: ignore[no-untyped-def]
    data = raw("dgx1-v100")
    change(data)
    return data


def _set(data: dict, path: str, value: object) -> None:
    *parents, last = path.split(".")
    for p in parents:
        data = data[p]
    data[last] = value


BAD_INPUTS = [
    # (description, change to the DGX-1 data, expected key, words in the problem)
    ("unknown key", lambda d: _set(d, "nvlink_link", 3), "nvlink_link", "unknown key"),
    ("unknown nested key", lambda d: _set(d, "device.memory", 3), "device.memory", "unknown key"),
    ("wrong type", lambda d: _set(d, "num_devices", "eight"), "num_devices", "expected an integer"),
    ("bool for number", lambda d: _set(d, "pcie_h2d_gbps", True), "pcie_h2d_gbps", "expected"),
    ("zero memory", lambda d: _set(d, "device.memory_bytes", 0), "device.memory_bytes", "> 0"),
    ("negative memory", lambda d: _set(d, "device.memory_bytes", -1), "device.memory_bytes", "> 0"),
    ("negative host", lambda d: _set(d, "host_memory_bytes", -8), "host_memory_bytes", "> 0"),
    ("efficiency above 1", lambda d: _set(d, "compute_efficiency", 1.5), "compute_efficiency", "<= 1"),
    ("no fp32 peak", lambda d: _set(d, "device.peak_flops", {"fp16": 1e12}), "device.peak_flops.fp32", "missing"),
    ("unknown dtype", lambda d: _set(d, "device.peak_flops", {"fp32": 1e12, "fp8": 1e12}),
     "device.peak_flops.fp8", "unknown dtype"),
    ("asymmetric", lambda d: d["nvlink_links"][0].__setitem__(3, 1), "nvlink_links[0][3]", "not symmetric"),
    ("wrong size", lambda d: d["nvlink_links"].pop(), "nvlink_links", "8x8"),
    ("short row", lambda d: d["nvlink_links"][4].pop(), "nvlink_links", "8x8"),
    ("diagonal", lambda d: d["nvlink_links"][2].__setitem__(2, 1), "nvlink_links[2][2]", "diagonal"),
    ("negative links", lambda d: (d["nvlink_links"][1].__setitem__(6, -1), d["nvlink_links"][6].__setitem__(1, -1)),
     "nvlink_links[1][6]", ">= 0"),
    ("switch out of range", lambda d: _set(d, "pcie_switches", [[0, 1], [2, 8]]), "pcie_switches[1]", "out of range"),
    ("device behind two switches", lambda d: _set(d, "pcie_switches", [[0, 1], [1, 2]]), "pcie_switches[1]",
     "two switches"),
    ("matrix with nvswitch", lambda d: _set(d, "nvswitch", True), "nvlink_links", "not allowed"),
    # numbers: finite and bounded (NaN bandwidths passed and ended in a bogus "deadlock")
    ("NaN link bandwidth", lambda d: _set(d, "nvlink_gbps_per_link", float("nan")), "nvlink_gbps_per_link", "finite"),
    ("NaN PCIe bandwidth", lambda d: _set(d, "pcie_h2d_gbps", float("nan")), "pcie_h2d_gbps", "finite"),
    ("infinite PCIe bandwidth", lambda d: _set(d, "pcie_d2h_gbps", float("inf")), "pcie_d2h_gbps", "finite"),
    ("NaN peak", lambda d: _set(d, "device.peak_flops", {"fp32": float("nan")}), "device.peak_flops.fp32", "finite"),
    ("NaN efficiency", lambda d: _set(d, "nvlink_efficiency", float("nan")), "nvlink_efficiency", "finite"),
    ("NaN latency", lambda d: _set(d, "pcie_latency_s", float("nan")), "pcie_latency_s", "finite"),
    ("huge latency", lambda d: _set(d, "nvlink_latency_s", 1e300), "nvlink_latency_s", "<= 1"),
    ("huge memory", lambda d: _set(d, "device.memory_bytes", 2e18), "device.memory_bytes", "<="),
    ("huge host", lambda d: _set(d, "host_memory_bytes", 2 * 10**18), "host_memory_bytes", "<="),
    ("huge device count", lambda d: _set(d, "num_devices", 10**6), "num_devices", "<="),
    ("huge link count", lambda d: (d["nvlink_links"][1].__setitem__(6, 10**9), d["nvlink_links"][6].__setitem__(1, 10**9)),
     "nvlink_links[1][6]", "<="),
    ("int beyond 64 bits", lambda d: _set(d, "device.reserve_bytes", 2**64), "device.reserve_bytes", "at most"),
]


@pytest.mark.parametrize("what, change, key, words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_file_names_file_and_key(tmp_path: Path, what: str, change, key: str, words: str) -> None:  # type: ignore[no-untyped-def]
    path = write(tmp_path, _dgx1_with(change))
    with pytest.raises(ConfigError) as info:
        load_hardware(path)
    err = info.value
    assert err.source == str(path), what
    assert err.key == key, what
    assert words in err.problem, what
    assert str(info.value).startswith(f"{path}: {key}: ")


@pytest.mark.parametrize("what, change, key, words", BAD_INPUTS[:3] + BAD_INPUTS[10:12],
                         ids=[b[0] for b in BAD_INPUTS[:3] + BAD_INPUTS[10:12]])
def test_cli_bad_file_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            what: str, change, key: str, words: str) -> None:  # type: ignore[no-untyped-def]
    path = write(tmp_path, _dgx1_with(change))
    assert cli.main(["topo", "--hardware", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and key in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("text", ["num_devices: [\n", "- just\n- a list\n"])
def test_cli_unparsable_or_non_mapping_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            text: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    assert cli.main(["topo", "--hardware", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(path) in err and "Traceback" not in err


def test_cli_unknown_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["topo", "--hardware", "dgx-9000"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "dgx-9000" in err
