"""D2D swap in multi-process pipelines on CPU (gloo + shared-memory peer pools).

Runs under plans that stripe saved tensors into other ranks' pools must equal the plain
run bit for bit; the exporter's device bytes must drop, and the importer's pool fill, by
exactly the swapped bytes; a dead importer and a pool too small must end every rank with
an error that names them, without hanging.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal

import pytest
import torch
import torch.distributed as dist

from mpress.config.model_config import load_model_config
from mpress.contract.plan import PeerQuota, Plan, TensorRule
from mpress.launcher.job import start_job
from mpress.runtime.trainer import JobSpec, PipelineJob
from mpress.config.units import ALIGNMENT_BYTES
from tests.support.compare import assert_identical
from tests.support.plans import d2d_rule, pipeline_plan
from tests.support.spawn import spawn
from tests.support.tiny_pipeline import RANGES, STEPS, batch

pytestmark = pytest.mark.slow

WORLD = 4
MICROBATCHES = 4
POOL = 16 << 20
STAGE_LAYERS = {0: ["embed", "layers.0"], 1: ["layers.1"], 2: ["layers.2"], 3: ["layers.3", "head"]}


def with_pools(plan: Plan, pools: dict[int, int], quotas: dict[int, dict[int, int]] | None = None) -> Plan:
    """`plan` with peer pools on the given devices (and explicit exporter quotas)."""
    stages = [dataclasses.replace(sp, peer_pool_bytes=pools.get(sp.device, 0),
                                  peer_quotas=[PeerQuota(device=d, quota_bytes=b)
                                               for d, b in (quotas or {}).get(sp.stage, {}).items()])
              for sp in plan.stages]
    return dataclasses.replace(plan, stages=stages)


def _probe(job: PipelineJob, records: list[dict]) -> None:
    """After every forward of this rank's first stage: settle the swaps, release the
    copy-outs' device storage (as the next compute action of the program will: its
    release point) and record the rank's live device bytes (every byte, `LiveBytes`),
    bytes on each peer, and what the pools' ledgers hold."""
    stage = job.stages[0]
    original = stage.forward_one_chunk

    def forward(chunk: int, *args, **kwargs):
        out = original(chunk, *args, **kwargs)
        rt = stage.runtime
        for engine in rt.engines:
            engine.wait_idle()
        rt.release()
        peers = {d: rt.manager.peer_bytes(d) for d in range(WORLD) if d != rt.stage_plan.device}
        ledger = {d: job.peers.peer_usage(d, stage=rt.stage_plan.stage)["data_bytes"] for d in peers
                  if job.peers is not None and peers[d]}
        table = ([[(s.peer, s.nbytes) for s in e.stripes] for e in rt.d2d_engine.store.table.entries()]
                 if rt.d2d_engine is not None else [])
        records.append({"microbatch": chunk, "live_bytes": job.live.live_bytes, "peer_bytes": peers,
                        "moved_in": rt.manager.bytes_moved_in,
                        "ledger_bytes": ledger, "stripes": table, "num_swapped": rt.router.tensors_swapped})
        return out

    stage.forward_one_chunk = forward


def _plans_worker(rank: int, world: int, plan_paths: list[str | None], options: dict):
    spec = JobSpec(model=load_model_config("gpt-tiny"), schedule="1f1b", ranges=RANGES[world],
                   microbatch_size=2, num_microbatches=MICROBATCHES, seed=3,
                   peer_pool_bytes=options.get("peer_pool_bytes"))
    for plan_path in plan_paths:
        torch.manual_seed(7 + rank)
        plan = Plan.load(plan_path) if plan_path else None
        job = start_job(spec, plan, torch.device("cpu"))
        records: list[dict] = []
        if plan is not None:
            _probe(job, records)
        if rank == options.get("kill_rank"):
            _die_in_forward(job, options["kill_step"])
        losses = []
        for step in range(STEPS):
            job.current_step = step
            x, y = batch(step, MICROBATCHES)
            losses.append(job.step(x, y).loss)
        dist.barrier()  # every exporter finished its step before the importers read their pools
        usage = job.peers.pool_usage() if job.peers is not None else {}
        yield {"losses": losses, "state": job.state(), "probes": records, "pool_usage": usage}
        job.close()


def _die_in_forward(job: PipelineJob, step: int) -> None:
    stage = job.stages[0]
    original = stage.forward_one_chunk

    def forward(chunk: int, *args, **kwargs):
        if job.current_step == step and chunk == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(chunk, *args, **kwargs)

    stage.forward_one_chunk = forward


def run(plans: list[Plan | None], **options) -> tuple[list[list[dict]], dict[int, str], float]:
    """Per plan, per rank: the worker's results; the errors by rank; the wall time. Every
    rank runs on until it fails by itself: the tests check how the others notice."""
    spawned = spawn(_plans_worker, WORLD, plans, options, timeout_s=240,
                    group_timeout_s=options.get("timeout_s", 60), stop_others_on_error=False)
    return spawned.results, spawned.errors, spawned.elapsed_s


