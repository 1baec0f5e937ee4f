"""The optimizer under a plan: fp32 master weights (bf16 model), their offload with the
Adam states (`optim:` host rules, streamed one layer's chunk at a time by the program's
OI/OO actions), and the step on the host (`optimizer_step: host`). Every run steps the
optimizer one layer at a time, plain pipelining included. Pure plan tests first, then
one spawn of 2 CPU (gloo) ranks running every job: each must equal plain pipelining of
the same precision bit for bit (`torch.equal`), dropout on, and execute its program's
list exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpress.config.model_config import ModelConfig, load_model_config
from mpress.contract.actions import Kind
from mpress.contract.plan import Plan, StagePlan, Stripe, TensorRule
from mpress.errors import ConfigError
from mpress.runtime.master_weights import Kind as MasterKind
from mpress.runtime.optimizer_offload import layer_params
from mpress.runtime.trainer import JobSpec, PipelineJob
from tests.support.compare import assert_identical
from tests.support.jobs import resumed
from tests.support.plans import pipeline_plan
from tests.support.spawn import spawn
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES, batch

STEPS = 3
NUM_MICROBATCHES = 4
WORLD = 2
BYTES_PER_PARAM_OFF_DEVICE = 12
"""fp32 master (or host copy) + Adam's exp_avg and exp_avg_sq, 4 bytes each."""
OFFLOAD = TensorRule(tensor="optim:*", technique="host")
ACTIVATIONS = TensorRule(tensor="layers.*.**", technique="host")


def model(precision: str) -> ModelConfig:
    return dataclasses.replace(load_model_config(MODEL), precision=precision)


def plan_for(precision: str, schedule: str, rules: dict[int, list[TensorRule]],
             host_step: tuple[int, ...] = ()) -> Plan:
    return pipeline_plan(schedule, WORLD, NUM_MICROBATCHES, rules, model=model(precision), host_step=host_step)


# ---- the plan field (pure) -----------------------------------------------------------

def test_optimizer_step_round_trips_through_yaml(tmp_path):
    plan = plan_for("bf16", "1f1b", {0: [OFFLOAD]}, host_step=(1,))
    plan.save(tmp_path / "plan.yaml")
    loaded = Plan.load(tmp_path / "plan.yaml")
    assert loaded == plan
    assert [sp.optimizer_step for sp in loaded.stages] == ["device", "host"]


def test_bad_optimizer_step_values_are_refused(tmp_path):
    text = plan_for("bf16", "1f1b", {}, host_step=(0,)).to_yaml().replace("optimizer_step: host",
                                                                           "optimizer_step: cpu")
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError, match="optimizer_step"):
        Plan.load(tmp_path / "bad.yaml")
    d2d = TensorRule(tensor="optim:*", technique="d2d", stripes=[Stripe(device=1, fraction=1.0)])
    with pytest.raises(ConfigError, match="steps on the host"):
        StagePlan(stage=0, device=0, first_layer=0, end_layer=3, rules=[d2d], optimizer_step="host")


def test_an_offloaded_stage_streams_its_optimizer_one_layer_chunk_at_a_time():
    """Each offloaded layer's chunk comes in (OI) before its own step and goes out (OO)
    right after it; a stage without `optim:` rules steps as a whole (one OPT)."""
    plan = plan_for("bf16", "1f1b", {0: [OFFLOAD]})
    chunks = ["0:optim:embed", "0:optim:layers.0", "0:optim:layers.1"]
    moves = [(a.kind, a.tensor) for a in plan.program(0) if a.kind in (Kind.OI, Kind.OO, Kind.OPT)]
    assert [t for k, t in moves if k is Kind.OPT] == chunks
    for chunk in chunks:
        at = {k: moves.index((k, chunk)) for k in (Kind.OI, Kind.OPT, Kind.OO)}
        assert at[Kind.OI] < at[Kind.OPT] < at[Kind.OO], (chunk, moves)
    assert [str(a) for a in plan.program(1) if a.kind in (Kind.OI, Kind.OO, Kind.OPT)] == ["1OPT"]


