"""Every byte on a device, counted the same way at plan time (the memory probe runs
layers on the meta device) and at run time (the measured side of "this plan fits").

On CUDA the caching allocator counts (`memory_allocated`, `max_memory_allocated`). On a
CPU stand-in nothing does, so `LiveBytes` counts what a GPU's allocator would: every
tensor storage created on this rank while training, by any operator on any thread that
watches (a `TorchDispatchMode` sees each operator, the autograd engine's included, and
the storages it returns; a storage is live until its last reference dies, which a
`weakref.finalize` on the storage reports), plus the storages that existed before
(parameters, buffers, optimizer states, pools) that the owner adopts. Outputs that alias
an input (views, in-place and `out=` operators) add nothing. A storage made only from
host-side storages (the host optimizer step's copies and states) is host memory, not
device memory, and is not counted.

With a capacity, the operator that takes the live bytes over it raises
`DeviceOutOfMemory` at once, naming the rank, what the rank was doing and the largest
residents by name, so a CPU run is an honest stand-in for "would this fit on the GPU".
Units: bytes.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpress.errors import DeviceOutOfMemory
from mpress.config.units import fmt_bytes

_LARGEST_NAMED = 5
"""Residents an out-of-memory error names."""


def tensors_in(tree: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in nested tuples/lists/dicts (operator arguments and results, a
    module's inputs and outputs); a small walk instead of pytree, which costs more than
    the operators it would serve."""
    out = [] if out is None else out
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (tuple, list)):
        for t in tree:
            tensors_in(t, out)
    elif isinstance(tree, dict):
        for t in tree.values():
            tensors_in(t, out)
    return out


@dataclass
class _Resident:
    nbytes: int
    name: str
    host: bool


