"""Malformed hardware YAML through `mpress topo --hardware`, `mpress emulate --hardware`
and a training run planned for it (`plan: auto`)."""

from __future__ import annotations

import pytest

from mpress.config.presets import HARDWARE_DIR
from tests.malformed.cases import Case, check, laughs, mutated, params, put

DGX1 = (HARDWARE_DIR / "dgx1-v100.yaml").read_text()
TOPO = ("topo", "--hardware", "{d}/hw.yaml")


def hw(case_id: str, change, *words: str, argv: tuple[str, ...] = TOPO, subprocess: bool = False) -> Case:
    return Case(case_id, argv, {"hw.yaml": mutated(DGX1, change)}, ("hw.yaml", *words), subprocess=subprocess)


def _links(i: int, j: int, value: object):
    def change(data: dict) -> None:
        data["nvlink_links"][i][j] = value
        data["nvlink_links"][j][i] = value
    return change


CASES = [
    hw("nvlink-bandwidth-nan", put("nvlink_gbps_per_link", float("nan")), "nvlink_gbps_per_link", "finite",
       subprocess=True),
    hw("pcie-bandwidth-nan", put("pcie_h2d_gbps", float("nan")), "pcie_h2d_gbps", "finite"),
    hw("pcie-bandwidth-inf", put("pcie_d2h_gbps", float("inf")), "pcie_d2h_gbps", "finite"),
    hw("pcie-bandwidth-zero", put("pcie_d2h_gbps", 0), "pcie_d2h_gbps"),
    hw("peak-flops-nan", put("device.peak_flops.fp32", float("nan")), "device.peak_flops.fp32"),
    hw("efficiency-nan", put("compute_efficiency", float("nan")), "compute_efficiency"),
    hw("latency-huge", put("pcie_latency_s", 1e300), "pcie_latency_s"),
    hw("memory-1e30", put("device.memory_bytes", 1e30), "device.memory_bytes"),
    hw("memory-2e18", put("device.memory_bytes", 2 * 10**18), "device.memory_bytes", "<="),
    hw("host-memory-negative", put("host_memory_bytes", -1), "host_memory_bytes"),
    hw("num-devices-million", put("num_devices", 10**6), "num_devices"),
    hw("num-devices-word", put("num_devices", "eight"), "num_devices"),
    hw("link-count-huge", _links(1, 6, 10**9), "nvlink_links[1][6]"),
    hw("link-count-negative", _links(1, 6, -1), "nvlink_links[1][6]"),
    hw("matrix-asymmetric", lambda d: d["nvlink_links"][0].__setitem__(3, 1), "nvlink_links[0][3]"),
    hw("matrix-short", lambda d: d["nvlink_links"].pop(), "nvlink_links"),
    hw("unknown-key", put("nvlink_link", 3), "nvlink_link", "unknown key"),
    hw("reserve-not-the-sum", put("device.reserve_bytes", 1), "reserve_bytes"),
    Case("duplicate-key", TOPO, {"hw.yaml": DGX1 + "num_devices: 4\n"}, ("hw.yaml", "duplicate key 'num_devices'")),
    Case("alias-bomb", TOPO, {"hw.yaml": laughs()}, ("hw.yaml", "aliases expand"), subprocess=True),
    Case("not-a-mapping", TOPO, {"hw.yaml": "- a\n- b\n"}, ("hw.yaml", "mapping")),
    Case("missing-file", TOPO, {}, ("hw.yaml", "no such file")),
    hw("emulate-nan-bandwidth", put("nvlink_gbps_per_link", float("nan")), "nvlink_gbps_per_link",
       argv=("emulate", "--model", "gpt-tiny", "--hardware", "{d}/hw.yaml")),
    Case("train-plan-auto-nan-bandwidth", ("train", "--config", "{d}/train.yaml", "--nproc-per-node", "1"),
         {"hw.yaml": mutated((HARDWARE_DIR / "cpu-local.yaml").read_text(), put("pcie_h2d_gbps", float("nan"))),
          "train.yaml": "model: gpt-tiny\nnum_stages: 1\nsteps: 1\nplan: auto\nhardware: hw.yaml\n"},
         ("hw.yaml", "pcie_h2d_gbps"), subprocess=True),
]


@pytest.mark.parametrize("case", params(CASES))
def test_malformed_hardware(case: Case, tmp_path) -> None:
    check(case, tmp_path)
