"""Optimizer states on a local drive (`optim:` nvme rules, `mpress/runtime/swap/nvme.py`):
the contract's refusals first, then one spawn of 2 CPU (gloo) ranks whose tier is a
directory: a run with nvme rules (beside host ones) equals plain pipelining bit for bit,
executes its program, keeps the nvme layers' states in its files between steps (not on
the device, not in host memory), resumes from a checkpoint taken with the states on
the drive (the checkpoint reads them back from there) to the same parameters and losses,
and page-locks what its plan says it pins (the drive stores' staging buffers beside the
pools), as a GPU run would (a stand-in CUDA runtime records each registration)."""

from __future__ import annotations

import dataclasses
import fcntl
import os
from pathlib import Path

import pytest
import torch
import yaml

from mpress.config.model_config import load_model_config
from mpress.contract.plan import Plan, StagePlan, TensorRule
from mpress.contract.plan_check import NVME_STAGING_BYTES, drive_staging_bytes, on_drive
from mpress.errors import ConfigError, PlanError
from mpress.launcher.startup import plan_for
from mpress.runtime.optimizer_offload import layer_params
from mpress.runtime.train_config import load_train_config, model_config
from mpress.runtime.trainer import JobSpec, PipelineJob
from mpress.static.plan.planner_layer_data import plan_pinned_bytes
from tests.support.compare import assert_identical
from tests.support.cuda_fakes import FakeCudart, as_if_cuda
from tests.support.documented import one_line_error, run_documented
from tests.support.jobs import resumed
from tests.support.plans import drive_hardware, one_line, pipeline_plan, setup_for
from tests.support.spawn import spawn
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES, batch

STEPS = 3
NUM_MICROBATCHES = 4
WORLD = 2
BYTES_PER_PARAM = 12
"""What a bf16 layer's optimizer chunk holds per parameter: its fp32 master and Adam's
exp_avg and exp_avg_sq."""
NVME = TensorRule(tensor="optim:*", technique="nvme")
NVME_BLOCKS = TensorRule(tensor="optim:layers.*", technique="nvme")
HOST = TensorRule(tensor="optim:*", technique="host")
ACTIVATIONS = TensorRule(tensor="layers.*.**", technique="host")
MODEL_BF16 = dataclasses.replace(load_model_config(MODEL), precision="bf16")


# ---- the contract (pure) -------------------------------------------------------------

def test_nvme_is_refused_for_anything_but_optimizer_states():
    for tensor in ("layers.*.**", "*", "stash:layers.0", "layers.0.mlp.fc1#0"):
        with pytest.raises(ConfigError, match=r"technique: nvme holds optimizer states only \(optim:LAYER\)"):
            TensorRule(tensor=tensor, technique="nvme")
    with pytest.raises(ConfigError, match="steps on the host, so its optimizer states stay in host memory"):
        StagePlan(stage=0, device=0, first_layer=0, end_layer=3, rules=[NVME], optimizer_step="host")


def test_an_nvme_plan_round_trips_and_needs_a_drive_to_emulate(tmp_path):
    plan = pipeline_plan("1f1b", WORLD, NUM_MICROBATCHES, {0: [NVME]}, model=MODEL_BF16,
                         hardware=drive_hardware(tmp_path))
    plan.save(tmp_path / "plan.yaml")
    assert Plan.load(tmp_path / "plan.yaml") == plan
    with pytest.raises(Exception, match="states no local drive"):
        pipeline_plan("1f1b", WORLD, NUM_MICROBATCHES, {0: [NVME]}, model=MODEL_BF16)


def test_a_job_without_nvme_dir_is_refused_in_one_line(tmp_path):
    """Rank 0's start-up check, before any rank builds a stage: the plan's first nvme rule
    and the key that is missing, in one line (`mpress train` exits 2 with it)."""
    hardware = drive_hardware(tmp_path)
    plan = pipeline_plan("1f1b", WORLD, NUM_MICROBATCHES, {1: [HOST], 0: [ACTIVATIONS, NVME]}, hardware=hardware)
    dataclasses.replace(plan, hardware="cpu-local-drive").save(tmp_path / "plan.yaml")  # its name, as planned
    job = {"model": MODEL, "schedule": "1f1b", "num_stages": WORLD, "microbatch_size": MICROBATCH_SIZE,
           "num_microbatches": NUM_MICROBATCHES, "hardware": hardware, "device_memory": plan.device_memory_bytes,
           "plan": str(tmp_path / "plan.yaml")}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(job))
    cfg = load_train_config(tmp_path / "train.yaml")
    with pytest.raises(PlanError) as info:
        plan_for(cfg, model_config(cfg), WORLD, WORLD)
    assert one_line(info.value) == (f"{tmp_path / 'plan.yaml'}: stages[0].rules[1]: optim:* goes to nvme: set "
                                    "nvme_dir in the training config (a directory on a local drive)")
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({**job, "nvme_dir": str(tmp_path / "drive")}))
    cfg = load_train_config(tmp_path / "train.yaml")
    assert plan_for(cfg, model_config(cfg), WORLD, WORLD).plan.stages[0].rules[1].technique == "nvme"


