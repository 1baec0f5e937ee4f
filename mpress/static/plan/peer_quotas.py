"""D2D quotas and peer pools as a plan's program needs them: the planner's side of
`mpress.d2d.static.pool_slots`, the layout the runtime's quotas allocate by.

`program_quotas` reads the program (the rewriter's action lists and what each memory
action moves) and gives, per stage and peer device, the quota its D2D data takes there;
the planner writes those quotas into the plan (`with_peer_quotas`), the emulator charges
each lender the pool they make (`pool_bytes_by_device`), and a finished plan whose quotas
are smaller is refused (`check_quotas`), so a plan that passes cannot run a quota out of
room at run time. Units: bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from mpress.config.units import fmt_bytes
from mpress.config.vocabulary import Technique
from mpress.contract.actions import Kind, Schedule
from mpress.contract.plan import PeerQuota, Plan, StagePlan
from mpress.d2d.static.pool_slots import MIN_QUOTA_BYTES, quota_need
from mpress.errors import PlanError
from mpress.static.emulate.lowering import TensorInfo


def program_quotas(schedule: Schedule, tensors: dict[str, TensorInfo]) -> list[dict[int, int]]:
    """Per stage, per peer device: the quota the stage's D2D units and chunks need under
    `schedule` (empty for a stage that sends nothing to peers)."""
    unit_bytes = {name: t.pool_bytes for name, t in tensors.items()}
    weights = {name: t.stripes for name, t in tensors.items() if t.stripes}
    out: list[dict[int, int]] = [{} for _ in range(schedule.num_stages)]
    for actions in schedule.ranks:
        for stage in sorted({a.stage for a in actions if a.kind in (Kind.DO, Kind.OO)}):
            out[stage] = quota_need(actions, stage, unit_bytes, weights)
    return out


def check_quotas(plan: Plan, quotas: Sequence[dict[int, int]]) -> None:
    """Refuse, in one line naming the plan's key, a stage whose quota on a peer is smaller
    than its program needs there (or missing)."""
    for sp in plan.stages:
        given = {q.device: (k, q.quota_bytes) for k, q in enumerate(sp.peer_quotas)}
        for device, need in sorted(quotas[sp.stage].items()):
            if device not in given:
                raise PlanError(f"plan: stages[{sp.stage}].peer_quotas: the program puts {fmt_bytes(need)} of D2D "
                                f"data on device {device} and the stage has no quota there (allowed: a quota of at "
                                f"least {need} bytes; `mpress plan` writes them)")
            k, nbytes = given[device]
            if nbytes < need:
                raise PlanError(f"plan: stages[{sp.stage}].peer_quotas[{k}].quota_bytes: {nbytes} bytes on device "
                                f"{device}, the program's D2D slots there need {need} (allowed: >= {need})")


def pool_bytes_by_device(plan: Plan, quotas: Sequence[dict[int, int]], num_devices: int) -> list[int]:
    """Per device, the peer pool the runtime allocates there for `plan`: the plan's pool,
    or its exporters' quotas (the plan's, at least what the program needs) when larger."""
    pools = [0] * num_devices
    for device, nbytes in plan.peer_pool_bytes_by_device().items():
        pools[device] = nbytes
    held = [0] * num_devices
    for sp in plan.stages:
        given = {q.device: q.quota_bytes for q in sp.peer_quotas}
        for device in set(given) | set(quotas[sp.stage]):
            held[device] += max(given.get(device, 0), quotas[sp.stage].get(device, 0))
    return [max(p, h) for p, h in zip(pools, held)]


def with_peer_quotas(stages: Sequence[StagePlan], quotas: Sequence[dict[int, int]]) -> list[StagePlan]:
    """`stages` with each one's quotas set to what its program needs (the smallest quota,
    `MIN_QUOTA_BYTES`, on a peer its D2D rules name and its program sends nothing to: the
    runtime opens a quota on every peer a rule names) and each device's peer pool (on the
    first stage running there) to its exporters' quotas."""
    given: list[dict[int, int]] = []
    for sp in stages:
        named = {st.device for r in sp.rules if r.technique is Technique.D2D for st in r.stripes}
        given.append({d: quotas[sp.stage].get(d, MIN_QUOTA_BYTES) for d in named | set(quotas[sp.stage])})
    on_device: dict[int, int] = {}
    for q in given:
        for device, nbytes in q.items():
            on_device[device] = on_device.get(device, 0) + nbytes
    out = []
    for sp, q in zip(stages, given):
        first = min(s.stage for s in stages if s.device == sp.device)  # one pool per device: on its first stage
        out.append(replace(sp, peer_quotas=[PeerQuota(device=d, quota_bytes=b) for d, b in sorted(q.items())],
                           peer_pool_bytes=on_device.get(sp.device, 0) if sp.stage == first else 0))
    return out
