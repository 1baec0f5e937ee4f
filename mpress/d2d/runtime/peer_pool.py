"""Peer pools: spare memory of light GPUs, reserved once and written by their exporters.

At start-up every rank whose device the plan gives a peer pool (`StagePlan.
peer_pool_bytes`, the importer) allocates it in one piece and exports it (`transport.py`:
CUDA IPC on GPUs, shared memory on CPU); the handles go to every rank in one
`all_gather_object`; each exporter stage opens the pools its stripes go to (on CUDA
after checking `can_device_access_peer`; torch enables peer access when the first copy
runs) and keeps, per pool, a `QuotaPool` over its own slice of the pool (its quota,
`pool_layout.py`), laid out in per-unit slot regions as the plan's program says
(`slot_pool.py`, `d2d/static/pool_slots.py`), so it cannot fragment. From then on the importer takes no part: exporters carve
their quota and copy stripes with one-sided copies on their own streams (`PeerStore`).

The rank holding a pool never opens its own export: an idle GPU's pool (a lender no
stage runs on) is held by one of its exporters (`pool_layout.pool_holders`), and a
process cannot open a CUDA IPC handle it made (`transport.py`), so that exporter's
quota is a view of the buffer it allocated, and it writes its ledger slot directly.

A small shared-memory ledger per pool (named as the run's segments, `transport.py`) holds each exporter's bytes in use, high-water mark
and tensor bytes held, written by the exporter on every allocation and free, so the
importer (and its report) can see how much of its pool is used without taking part.
Liveness: every rank publishes its pid and process start time; `dead_ranks` tells which
rank's process is gone, so a dead importer is named instead of surfacing as a broken
socket or a hang.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch
import torch.distributed as dist

from mpress.config.vocabulary import Technique
from mpress.contract.plan import Plan
from mpress.d2d.runtime.liveness import ProcessId
from mpress.d2d.runtime.peer_store import PeerStore, peer_device
from mpress.d2d.runtime.pool_layout import (
    Quota,
    exporter_peers,
    plan_quotas,
    pool_holders,
)
from mpress.d2d.runtime.slot_pool import SlotPool
from mpress.d2d.runtime.transport import (
    PoolTransport,
    attach_shared_memory,
    create_segment,
    make_transport,
    release_segments,
)
from mpress.d2d.static.pool_slots import unit_slot_counts
from mpress.errors import PlanError, SwapError, TopologyError
from mpress.runtime.memory.block_pool import Block

_LEDGER_FIELDS = 3  # per quota: bytes in use (aligned blocks), high-water mark, tensor bytes held


# ---- the ledger and an exporter's quota ----------------------------------------------------

class QuotaPool(SlotPool):
    """An exporter's quota of a peer pool: slots of its units' regions (`slot_pool.py`,
    sized by the program's `counts`), use published in the pool's ledger so the importer
    sees it."""

    def __init__(self, buffer: torch.Tensor, *, quota: Quota, ledger: torch.Tensor, slot: int,
                 counts: Mapping[str, int] | None = None) -> None:
        super().__init__(buffer, counts=counts,
                         name=f"peer pool quota of stage {quota.stage} on device {quota.device}")
        self.quota = quota
        self.ledger_counters = ledger
        """The whole pool's ledger (every exporter's slots)."""
        self.ledger_slot = ledger[slot * _LEDGER_FIELDS:(slot + 1) * _LEDGER_FIELDS]
        """This quota's counters in the ledger."""
        self._ledger_lock = threading.Lock()
        self._data_bytes = 0

    def allocate(self, nbytes: int, owner: str) -> Block:
        block = super().allocate(nbytes, owner)
        self._publish(block.nbytes)
        return block

    def allocate_slot(self, unit: str, nbytes: int, owner: str) -> Block:
        block = super().allocate_slot(unit, nbytes, owner)
        self._publish(block.nbytes)
        return block

    def free(self, block: Block) -> None:
        super().free(block)
        self._publish(-block.nbytes)

    def _publish(self, data_delta: int) -> None:
        with self._ledger_lock:  # the out worker allocates while the in worker frees
            self._data_bytes += data_delta
            self.ledger_slot[0] = self.used_bytes
            self.ledger_slot[1] = self.used_high_water_bytes
            self.ledger_slot[2] = self._data_bytes


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

    def __init__(self, plan: Plan, rank: int, device: torch.device, transport: PoolTransport,
                 infos: list[_RankInfo], local_buffers: dict[int, torch.Tensor],
                 ledgers: list[shared_memory.SharedMemory], quotas: dict[tuple[int, int], QuotaPool],
                 attached: list[mmap.mmap], group: dist.ProcessGroup | None = None,
                 node_devices: Sequence[int] | None = None) -> None:
        self.plan = plan
        self.node_devices = node_devices
        """The GPU of each of the plan's devices in this rank's replica (`peer_device`)."""
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

    def pool_on(self, device: int) -> torch.Tensor | None:
        """The pool this rank allocated for device `device` (to lend it), if any."""
        return self._local_buffers.get(device)

    def quota(self, stage: int, device: int) -> QuotaPool:
        """Stage `stage`'s quota on device `device`'s pool."""
        pool = self._quotas.get((stage, device))
        if pool is None:
            raise PlanError(f"stage {stage} has no quota on device {device}'s peer pool")
        return pool

    def store_for(self, stage: int) -> PeerStore:
        """The D2D swap destination of `stage` (this rank runs it): its quotas of the peer
        pools, striped by the weights of the stage's first D2D rule unless a swap names
        its own."""
        rule = next((r for r in self.plan.stage(stage).rules if r.technique is Technique.D2D), None)
        if rule is None:
            raise PlanError(f"stage {stage} has no D2D rule: it writes into no peer pool")
        return PeerStore(self, stage, self.device, tuple((st.device, st.fraction) for st in rule.stripes),
                         node_devices=self.node_devices)

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
                # the job's rank (the group is a dp replica's pipeline when the job has several)
                rank = dist.get_global_rank(self.group, info.rank) if self.group is not None else info.rank
                lines.append(f"rank {rank} (pid {info.process.pid}, {role}) has died")
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
                     transport: PoolTransport | None = None, node_devices: Sequence[int] | None = None) -> PeerPools:
    """Allocate, exchange and open the job's peer pools (a collective over `group`).

    stage_ids: the stages this rank runs (their plan devices are its devices).
    node_devices: the CUDA index of each of the plan's devices in this rank's replica
    (the pools and peers of replica k > 0 on a node shared with others are its own GPUs,
    `peer_device`); None: the plan's numbers.
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
            buffer, payload = transport.create(nbytes, peer_device(device, d, node_devices))
            local[d] = buffer
            ledger = create_segment(max(8, 8 * _LEDGER_FIELDS * len(quotas[d])))
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
        own = {e.device: (local[e.device], torch.frombuffer(ledger.buf, dtype=torch.int64))
               for e, ledger in zip(exports, ledgers)}
        opened = _open_quotas(infos, stage_ids, device, transport, plan, attached, own, node_devices)
    except Exception as exc:  # noqa: BLE001 - as above
        error = _describe_failure(exc)
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, _RankInfo(rank=rank, process=mine.process, exports=(),
                                               error=error), group=group)
    _raise_if_any_failed(outcomes, transport, ledgers, attached)
    return PeerPools(plan, rank, device, transport, infos, local, ledgers, opened, attached, group, node_devices)


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
                 plan: Plan, attached: list[mmap.mmap], own: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 node_devices: Sequence[int] | None = None) -> dict[tuple[int, int], QuotaPool]:
    """The quotas of this rank's stages. `own`: pool device -> (buffer, ledger counters) of
    the pools this rank holds; its stages write into those directly (no IPC open of its
    own export), and open the other ranks' pools through `transport`."""
    exports = {e.device: e for info in infos for e in info.exports}
    opened: dict[tuple[int, int], QuotaPool] = {}
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = dict(own)
    for stage in stage_ids:
        for peer in exporter_peers(plan, stage):
            export = exports[peer]
            where = peer_device(device, peer, node_devices)
            if device.type == "cuda":
                _check_peer_access(device, where.index)
            if peer not in buffers:
                ledger = attach_shared_memory(export.ledger)
                attached.append(ledger)
                buffers[peer] = (transport.open(export.payload, where),
                                 torch.frombuffer(ledger, dtype=torch.int64))
            buffer, counters = buffers[peer]
            slot, quota = next((i, q) for i, q in enumerate(export.quotas) if q.stage == stage)
            view = buffer[quota.offset_bytes:quota.offset_bytes + quota.nbytes]
            counts = unit_slot_counts(plan.program(plan.rank_of_stage(stage)), stage) if plan.actions else None
            opened[(stage, peer)] = QuotaPool(view, quota=quota, ledger=counters, slot=slot,
                                              counts=counts)
    return opened


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
    release_segments([*attached, *ledgers], unlink=ledgers)
