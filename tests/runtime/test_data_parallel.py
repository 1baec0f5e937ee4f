"""Data-parallel replicas of the pipeline on CPU (gloo): a `dp` x `pp` mesh, each stage's
gradients averaged over its replicas by DDP (`mpress.runtime.data_parallel`).

Under a mixed plan (host swap, recompute, optimizer-state offload) every rank's losses
and final state equal the same dp x pp run without a plan bit for bit, and the replicas,
which trained on different batches, end with identical states."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mpress.errors import UserError
from mpress.launcher.checkpoints.checkpoint import Checkpoints
from mpress.launcher.devices import join_replicas
from mpress.launcher.job import start_job
from mpress.config.model_config import load_model_config
from mpress.contract.plan import Plan, TensorRule
from mpress.runtime.data_parallel import replica_coordinates
from mpress.runtime.train_config import TrainConfig, check_world_size, load_train_config
from mpress.runtime.trainer import JobSpec
from tests.support.compare import assert_identical, assert_states_equal
from tests.support.plans import pipeline_plan
from tests.support.spawn import spawn
from tests.support.tiny_pipeline import (
    MICROBATCH_SIZE,
    MODEL,
    RANGES,
    STEPS,
    batch,
    num_stages_of,
)

NUM_MICROBATCHES = 4


def _config(pp: int, dp: int, root: str | None, resume: bool = False):
    """The train config the checkpoints of these jobs are made under."""
    return load_train_config("gpt-tiny-plain", [
        ("num_stages", str(pp)), ("dp", str(dp)), ("seed", "3"), ("microbatch_size", str(MICROBATCH_SIZE)),
        ("num_microbatches", str(NUM_MICROBATCHES)), ("checkpoint.dir", root or "null"),
        ("checkpoint.resume", str(resume).lower())])


_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
                "allgather_into_tensor_coalesced", "broadcast", "barrier", "reduce", "gather", "scatter",
                "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall",
                "alltoall_base", "send", "recv", "recv_anysource", "monitored_barrier")


def _record_world_collectives() -> list[str]:
    """From now on, the name of each collective that runs on the default (world) group:
    torch's `dist.*` functions, its pipelining and DDP all reach a group through these
    `ProcessGroup` methods (on NCCL the first of them builds the world's communicator)."""
    pg_class = torch._C._distributed_c10d.ProcessGroup
    world = dist.distributed_c10d._get_default_group().group_name
    seen: list[str] = []
    for name in _COLLECTIVES:
        real = getattr(pg_class, name, None)
        if real is None:
            continue

        def call(self, *args, _real=real, _name=name, **kwargs):
            if self.group_name == world:
                seen.append(_name)
            return _real(self, *args, **kwargs)
        setattr(pg_class, name, call)
    return seen


def _groups_held() -> list[list[int]]:
    """The global ranks of every process group this rank belongs to, sorted (torch also
    files the last group it is not in, under `GroupMember.NON_GROUP_MEMBER`)."""
    return sorted(sorted(ranks) for pg, ranks in dist.distributed_c10d._world.pg_group_ranks.items()
                  if isinstance(pg, dist.ProcessGroup))


def _dp_worker(rank: int, world: int, plan_paths: list[str | None], dp: int, root: str | None = None,
               schedule: str = "1f1b"):
    """One job per plan on a dp x pp mesh, joined as `mpress.train` joins it; replica k
    trains on batches k, dp + k, ... root: the jobs under a plan save their final step
    there (DCP; with no control group here, on the default group: after the record)."""
    on_world = _record_world_collectives()
    replicas = join_replicas(torch.device("cpu"), dp)
    spec = JobSpec(model=load_model_config(MODEL), schedule=schedule,
                   ranges=RANGES[num_stages_of(schedule, replicas.pp_size)],
                   microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES, seed=3)
    for plan_path in plan_paths:
        torch.manual_seed(7 + rank)  # dropout draws: per rank, the same in every run
        plan = Plan.load(plan_path) if plan_path else None
        job = start_job(spec, plan, torch.device("cpu"), group=replicas.pp_group, dp_group=replicas.dp_group)
        losses = []
        for step in range(STEPS):
            x, y = batch(step * dp + replicas.dp_rank, NUM_MICROBATCHES)
            losses.append(job.step(x, y).loss)
        world_collectives = list(on_world)
        if plan is not None and root is not None:
            Checkpoints(_config(replicas.pp_size, dp, root), job, None, dp_rank=replicas.dp_rank).save(STEPS - 1)
        swapped = sum(rt.router.tensors_swapped for rt in job.runtimes)
        recomputed = sum(rt.router.layers_recomputed for rt in job.runtimes)
        yield {"losses": losses, "state": job.state(), "dp_rank": replicas.dp_rank, "pp_rank": replicas.pp_rank,
               "swapped": swapped, "recomputed": recomputed, "offloaded": sorted(job.offloads),
               "groups": _groups_held(), "world_collectives": world_collectives}
        job.close()


def _mixed_plan(pp: int, schedule: str = "1f1b") -> Plan:
    """Host swap, recompute and optimizer-state offload, spread over the stages."""
    last = num_stages_of(schedule, pp) - 1
    rules = {0: [TensorRule(tensor="optim:*", technique="host"), TensorRule(tensor="layers.0.**", technique="host")],
             1: [TensorRule(tensor="layers.*.**", technique="recompute", microbatches="0-1"),
                 TensorRule(tensor="layers.*.**", technique="host", microbatches="2-3")]}
    rules.setdefault(last, []).extend([TensorRule(tensor="optim:*", technique="host"),
                                       TensorRule(tensor="head.**", technique="recompute")])
    return pipeline_plan(schedule, pp, NUM_MICROBATCHES, rules)


def _run(dp: int, pp: int, root: str | None = None, schedule: str = "1f1b") -> tuple[list[dict], list[dict]]:
    """The plain and the mixed dp x pp runs' results per rank (`root`: see `_dp_worker`)."""
    spawned = spawn(_dp_worker, dp * pp, [None, _mixed_plan(pp, schedule)], dp, root, schedule, timeout_s=600)
    assert not spawned.errors, spawned.errors
    return spawned.results[0], spawned.results[1]


def _assert_equal_runs(plain: list[dict], mixed: list[dict], dp: int, pp: int) -> None:
    """The mixed run equals the plain one bit for bit, and each run's replicas end equal."""
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
    # the groups each rank holds are the world (gloo here) and the two it uses: its
    # replica's pipeline and its stage's replicas; nothing ran on the world group
    for r, got in enumerate(plain + mixed):
        k, p = divmod(r % (dp * pp), pp)
        assert got["groups"] == sorted([list(range(dp * pp)), [k * pp + q for q in range(pp)],
                                        [j * pp + p for j in range(dp)]]), (r, got["groups"])
        assert got["world_collectives"] == [], (r, got["world_collectives"])


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory) -> tuple[list[dict], list[dict], str]:
    """The 2 x 2 runs' results per rank, and where the mixed run saved its last step."""
    root = str(tmp_path_factory.mktemp("dp2") / "ckpt")
    return (*_run(2, 2, root), root)