def test_mpress_train_runs_an_nvme_plan_within_its_prediction_and_refuses_it_without_nvme_dir(tmp_path):
    """Through the documented command on 2 CPU ranks: without `nvme_dir` one line, exit 2;
    with it the run trains, each rank's measured peak and start-up peak are within the
    emulator's prediction of the same program (and at least 90% of it), the report says
    how the files were opened, and no file is left on the drive."""
    hardware = drive_hardware(tmp_path)
    plan = pipeline_plan("1f1b", WORLD, NUM_MICROBATCHES, {0: [ACTIVATIONS, NVME], 1: [NVME_BLOCKS]},
                         hardware=hardware)
    dataclasses.replace(plan, hardware="cpu-local-drive").save(tmp_path / "plan.yaml")
    job = {"model": MODEL, "schedule": "1f1b", "num_stages": WORLD, "microbatch_size": MICROBATCH_SIZE,
           "num_microbatches": NUM_MICROBATCHES, "hardware": hardware, "device_memory": plan.device_memory_bytes,
           "plan": str(tmp_path / "plan.yaml"), "steps": 2, "log_every": 2, "report": str(tmp_path / "report.json")}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(job))
    argv = ["train", "--config", str(tmp_path / "train.yaml"), "--nproc-per-node", str(WORLD)]
    code, _out, err = run_documented(argv, cwd=tmp_path)
    one_line_error(code, err, "stages[0].rules[1]: optim:* goes to nvme: set nvme_dir in the training config")
    drive = tmp_path / "drive"
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({**job, "nvme_dir": str(drive)}))
    code, _out, err = run_documented(argv, cwd=tmp_path)
    assert code == 0, err[-3000:]
    rows = yaml.safe_load((tmp_path / "report.json").read_text())
    assert len(rows) == WORLD
    for r in rows:
        assert 0.9 * r["predicted"] <= r["measured"] <= r["predicted"], r
        assert 0 < r["startup"] <= r["predicted"], r
        assert r["nvme"] == "O_DIRECT" or r["nvme"].startswith("buffered ("), r
    assert list(drive.iterdir()) == []


# ---- multi-process -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Job:
    plan: Plan | None = None
    resume_after: int | None = None
    schedule: str = "1f1b"


def _run_one(job: Job, plan_path: str | None, rank: int, nvme_dir: str) -> dict:
    """One job on this rank, its pinned host memory page-locked through a stand-in CUDA
    runtime (what a GPU run registers: the pools and the drive stores' staging buffers)."""
    cudart = FakeCudart()
    with pytest.MonkeyPatch.context() as patch:
        as_if_cuda(patch, cudart)
        result = _train(job, plan_path, rank, nvme_dir, cudart)
    result["left_pinned"] = dict(cudart.registered)  # once the job closed: nothing stays page-locked
    return result


def _train(job: Job, plan_path: str | None, rank: int, nvme_dir: str, cudart: FakeCudart) -> dict:
    n = 2 * WORLD if job.schedule == "interleaved" else WORLD
    spec = JobSpec(model=MODEL_BF16, schedule=job.schedule, ranges=RANGES[n], microbatch_size=MICROBATCH_SIZE,
                   num_microbatches=NUM_MICROBATCHES, seed=3, nvme_dir=nvme_dir)
    plan = Plan.load(plan_path) if plan_path else None
    torch.manual_seed(7 + rank)
    pj = PipelineJob(spec, plan, torch.device("cpu"))
    losses = []
    for step in range(STEPS):
        if step == job.resume_after:
            pj = resumed(pj, lambda: PipelineJob(spec, plan, torch.device("cpu")), step)
        losses.append(pj.step(*batch(step, NUM_MICROBATCHES)).loss)
    drive = []
    for rt, module in zip(pj.runtimes, pj.modules):
        engine = rt.nvme_engine if rt is not None else None
        if engine is None:
            continue
        engine.wait_idle()
        store = engine.store
        routes = {layer for layer in rt.router.layers
                  if (found := rt.router.rules.model_data_rule("optim", layer)) and found[1].technique == "nvme"}
        params = layer_params(module, list(rt.router.layers))
        named = dict(module.named_parameters())
        report = rt.manager.report()
        drive.append({"disk_bytes": report["disk_bytes"], "host_bytes": report["host_bytes"],
                      "expected": BYTES_PER_PARAM * sum(named[n].numel() for layer in routes for n in params[layer]),
                      "file_bytes": os.path.getsize(store.path), "path": str(store.path),
                      "direct": store.direct, "fd_direct": bool(fcntl.fcntl(store.fd, fcntl.F_GETFL) & os.O_DIRECT),
                      "said": rt.stats.extra["nvme"], "io": engine.stats.num_out + engine.stats.num_in})
    executed = ([str(a) for a in pj.program.last_log], [str(a) for a in pj.program.actions]) \
        if pj.program is not None else None
    result = {"losses": losses, "state": pj.state(), "drive": drive, "executed": executed,
              "pinned": sum(cudart.registered.values())}
    pj.close()
    result["left"] = [name for name in os.listdir(nvme_dir) if name.endswith(f"-{os.getpid()}.mpress-optim")]
    return result


