"""Stand-ins for CUDA's runtime on a machine without a GPU: what the pinned pools register
(`FakeCudart`), the events the host step and the swap copies record (`FakeEvent`) and the
compute stream a release point orders after them (`FakeStream`), and copies that finish
when the test says (`HeldCopy`, `HeldInStore`), so CPU tests can take the code paths a
GPU run takes and check what they ask of CUDA."""

from __future__ import annotations

import threading

import torch

from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.swap.store import Copy, HostStore


class FakeCudart:
    """Stands in for `torch.cuda.cudart()`: records what is page-locked (cudaError 0 = success)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(f"register {size} flags {flags}")
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append("unregister")
        return 0 if self.registered.pop(ptr, None) is not None else 712  # cudaErrorHostMemoryNotRegistered

    def cudaGetErrorString(self, error: int) -> str:
        return {2: "out of memory", 712: "not registered"}[int(error)]


class FakeEvent:
    """torch.cuda.Event on a machine without CUDA: copies are synchronous here; records how
    each event was made (`made`: its keyword arguments, across instances)."""

    made: list[dict] = []

    def __init__(self, **kwargs) -> None:
        FakeEvent.made.append(kwargs)

    def record(self, _stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, _end) -> float:
        return 0.0


class FakeStream:
    """torch.cuda.current_stream() on a machine without CUDA: records each event it was
    told to wait on (`waited`), and what `on_wait` returns at that moment (`seen`)."""

    def __init__(self, on_wait=lambda: None) -> None:
        self.waited: list = []
        self.seen: list = []
        self.on_wait = on_wait

    def wait_event(self, event) -> None:
        self.waited.append(event)
        self.seen.append(self.on_wait())


def as_if_cuda(monkeypatch, cudart: FakeCudart) -> None:
    """torch says CUDA is available and its runtime is `cudart`: the code paths a GPU run
    takes, on this machine. A CUDA build of torch (the GPU machines' 2.11) asks the driver
    whether the current stream is capturing a graph in every Adam step once CUDA says it
    is available; there is no driver here, and no capture."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


class FakeAllocator:
    """torch's CUDA caching allocator as its counters show it, with cuBLAS workspaces:
    `allocated` bytes of tensors, `workspaces` bytes of workspaces that torch's clear frees,
    `peak` the high-water mark of both."""

    def __init__(self, allocated: int, workspaces: int) -> None:
        self.allocated = allocated
        self.workspaces = workspaces
        self.peak = allocated + workspaces

    def install(self, monkeypatch) -> None:
        import torch

        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated + self.workspaces)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak)
        monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", self.clear, raising=False)

    def clear(self) -> None:
        self.workspaces = 0


class HeldCopy(Copy):
    """A copy that completes when the test opens `release`, as a slow DMA would delay a
    CUDA copy (a CPU copy is done once issued)."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__(done=None, start=None, wall_s=0.0)
        self.release = release

    @property
    def finished(self) -> bool:
        return False  # as a CUDA copy: the engine must wait for it

    def wait_s(self) -> float:
        if not self.release.wait(10):
            raise TimeoutError("the test never released the copy")
        return 0.0


class HeldInStore(HostStore):
    """The host store whose swap-in copies complete when the test opens `go` (the bytes
    move at once on CPU; only their completion is held); counts them in `issued`."""

    def __init__(self, pool: PinnedHostPool) -> None:
        super().__init__(pool, torch.device("cpu"))
        self.go = threading.Event()
        """Set: the held copies complete."""
        self.issued = 0

    def copy_in(self, placement, batch, ready):
        super().copy_in(placement, batch, ready)
        self.issued += 1
        return [HeldCopy(self.go)]
