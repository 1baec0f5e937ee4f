"""Peer quotas laid out by the program (`mpress.d2d.static.pool_slots`, `slot_pool.py`):
any quota at least what the program needs runs its D2D allocations without running out,
the allocator carves exactly that need, and a byte less runs out; plus the plan of
`bench/runtime.py`'s D2D variant, whose first-fit quotas fragmented into failure."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import random
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from mpress.config.units import ALIGNMENT_BYTES
from mpress.contract.actions import Action, Kind
from mpress.contract.plan import PeerQuota
from mpress.d2d.static.pool_slots import (
    MIN_QUOTA_BYTES,
    quota_need,
    unit_slot_counts,
    unit_stripes,
)
from mpress.errors import PlanError, SwapError
from mpress.static.plan.plan_eval import check_quotas
from mpress.static.schedules import one_f_one_b
from tests.support.peers import replay
from tests.support.plans import three_stage_d2d_plan


@st.composite
def d2d_programs(draw):
    """(actions, stage, unit bytes in the plan, unit bytes at run time, weights): one
    rank's 1F1B list with DO after the forwards of the microbatches each unit's rule
    picks and its DI anywhere between that forward and the backward."""
    num_stages = draw(st.integers(1, 4))
    num_mb = draw(st.integers(1, 8))
    stage = draw(st.integers(0, num_stages - 1))
    base = list(one_f_one_b(num_stages, num_mb).ranks[stage])
    peers = [d for d in range(6) if d != stage]
    units = {}
    for u in range(draw(st.integers(1, 5))):
        chosen = draw(st.lists(st.sampled_from(peers), min_size=1, max_size=3, unique=True))
        weights = tuple((d, draw(st.floats(0.1, 1.0))) for d in chosen)
        planned = ALIGNMENT_BYTES * draw(st.integers(1, 3000))  # every tensor rounded: aligned
        spans = planned - draw(st.integers(0, ALIGNMENT_BYTES - 1))  # the last tensor not rounded
        mbs = draw(st.lists(st.integers(0, num_mb - 1), min_size=1, unique=True))
        units[f"layers.{u}.**@r0"] = (weights, planned, spans, set(mbs))
    actions: list[Action] = []
    pending: dict[int, list[str]] = {}
    for a in base:
        if a.kind is Kind.B:
            for unit in pending.pop(a.microbatch, []):  # the rest: right before the backward
                actions.append(Action(stage, Kind.DI, a.microbatch, unit))
        actions.append(a)
        for mb, names in list(pending.items()):  # some swap-ins go early, after any action
            early = [n for n in names if draw(st.booleans())]
            actions += [Action(stage, Kind.DI, mb, n) for n in early]
            pending[mb] = [n for n in names if n not in early]
        if a.kind is Kind.F:
            names = [n for n, (_w, _p, _s, mbs) in units.items() if a.microbatch in mbs]
            actions += [Action(stage, Kind.DO, a.microbatch, n) for n in names]
            pending[a.microbatch] = names
    return (actions, stage, {n: p for n, (_w, p, _s, _m) in units.items()},
            {n: s for n, (_w, _p, s, _m) in units.items()}, {n: w for n, (w, _p, _s, _m) in units.items()})


@settings(max_examples=60, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(d2d_programs(), st.integers(0, 2**32 - 1), st.integers(0, 4))
def test_quotas_of_the_program_never_run_out_and_are_all_it_carves(program, seed, extra):
    actions, stage, planned, spans, weights = program
    need = quota_need(actions, stage, planned, weights)
    quotas = {d: n + extra * ALIGNMENT_BYTES for d, n in need.items()}
    pools = replay(actions, stage, quotas, spans, weights, random.Random(seed))
    # the regions the runtime carved are the planner's figure, to the byte (a peer no
    # stripe reaches has the smallest quota and nothing carved)
    carved = {d: p.in_use_bytes for d, p in pools.pools.items()}
    assert carved == {d: 0 if carved[d] == 0 and n == MIN_QUOTA_BYTES else n for d, n in need.items()}
    assert all(p.slots_in_use_bytes == 0 for p in pools.pools.values())


@settings(max_examples=30, deadline=None)
@given(d2d_programs(), st.integers(0, 2**32 - 1), st.data())
def test_a_quota_below_the_need_runs_out(program, seed, data):
    actions, stage, planned, spans, weights = program
    need = quota_need(actions, stage, planned, weights)
    reached = {p for u in planned for p, _ in unit_stripes(planned[u], weights[u])}
    short = data.draw(st.sampled_from(sorted(reached)))  # a peer some stripe reaches
    quotas = {d: (n - ALIGNMENT_BYTES if d == short else n) for d, n in need.items()}
    with pytest.raises(SwapError, match="exhausted"):
        replay(actions, stage, quotas, spans, weights, random.Random(seed))


def test_slot_counts_follow_the_program():
    """Under 1F1B stage 0 of 4 holds 4 microbatches at once; a unit only some
    microbatches swap holds at most those."""
    actions = []
    for a in one_f_one_b(4, 8).ranks[0]:
        if a.kind is Kind.B:
            actions.append(Action(0, Kind.DI, a.microbatch, "a"))
        actions.append(a)
        if a.kind is Kind.F:
            actions.append(Action(0, Kind.DO, a.microbatch, "a"))
            if a.microbatch % 2:
                actions.append(Action(0, Kind.DO, a.microbatch, "b"))
    assert unit_slot_counts(actions, 0) == {"a": 4, "b": 2}


def test_the_plan_check_refuses_a_quota_below_the_programs_need():
    """What `evaluate_plan` runs on a finished plan: one line naming the key and the need."""
    plan = three_stage_d2d_plan()
    need = [{1: 3 * ALIGNMENT_BYTES, 2: ALIGNMENT_BYTES}, {}, {}]
    quotas = {1: 3 * ALIGNMENT_BYTES, 2: ALIGNMENT_BYTES}
    fits = dataclasses.replace(plan, stages=[dataclasses.replace(plan.stages[0], peer_quotas=[
        PeerQuota(device=d, quota_bytes=b) for d, b in quotas.items()]), *plan.stages[1:]])
    check_quotas(fits, need)  # accepted: exactly the need
    short = dataclasses.replace(fits, stages=[dataclasses.replace(fits.stages[0], peer_quotas=[
        PeerQuota(device=1, quota_bytes=2 * ALIGNMENT_BYTES), PeerQuota(device=2, quota_bytes=ALIGNMENT_BYTES)]),
        *fits.stages[1:]])
    with pytest.raises(PlanError, match=r"^plan: stages\[0\]\.peer_quotas\[0\]\.quota_bytes: 1024 bytes on device 1, "
                                        r"the program's D2D slots there need 1536"):
        check_quotas(short, need)
    with pytest.raises(PlanError, match=r"stages\[0\]\.peer_quotas: .* device 2 and the stage has no quota there"):
        check_quotas(dataclasses.replace(fits, stages=[dataclasses.replace(fits.stages[0], peer_quotas=[
            PeerQuota(device=1, quota_bytes=3 * ALIGNMENT_BYTES)]), *fits.stages[1:]]), need)


def _bench():
    path = Path(__file__).parents[3] / "bench" / "runtime.py"
    spec = importlib.util.spec_from_file_location("bench_runtime", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.slow
def test_bench_d2d_variant_fits_its_quotas():
    """`bench/runtime.py`'s D2D variant (gpt-tiny-mixed, 4 stages, every saved tensor
    striped half to each of two peers) stopped with 'peer pool quota of stage 0 on device
    2 exhausted' under first-fit quotas of half the host pool: its plan's quotas now hold
    every stage's program, replayed with swap-ins completing late or early."""
    from mpress.hardware.server import load_hardware
    from mpress.launcher.startup import plan_for
    from mpress.runtime.train_config import load_train_config, model_config
    from mpress.static.plan.evaluate import setup_pipeline
    from mpress.static.plan.plan_draft import peer_quota_bytes
    from mpress.static.plan.plan_eval import evaluate_plan

    tcfg = load_train_config("gpt-tiny-mixed")
    cfg = model_config(tcfg)
    variants = dict(_bench().variants(plan_for(tcfg, cfg, 4, 4).plan, cfg))
    plan = variants["mpress, d2d-only (2 peers each)"]
    hardware = load_hardware(plan.hardware, num_devices=plan.num_devices, memory_bytes=plan.device_memory_bytes)
    setup = setup_pipeline(cfg, hardware, schedule=plan.schedule, num_stages=plan.num_stages,
                           microbatch_size=plan.microbatch_size, num_microbatches=plan.num_microbatches,
                           ranges=[(sp.first_layer, sp.end_layer) for sp in plan.stages])
    tensors = evaluate_plan(setup, plan).tensors  # refuses quotas below the program's need
    planned = {n: t.pool_bytes for n, t in tensors.items()}
    weights = {n: t.stripes for n, t in tensors.items() if t.stripes}
    exporters = [sp for sp in plan.stages if sp.peer_quotas]
    assert [sp.stage for sp in exporters] == [0, 1, 2]
    for sp in exporters:
        actions = plan.program(plan.rank_of_stage(sp.stage))
        quotas = {q.device: q.quota_bytes for q in sp.peer_quotas}
        for seed in range(3):
            pools = replay(actions, sp.stage, quotas, planned, weights, random.Random(seed))
            assert {d: p.in_use_bytes for d, p in pools.pools.items()} == quotas
    # before: first fit in quotas of half the host variant's pinned pool (with the
    # planner's old slack), larger than the slots need, ran out as the bench did
    stage0 = plan.stages[0]
    old = peer_quota_bytes(variants["mpress, host-swap-only"].stages[0].pinned_host_bytes / 2)
    assert old > max(q.quota_bytes for q in stage0.peer_quotas)
    failures = []
    for seed in range(10):
        with contextlib.suppress(SwapError):
            replay(plan.program(0), 0, {q.device: old for q in stage0.peer_quotas}, planned, weights,
                   random.Random(seed), laid_out=False)
            continue
        failures.append(seed)
    assert failures, "first fit no longer fragments: the regression shows nothing"
