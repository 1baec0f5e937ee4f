"""Measuring peak memory the same way for every contender: live tensor bytes.

On CPU there is no allocator statistic, so `LiveBytes` (`mpress.contract.live_bytes`, the one the
runtime counts a CPU rank with) sees every operator that runs while it watches,
autograd's backward included, and counts the storages operators create until they die.
Outputs that alias an input (views, in-place and `out=` operators) add nothing. Memory
an operator allocates and frees inside itself (workspaces, im2col buffers, contiguous
copies) is not seen; storages that existed before it started (parameters, the input
batch) are not counted.

On CUDA, `cuda_peak_bytes` uses the caching allocator's own high-water mark
(`torch.cuda.max_memory_allocated`), which does include workspaces.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from mpress.contract.live_bytes import LiveBytes

__all__ = ["LiveBytes", "cuda_peak_bytes", "live_peak_bytes"]


def live_peak_bytes(fn: Callable[[], Any]) -> int:
    """Run `fn()` under `LiveBytes` and return the peak of live tensor bytes it created
    (bytes above what was live when it started). The result of `fn` is dropped first."""
    with LiveBytes() as tracker:
        fn()
    return tracker.peak_bytes


def cuda_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Run `fn()` on a CUDA device and return `max_memory_allocated` above the bytes
    allocated when it started (bytes, the caching allocator's high-water mark)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base
