"""`mpress topo`: show the topology of a hardware preset/YAML or of this machine.

Prints a device summary (count x model, memory, peak FLOP/s per dtype), the NVLink link
count of every GPU pair (`NV2`, `NV1`, `PCIe` for none, `X` on the diagonal), the
effective one-direction GB/s of every pair (NVLink, or the PCIe path where there is no
NVLink), the PCIe switch groups, host memory and PCIe bandwidth (GB = 1e9 bytes).
--json prints the same as JSON: the hardware's own keys (as in its YAML; bytes as
integers, times in seconds, bandwidths in GB/s), the link matrix, and per pair the
effective one-direction GB/s and whether it goes over NVLink.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mpress.commands.flags import EXIT_STATUS, HelpFormatter, add_flag
from mpress.config.loader import to_dict
from mpress.hardware.server import Hardware, load_hardware
from mpress.config.presets import hardware_presets
from mpress.ui import make_console, print_json
from mpress.config.units import fmt_bytes

EPILOG = """\
examples:
    mpress topo --hardware dgx1-v100
    mpress topo --local
    mpress topo --hardware hgx-h100 --json

Without --hardware, the local machine is detected through NVML; when it finds no NVIDIA
GPU, one line on stderr says why, nothing else is shown, and the exit status is 1.

""" + EXIT_STATUS


def register(subparsers: Any) -> None:
    """Add the `topo` subcommand to the `mpress` parser."""
    parser = subparsers.add_parser(
        "topo", help="show the GPU/NVLink/PCIe topology of a preset or of this machine",
        description="Show the GPU, NVLink and PCIe topology of a hardware preset, a YAML file or this machine.",
        epilog=EPILOG,
        formatter_class=HelpFormatter)
    source = parser.add_mutually_exclusive_group()
    add_flag(source, "hardware", help=f"hardware preset ({', '.join(hardware_presets())}) or a YAML path")
    source.add_argument("--local", action="store_true",
                        help="detect this machine through NVML (the default without --hardware)")
    add_flag(parser, "json")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Show the requested topology; see EPILOG for the exit status."""
    console = _console()
    if args.hardware:
        hw = load_hardware(args.hardware)
        if args.json:
            print_json(topology_json(hw))
        else:
            render_hardware(hw, console, title=f"{hw.name}")
        return 0
    # Imported here: the detection module is only needed for --local.
    from mpress.d2d.static.topology import detect_local_hardware

    topology, reason = detect_local_hardware()
    if topology is None:
        presets = ", ".join(hardware_presets())
        print(f"mpress topo: {reason}; use --hardware PRESET to show a preset ({presets})", file=sys.stderr)
        return 1
    if args.json:
        print_json(topology_json(topology.hardware, notes=topology.notes))
    else:
        render_hardware(topology.hardware, console, title="local machine (detected through NVML)",
                        notes=topology.notes)
    return 0


def _console() -> Console:
    return make_console()


def link_label(hw: Hardware, i: int, j: int) -> str:
    """Cell of the link matrix: `X` on the diagonal, `NV<n>`, or `PCIe` when no NVLink."""
    if i == j:
        return "X"
    n = hw.links(i, j)
    return f"NV{n}" if n else "PCIe"


def pair_gbps(hw: Hardware, i: int, j: int) -> tuple[float, bool]:
    """Effective one-direction GB/s from device i to j and whether it is over NVLink.

    Without NVLink a peer copy crosses PCIe: out of i's uplink and into j's, so it is
    bounded by the slower of the two directions.
    """
    nvlink = hw.nvlink_gbps(i, j)
    if nvlink > 0:
        return nvlink, True
    return min(hw.pcie_gbps("d2h"), hw.pcie_gbps("h2d")), False


def _flops(value: float) -> str:
    if value >= 1e12:
        return f"{value / 1e12:g} TFLOP/s"
    return f"{value / 1e9:g} GFLOP/s"