def _jobs_worker(rank: int, world: int, plan_paths: list[str | None], jobs: list[Job], nvme_dir: str):
    for job, path in zip(jobs, plan_paths):
        yield _run_one(job, path, rank, nvme_dir)


def _pools_as_run(plan: Plan) -> Plan:
    """`plan` without a pool for a stage that sends nothing to the host (no `host` rule):
    the runtime makes none there, as a planned plan asks for none (`pipeline_plan` gives
    every stage one)."""
    return dataclasses.replace(plan, stages=[
        sp if any(r.technique == "host" for r in sp.rules) else dataclasses.replace(sp, pinned_host_bytes=0)
        for sp in plan.stages])


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> tuple[Path, dict[str, Job]]:
    """The directory the drive is in, and the jobs by name."""
    where = tmp_path_factory.mktemp("nvme")
    (where / "drive").mkdir()
    hardware = drive_hardware(where)
    # stage 0: every chunk on the drive, activations to the host; stage 1: the blocks'
    # chunks on the drive, the head's to the host (the first matching rule decides)
    mixed = pipeline_plan("1f1b", WORLD, NUM_MICROBATCHES, {0: [NVME, ACTIVATIONS], 1: [NVME_BLOCKS, HOST]},
                          model=MODEL_BF16, hardware=hardware)
    # interleaved: two stages per rank, each with its own file (stage 2 on the drive, 3 on the host)
    looped = _pools_as_run(pipeline_plan("interleaved", WORLD, NUM_MICROBATCHES,
                                         {0: [NVME], 1: [NVME_BLOCKS, HOST], 2: [NVME], 3: [HOST]},
                                         model=MODEL_BF16, hardware=hardware))
    return where, {"plain": Job(), "nvme": Job(plan=mixed), "nvme-resumed": Job(plan=mixed, resume_after=2),
                   "plain-interleaved": Job(schedule="interleaved"),
                   "nvme-interleaved": Job(plan=looped, schedule="interleaved", resume_after=1)}


@pytest.fixture(scope="module")
def results(jobs):
    where, named = jobs
    spawned = spawn(_jobs_worker, WORLD, [job.plan for job in named.values()], list(named.values()),
                    str(where / "drive"))
    if spawned.errors:
        pytest.fail(f"ranks failed: { {r: t.splitlines()[0] for r, t in spawned.errors.items()} }")
    return dict(zip(named, spawned.results))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nvme", "nvme-resumed", "nvme-interleaved"])
def test_runs_with_states_on_the_drive_equal_plain_pipelining(results, name):
    assert_identical(results["plain-interleaved" if "interleaved" in name else "plain"], results[name], masters=True)
    for rank, r in enumerate(results[name]):
        executed, planned = r["executed"]
        assert executed == planned, rank


@pytest.mark.slow
@pytest.mark.parametrize("name, stages", [("nvme", [1, 1]), ("nvme-resumed", [1, 1]), ("nvme-interleaved", [2, 1])])
def test_the_nvme_layers_states_live_in_the_files_between_steps(results, name, stages):
    """After the last step each stage's nvme layers' masters and Adam states are on the
    drive, exactly (and its file holds at least that), the descriptor's O_DIRECT is what
    the stage reports, and the files are gone once the job closed. `stages`: per rank,
    its stages with nvme rules (each has its own file)."""
    for rank, r in enumerate(results[name]):
        assert len(r["drive"]) == stages[rank]
        for drive in r["drive"]:
            assert drive["expected"] > 0 and drive["disk_bytes"] == drive["expected"], (rank, drive)
            assert drive["file_bytes"] >= drive["expected"] and drive["io"] > 0
            assert drive["fd_direct"] == drive["direct"]
            assert drive["said"] == "O_DIRECT" if drive["direct"] else drive["said"].startswith("buffered (")
        assert len({drive["path"] for drive in r["drive"]}) == stages[rank]
        assert r["left"] == [], r["left"]
    if "interleaved" not in name:  # stage 1 holds the head there: its chunk goes to the host, beside the drive
        assert results[name][1]["drive"][0]["host_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nvme", "nvme-resumed", "nvme-interleaved"])
def test_a_run_pins_what_its_plan_says_it_pins(jobs, results, name):
    """What the ranks page-lock together while they train is the plan's pinned total
    (`plan_pinned_bytes`, which `mpress plan` reports and the plan check holds against
    the host): the stages' pools and, apart, each drive store's two staging buffers. A
    plan that left the staging out would fall short by those. Once the job closed,
    nothing is left page-locked."""
    plan = jobs[1][name].plan
    drive = sum(drive_staging_bytes(sp) for sp in plan.stages)
    assert drive == 2 * NVME_STAGING_BYTES * sum(on_drive(sp) for sp in plan.stages) > 0
    pinned = [r["pinned"] for r in results[name]]
    assert sum(pinned) == plan_pinned_bytes(plan, setup_for(plan, MODEL_BF16).costs), pinned
    assert all(r["left_pinned"] == {} for r in results[name]), [r["left_pinned"] for r in results[name]]