def test_a_host_step_stage_moves_no_optimizer_chunks():
    """`optimizer_step: host` subsumes the stage's `optim:` rules (its data lives on the
    host for good, `optimizer_offload.py`): its program must not stream chunks through
    the device, which nothing at run time would execute."""
    plan = plan_for("bf16", "1f1b", {0: [OFFLOAD]}, host_step=(0,))
    moves = [str(a) for a in plan.program(0) if a.kind in (Kind.OI, Kind.OO)]
    assert moves == [], moves


def test_a_plan_without_the_field_loads_with_device_steps(tmp_path):
    text = plan_for("fp32", "1f1b", {}).to_yaml()
    assert "optimizer_step: device" in text
    (tmp_path / "old.yaml").write_text(text.replace("  optimizer_step: device\n", ""))
    assert all(sp.optimizer_step == "device" for sp in Plan.load(tmp_path / "old.yaml").stages)


# ---- multi-process -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Job:
    precision: str
    schedule: str = "1f1b"
    plan: Plan | None = None
    resume_after: int | None = None
    """Save the state after this many steps, build a new job, load it and go on."""


def _run_one(job: Job, plan_path: str | None, rank: int) -> dict:
    n = 2 * WORLD if job.schedule == "interleaved" else WORLD
    spec = JobSpec(model=model(job.precision), schedule=job.schedule, ranges=RANGES[n],
                   microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES, seed=3)
    plan = Plan.load(plan_path) if plan_path else None
    torch.manual_seed(7 + rank)  # dropout draws: per rank, the same in every run
    pj = PipelineJob(spec, plan, torch.device("cpu"))
    startup = {"startup": pj.startup_peak_bytes,
               "param_bytes": sum(p.numel() * p.element_size() for m in pj.modules for p in m.parameters()),
               "master_bytes": sum(pj.masters.nbytes(n) for n in pj.masters.names(MasterKind.DEVICE_MASTER))}
    losses = []
    for step in range(STEPS):
        if step == job.resume_after:
            pj = resumed(pj, lambda: PipelineJob(spec, plan, torch.device("cpu")), step)
        x, y = batch(step, NUM_MICROBATCHES)
        losses.append(pj.step(x, y).loss)
    live_between_steps = pj.live.live_bytes  # after the last step: what stays on the device
    swaps = {}  # before `state()`, which brings each chunk home and sends it out again
    for s, rt in zip(pj.stage_ids, pj.runtimes):
        if s in pj.offloads:
            rt.engine.wait_idle()
            swaps[s] = {"out": rt.engine.stats.num_out, "in": rt.engine.stats.num_in,
                        "activation_rules": any(not r.tensor.startswith("optim:") for r in rt.stage_plan.rules)}
    executed = ([str(a) for a in pj.program.last_log], [str(a) for a in pj.program.actions]) \
        if pj.program is not None else None
    stages = []
    for rt, module in zip(pj.runtimes, pj.modules):
        if rt.engine is not None:
            rt.engine.wait_idle()  # swap-outs after the step land in the manager's table
        report = rt.manager.report()
        stages.append({"stage": rt.stage_plan.stage, "host_bytes": report["host_bytes"],
                       "masters": report["categories"]["master"]["num_tensors"],
                       "num_params": sum(p.numel() for p in module.parameters()),
                       "num_tensors": len(list(module.parameters())),
                       "chunks": sum(1 for names in layer_params(module, list(rt.router.layers)).values() if names),
                       "bytes_out": rt.engine.stats.bytes_out if rt.engine is not None else 0})
    result = {"losses": losses, "state": pj.state(), "stages": stages, "swaps": swaps, "live_bytes": live_between_steps, **startup,
              "executed": executed, "num_params": {s: sum(p.numel() for p in m.parameters())
                                                    for s, m in zip(pj.stage_ids, pj.modules)},
              "dtypes": {p.dtype for m in pj.modules for p in m.parameters()}}
    pj.close()
    return result


def _jobs_worker(rank: int, world: int, plan_paths: list[str | None], jobs: list[Job]):
    for job, path in zip(jobs, plan_paths):
        yield _run_one(job, path, rank)


