"""How a swapped tensor's elements lie in memory, and how they come back the same way.

A swap moves bytes, so the engine turns every tensor it is given into a contiguous run of
bytes on the training thread, on the compute stream, before it records the ready event:

- a *dense* tensor (its elements fill a contiguous range of its storage in some order of
  its dimensions: contiguous, transposed, permuted, channels-last) is moved as it lies:
  its bytes go to a view of the same strides over the pool block (`Layout.over`: the
  copy is one memcpy, nothing is gathered), and the swap-in allocates the same strides
  (`torch.empty_strided`), so the tensor comes back in its own layout (a backward
  reading a transposed operand reads it transposed again, with the same kernels and
  the same bits);
- any other tensor (a strided slice with gaps, an expanded view) is gathered first into
  a dense copy with its dimensions in the same memory order (`clone`, as torch's
  `preserve_format` does) and comes back like that copy (the gaps are not its bytes);
- a lazy conjugate or negative view is resolved first (its storage holds the
  unconjugated values: copying its bytes would lose the conjugation), on the compute
  stream so the copy streams that read the result are ordered after it.

Gathers and resolutions allocate on the compute stream: the caching allocator reuses a
freed block only for the stream that allocated it, so memory a copy stream allocated
would stay cached for that stream alone, and reserved memory would grow.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Layout", "moved_as_it_lies"]


class Layout(NamedTuple):
    """Dtype, shape and strides of a swapped tensor, whose elements are dense: they fill
    `nbytes` from the element at index 0 on (the strides are a permutation of a
    contiguous tensor's, none negative). A named tuple: one is made per swapped tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    nbytes: int

    @staticmethod
    def source(tensor: torch.Tensor) -> tuple[Layout, torch.Tensor]:
        """The layout `tensor` comes back in, and a dense tensor holding its elements in
        that layout: `tensor` itself when it is dense (no copy, no new tensor: the caller
        swaps it out as autograd saved it), else a gather made here (detached: no autograd
        node; on the calling thread's current stream)."""
        if not moved_as_it_lies(tensor):
            tensor = tensor.detach()
            if tensor.is_conj():
                tensor = tensor.resolve_conj()
            if tensor.is_neg():
                tensor = tensor.resolve_neg()
            if not tensor.is_contiguous() and not _dense(tensor):
                tensor = tensor.clone()  # preserve_format: dense, dimensions in the same memory order
                if not _dense(tensor):  # not expected from clone; contiguous is always dense
                    tensor = tensor.contiguous()
        return Layout(tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.nbytes), tensor

    def empty(self, device: torch.device) -> torch.Tensor:
        """A new tensor of this layout on `device` (calling thread's current stream)."""
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)

    def over(self, typed: torch.Tensor, offset_bytes: int) -> torch.Tensor:
        """A tensor of this layout over `typed` (a flat tensor of this dtype) starting
        `offset_bytes` into it (a multiple of the element size); no copy."""
        start = typed.storage_offset() + offset_bytes // self.dtype.itemsize
        return typed.as_strided(self.shape, self.stride, start)

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """A dense `tensor` of this layout as its bytes in memory order (no copy)."""
        numel = self.nbytes // self.dtype.itemsize
        return tensor.as_strided((numel,), (1,), tensor.storage_offset()).view(torch.uint8)


def moved_as_it_lies(tensor: torch.Tensor) -> bool:
    """Whether a swap moves `tensor` as it lies (dense, no lazy conjugate or negative
    bit) and brings it back with its own strides: the fetched tensor then holds the
    elements of the storage range `tensor` spans, in the same order, so any other view
    within that range can be rebuilt over it (`as_strided`, offsets taken from its
    start)."""
    if tensor.is_neg() or (tensor.dtype.is_complex and tensor.is_conj()):  # (only complex tensors have the bit)
        return False
    return tensor.is_contiguous() or _dense(tensor)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s elements fill a contiguous range of memory in some order of its
    dimensions (no gaps, no overlaps)."""
    # innermost first (smallest stride): each dimension's stride must be the number of
    # elements of the dimensions inside it; size-1 dimensions (any stride) take no room.
    # Plain integers, no tensor op: the swap-out path runs this per tensor.
    shape = tensor.shape
    if 0 in shape:
        return True
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(tensor.stride(), shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True
