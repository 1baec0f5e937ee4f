"""Peer pools: spare memory of light GPUs, reserved once and written by their exporters.

At start-up every rank whose device the plan gives a peer pool (`StagePlan.
peer_pool_bytes`, the importer) allocates it in one piece and exports it; the handles go
to every rank in one `all_gather_object`; each exporter stage opens the pools its
stripes go to (on CUDA after checking `can_device_access_peer`; torch enables peer access
when the first copy runs) and keeps, per pool, a `QuotaPool`: a `BlockPool` over its own slice of
the pool (its quota, from `StagePlan.peer_quotas`, or an equal share of the pool when
the plan gives none). From then on the importer takes no part: exporters carve their
quota and copy stripes with one-sided copies on their own streams.

Two transports implement the same interface:

- `CudaIpcTransport`: the pool is a CUDA allocation on the importer's GPU, exported
  with torch's CUDA IPC (`torch.multiprocessing.reductions.reduce_tensor`, i.e.
  `cudaIpcGetMemHandle`) and opened by exporters as a tensor on that GPU, so a copy into
  it is a peer-to-peer copy over NVLink;
- `SharedMemoryTransport`: the pool is a `multiprocessing.shared_memory` segment, so the
  whole protocol runs on CPU-only machines and in CI (a test vehicle, not a fast path).

A small shared-memory ledger per pool holds each exporter's bytes in use, high-water mark
and tensor bytes held, written by the exporter on every allocation and free, so the importer (and its report) can
see how much of its pool is used without taking part. Liveness: every rank publishes its
pid and process start time; `dead_ranks` tells which rank's process is gone, so a dead
importer is named instead of surfacing as a broken socket or a hang.
"""

from __future__ import annotations

import _posixshmem  # POSIX shared memory, as multiprocessing.shared_memory uses it
import abc
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch
import torch.distributed as dist

from mpress.errors import PlanError, SwapError, TopologyError
from mpress.plan import Plan
from mpress.runtime.host_pool import BlockPool, HostBlock

ALIGNMENT_BYTES = 512
"""Alignment of quotas inside a pool and of blocks inside a quota."""
_LEDGER_FIELDS = 3  # per quota: bytes in use (aligned blocks), high-water mark, tensor bytes held


# ---- pure: who exports to whom, how much ------------------------------------------------

@dataclass(frozen=True)
class Quota:
    """The part of device `device`'s peer pool that stage `stage` may fill."""

    stage: int
    device: int
    offset_bytes: int
    nbytes: int


def pool_bytes_by_device(plan: Plan) -> dict[int, int]:
    """Peer pool each device reserves (sum over the stages it runs)."""
    out: dict[int, int] = {}
    for sp in plan.stages:
        if sp.peer_pool_bytes:
            out[sp.device] = out.get(sp.device, 0) + sp.peer_pool_bytes
    return out


def uses_peer_pools(plan: Plan) -> bool:
    """Whether the plan reserves a peer pool or D2D-swaps anything."""
    return any(sp.peer_pool_bytes or any(r.technique == "d2d" for r in sp.rules) for sp in plan.stages)


def rank_of_stage(plan: Plan, stage: int) -> int:
    """The rank that runs `stage` (stage s on rank s % ranks: one stage per rank, or
    several under interleaved schedules)."""
    return stage % plan.num_ranks


def pool_holders(plan: Plan, quotas: dict[int, list[Quota]]) -> dict[int, int]:
    """Per pool device, the rank that allocates and exports it: the rank running a stage
    there, or, for an idle device, the lowest rank among its exporters."""
    owner = {plan.stage_to_device[s]: rank_of_stage(plan, s) for s in range(plan.num_stages)}
    return {d: owner.get(d, min(rank_of_stage(plan, q.stage) for q in qs)) for d, qs in quotas.items()}


def exporter_peers(plan: Plan, stage: int) -> list[int]:
    """Devices stage `stage` stripes to (any D2D rule), in first-seen order."""
    peers: list[int] = []
    for rule in plan.stage(stage).rules:
        for stripe in rule.stripes if rule.technique == "d2d" else ():
            if stripe.device not in peers:
                peers.append(stripe.device)
    return peers


