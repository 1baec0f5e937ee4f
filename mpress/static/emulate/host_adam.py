"""Time of an Adam step run by the host CPU over parameters kept in host memory (DeepSpeed's
`DeepSpeedCPUAdam`, as ZeRO-Offload and ZeRO-Infinity run it). A pipeline stage's
`optimizer_step: host` runs torch's Adam instead: `host_step_time.py`.

The step is bound by host DRAM, not by the CPU's arithmetic: DeepSpeed's vectorised step
(`csrc/includes/cpu_adam.h`, `Step_AVX`) streams, per parameter, loads of the fp32 gradient,
exp_avg, exp_avg_sq and parameter (16 B) and stores of the parameter, exp_avg and exp_avg_sq
(12 B), plus the fp16 copy of the updated parameter that goes back to the GPU (2 B, its
`dev_params` buffer): `HOST_ADAM_BYTES_PER_PARAM` = 30 B, about 10 FLOPs against them
(far below a CPU socket's FLOP/s per byte of DRAM bandwidth). So the step takes its bytes
over `Hardware.host_memory_gbps`, which every process stepping at the same time shares
(the ranks of a server each step their 1/N of the parameters at once).

Units: bytes, seconds, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from mpress.errors import UserError
from mpress.hardware.server import Hardware

HOST_ADAM_BYTES_PER_PARAM = 4 * 4 + 3 * 4 + 2
"""Host DRAM bytes one parameter's CPU Adam update moves: fp32 gradient, exp_avg,
exp_avg_sq and parameter read; parameter, exp_avg, exp_avg_sq written; fp16 copy written."""


def host_adam_step_s(num_params: int, hardware: Hardware, sharers: int = 1) -> float:
    """Seconds of one CPU Adam step over `num_params` parameters while `sharers` processes
    (this one included) step at once, each getting 1/sharers of the host DRAM bandwidth.

    Raises UserError when the hardware states no `host_memory_gbps` (the step's only rate)."""
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    return host_dram_s(num_params * HOST_ADAM_BYTES_PER_PARAM, hardware, sharers)


def host_dram_s(nbytes: int, hardware: Hardware, sharers: int = 1) -> float:
    """Seconds a host (CPU) optimizer step that reads and writes `nbytes` of host DRAM
    takes while `sharers` processes (this one included) step at once, each getting
    1/sharers of `host_memory_gbps`: the one rate of every CPU step, DeepSpeed's cpu_adam
    (`host_adam_step_s`) and torch's Adam as the runtime runs it (`host_step_time`).

    Raises UserError when the hardware states no `host_memory_gbps`."""
    if sharers < 1:
        raise ValueError(f"sharers must be >= 1, got {sharers}")
    if nbytes == 0:
        return 0.0
    if hardware.host_memory_gbps is None:
        raise UserError(f"hardware {hardware.name}: host_memory_gbps is not set; a host (CPU) optimizer "
                        f"step needs the host DRAM bandwidth (GB/s)")
    return nbytes * sharers / (hardware.host_memory_gbps * 1e9)