def finished(results: list[list[dict | None]]) -> None:
    """Every rank got through every plan (a rank that dies without raising, e.g. by a
    signal, leaves no error and no result)."""
    missing = [(plan, rank) for plan, per_rank in enumerate(results) for rank, r in enumerate(per_rank) if r is None]
    assert not missing, f"(plan, rank) without a result or an error: {missing}"


D2D_ONLY = with_pools(pipeline_plan("1f1b", WORLD, MICROBATCHES, {
    0: [d2d_rule("*", {2: 0.75, 3: 0.25})],
    1: [d2d_rule("layers.1.**", {3: 1.0})]}), {2: POOL, 3: POOL}, quotas={0: {2: 8 << 20, 3: 4 << 20}, 1: {3: 4 << 20}})
D2D_LAYER_AHEAD = dataclasses.replace(D2D_ONLY, swap_in_policy="layer-ahead")
"""Swap-ins only `prefetch_lead` ahead: tensors stay on the peers between forward and backward."""

MIXED = with_pools(pipeline_plan("1f1b", WORLD, MICROBATCHES, {
    0: [TensorRule(tensor="embed.**", technique="host"),
        TensorRule(tensor="layers.0.**", technique="recompute", microbatches="0-1"),
        d2d_rule("layers.0.**", {2: 0.5, 3: 0.5}, "2-3")],
    1: [d2d_rule("layers.1.**", {3: 1.0}, "0,2"),
        TensorRule(tensor="layers.1.**", technique="host", microbatches="1,3")],
    2: [TensorRule(tensor="layers.2.**", technique="recompute")],
    3: [d2d_rule("head.**", {0: 0.6, 1: 0.4}), TensorRule(tensor="layers.3.**", technique="host")]}),
    {0: POOL, 1: POOL, 2: POOL, 3: POOL}, quotas={0: {2: 4 << 20, 3: 4 << 20}})

OPTIM_TO_PEERS = with_pools(pipeline_plan("1f1b", WORLD, MICROBATCHES, {
    0: [d2d_rule("optim:*", {2: 0.5, 3: 0.5}), d2d_rule("layers.0.**", {2: 1.0})],
    1: [d2d_rule("optim:layers.1", {3: 1.0}), TensorRule(tensor="layers.1.**", technique="host")]}),
    {2: POOL, 3: POOL})
"""Adam states between steps in peer pools, with activations swapped too."""

def _idle_lender() -> Plan:
    """Stages on devices 0, 1, 2 and 4 of a 5-device machine; device 3 runs no stage but
    lends its memory: rank 0, its lowest exporter, allocates and exports that pool."""
    plan = pipeline_plan("1f1b", WORLD, MICROBATCHES, {0: [d2d_rule("layers.0.**", {3: 0.5, 2: 0.5})],
                                                       1: [d2d_rule("layers.1.**", {3: 1.0})]})
    devices = [0, 1, 2, 4]
    stages = [dataclasses.replace(sp, device=devices[sp.stage], peer_pool_bytes=POOL if sp.stage == 2 else 0,
                                  peer_quotas=[PeerQuota(device=3, quota_bytes=4 << 20)] if sp.stage < 2 else [])
              for sp in plan.stages]
    return dataclasses.replace(plan, num_devices=5, stage_to_device=devices, stages=stages)


IDLE_LENDER = _idle_lender()

KEEP_ALL = pipeline_plan("1f1b", WORLD, MICROBATCHES, {0: [TensorRule(tensor="*", technique="keep")]})