def topology_json(hw: Hardware, notes: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """What `render_hardware` shows, as plain data: the hardware's keys, the NVLink link
    count per pair, the effective GB/s per pair (None on the diagonal) and whether it
    is over NVLink, the effective PCIe GB/s per direction, and notes."""
    n = range(hw.num_devices)
    return {"hardware": to_dict(hw),
            "nvlink_links": [[0 if i == j else hw.links(i, j) for j in n] for i in n],
            "pair_gbps": [[None if i == j else pair_gbps(hw, i, j)[0] for j in n] for i in n],
            "pair_over_nvlink": [[None if i == j else pair_gbps(hw, i, j)[1] for j in n] for i in n],
            "pcie_effective_gbps": {"h2d": hw.pcie_gbps("h2d"), "d2h": hw.pcie_gbps("d2h")},
            "notes": list(notes)}


def device_summary(hw: Hardware) -> str:
    """One line: count x model, memory, peak FLOP/s per dtype, compute efficiency."""
    peaks = ", ".join(f"{dtype} {_flops(v)}" for dtype, v in hw.device.peak_flops.items())
    return (f"{hw.num_devices} x {hw.device.name}, {fmt_bytes(hw.device.memory_bytes)} each; "
            f"peak {peaks}; compute efficiency {hw.compute_efficiency:g}")


def _matrix_table(hw: Hardware, cell: Any) -> Table:
    table = Table(box=box.SIMPLE, pad_edge=False)
    table.add_column("")
    for j in range(hw.num_devices):
        table.add_column(f"GPU{j}", justify="right")
    for i in range(hw.num_devices):
        table.add_row(f"GPU{i}", *(cell(i, j) for j in range(hw.num_devices)))
    return table


def _gbps_cell(hw: Hardware, i: int, j: int) -> str:
    if i == j:
        return "X"
    gbps, over_nvlink = pair_gbps(hw, i, j)
    return f"{gbps:.1f}" if over_nvlink else f"[dim]{gbps:.1f}p[/dim]"


def render_hardware(hw: Hardware, console: Console, *, title: str, notes: list[str] | tuple[str, ...] = ()) -> None:
    """Print the topology of `hw` (see the module docstring) to `console`."""
    console.print(f"[bold]{escape(title)}[/bold]")
    if hw.source:
        console.print(f"source: {escape(hw.source)}")
    console.print(escape(device_summary(hw)))
    fabric = (f"NVSwitch, {hw.nvlink_links_per_gpu} link(s) per GPU" if hw.nvswitch
              else "point-to-point NVLink mesh" if hw.nvlink_links is not None else "no NVLink")
    console.print(f"NVLink: {fabric}; {hw.nvlink_gbps_per_link:g} GB/s per link per direction nominal, "
                  f"efficiency {hw.nvlink_efficiency:g}")
    # Titles go on lines of their own: a table title wraps to the table's width.
    console.print("NVLink links per pair (NV<n> = n links; PCIe = no NVLink):")
    console.print(_matrix_table(hw, lambda i, j: link_label(hw, i, j)))
    shared = "; under NVSwitch, with one peer at a time" if hw.nvswitch else ""
    console.print(f"Effective GB/s per pair, one direction (p = over PCIe, no NVLink{shared}):")
    console.print(_matrix_table(hw, lambda i, j: _gbps_cell(hw, i, j)))
    if hw.pcie_switches:
        groups = " ".join("[" + " ".join(f"GPU{d}" for d in g) + "]" for g in hw.pcie_switches)
        console.print(f"PCIe switches (GPUs in one group share an uplink): {escape(groups)}")
    else:
        console.print("PCIe switches: none shared (each GPU has its own uplink)")
    console.print(f"host memory {fmt_bytes(hw.host_memory_bytes)}; PCIe per uplink: "
                  f"h2d {hw.pcie_h2d_gbps:g} / d2h {hw.pcie_d2h_gbps:g} GB/s nominal, "
                  f"{hw.pcie_gbps('h2d'):.1f} / {hw.pcie_gbps('d2h'):.1f} GB/s effective "
                  f"(efficiency {hw.pcie_efficiency:g})")
    for note in notes:
        console.print(f"note: {escape(note)}")
