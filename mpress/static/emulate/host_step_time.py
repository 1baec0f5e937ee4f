"""Time of a stage's optimizer step on the host as the runtime runs it (`optimizer_step:
host`; `runtime/master_weights.py` HOST_COPY, one layer's parameters per call).

Not DeepSpeed's fused `cpu_adam` (`host_adam.py`, 30 B per parameter, what the ZeRO
baselines run): the runtime steps `torch.optim.Adam` over fp32 host tensors, which torch
runs one tensor at a time (`torch/optim/adam.py` `_single_tensor_adam`: no foreach on CPU
tensors, no fused unless asked). Like cpu_adam it is bound by host DRAM, so it takes the
bytes its operations read and write over `Hardware.host_memory_gbps`, shared by the ranks
stepping at once. Per parameter, fp32 (4 B) each, read (r) and written (w):

    exp_avg.lerp_(grad, 1 - beta1)            r exp_avg, grad          w exp_avg     12
    exp_avg_sq.mul_(beta2)                    r exp_avg_sq             w exp_avg_sq   8
      .addcmul_(grad, grad, 1 - beta2)        r exp_avg_sq, grad       w exp_avg_sq  12
    denom = exp_avg_sq.sqrt()                 r exp_avg_sq             w new          8
      / bias_correction2_sqrt                 r that                   w new          8
      .add_(eps)                              r denom                  w denom        8
    param.addcdiv_(exp_avg, denom, -step)     r param, exp_avg, denom  w param       16
                                                                                     --
                                                                                     72

(with `weight_decay` > 0, `grad.add(param, alpha=wd)` reads 8 and writes 4 more; the
trainer's default is 0 and a plan does not know the job's, so it is not counted). Around
it the runtime copies, in the parameter's dtype of `p` bytes (its pinned staging buffer):
the gradient upcast to fp32 (`staging.to(float32)`: r p, w 4; none for fp32, where it is
the staging buffer itself) and the rounding of the updated fp32 copy into the staging
buffer (`staging.copy_(master)`: r 4, w p). The DMA copies of the staging buffers across
PCIe are the step's transfers (`lowering._host_step`), not counted here.

The count assumes the temporaries' pages are resident. With glibc's default malloc, a
temporary above its mmap threshold (32 MiB at most: any large layer's tensor) is mapped
fresh at every step and unmapped after it, and the first touch of each page faults; on
the development box (2 threads, 20M fp32 parameters in one tensor) torch's Adam step took
69 ms by default (134 B/param at the measured copy bandwidth) and 22 ms (66 B/param,
under the 72 counted) with MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ raised so
freed memory is reused. Those faults are not modelled: run such jobs with an allocator
that keeps freed memory (those variables, jemalloc or tcmalloc), or expect about twice
this time.

Units: bytes, seconds, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

from mpress.hardware.server import Hardware
from mpress.static.emulate.host_adam import host_dram_s

MASTER_BYTES = 4
"""fp32: what torch's Adam steps on the host (the master copy, its gradient and states)."""

TORCH_ADAM_BYTES_PER_PARAM = 12 + 8 + 12 + 8 + 8 + 8 + 16
"""Host DRAM bytes `_single_tensor_adam` reads and writes per fp32 parameter (module
docstring's table; weight_decay 0)."""


def host_step_bytes(num_params: int, param_bytes: int) -> int:
    """Host DRAM bytes one host step over `num_params` parameters of `param_bytes` bytes in
    all (their dtype: the staging buffers') reads and writes: torch's Adam, the gradients'
    upcast to fp32 (none when the parameters are fp32) and the rounding back."""
    if num_params < 0 or param_bytes < 0:
        raise ValueError(f"num_params and param_bytes must be >= 0, got {num_params}, {param_bytes}")
    master = MASTER_BYTES * num_params
    upcast = 0 if param_bytes == master else param_bytes + master
    rounding = master + param_bytes
    return TORCH_ADAM_BYTES_PER_PARAM * num_params + upcast + rounding


def host_step_s(num_params: int, param_bytes: int, hardware: Hardware, sharers: int = 1) -> float:
    """Seconds of one host step over `num_params` parameters (`param_bytes` in all) while
    `sharers` ranks (this one included) step on the host at once, each getting 1/sharers of
    the host DRAM bandwidth (`host_adam.host_dram_s`).

    Raises UserError when the hardware states no `host_memory_gbps` (the step's only rate)."""
    return host_dram_s(host_step_bytes(num_params, param_bytes), hardware, sharers)
