"""Data-parallel replicas of the pipeline on CPU (gloo): a `dp` x `pp` mesh, each stage's
gradients averaged over its replicas by DDP (`mpress.runtime.data_parallel`).

Under a mixed plan (host swap, recompute, optimizer-state offload) every rank's losses
and final state equal the same dp x pp run without a plan bit for bit, and the replicas,
which trained on different batches, end with identical states."""

from __future__ import annotations

import pytest
import torch

from mpress.launcher.checkpoint import Checkpoints
from mpress.launcher.job import start_job
from mpress.model_config import load_model_config
from mpress.plan import Plan, TensorRule
from mpress.runtime.data_parallel import make_replicas
from mpress.runtime.train_config import load_train_config
from mpress.runtime.trainer import JobSpec
from tests.support.compare import assert_identical, assert_states_equal
from tests.support.plans import pipeline_plan
from tests.support.spawn import spawn
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES, STEPS, batch

NUM_MICROBATCHES = 4


def _dp_worker(rank: int, world: int, plan_paths: list[str | None], dp: int):
    """One job per plan on a dp x pp mesh; replica k trains on batches k, dp + k, ..."""
    replicas = make_replicas(dp, "cpu")
    spec = JobSpec(model=load_model_config(MODEL), schedule="1f1b", ranges=RANGES[replicas.pp_size],
                   microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES, seed=3)
    for plan_path in plan_paths:
        torch.manual_seed(7 + rank)  # dropout draws: per rank, the same in every run
        plan = Plan.load(plan_path) if plan_path else None
        job = start_job(spec, plan, torch.device("cpu"), group=replicas.pp_group, dp_group=replicas.dp_group)
        losses = []
        for step in range(STEPS):
            x, y = batch(step * dp + replicas.dp_rank, NUM_MICROBATCHES)
            losses.append(job.step(x, y).loss)
        swapped = sum(rt.router.tensors_swapped for rt in job.runtimes)
        recomputed = sum(rt.router.layers_recomputed for rt in job.runtimes)
        yield {"losses": losses, "state": job.state(), "dp_rank": replicas.dp_rank, "pp_rank": replicas.pp_rank,
               "swapped": swapped, "recomputed": recomputed, "offloaded": sorted(job.offloads)}
        job.close()


def _mixed_plan(pp: int) -> Plan:
    """Host swap, recompute and optimizer-state offload, spread over the stages."""
    last = pp - 1
    rules = {0: [TensorRule(tensor="optim:*", technique="host"), TensorRule(tensor="layers.0.**", technique="host")],
             1: [TensorRule(tensor="layers.*.**", technique="recompute", microbatches="0-1"),
                 TensorRule(tensor="layers.*.**", technique="host", microbatches="2-3")]}
    rules.setdefault(last, []).extend([TensorRule(tensor="optim:*", technique="host"),
                                       TensorRule(tensor="head.**", technique="recompute")])
    return pipeline_plan("1f1b", pp, NUM_MICROBATCHES, rules)


def _check(dp: int, pp: int) -> None:
    spawned = spawn(_dp_worker, dp * pp, [None, _mixed_plan(pp)], dp, timeout_s=600)
    assert not spawned.errors, spawned.errors
    plain, mixed = spawned.results
    assert [(r["dp_rank"], r["pp_rank"]) for r in mixed] == [(k, p) for k in range(dp) for p in range(pp)]
    assert_identical(plain, mixed)
    assert sum(r["swapped"] for r in mixed) > 0 and sum(r["recomputed"] for r in mixed) > 0
    assert any(r["offloaded"] for r in mixed)
    last = [r for r in mixed if r["pp_rank"] == pp - 1]
    assert all(None not in r["losses"] for r in last)
    assert last[0]["losses"] != last[1]["losses"], "the replicas trained on the same batches"
    for run in (plain, mixed):  # the reduction keeps the replicas equal
        for p in range(pp):
            assert_states_equal(run[p]["state"], run[pp + p]["state"])


@pytest.mark.slow
def test_two_replicas_of_two_stages_equal_the_plain_run_and_each_other():
    _check(2, 2)


@pytest.mark.slow
def test_two_replicas_of_four_stages_equal_the_plain_run_and_each_other():
    _check(2, 4)


def _checkpoint_worker(rank: int, world: int, plan_paths: list[str | None], dp: int, root: str, resume: bool):
    """A dp x pp job under the plan: with `resume`, its state as loaded from `root` (no
    step run); else its state after STEPS steps, saved to `root`."""
    replicas = make_replicas(dp, "cpu") if dp > 1 else None
    pp = replicas.pp_size if replicas is not None else world
    cfg = load_train_config("gpt-tiny-plain", [("num_stages", str(pp)), ("dp", str(dp)), ("seed", "3"),
                                               ("microbatch_size", str(MICROBATCH_SIZE)),
                                               ("num_microbatches", str(NUM_MICROBATCHES)),
                                               ("checkpoint.dir", root), ("checkpoint.resume", str(resume).lower())])
    spec = JobSpec(model=load_model_config(MODEL), schedule="1f1b", ranges=RANGES[pp], microbatch_size=MICROBATCH_SIZE,
                   num_microbatches=NUM_MICROBATCHES, seed=3)
    plan = Plan.load(plan_paths[0])
    job = start_job(spec, plan, torch.device("cpu"), group=replicas.pp_group if replicas else None,
                    dp_group=replicas.dp_group if replicas else None)
    checkpoints = Checkpoints(cfg, job, None, dp_rank=replicas.dp_rank if replicas else 0)
    if resume:
        yield {"next": checkpoints.resume(), "state": job.state()}
    else:
        for step in range(STEPS):
            x, y = batch(step * dp + (replicas.dp_rank if replicas else 0), NUM_MICROBATCHES)
            job.step(x, y)
        checkpoints.save(STEPS - 1)
        yield {"state": job.state()}
    job.close()


@pytest.mark.slow
def test_a_checkpoint_of_two_replicas_resumes_on_one(tmp_path):
    saved = spawn(_checkpoint_worker, 4, [_mixed_plan(2)], 2, str(tmp_path / "dp2"), False, timeout_s=600)
    assert not saved.errors, saved.errors
    # replica 0 wrote the model and optimizer state; replica 1 only its generators
    shards = {p.name: p.stat().st_size for p in (tmp_path / "dp2").glob("step*/__*.distcp")}
    assert len(shards) == 4 and shards["__2_0.distcp"] < shards["__0_0.distcp"] / 10, shards
    one = spawn(_checkpoint_worker, 2, [_mixed_plan(2)], 1, str(tmp_path / "dp2"), True, timeout_s=600)
    assert not one.errors, one.errors
    for p, loaded in enumerate(one.results[0]):
        assert loaded["next"] == STEPS
        assert_states_equal(saved.results[0][p]["state"], loaded["state"])
        assert_states_equal(saved.results[0][2 + p]["state"], loaded["state"])