@dataclasses.dataclass
class Runs:
    """Per job, per rank: losses, final state and per-stage accounting (one spawn), and
    the errors by rank of the job that stopped the spawn (jobs after it did not run)."""

    results: dict[str, list[dict | None]]
    errors: dict[int, str]

    def __getitem__(self, name: str) -> list[dict]:
        if any(r is None for r in self.results[name]):
            firsts = {rank: text.splitlines()[0] for rank, text in self.errors.items()}
            pytest.fail(f"job {name} did not finish: {firsts}")
        return self.results[name]  # type: ignore[return-value]


def stage_records(result: list[dict]) -> dict[int, dict]:
    return {st["stage"]: st for r in result for st in r["stages"]}


JOBS = {
    # jobs run in this order in one spawn; a failing job stops the ones after it
    "bf16": Job(precision="bf16"),
    "bf16-resumed": Job(precision="bf16", resume_after=2),
    "bf16-offload": Job(precision="bf16", plan=plan_for("bf16", "1f1b", {0: [OFFLOAD, ACTIVATIONS], 1: [OFFLOAD]})),
    "bf16-mixed-resumed": Job(precision="bf16", resume_after=2,
                              plan=plan_for("bf16", "1f1b", {1: [OFFLOAD, ACTIVATIONS]}, host_step=(0,))),
    "fp32": Job(precision="fp32"),
    "fp32-host-step": Job(precision="fp32", plan=plan_for("fp32", "1f1b", {1: [ACTIVATIONS]}, host_step=(0, 1))),
    "bf16-interleaved": Job(precision="bf16", schedule="interleaved"),
    # rank 0 holds stages 0 (host step) and 2 (offload): one optimizer over CPU and device masters
    "bf16-interleaved-mixed": Job(precision="bf16", schedule="interleaved",
                                  plan=plan_for("bf16", "interleaved", {2: [OFFLOAD], 1: [OFFLOAD]}, host_step=(0, 3))),
    # last: the host step subsumes stage 0's `optim:` rule (see
    # test_a_host_step_stage_moves_no_optimizer_chunks)
    "bf16-host-step": Job(precision="bf16", plan=plan_for("bf16", "1f1b", {0: [OFFLOAD, ACTIVATIONS]},
                                                          host_step=(0, 1))),
}
OPTIMIZER_BYTES_PER_PARAM = {"bf16": 12, "fp32": 8}
"""Optimizer data per parameter a stage keeps on the device when it steps there and
offloads nothing: Adam's two fp32 states, plus the fp32 master under bf16 (fp32 steps
the parameter itself)."""
BASELINE = {"bf16-resumed": "bf16", "bf16-offload": "bf16", "bf16-host-step": "bf16", "bf16-mixed-resumed": "bf16",
            "fp32-host-step": "fp32", "bf16-interleaved-mixed": "bf16-interleaved"}
"""The plain, uninterrupted run each job must equal bit for bit."""


@pytest.fixture(scope="module")
def results() -> Runs:
    spawned = spawn(_jobs_worker, WORLD, [job.plan for job in JOBS.values()], list(JOBS.values()))
    return Runs(dict(zip(JOBS, spawned.results)), spawned.errors)


@pytest.mark.slow
def test_bf16_trains_half_parameters_with_fp32_masters(results):
    plain = results["bf16"]
    assert all(r["dtypes"] == {torch.bfloat16} for r in plain)
    masters = {k: v for r in plain for k, v in r["state"]["masters"].items()}
    model_state = {k: v for r in plain for k, v in r["state"]["model"].items()}
    assert masters.keys() == model_state.keys()
    assert all(m.dtype == torch.float32 and torch.equal(m.to(torch.bfloat16), model_state[k])
               for k, m in masters.items())
    assert any(not torch.equal(m, model_state[k].float()) for k, m in masters.items())
    assert all("masters" not in r["state"] for r in results["fp32"])


@pytest.mark.slow
@pytest.mark.parametrize("name, plain", BASELINE.items())
def test_runs_equal_plain_pipelining_bit_for_bit(results, name, plain):
    assert all(loss is not None for loss in results[name][-1]["losses"])
    assert_identical(results[plain], results[name], masters=True)
    for rank, r in enumerate(results[name]):  # what ran is the plan's list, action for action
        if JOBS[name].plan is not None:
            executed, planned = r["executed"]
            assert executed == planned, rank


