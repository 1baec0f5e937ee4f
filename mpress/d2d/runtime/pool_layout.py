"""The layout of the job's peer pools, read from the plan: who holds each pool, who
exports to it, and each exporter's quota inside it.

Pure arithmetic over the plan (every rank computes the same answer): which device gets a
pool and how large (`StagePlan.peer_pool_bytes`, or, for an idle GPU, the sum of its
exporters' quotas), which rank allocates it, and where each exporter's quota starts.
Quotas are aligned to `ALIGNMENT_BYTES`. Units: bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpress.errors import PlanError
from mpress.contract.plan import Plan
from mpress.config.units import ALIGNMENT_BYTES, round_up
from mpress.config.vocabulary import Technique


@dataclass(frozen=True)
class Quota:
    """The part of device `device`'s peer pool that stage `stage` may fill."""

    stage: int
    device: int
    offset_bytes: int
    nbytes: int


def pool_holders(plan: Plan, quotas: dict[int, list[Quota]]) -> dict[int, int]:
    """Per pool device, the rank that allocates and exports it: the rank running a stage
    there, or, for an idle device, the lowest rank among its exporters.

    An idle device runs no process, so its pool must be allocated by a process whose own
    GPU is another one: that creates the holder's CUDA context on the idle GPU. Taking an
    exporter (which opens a context there anyway to write its stripes) adds no context;
    the plan counts one per exporter (`d2d/static/mapping.py`, `idle_lendable_bytes`). The
    holder writes into its own allocation and never opens its own export (`peer_pool.py`)."""
    owner = {plan.stage_to_device[s]: plan.rank_of_stage(s) for s in range(plan.num_stages)}
    return {d: owner.get(d, min(plan.rank_of_stage(q.stage) for q in qs)) for d, qs in quotas.items()}


def exporter_peers(plan: Plan, stage: int) -> list[int]:
    """Devices stage `stage` stripes to (any D2D rule), in first-seen order."""
    peers: list[int] = []
    for rule in plan.stage(stage).rules:
        for stripe in rule.stripes if rule.technique is Technique.D2D else ():
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
    pools = plan.peer_pool_bytes_by_device()
    wanted: dict[int, list[tuple[int, int | None]]] = {}
    for sp in plan.stages:
        given = {q.device: q.quota_bytes for q in sp.peer_quotas}
        for device in exporter_peers(plan, sp.stage):
            wanted.setdefault(device, []).append((sp.stage, given.get(device)))
    busy = set(plan.stage_to_device)
    for device, exporters in wanted.items():
        if device not in busy and all(b is not None for _, b in exporters):
            pools[device] = sum(round_up(b, ALIGNMENT_BYTES) for _, b in exporters)  # type: ignore[arg-type]
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
        fixed = sum(round_up(b, ALIGNMENT_BYTES) for _, b in exporters if b is not None)
        open_count = sum(1 for _, b in exporters if b is None)
        if fixed > capacity or (open_count and capacity - fixed < open_count * ALIGNMENT_BYTES):
            need = ", ".join(f"stage {s} needs {round_up(b, ALIGNMENT_BYTES)} bytes" for s, b in exporters
                             if b is not None)
            left = f"; {open_count} exporter(s) without a quota share what is left" if open_count else ""
            raise PlanError(f"peer pool of device {device} is too small: {capacity} bytes for its exporters' "
                            f"quotas ({need}; total {fixed}{left})")
        share = ((capacity - fixed) // open_count // ALIGNMENT_BYTES * ALIGNMENT_BYTES) if open_count else 0
        sizes = [(s, round_up(b, ALIGNMENT_BYTES) if b is not None else share) for s, b in exporters]
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
