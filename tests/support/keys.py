"""Tensor identities for tests."""

from __future__ import annotations

from mpress.contract.identity import TensorKey


def key(name: str, microbatch: int | None = 0, *, rank: int = 0, stage: int = 0) -> TensorKey:
    """`name` of `microbatch` (None: not per microbatch, e.g. optimizer state) on `rank` and
    `stage`; a module whose engine or manager runs as another rank or stage binds its own
    with `functools.partial(key, rank=..., stage=...)`, since error messages name them."""
    return TensorKey(rank=rank, stage=stage, microbatch=microbatch, tensor=name)