def test_d2d_and_mixed_plans_equal_the_plain_run_and_move_exactly_the_swapped_bytes():
    (plain, d2d_only, mixed, keep, d2d_ahead, optim, idle), errors, _ = run(
        [None, D2D_ONLY, MIXED, KEEP_ALL, D2D_LAYER_AHEAD, OPTIM_TO_PEERS, IDLE_LENDER])
    assert not errors, errors
    finished([plain, d2d_only, mixed, keep, d2d_ahead, optim, idle])
    for result in (d2d_only, mixed, keep, d2d_ahead, optim, idle):
        assert_identical(plain, result)
    assert all(optim[r]["pool_usage"][r]["high_water_bytes"] > 0 for r in (2, 3))
    assert idle[0]["pool_usage"][3]["high_water_bytes"] > 0 and idle[0]["pool_usage"][3]["data_bytes"] == 0

    # rank 0 (stage 0) after each forward: what left its device is what its peers hold
    kept, swapped = keep[0]["probes"], d2d_ahead[0]["probes"]
    assert [p["microbatch"] for p in kept] == [p["microbatch"] for p in swapped]
    moved_any = False
    for k, s in zip(kept, swapped):
        on_peers = sum(s["peer_bytes"].values())
        # the metadata table: a unit's tensors are striped as one run of bytes, each
        # tensor at an aligned offset, so the stripes hold the tensors' bytes and the
        # alignment gaps between them (under one alignment unit per tensor)
        held = {}
        for stripes in s["stripes"]:
            for device, size in stripes:
                held[device] = held.get(device, 0) + size
        assert on_peers <= sum(held.values()) < on_peers + ALIGNMENT_BYTES * max(1, s["num_swapped"])
        if s["moved_in"] == 0:  # before the first swap-in: the device holds what the keep
            # run holds less exactly what went to the peers (the router moves storages)
            drop = k["live_bytes"] - s["live_bytes"]
            assert drop == on_peers, (k["microbatch"], drop, on_peers)
        for device, nbytes in held.items():
            assert s["ledger_bytes"].get(device, 0) == nbytes  # the importer's pool holds exactly that
        moved_any |= on_peers > 0
        # stripes follow the weights: large tensors 3:1 over devices 2 and 3
        for stripes in s["stripes"]:
            sizes = dict(stripes)
            if len(sizes) == 2:
                assert abs(sizes[2] - 3 * sizes[3]) <= 4 * 512, sizes
    assert moved_any
    assert sum(1 for s in swapped if s["moved_in"] == 0 and sum(s["peer_bytes"].values())) >= 2
    peer_total = {d: sum(p["peer_bytes"][d] for p in swapped) for d in (2, 3)}
    assert peer_total[2] > 2 * peer_total[3] > 0  # 0.75 / 0.25 by bytes over the step
    # the importers' pools are empty again after the step
    for rank in (2, 3):
        assert d2d_ahead[rank]["pool_usage"][rank]["data_bytes"] == 0
        assert d2d_ahead[rank]["pool_usage"][rank]["high_water_bytes"] > 0


def random_d2d_plan(rng: random.Random) -> Plan:
    """Per stage: up to two random layers, each D2D-swapped (striped over one to three
    peers in random proportions), host-swapped, recomputed or kept, in a random set of
    microbatches; at least one D2D rule in every plan."""
    rules: dict[int, list[TensorRule]] = {}
    for stage, layers in STAGE_LAYERS.items():
        peers = [d for d in range(WORLD) if d != stage]
        for layer in rng.sample(layers, rng.randint(0, min(2, len(layers)))):
            mbs = rng.sample(range(MICROBATCHES), rng.randint(1, min(4, MICROBATCHES)))
            selector = ",".join(map(str, sorted(mbs)))
            technique = rng.choice(["d2d", "d2d", "host", "recompute", "keep"])
            if technique == "d2d":
                chosen = rng.sample(peers, rng.randint(1, min(3, len(peers))))
                weights = [rng.randint(1, 4) for _ in chosen]
                stripes = {d: w / sum(weights) for d, w in zip(chosen, weights)}
                rules.setdefault(stage, []).append(d2d_rule(f"{layer}.**", stripes, selector))
            else:
                rules.setdefault(stage, []).append(TensorRule(tensor=f"{layer}.**", technique=technique,
                                                              microbatches=selector))
    if not any(r.technique == "d2d" for rs in rules.values() for r in rs):  # never a vacuous example
        rules.setdefault(0, []).insert(0, d2d_rule("embed.**", {1: 1.0}))
    return with_pools(pipeline_plan("1f1b", WORLD, MICROBATCHES, rules), {d: POOL for d in range(WORLD)})


def test_random_d2d_plans_are_bit_identical_to_the_plain_run():
    rng = random.Random("d2d-runs")
    plans = [random_d2d_plan(rng) for _ in range(3)]
    assert len({tuple(p.actions) for p in plans}) == 3  # drawn, not one plan repeated
    results, errors, _ = run([None, *plans])
    assert not errors, errors
    finished(results)
    for result in results[1:]:
        assert_identical(results[0], result)


def test_a_dead_importer_stops_every_rank_with_an_error_naming_it():
    results, errors, elapsed = run([D2D_ONLY], kill_rank=3, kill_step=1, timeout_s=30)
    assert set(errors) == {0, 1, 2}, errors  # rank 3 was killed and wrote nothing
    for rank, text in errors.items():
        first = text.splitlines()[0]
        assert "rank 3 (pid" in first and "holds the D2D peer pool of device(s) 3" in first and "has died" in first, \
            (rank, first)
    assert elapsed < 120  # bounded: far below the hang a blocked collective would mean


def test_a_peer_pool_too_small_for_the_plan_fails_at_start_up_on_every_rank():
    results, errors, elapsed = run([D2D_ONLY], peer_pool_bytes=1 << 20, timeout_s=30)
    assert set(errors) == set(range(WORLD)), errors
    for text in errors.values():
        first = text.splitlines()[0]
        assert first.startswith("PlanError: peer pools: rank "), first
        assert "peer pool of device 2 is too small: 1048576 bytes" in first or \
               "peer pool of device 3 is too small: 1048576 bytes" in first, first
    assert all(r is None for r in results[0])  # nothing trained
