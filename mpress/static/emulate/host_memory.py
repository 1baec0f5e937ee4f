"""Pinned host memory per stage: the bytes a stage's pinned pool must hold at once when
the rank runs its program, so the runtime pins exactly what the plan says.

A host-swapped unit takes its pool blocks (`TensorInfo.pool_bytes`: each tensor rounded
up to the pool's alignment) when its swap-out is issued and gives them back once its
swap-in has copied them, at the latest when the backward that consumes it ends. An
optimizer chunk offloaded to the host lives in the pool from the start (the runtime sends
it out when the job is built); its OI gives the blocks back by the end of the chunk's
optimizer step, its OO takes them again. On a GPU the swap-in's copy may still run when
the step has been enqueued and the OO (or a later SO) reserves; the runtime frees the
blocks when that copy completes, and a reservation the pool is short for waits for it
(`HostStore.await_room`), so the pool never holds a chunk twice and this figure stays
what the runtime holds. D2D units and chunks (with stripes) use peer pools, not this one;
chunks on the drive (`nvme` rules) take no blocks: they cross the drive store's own
staging buffers, pinned apart and counted apart (`mpress.contract.plan_check.host_bytes`).

The pool the plan asks for is that peak plus room for fragmentation: the runtime carves
blocks first fit, and blocks come back in another order than they went out (a swap-in
completes when its copy does), so the free bytes can be in pieces smaller than the next
tensor's block. `FRAGMENTATION_HEADROOM` of the peak, and one largest block, are added;
that is what the runtime pins (`PinnedHostPool` pins exactly the plan's figure). Units:
bytes.
"""

from __future__ import annotations

from mpress.contract.actions import Action, Kind, Schedule
from mpress.static.emulate.lowering import TensorInfo
from mpress.config.units import ALIGNMENT_BYTES, round_up

FRAGMENTATION_HEADROOM = 0.25
"""Pool bytes over the program's most bytes at once, as a fraction of them (see the module
docstring; a pool of exactly the peak runs out in `bench/runtime.py`'s host-swap-only
variant)."""


def pinned_bytes(schedule: Schedule, tensors: dict[str, TensorInfo]) -> list[int]:
    """Per stage, the pinned pool its program needs: the most pool bytes in use over one
    iteration of `schedule` (a program: the rewriter's action lists), starting with its
    host-offloaded optimizer chunks in the pool, plus room for fragmentation (0 for a
    stage that moves nothing to the host)."""
    peak = [0] * schedule.num_stages
    largest = [0] * schedule.num_stages
    for actions in schedule.ranks:
        on_host = {a.tensor for a in actions if a.kind is Kind.OO and _host(a, tensors)}
        in_use: dict[int, int] = {}
        for name in on_host:
            stage = next(a.stage for a in actions if a.tensor == name)
            in_use[stage] = in_use.get(stage, 0) + tensors[name].pool_bytes  # type: ignore[index]
        held: dict[tuple[int, int | None, str | None], int] = {}  # what a compute action gives back
        for s, b in in_use.items():
            peak[s] = max(peak[s], b)
        for a in actions:
            if a.kind in (Kind.SO, Kind.OO) and _host(a, tensors):
                nbytes = tensors[a.tensor].pool_bytes  # type: ignore[index]
                largest[a.stage] = max(largest[a.stage], tensors[a.tensor].largest_block_bytes)  # type: ignore[index]
                in_use[a.stage] = in_use.get(a.stage, 0) + nbytes
                peak[a.stage] = max(peak[a.stage], in_use[a.stage])
                if a.kind is Kind.SO:
                    key = (a.stage, a.microbatch, None)  # given back by B(s, m)
                    held[key] = held.get(key, 0) + nbytes
            elif a.kind is Kind.OI and _host(a, tensors):
                held[(a.stage, None, a.tensor)] = tensors[a.tensor].pool_bytes  # type: ignore[index]
            elif a.kind in (Kind.B, Kind.W) or (a.kind is Kind.OPT and a.tensor is not None):
                # a split backward gives its units' pool bytes back with its W, the end of its backward
                key = (a.stage, a.microbatch, None) if a.kind is not Kind.OPT else (a.stage, None, a.tensor)
                in_use[a.stage] = in_use.get(a.stage, 0) - held.pop(key, 0)
    return [p + round_up(int(p * FRAGMENTATION_HEADROOM), ALIGNMENT_BYTES) + b if p else 0
            for p, b in zip(peak, largest)]


def _host(action: Action, tensors: dict[str, TensorInfo]) -> bool:
    """Whether the unit an SO/OO/OI action moves goes to the host (not striped to peers)."""
    return not tensors[action.tensor or ""].stripes