@pytest.mark.slow
def test_two_replicas_of_two_stages_equal_the_plain_run_and_each_other(two_by_two):
    plain, mixed, _root = two_by_two
    _assert_equal_runs(plain, mixed, 2, 2)


@pytest.mark.slow
def test_two_replicas_of_four_stages_equal_the_plain_run_and_each_other():
    _assert_equal_runs(*_run(2, 4), 2, 4)


@pytest.mark.slow
def test_two_replicas_of_an_interleaved_pipeline_equal_the_plain_run_and_each_other():
    # two stages per rank: two DDPs per rank over one dp group, reducing in schedule order
    _assert_equal_runs(*_run(2, 2, schedule="interleaved"), 2, 2)


def _resume_worker(rank: int, world: int, plan_paths: list[str | None], root: str):
    """A job of one replica under the plan, its state as loaded from `root` (no step run)."""
    spec = JobSpec(model=load_model_config(MODEL), schedule="1f1b", ranges=RANGES[world],
                   microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES, seed=3)
    job = start_job(spec, Plan.load(plan_paths[0]), torch.device("cpu"))
    yield {"next": Checkpoints(_config(world, 1, root, resume=True), job, None).resume(), "state": job.state()}
    job.close()


@pytest.mark.slow
def test_a_checkpoint_of_two_replicas_resumes_on_one(two_by_two):
    _plain, saved, root = two_by_two
    # replica 0 wrote the model and optimizer state; replica 1 only its generators
    shards = {p.name: p.stat().st_size for p in Path(root).glob("step*/__*.distcp")}
    assert len(shards) == 4 and shards["__2_0.distcp"] < shards["__0_0.distcp"] / 10, shards
    one = spawn(_resume_worker, 2, [_mixed_plan(2)], root, timeout_s=600)
    assert not one.errors, one.errors
    for p, loaded in enumerate(one.results[0]):
        assert loaded["next"] == STEPS
        assert_states_equal(saved[p]["state"], loaded["state"])
        assert_states_equal(saved[2 + p]["state"], loaded["state"])