def plan_quotas(plan: Plan, pool_override_bytes: int | None = None) -> dict[int, list[Quota]]:
    """Per importer device, the quotas of its exporters, laid out one after the other.

    Quotas come from the exporters' `peer_quotas`; a device an exporter stripes to without
    a quota gets an equal share of what the pool has left. A device no stage runs on (an
    idle GPU, a fine lender) has a pool exactly as large as its exporters' quotas, which
    they must then all give. `pool_override_bytes` replaces every pool's size (a sizing
    experiment). Raises PlanError, with the numbers, when a pool cannot hold its quotas or
    a stage stripes to a device without a pool.
    """
    pools = pool_bytes_by_device(plan)
    wanted: dict[int, list[tuple[int, int | None]]] = {}
    for sp in plan.stages:
        given = {q.device: q.quota_bytes for q in sp.peer_quotas}
        for device in exporter_peers(plan, sp.stage):
            wanted.setdefault(device, []).append((sp.stage, given.get(device)))
    busy = set(plan.stage_to_device)
    for device, exporters in wanted.items():
        if device not in busy and all(b is not None for _, b in exporters):
            pools[device] = sum(_round_up(b, ALIGNMENT_BYTES) for _, b in exporters)  # type: ignore[arg-type]
    if pool_override_bytes is not None:
        pools = {d: pool_override_bytes for d in pools}
    out: dict[int, list[Quota]] = {}
    for device, exporters in sorted(wanted.items()):
        capacity = pools.get(device, 0)
        if capacity <= 0 and device not in busy:
            stages = ", ".join(str(s) for s, b in exporters if b is None)
            raise PlanError(f"stage(s) {stages} stripe to device {device}, which runs no stage, without a "
                            "peer_quotas entry for it (the size of such a pool is the sum of its quotas)")
        if capacity <= 0:
            stages = ", ".join(str(s) for s, _ in exporters)
            raise PlanError(f"stage(s) {stages} stripe to device {device}, which reserves no peer pool "
                            "(peer_pool_bytes of its stages is 0)")
        fixed = sum(_round_up(b, ALIGNMENT_BYTES) for _, b in exporters if b is not None)
        open_count = sum(1 for _, b in exporters if b is None)
        if fixed > capacity or (open_count and capacity - fixed < open_count * ALIGNMENT_BYTES):
            need = ", ".join(f"stage {s} needs {_round_up(b, ALIGNMENT_BYTES)} bytes" for s, b in exporters
                             if b is not None)
            left = f"; {open_count} exporter(s) without a quota share what is left" if open_count else ""
            raise PlanError(f"peer pool of device {device} is too small: {capacity} bytes for its exporters' "
                            f"quotas ({need}; total {fixed}{left})")
        share = ((capacity - fixed) // open_count // ALIGNMENT_BYTES * ALIGNMENT_BYTES) if open_count else 0
        sizes = [(s, _round_up(b, ALIGNMENT_BYTES) if b is not None else share) for s, b in exporters]
        total = sum(b for _, b in sizes)
        if total > capacity or any(b <= 0 for _, b in sizes):
            need = ", ".join(f"stage {s} needs {b} bytes" for s, b in sizes)
            raise PlanError(f"peer pool of device {device} is too small: {capacity} bytes for its exporters' "
                            f"quotas ({need}; total {total})")
        offset = 0
        out[device] = []
        for stage, nbytes in sizes:
            out[device].append(Quota(stage=stage, device=device, offset_bytes=offset, nbytes=nbytes))
            offset += nbytes
    return out


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ---- transports ---------------------------------------------------------------------------

class PoolTransport(abc.ABC):
    """Allocates, exports and opens pool memory. `create` runs on the importer, `open`
    on exporters; payloads must pickle (they travel through `all_gather_object`)."""

    name: str

    @abc.abstractmethod
    def create(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any]:
        """A flat uint8 buffer of `nbytes` (aligned start) and its picklable export."""

    @abc.abstractmethod
    def open(self, payload: Any, device: torch.device) -> torch.Tensor:
        """The buffer an importer exported, mapped into this process."""

    def close(self) -> None:
        """Unmap what was opened and free what was created (after the job)."""


class SharedMemoryTransport(PoolTransport):
    """Pools in POSIX shared memory (CPU stand-in for GPU memory)."""

    name = "shm"

    def __init__(self) -> None:
        self._created: list[shared_memory.SharedMemory] = []
        self._opened: list[mmap.mmap] = []
        self._buffers: list[torch.Tensor] = []

    def create(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any]:
        try:
            shm = shared_memory.SharedMemory(create=True, size=nbytes + ALIGNMENT_BYTES)
        except OSError as exc:
            raise SwapError(f"cannot allocate a {nbytes}-byte shared-memory peer pool: {exc}") from exc
        self._created.append(shm)
        fd = getattr(shm, "_fd", -1)
        if fd >= 0 and hasattr(os, "posix_fallocate"):
            # the segment is sparse until written: reserve it now, so a full /dev/shm is a
            # start-up error here and not a SIGBUS at the first swap
            try:
                os.posix_fallocate(fd, 0, nbytes + ALIGNMENT_BYTES)
            except OSError as exc:
                raise SwapError(f"cannot reserve a {nbytes}-byte shared-memory peer pool in /dev/shm: "
                                f"{exc.strerror}") from exc
        buffer = self._aligned(shm, nbytes)
        return buffer, (shm.name, nbytes)

    def open(self, payload: Any, device: torch.device) -> torch.Tensor:
        name, nbytes = payload
        segment = attach_shared_memory(name)
        self._opened.append(segment)
        return self._aligned(segment, nbytes)

    def _aligned(self, shm: shared_memory.SharedMemory | mmap.mmap, nbytes: int) -> torch.Tensor:
        raw = torch.frombuffer(shm.buf if isinstance(shm, shared_memory.SharedMemory) else shm, dtype=torch.uint8)
        pad = (-raw.data_ptr()) % ALIGNMENT_BYTES
        buffer = raw[pad:pad + nbytes]
        self._buffers.append(buffer)
        return buffer

    def close(self) -> None:
        self._buffers.clear()
        _release([*self._opened, *self._created], unlink=self._created)
        self._opened.clear()
        self._created.clear()


class CudaIpcTransport(PoolTransport):
    """Pools in GPU memory, shared with CUDA IPC through torch's tensor reductions."""

    name = "cuda-ipc"

    def __init__(self) -> None:
        self._keep: list[torch.Tensor] = []

    def create(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        try:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:
            free, total = torch.cuda.mem_get_info(device)
            raise SwapError(f"cannot allocate the {nbytes}-byte peer pool on {device}: {free} of {total} "
                            "bytes free") from exc
        self._keep.append(buffer)  # the exporters' mappings need it alive
        return buffer, reduce_tensor(buffer)

    def open(self, payload: Any, device: torch.device) -> torch.Tensor:
        # the handle names the importer's GPU by index: every rank must see the GPUs
        # numbered alike (the same CUDA_VISIBLE_DEVICES), which torchrun's default gives
        rebuild, args = payload
        buffer = rebuild(*args)
        self._keep.append(buffer)
        return buffer

    def close(self) -> None:
        self._keep.clear()


def make_transport(device: torch.device) -> PoolTransport:
    """CUDA IPC for CUDA devices, shared memory otherwise."""
    return CudaIpcTransport() if device.type == "cuda" else SharedMemoryTransport()


def attach_shared_memory(name: str) -> mmap.mmap:
    """Map an existing shared-memory segment without registering it with the resource
    tracker: `SharedMemory(name=...)` does register it (before Python 3.13), and the
    tracker would then unlink the importer's segment when this process exits."""
    fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


# ---- the ledger and an exporter's quota ----------------------------------------------------

class QuotaPool(BlockPool):
    """An exporter's quota of a peer pool: blocks carved locally, use published in the
    pool's ledger so the importer sees it."""

    def __init__(self, buffer: torch.Tensor, *, quota: Quota, ledger: torch.Tensor, slot: int) -> None:
        super().__init__(buffer, alignment_bytes=ALIGNMENT_BYTES,
                         name=f"peer pool quota of stage {quota.stage} on device {quota.device}")
        self.quota = quota
        self.ledger_counters = ledger
        """The whole pool's ledger (every exporter's slots)."""
        self.ledger_slot = ledger[slot * _LEDGER_FIELDS:(slot + 1) * _LEDGER_FIELDS]
        """This quota's counters in the ledger."""
        self._ledger_lock = threading.Lock()
        self._data_bytes = 0

    def allocate(self, nbytes: int, owner: str) -> HostBlock:
        block = super().allocate(nbytes, owner)
        self._publish(block.nbytes)
        return block

    def free(self, block: HostBlock) -> None:
        super().free(block)
        self._publish(-block.nbytes)

    def _publish(self, data_delta: int) -> None:
        with self._ledger_lock:  # the out worker allocates while the in worker frees
            self._data_bytes += data_delta
            self.ledger_slot[0] = self.in_use_bytes
            self.ledger_slot[1] = self.high_water_bytes
            self.ledger_slot[2] = self._data_bytes


# ---- liveness --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProcessId:
    """A process, robust to pid reuse: pid plus start time (Linux clock ticks)."""

    pid: int
    start_ticks: int

    @staticmethod
    def current() -> ProcessId:
        return ProcessId(os.getpid(), _start_ticks(os.getpid()) or 0)

    def alive(self) -> bool:
        """False when the process exited (also when it is a zombie or the pid was reused)."""
        try:
            with open(f"/proc/{self.pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            return False
        except OSError:  # no procfs: ask the kernel about the pid only
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
            return True
        state, start = fields[0], int(fields[19])
        return state not in ("Z", "X") and (self.start_ticks == 0 or start == self.start_ticks)


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


# ---- the job-wide set of pools ---------------------------------------------------------------

@dataclass(frozen=True)
class _Export:
    device: int
    nbytes: int
    payload: Any
    ledger: str
    quotas: tuple[Quota, ...]


@dataclass(frozen=True)
class _RankInfo:
    rank: int
    process: ProcessId
    exports: tuple[_Export, ...]
    error: tuple[str, str] | None
    """(error class, message) when this rank's part of the setup failed."""


class PeerPools:
    """This rank's side of every peer pool of the job (see the module docstring).

    Build with `setup_peer_pools` (a collective: every rank calls it). Close after the job.
    """

    def __init__(self, rank: int, device: torch.device, transport: PoolTransport, infos: list[_RankInfo],
                 local_buffers: dict[int, torch.Tensor], ledgers: list[shared_memory.SharedMemory],
                 quotas: dict[tuple[int, int], QuotaPool], attached: list[mmap.mmap],
                 group: dist.ProcessGroup | None = None) -> None:
        self.rank = rank
        self.group = group
        self.device = device
        self.transport = transport
        self._infos = infos
        self._local_buffers = local_buffers
        self._ledgers = ledgers
        self._quotas = quotas
        self._attached = attached
        """Other ranks' ledgers this rank writes its quotas' use into."""
        self._owner = {e.device: info.rank for info in infos for e in info.exports}
        """Pool device -> the rank that holds (allocated and exported) it."""

    def quota(self, stage: int, device: int) -> QuotaPool:
        """Stage `stage`'s quota on device `device`'s pool."""
        pool = self._quotas.get((stage, device))
        if pool is None:
            raise PlanError(f"stage {stage} has no quota on device {device}'s peer pool")
        return pool

    def rank_of_device(self, device: int) -> int:
        return self._owner[device]

    def check_peer(self, device: int) -> None:
        """Raise SwapError if the process holding device `device`'s pool is gone."""
        info = self._infos[self._owner[device]]
        if not info.process.alive():
            raise SwapError(f"peer rank {info.rank} (device {device}, pid {info.process.pid}), which holds a D2D "
                            "peer pool, has died")

    def dead_ranks(self) -> list[str]:
        """One line per other rank of the job whose process is gone: first those holding
        pools this rank writes into, then other pool holders, then the rest."""
        mine = {peer for _stage, peer in self._quotas}
        def order(info: _RankInfo) -> tuple[bool, bool, int]:
            return (not any(e.device in mine for e in info.exports), not info.exports, info.rank)
        lines = []
        for info in sorted(self._infos, key=order):
            if info.rank != self.rank and not info.process.alive():
                role = (f"holds the D2D peer pool of device(s) {', '.join(str(e.device) for e in info.exports)}"
                        if info.exports else "holds no peer pool")
                lines.append(f"rank {info.rank} (pid {info.process.pid}, {role}) has died")
        return lines

    def pool_usage(self) -> dict[int, dict[str, int]]:
        """For the pools this rank holds: capacity, bytes in use (aligned blocks), tensor
        bytes held and high-water mark (summed over exporters), read from the ledgers."""
        out = {}
        for info in self._infos:
            if info.rank != self.rank:
                continue
            for export, ledger in zip(info.exports, self._ledgers):
                out[export.device] = _usage(export, torch.frombuffer(ledger.buf, dtype=torch.int64))
        return out

    def peer_usage(self, device: int, stage: int | None = None) -> dict[str, int]:
        """The same figures for a pool this rank writes into, read from its ledger: all
        exporters', or only stage `stage`'s quota."""
        for (quota_stage, peer), quota in self._quotas.items():
            if peer == device and stage in (None, quota_stage):
                export = next(e for i in self._infos for e in i.exports if e.device == device)
                if stage is None:
                    return _usage(export, quota.ledger_counters)
                return dict(_usage(export, quota.ledger_slot), capacity_bytes=quota.capacity_bytes)
        raise PlanError(f"rank {self.rank} writes into no peer pool on device {device}"
                        + (f" for stage {stage}" if stage is not None else ""))

    def close(self, *, barrier: bool = False) -> None:
        """Unmap and free (holders unlink their pools and ledgers). `barrier`: first wait
        until every rank is done with the pools (a collective; skipped if it fails), so no
        holder frees memory an exporter still maps."""
        if barrier and dist.is_initialized():
            try:
                dist.barrier(group=self.group)
            except Exception:  # noqa: BLE001 - a dead peer: nobody is left to wait for
                pass
        self._quotas.clear()
        self._local_buffers.clear()
        _close_all(self.transport, self._ledgers, self._attached)
        self._attached.clear()
        self._ledgers.clear()


def _usage(export: _Export, counters: torch.Tensor) -> dict[str, int]:
    return {"capacity_bytes": export.nbytes,
            "in_use_bytes": int(counters[0::_LEDGER_FIELDS].sum()),
            # the sum of the exporters' high-water marks: an upper bound of the pool's own
            "high_water_bytes": int(counters[1::_LEDGER_FIELDS].sum()),
            "data_bytes": int(counters[2::_LEDGER_FIELDS].sum())}


def setup_peer_pools(plan: Plan, stage_ids: list[int], device: torch.device, *,
                     group: dist.ProcessGroup | None = None, pool_override_bytes: int | None = None,
                     transport: PoolTransport | None = None) -> PeerPools:
    """Allocate, exchange and open the job's peer pools (a collective over `group`).

    stage_ids: the stages this rank runs (their plan devices are its devices).
    Two rounds, each ending in an all-gather of every rank's outcome: allocate and export
    (a pool too small for its quotas, an allocation that failed), then open the peers'
    pools (a peer that cannot be reached). Every rank raises the same error when any rank
    failed, having freed what it made, so none hangs and none trains on alone.
    """
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    transport = transport or make_transport(device)
    exports: list[_Export] = []
    ledgers: list[shared_memory.SharedMemory] = []
    local: dict[int, torch.Tensor] = {}
    error = None
    try:
        quotas = plan_quotas(plan, pool_override_bytes)  # the same on every rank
        for d, holder in sorted(pool_holders(plan, quotas).items()):
            if holder != rank:
                continue
            nbytes = sum(q.nbytes for q in quotas[d])
            buffer, payload = transport.create(nbytes, _peer_device(device, d))
            local[d] = buffer
            ledger = shared_memory.SharedMemory(create=True, size=max(8, 8 * _LEDGER_FIELDS * len(quotas[d])))
            ledgers.append(ledger)
            torch.frombuffer(ledger.buf, dtype=torch.int64).zero_()
            exports.append(_Export(device=d, nbytes=nbytes, payload=payload, ledger=ledger.name,
                                   quotas=tuple(quotas[d])))
    except Exception as exc:  # noqa: BLE001 - whatever failed, the other ranks must hear of it
        error = _describe_failure(exc)
    mine = _RankInfo(rank=rank, process=ProcessId.current(), exports=tuple(exports), error=error)
    infos: list[Any] = [None] * world
    dist.all_gather_object(infos, mine, group=group)
    _raise_if_any_failed(infos, transport, ledgers, [])
    attached: list[mmap.mmap] = []
    opened: dict[tuple[int, int], QuotaPool] = {}
    error = None
    try:
        opened = _open_quotas(infos, stage_ids, device, transport, plan, attached)
    except Exception as exc:  # noqa: BLE001 - as above
        error = _describe_failure(exc)
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, _RankInfo(rank=rank, process=mine.process, exports=(),
                                               error=error), group=group)
    _raise_if_any_failed(outcomes, transport, ledgers, attached)
    return PeerPools(rank, device, transport, infos, local, ledgers, opened, attached, group)


def _raise_if_any_failed(infos: list[_RankInfo], transport: PoolTransport, ledgers: list[shared_memory.SharedMemory],
                         attached: list[mmap.mmap]) -> None:
    failed = [i for i in infos if i.error]
    if not failed:
        return
    _close_all(transport, ledgers, attached)
    first = failed[0]
    kind, text = first.error
    raise _ERRORS.get(kind, SwapError)(f"peer pools: rank {first.rank}: {text}")


_ERRORS: dict[str, type[Exception]] = {"PlanError": PlanError, "TopologyError": TopologyError, "SwapError": SwapError}
"""Errors a rank's setup failure is raised as on every rank (anything else: SwapError)."""


def _describe_failure(exc: Exception) -> tuple[str, str]:
    """(error class name, message) of a setup failure, to send to the other ranks."""
    name = type(exc).__name__
    return (name, str(exc)) if name in _ERRORS else ("SwapError", f"{name}: {exc}")


def _open_quotas(infos: list[_RankInfo], stage_ids: list[int], device: torch.device, transport: PoolTransport,
                 plan: Plan, attached: list[mmap.mmap]) -> dict[tuple[int, int], QuotaPool]:
    exports = {e.device: e for info in infos for e in info.exports}
    opened: dict[tuple[int, int], QuotaPool] = {}
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for stage in stage_ids:
        for peer in exporter_peers(plan, stage):
            export = exports[peer]
            if device.type == "cuda":
                _check_peer_access(device, peer)
            if peer not in buffers:
                ledger = attach_shared_memory(export.ledger)
                attached.append(ledger)
                buffers[peer] = (transport.open(export.payload, _peer_device(device, peer)),
                                 torch.frombuffer(ledger, dtype=torch.int64))
            buffer, counters = buffers[peer]
            slot, quota = next((i, q) for i, q in enumerate(export.quotas) if q.stage == stage)
            view = buffer[quota.offset_bytes:quota.offset_bytes + quota.nbytes]
            opened[(stage, peer)] = QuotaPool(view, quota=quota, ledger=counters, slot=slot)
    return opened


def _peer_device(device: torch.device, peer: int) -> torch.device:
    return torch.device("cuda", peer) if device.type == "cuda" else device


def _check_peer_access(device: torch.device, peer: int) -> None:
    own = device.index if device.index is not None else torch.cuda.current_device()
    if peer >= torch.cuda.device_count():
        raise TopologyError(f"the plan stripes to GPU {peer}, this process sees {torch.cuda.device_count()} GPUs "
                            "(is CUDA_VISIBLE_DEVICES the same on every rank?)")
    if peer != own and not torch.cuda.can_device_access_peer(own, peer):
        raise TopologyError(f"GPU {own} cannot access GPU {peer} directly (no peer access), but the plan "
                            "stripes D2D swaps to it")


def _close_all(transport: PoolTransport, ledgers: list[shared_memory.SharedMemory],
               attached: list[mmap.mmap]) -> None:
    """Free this rank's pools and ledgers and unmap the other ranks' ledgers."""
    transport.close()
    _release([*attached, *ledgers], unlink=ledgers)


def _release(segments: Sequence[shared_memory.SharedMemory | mmap.mmap],
             unlink: Sequence[shared_memory.SharedMemory] = ()) -> None:
    """Unmap `segments` and remove the names of those this process created (`unlink`)."""
    for segment in segments:
        try:
            segment.close()
        except BufferError:  # a tensor view is still alive somewhere; the OS unmaps at exit
            pass
    for shm in unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