@pytest.mark.slow
def test_a_resumed_run_holds_what_the_uninterrupted_one_holds(results):
    """Between steps a run resumed from a checkpoint has the same bytes on each rank's
    device as one that never stopped (the loaded model and optimizer data replace what
    was there; Adam's `step` counts are host scalars in both)."""
    for rank, (a, b) in enumerate(zip(results["bf16"], results["bf16-resumed"])):
        assert b["live_bytes"] == a["live_bytes"], (rank, a["live_bytes"], b["live_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16-offload", "bf16-host-step", "bf16-mixed-resumed", "fp32-host-step",
                                  "bf16-interleaved-mixed"])
def test_optimizer_data_off_the_device_is_in_the_managers_report(results, name):
    """Every stage with an `optim:*` host rule or a host step has its masters (or host
    copies) and both Adam states off the device after a step (the rank's live bytes are
    the plain run's less exactly those), and its manager says so."""
    job = JOBS[name]
    plan, plain = job.plan, results[BASELINE[name]]
    offs = []
    for rank, (r, p) in enumerate(zip(results[name], plain)):
        # between steps the device holds the plain run's bytes less the optimizer data of
        # every stage whose data is off it (activations are all back by then)
        offs.append(sum(OPTIMIZER_BYTES_PER_PARAM[job.precision] * n for s, n in r["num_params"].items()
                        if plan.stage(s).optimizer_step == "host" or OFFLOAD in plan.stage(s).rules))
        assert p["live_bytes"] - r["live_bytes"] == offs[-1], (rank, p["live_bytes"], r["live_bytes"], offs[-1])
    assert any(offs)
    for s, st in stage_records(results[name]).items():
        sp = plan.stage(s)
        off = sp.optimizer_step == "host" or OFFLOAD in sp.rules
        assert st["host_bytes"] == (BYTES_PER_PARAM_OFF_DEVICE * st["num_params"] if off else 0), s
        # a host step tracks each parameter's host copy; an offload moves each layer's
        # masters as one group (`optimizer_offload.py`)
        host = sp.optimizer_step == "host"
        assert st["masters"] == (st["num_tensors"] if host else st["chunks"] if off else 0), s
        # the swap engine carries what the program sends out: offloaded chunks (OO) and
        # activations (SO; none where B follows F at once); a host step moves nothing
        swaps_optimizer = sp.optimizer_step == "device" and OFFLOAD in sp.rules
        sends = {a.kind for a in plan.program(s % WORLD) if a.stage == s and a.kind in (Kind.SO, Kind.OO)}
        assert (Kind.OO in sends) == swaps_optimizer, s
        assert (st["bytes_out"] > 0) == bool(sends), s


@pytest.mark.slow
def test_each_offloaded_chunk_moves_as_two_grouped_copies_per_direction(results):
    """An offloaded layer's optimizer data moves as two swap groups (its Adam states, its
    masters), each one copy batch per direction, whatever its number of parameters: sent
    out at start-up (masters only: Adam makes its states in the first step), brought in
    for each step (masters only in the first) and sent out after it (both groups). One
    swap per tensor made 3 per parameter and step."""
    counted = 0
    for r in results["bf16-offload"]:
        for s, sw in r["swaps"].items():
            if sw["activation_rules"]:
                continue  # its engine swaps activations too
            layers = stage_records([r])[s]["chunks"]
            assert sw["out"] == layers * (1 + 2 * STEPS), (s, sw)
            assert sw["in"] == layers * (1 + 2 * (STEPS - 1)), (s, sw)
            counted += 1
    assert counted


@pytest.mark.slow
def test_offloaded_masters_are_never_all_on_the_device_at_start_up(results):
    """A plain bf16 rank holds its parameters and every fp32 master at start-up; a rank
    whose plan offloads its optimizer data makes each layer's masters and sends them out
    before the next layer's are made, so its start-up peak stays below that (it held
    them all until the first step's release point before)."""
    for rank, (plain, offload) in enumerate(zip(results["bf16"], results["bf16-offload"])):
        assert plain["master_bytes"] == offload["master_bytes"] > 0
        assert plain["startup"] >= plain["param_bytes"] + plain["master_bytes"], rank
        assert offload["param_bytes"] < offload["startup"] < offload["param_bytes"] + offload["master_bytes"], rank