class LiveBytes:
    """The live and peak bytes of one rank's device (see the module docstring).

    rank: for messages. capacity_bytes: the device's usable memory (None: unbounded).
    `context` names what the rank is doing (an action such as `1B3`); the runtime sets it.
    """

    def __init__(self, *, rank: int = 0, capacity_bytes: int | None = None) -> None:
        self.rank = rank
        self.capacity_bytes = capacity_bytes
        self.context = "start-up"
        self._lock = threading.RLock()
        self._residents: dict[int, _Resident] = {}
        self._live = 0
        self._peak = 0
        self._peak_context = ""
        self._entered: list[contextlib.ExitStack] = []
        self.timeline: list[tuple[float, int]] | None = None
        """When a list: (time.perf_counter(), live bytes) after every change, for a trace."""

    # ---- what is counted --------------------------------------------------------------

    def adopt(self, tensor: torch.Tensor, name: str, *, host: bool = False) -> None:
        """Count `tensor`'s storage (made before watching, or by a thread that does not
        watch) under `name`; `host`: it is host memory (never counted, and what is made
        from it alone is host memory too). A storage already counted keeps its entry."""
        self._add(tensor.untyped_storage(), name, host)

    def label(self, tensor: torch.Tensor, name: str) -> None:
        """Give a counted storage a better name (e.g. the saved tensor it holds)."""
        with self._lock:
            resident = self._residents.get(tensor.untyped_storage()._cdata)
            if resident is not None:
                resident.name = name

    def _add(self, storage: torch.UntypedStorage, name: str, host: bool) -> None:
        key = storage._cdata
        with self._lock:
            if key in self._residents:
                return
            nbytes = 0 if host else storage.nbytes()
            self._residents[key] = _Resident(nbytes, name, host)
            self._live += nbytes
            if self.timeline is not None and nbytes:
                self.timeline.append((time.perf_counter(), self._live))
            if self._live > self._peak:
                self._peak, self._peak_context = self._live, self.context
            over = self.capacity_bytes is not None and self._live > self.capacity_bytes
        weakref.finalize(storage, self._free, key)
        if over:
            raise DeviceOutOfMemory(self._oom_message(name, nbytes))

    def resized(self, tensor: torch.Tensor, name: str) -> None:
        """`tensor`'s storage was resized in place (a layer's host parameters fetched into
        it or dropped from it, `mpress.runtime.layer_data`): count its bytes now. No
        operator makes such a storage, so no watch sees it; one not counted yet is adopted."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        with self._lock:
            resident = self._residents.get(key)
            if resident is not None and not resident.host:
                self._live += storage.nbytes() - resident.nbytes
                resident.nbytes = storage.nbytes()
                if self.timeline is not None:
                    self.timeline.append((time.perf_counter(), self._live))
                if self._live > self._peak:
                    self._peak, self._peak_context = self._live, self.context
                over = self.capacity_bytes is not None and self._live > self.capacity_bytes
                if over:
                    raise DeviceOutOfMemory(self._oom_message(name, storage.nbytes()))
                return
        self._add(storage, name, False)

    def _free(self, key: int) -> None:
        with self._lock:
            resident = self._residents.pop(key, None)
            if resident is not None:
                self._live -= resident.nbytes
                if self.timeline is not None and resident.nbytes:
                    self.timeline.append((time.perf_counter(), self._live))

    def counts(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s storage is counted (made while watching, or adopted)."""
        with self._lock:
            return tensor.untyped_storage()._cdata in self._residents

    def is_host(self, tensor: torch.Tensor) -> bool:
        with self._lock:
            resident = self._residents.get(tensor.untyped_storage()._cdata)
            return resident is not None and resident.host

    # ---- figures ----------------------------------------------------------------------

    @property
    def live_bytes(self) -> int:
        with self._lock:
            return self._live

    @property
    def peak_bytes(self) -> int:
        with self._lock:
            return self._peak

    @property
    def peak_context(self) -> str:
        """What the rank was doing when the peak was reached."""
        with self._lock:
            return self._peak_context

    def reset_peak(self) -> None:
        """Start a new high-water mark from the bytes live now (per step, per probe)."""
        with self._lock:
            self._peak, self._peak_context = self._live, self.context

    def largest(self, count: int = _LARGEST_NAMED) -> list[tuple[str, int]]:
        """The largest residents now: (name, bytes), largest first; same names summed."""
        with self._lock:
            by_name: dict[str, int] = {}
            for r in self._residents.values():
                if r.nbytes:
                    by_name[r.name] = by_name.get(r.name, 0) + r.nbytes
        return sorted(by_name.items(), key=lambda kv: -kv[1])[:count]

    def _oom_message(self, name: str, nbytes: int) -> str:
        largest = ", ".join(f"{n} {fmt_bytes(b)}" for n, b in self.largest())
        return (f"rank {self.rank} {self.context}: out of device memory: {name} ({fmt_bytes(nbytes)}) takes the "
                f"live bytes to {self._live:,} B, over the capacity of {self.capacity_bytes:,} B; "
                f"largest: {largest}")

    # ---- watching -----------------------------------------------------------------------

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Count what operators on this thread create, until the block ends."""
        with _Watch(self):
            yield

    def __enter__(self) -> LiveBytes:
        """`with LiveBytes() as live:` watches this thread for the block."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.watch())
        self._entered.append(stack)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._entered.pop().close()

    def storage_bytes(self) -> dict[int, int]:
        """The counted storages alive now: storage key (`_cdata`) -> bytes."""
        with self._lock:
            return {key: r.nbytes for key, r in self._residents.items()}


class _Watch(TorchDispatchMode):
    """The dispatch mode one thread runs under while it is watched."""

    def __init__(self, tracker: LiveBytes) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        results = tensors_in(out)
        if not results:
            return out
        inputs = tensors_in((args, kwargs))
        seen = {t.untyped_storage()._cdata for t in inputs}
        host = bool(inputs) and all(self.tracker.is_host(t) for t in inputs)
        name = f"{func.__name__.split('.')[0]} in {self.tracker.context}"
        for t in results:
            storage = t.untyped_storage()
            if storage._cdata not in seen:
                self.tracker._add(storage, name, host)
        return out