def test_the_world_is_dp_replicas_of_the_pipeline():
    cfg = TrainConfig(model="gpt-tiny", num_stages=2, dp=3, num_microbatches=2)
    assert check_world_size(cfg, 6) == 2
    assert cfg.global_batch_size == 3 * 2 * 1
    with pytest.raises(UserError, match=r"^dp: 4 ranks cannot hold 3 replicas of the pipeline"):
        check_world_size(cfg, 4)
    with pytest.raises(UserError, match=r"^num_stages: 1f1b runs one stage per rank, so num_stages \(2\) must equal"):
        check_world_size(cfg, 9)  # 3 replicas of 3 ranks


@pytest.mark.parametrize("world,dp", [(4, 2), (8, 2), (8, 4), (6, 3), (3, 1)])
def test_replica_coordinates_are_known_before_the_mesh(world, dp):
    """A rank chooses and binds its device before the mesh exists (init_device_mesh would
    make LOCAL_RANK's GPU current first), from the coordinates the mesh then gives it
    (make_replicas checks they agree on every multi-process run here)."""
    pp = world // dp
    layout = torch.arange(world).view(dp, pp)  # the (dp, pp) mesh, as init_device_mesh lays it out
    for rank in range(world):
        d, p = replica_coordinates(rank, world, dp)
        assert layout[d, p] == rank


def test_replica_coordinates_refuse_a_world_that_is_not_whole_replicas():
    with pytest.raises(ValueError, match="not in 2 replicas"):
        replica_coordinates(0, 5, 2)


def _mismatch_worker(rank: int, world: int, _plans, seed_of_rank_1: int):
    """Two replicas of a one-stage pipeline whose second replica built its stage from
    another seed."""
    from types import SimpleNamespace

    from mpress.runtime.data_parallel import replicate_stages

    torch.manual_seed(0 if rank == 0 else seed_of_rank_1)
    stage = SimpleNamespace(submod=torch.nn.Linear(4, 4), stage_index=0)
    replicate_stages([stage], torch.distributed.group.WORLD, torch.device("cpu"))
    yield "replicated"


@pytest.mark.slow
def test_replicas_built_differently_are_refused_not_silently_overwritten():
    """DDP no longer broadcasts replica 0's parameters at start-up (a transient of up to
    250 MiB per device); the replicas' agreement is checked instead."""
    same = spawn(_mismatch_worker, 2, [None], 0)
    assert not same.errors and same.results[0] == ["replicated", "replicated"]
    differ = spawn(_mismatch_worker, 2, [None], 1)
    assert set(differ.errors) == {0, 1}
    assert all("stage 0: its replicas differ in weight" in e for e in differ.errors.values()), differ.errors
