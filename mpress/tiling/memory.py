"""Measuring peak memory the same way for every contender: live tensor bytes.

On CPU there is no allocator statistic, so `LiveBytes` (a `TorchDispatchMode`) sees every
operator that runs while it is active, autograd's backward included, and counts the
storages operators create: a storage is live from the operator that returns it until
its last reference dies (a `weakref.finalize` on the storage, which PyTorch keeps as one
Python object per storage). Outputs that alias an input (views, in-place and `out=`
operators) add nothing. Memory an operator allocates and frees inside itself
(workspaces, im2col buffers, contiguous copies) is not seen; storages that existed
before the mode started (parameters, the input batch) are not counted.

On CUDA, `cuda_peak_bytes` uses the caching allocator's own high-water mark
(`torch.cuda.max_memory_allocated`), which does include workspaces.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _tensors(tree: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in nested tuples/lists/dicts (operator arguments and results); a small
    walk instead of pytree, which costs more than the operators of a tile."""
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (tuple, list)):
        for t in tree:
            _tensors(t, out)
    elif isinstance(tree, dict):
        for t in tree.values():
            _tensors(t, out)
    return out


class LiveBytes(TorchDispatchMode):
    """Live bytes of storages created while active, and their high-water mark (bytes).

    Use as a context manager; `live_bytes` and `peak_bytes` are relative to entering it.
    Works on CPU and on the meta device (where it measures without computing).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs: set[int] | None = None
        for t in _tensors(out, []):
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._sizes:
                continue
            if inputs is None:
                inputs = {a.untyped_storage()._cdata for a in _tensors((args, kwargs), [])}
            if key in inputs:
                continue
            size = storage.nbytes()
            self._sizes[key] = size
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.live_bytes -= size


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
