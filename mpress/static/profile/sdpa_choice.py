"""Which kernel scaled dot-product attention runs on a GPU, from shapes alone (no torch).

torch tries SDPA's fused kernels in a fixed order and takes the first whose conditions
the call meets (torch 2.11's `sdp_utils.cpp`; 2.13 the same for what is here):

1. **flash** (compute capability 8.0 and up): fp16/bf16 inputs, no mask, query, key and
   value heads of one width, at most 256 and a multiple of 8, a causal call only with as
   many queries as keys; on sm86/sm89 a backward only up to head width 192.
   Grouped-query heads (`enable_gqa`) are taken.
2. **efficient**: no grouped-query heads; head widths a multiple of 4 (fp32) or 8
   (fp16/bf16); fp32 and fp16 everywhere, bf16 from sm80.
3. **math**: everything else (and shapes no fused kernel takes: not 4-d, or query heads
   not a multiple of the key/value heads).

Two users share this one choice: the fake profiler's `cuda_kernels.CudaKernels`, which
runs the chosen kernel's fake implementation (it reads the shapes off the tensors,
`cuda_kernels.attention_kernel`), and the analytic Llama profile (`analytic_llama`), which
lists what the chosen kernel saves without loading torch. The compute capability comes
from the hardware preset's device name (`compute_capability`).
"""

from __future__ import annotations

import re

from mpress.hardware.server import Hardware

COMPUTE_CAPABILITY = {"V100": (7, 0), "T4": (7, 5), "A100": (8, 0), "A10": (8, 6), "A40": (8, 6),
                      "L4": (8, 9), "L40": (8, 9), "H100": (9, 0), "H200": (9, 0), "H800": (9, 0),
                      "B200": (10, 0)}
"""Compute capability by GPU model (the word in a preset's device name)."""
UNKNOWN_GPU = (8, 0)
"""A GPU whose model the table does not know: assumed to run flash attention."""

HALF_DTYPES = ("float16", "bfloat16")
"""torch dtype names (`str(torch.float16)` less its `torch.` prefix) of 16-bit floats."""

FUSED = ("flash", "efficient")
"""The fused kernels: they save (query, key, value, output, log-sum-exp) and their random
generator's state, never the T x T probabilities the math path keeps."""

RNG_STATE = {"flash": (("seed", [2], "uint64"), ("offset", [], "uint64")),
             "efficient": (("seed", [], "int64"), ("offset", [], "int64"))}
"""What each fused CUDA kernel saves beside its output and log-sum-exp, (name, shape,
dtype) each, whatever the dropout: flash's philox seed and offset (24 bytes), the
efficient kernel's (16 bytes); torch's meta functions for
`_scaled_dot_product_flash_attention` and `_scaled_dot_product_efficient_attention`,
which CUDA's kernels match. The CPU's flash kernel saves none."""

LSE_ALIGNMENT = {"flash": 1, "efficient": 32}
"""The log-sum-exp (B x heads x queries, fp32) each fused CUDA kernel keeps has its query
dimension padded to a multiple of this (the efficient kernel's blocks of 32 queries)."""


def lse_columns(kernel: str, queries: int) -> int:
    """The query dimension of the log-sum-exp `kernel` saves for `queries` queries."""
    align = LSE_ALIGNMENT[kernel]
    return -(-queries // align) * align


def compute_capability(hardware: Hardware) -> tuple[int, int] | None:
    """The target's CUDA compute capability; None for a CPU stand-in (a device named CPU)."""
    name = hardware.device.name
    if re.search(r"\bCPU\b", name, re.IGNORECASE):
        return None
    words = set(re.findall(r"[A-Z]+\d+", name.upper()))
    return next((cc for model, cc in COMPUTE_CAPABILITY.items() if model in words), UNKNOWN_GPU)


def sdpa_kernel(cc: tuple[int, int], *, dtype: str, heads: int, kv_heads: int, value_heads: int, head_dim: int,
                value_head_dim: int, queries: int, keys: int, mask: bool = False, enable_gqa: bool = False,
                is_causal: bool = False, grad: bool = False) -> str:
    """"flash", "efficient" or "math": the kernel SDPA runs on a GPU of compute capability
    `cc` for (B, heads, queries, head_dim) queries, (B, kv_heads, keys, head_dim) keys and
    (B, value_heads, keys, value_head_dim) values of torch dtype `dtype` (its name, e.g.
    "bfloat16"), with a mask or not (see the module docstring). `grad`: the backward will
    run (some GPUs' flash refuses wide heads then)."""
    if kv_heads != value_heads or (heads != kv_heads and not (enable_gqa and heads % kv_heads == 0)):
        return "math"  # torch raises on such shapes; nothing fused takes them
    if cc >= (8, 0) and dtype in HALF_DTYPES and not mask and head_dim == value_head_dim \
            and head_dim % 8 == 0 and head_dim <= 256 and not (is_causal and queries != keys) \
            and not (cc in ((8, 6), (8, 9)) and head_dim > 192 and grad):
        return "flash"
    if enable_gqa:
        return "math"
    align = 4 if dtype == "float32" else 8
    aligned = head_dim % align == 0 and value_head_dim % align == 0
    if aligned and (dtype in ("float32", "float16") or (dtype == "bfloat16" and cc >= (8, 0))):
        return "efficient"
    return "math"
