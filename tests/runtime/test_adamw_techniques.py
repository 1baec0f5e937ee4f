"""AdamW + warmup/cosine + global-norm clipping under every technique, on 2 and 4 CPU
(gloo) ranks, 1F1B and interleaved 1F1B, against torch alone (issue 27's done-when; the
sibling `test_adamw_runs.py` covers 2 ranks under 1F1B with recompute, host swap, offload
and the host step, and a resume mid-warmup).

Each run -- D2D swap (activations and optimizer states striped into the other ranks'
peer pools), op-level recompute (the planner's keep + recompute rules), host swap,
whole-layer recompute, optimizer-state offload and the host optimizer step, mixed within
a plan, and resumed mid-warmup or mid-decay -- must equal bit for bit (`torch.equal`) a
reference written with torch alone: `PipelineStage`s under `Schedule1F1B` or
`ScheduleInterleaved1F1B` (stage s on rank s % world), `torch.optim.AdamW` over the same
groups, `LambdaLR` with the schedule's factor and the global norm summed over the ranks,
uninterrupted. One spawn per rank count runs every job of that count.

Interleaved on 4 ranks needs 8 stages: it trains gpt-tiny with 6 blocks (`DEEP`), one
layer a stage.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
)

from mpress.config.model_config import ModelConfig, load_model_config
from mpress.contract.plan import Plan, TensorRule
from mpress.launcher.job import start_job
from mpress.models import build_stage, lm_loss
from mpress.runtime.lr_schedule import LrSchedule
from mpress.runtime.trainer import JobSpec
from tests.support.jobs import resumed
from tests.support.plans import d2d_rule, op_level_recompute, pipeline_plan, rule
from tests.support.spawn import spawn
from tests.support.tiny_pipeline import (
    MICROBATCH_SIZE,
    MODEL,
    RANGES,
    batch,
    num_stages_of,
)

pytestmark = pytest.mark.slow

STEPS = 5
NUM_MICROBATCHES = 4
SEED = 3
LR = 1e-2
WEIGHT_DECAY = 0.1
MAX_NORM = 0.5
"""Small enough that clipping scales the gradients of every step (checked)."""
SCHEDULE = LrSchedule(kind="cosine", lr=LR, total_steps=STEPS, warmup_steps=2, min_lr=1e-3)
MID_WARMUP = 1
"""Resume before step 1: the second warmup step."""
MID_DECAY = 3
"""Resume before step 3: half-way through the cosine decay (steps 2-4)."""
POOL = 16 << 20
"""Peer pool each device lends."""
OFFLOAD = rule("optim:*", "host")
DEEP = dataclasses.replace(load_model_config(MODEL), num_layers=6)
"""gpt-tiny with 6 blocks: 8 layers, for 8 stages (interleaved on 4 ranks)."""
DEEP_RANGES = [(i, i + 1) for i in range(8)]


@dataclasses.dataclass(frozen=True)
class Job:
    world: int
    schedule: str = "1f1b"
    plan: Plan | None = None
    reference: bool = False
    """Run the torch-only reference instead of mpress."""
    resume_after: int | None = None
    """Save the state after this many steps, close the job, start a new one, load it and go on."""

    @property
    def deep(self) -> bool:
        """Interleaved on 4 ranks: `DEEP`, one layer a stage."""
        return self.world == 4 and self.schedule == "interleaved"

    @property
    def model(self) -> ModelConfig:
        return DEEP if self.deep else load_model_config(MODEL)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return DEEP_RANGES if self.deep else RANGES[num_stages_of(self.schedule, self.world)]


def plan_of(world: int, schedule: str, rules: dict[int, list[TensorRule]], host_step: tuple[int, ...] = ()) -> Plan:
    """A plan for gpt-tiny's stages with `rules`, every device lending a peer pool (set on
    its first stage)."""
    job = Job(world, schedule)
    return pipeline_plan(schedule, world, NUM_MICROBATCHES, rules, host_step=host_step,
                         peer_pools={s: POOL for s in range(world)}, model=job.model, ranges=job.ranges)


def spec(job: Job) -> JobSpec:
    return JobSpec(model=job.model, schedule=job.schedule, ranges=job.ranges, microbatch_size=MICROBATCH_SIZE,
                   num_microbatches=NUM_MICROBATCHES, seed=SEED, lr=LR, betas=(0.9, 0.95),
                   weight_decay=WEIGHT_DECAY, optimizer="adamw", lr_schedule=SCHEDULE, clip_grad_norm=MAX_NORM)


# ---- the reference: torch alone ----------------------------------------------------------

def _reference(rank: int, job: Job) -> dict:
    """gpt-tiny's stages of `rank` (s = rank, rank + world, ...) under torch's schedule,
    AdamW (no decay on 1-D parameters and embeddings), LambdaLR and a hand-written
    global clip over every stage of every rank."""
    cfg, world, schedule_name, ranges = job.model, job.world, job.schedule, job.ranges
    device = torch.device("cpu")
    n = len(ranges)
    torch.manual_seed(7 + rank)  # dropout draws: per rank, as in the mpress runs (seeded before building)
    b, t = MICROBATCH_SIZE, cfg.seq_len
    modules, stages = [], []
    for s in range(rank, n, world):
        start, end = ranges[s]
        module = build_stage(cfg, start, end, seed=SEED, device=device)
        module.train()
        x = (torch.zeros(b, t, dtype=torch.long) if s == 0
             else torch.zeros(b, t, cfg.hidden_size, requires_grad=True))
        y = torch.zeros(b, t, cfg.vocab_size if s == n - 1 else cfg.hidden_size, requires_grad=True)
        modules.append(module)
        stages.append(PipelineStage(module, s, n, device, input_args=x, output_args=y))
    if schedule_name == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, NUM_MICROBATCHES, loss_fn=lm_loss)
    else:
        schedule = Schedule1F1B(stages[0], NUM_MICROBATCHES, loss_fn=lm_loss)
    first, last = rank == 0, rank == (n - 1) % world
    named = [(name, p) for m in modules for name, p in m.named_parameters()]
    exempt = [p for name, p in named if p.dim() < 2 or name.startswith("embed.")]
    decay = [p for name, p in named if not (p.dim() < 2 or name.startswith("embed."))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": exempt, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, SCHEDULE.factor)
    losses, norms, lrs = [], [], []
    for step in range(STEPS):
        inputs, targets = batch(step, NUM_MICROBATCHES)
        out: list[torch.Tensor] = []
        if first and last:
            schedule.step(inputs, target=targets, losses=out, return_outputs=False)
        elif first:
            schedule.step(inputs, return_outputs=False)
        elif last:
            schedule.step(target=targets, losses=out, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        total = torch.zeros(1)
        for _name, p in named:
            norm_p = torch.linalg.vector_norm(p.grad, 2, dtype=torch.float32)
            total += norm_p * norm_p
        dist.all_reduce(total)
        norm = torch.sqrt(total[0])
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        for _name, p in named:
            p.grad.mul_(coef)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(float(torch.stack(out).mean()) if out else None)
        norms.append(float(norm))
    model = {name: p.detach().clone() for m in modules for name, p in m.state_dict().items()}
    state = {"model": model,
             "optimizer": {"state": {name: {k: v.clone() for k, v in opt.state[p].items()} for name, p in named}}}
    return {"losses": losses, "norms": norms, "lrs": lrs, "state": state}


# ---- mpress -----------------------------------------------------------------------------

def _run(job: Job, plan_path: str | None, rank: int) -> dict:
    s = spec(job)
    plan = Plan.load(plan_path) if plan_path else None
    torch.manual_seed(7 + rank)
    pj = start_job(s, plan, torch.device("cpu"))
    losses, norms, lrs = [], [], []
    for step in range(STEPS):
        if step == job.resume_after:
            pj = resumed(pj, lambda: start_job(s, plan, torch.device("cpu")), step)
        x, y = batch(step, NUM_MICROBATCHES)
        result = pj.step(x, y)
        assert not result.skipped, (rank, step)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        lrs.append(result.lr)
    out = {"losses": losses, "norms": norms, "lrs": lrs, "state": pj.state(), "executed": None,
           "swapped": sum(rt.router.tensors_swapped for rt in pj.runtimes),
           "recomputed": sum(rt.router.layers_recomputed for rt in pj.runtimes)}
    if pj.program is not None:
        out["executed"] = ([str(a) for a in pj.program.last_log], [str(a) for a in pj.program.actions])
    pj.close()
    return out


def _worker(rank: int, world: int, plan_paths: list[str | None], jobs: list[Job]):
    for job, path in zip(jobs, plan_paths):
        yield _reference(rank, job) if job.reference else _run(job, path, rank)


def _op_level(layers: dict[str, int]) -> list[TensorRule]:
    return [r for layer, option in layers.items() for r in op_level_recompute(layer, option)]


# Stages of 2 ranks, 1F1B: 0 = embed, layers.0, layers.1; 1 = layers.2, layers.3, head.
# Interleaved (4 stages, s on rank s % 2): 0 = embed, layers.0; 1 = layers.1; 2 = layers.2; 3 = layers.3, head.
# 4 ranks, 1F1B: the interleaved stages, one per rank; interleaved: `DEEP`, one layer a stage.
# MIXED_2's stage 0 streams one layer's optimizer data and keeps the others' (as the planner's
# last step writes a plan, `planner_optim_keep.py`).
D2D_2 = plan_of(2, "1f1b", {0: [d2d_rule("layers.0.**", {1: 1.0}), d2d_rule("optim:layers.1", {1: 1.0})],
                            1: [d2d_rule("layers.3.**", {0: 1.0}), d2d_rule("optim:*", {0: 1.0})]})
OP_LEVEL_2 = plan_of(2, "1f1b", {0: _op_level({"layers.0": 0, "layers.1": 1}),
                                 1: [*_op_level({"layers.2": 2}), rule("layers.3.**", "recompute")]})
MIXED_2 = plan_of(2, "1f1b", {0: [*_op_level({"layers.0": 1}), d2d_rule("layers.1.**", {1: 1.0}, "0,2"),
                                  rule("layers.1.**", "host", "1,3"), rule("optim:layers.1", "host")],
                              1: [d2d_rule("layers.2.**", {0: 1.0}), rule("layers.3.**", "recompute"),
                                  d2d_rule("optim:*", {0: 1.0})]})
HOST_STEP_2 = plan_of(2, "1f1b", {0: [rule("layers.0.**", "host"), *_op_level({"layers.1": 0})],
                                  1: [d2d_rule("layers.2.**", {0: 1.0})]}, host_step=(1,))
INTERLEAVED = plan_of(2, "interleaved", {0: [*_op_level({"layers.0": 0}), OFFLOAD],
                                         1: [d2d_rule("layers.1.**", {0: 1.0})],
                                         2: [rule("layers.2.**", "host")],
                                         3: [rule("layers.3.**", "recompute"), d2d_rule("optim:*", {0: 1.0})]})
INTERLEAVED_HOST_STEP = plan_of(2, "interleaved", {0: [d2d_rule("layers.0.**", {1: 1.0})],
                                                   1: [*_op_level({"layers.1": 1}), OFFLOAD],
                                                   2: [rule("layers.2.**", "recompute")],
                                                   3: [rule("layers.3.**", "host")]}, host_step=(2,))
MIXED_4 = plan_of(4, "1f1b", {0: [d2d_rule("layers.0.**", {2: 0.75, 3: 0.25}), OFFLOAD],
                              1: [*_op_level({"layers.1": 0}), d2d_rule("optim:*", {3: 1.0})],
                              2: [rule("layers.2.**", "host")],
                              3: [rule("layers.3.**", "recompute"), OFFLOAD]})
HOST_STEP_4 = plan_of(4, "1f1b", {0: [rule("layers.0.**", "host")],
                                  1: [d2d_rule("layers.1.**", {0: 0.5, 2: 0.5})],
                                  2: [*_op_level({"layers.2": 2}), OFFLOAD],
                                  3: [rule("layers.3.**", "recompute")]}, host_step=(0, 3))
INTERLEAVED_4 = plan_of(4, "interleaved", {0: [rule("embed.**", "host"), OFFLOAD],
                                           1: [*_op_level({"layers.0": 1}), d2d_rule("optim:*", {2: 1.0})],
                                           2: [d2d_rule("layers.1.**", {0: 0.5, 3: 0.5})],
                                           4: [rule("layers.3.**", "recompute")],
                                           5: [rule("layers.4.**", "host"), OFFLOAD],
                                           6: [d2d_rule("layers.5.**", {1: 1.0})]}, host_step=(3,))
"""8 stages of one layer (embed, layers.0-5, head), s on rank s % 4."""

JOBS = {
    2: {
        "reference-1f1b": Job(2, reference=True),
        "reference-interleaved": Job(2, "interleaved", reference=True),
        "d2d": Job(2, plan=D2D_2),
        "op-level-recompute": Job(2, plan=OP_LEVEL_2),
        "plain-resumed-mid-decay": Job(2, resume_after=MID_DECAY),
        "mixed-resumed-mid-decay": Job(2, plan=MIXED_2, resume_after=MID_DECAY),
        "host-step-resumed-mid-decay": Job(2, plan=HOST_STEP_2, resume_after=MID_DECAY),
        "interleaved-plain": Job(2, "interleaved"),
        "interleaved-mixed": Job(2, "interleaved", plan=INTERLEAVED),
        "interleaved-mixed-resumed-mid-warmup": Job(2, "interleaved", plan=INTERLEAVED, resume_after=MID_WARMUP),
        "interleaved-host-step-resumed-mid-decay": Job(2, "interleaved", plan=INTERLEAVED_HOST_STEP,
                                                       resume_after=MID_DECAY),
    },
    4: {
        "reference-1f1b": Job(4, reference=True),
        "plain": Job(4),
        "mixed": Job(4, plan=MIXED_4),
        "mixed-resumed-mid-warmup": Job(4, plan=MIXED_4, resume_after=MID_WARMUP),
        "host-step-resumed-mid-decay": Job(4, plan=HOST_STEP_4, resume_after=MID_DECAY),
        "reference-interleaved": Job(4, "interleaved", reference=True),
        "interleaved-mixed": Job(4, "interleaved", plan=INTERLEAVED_4),
        "interleaved-mixed-resumed-mid-decay": Job(4, "interleaved", plan=INTERLEAVED_4, resume_after=MID_DECAY),
    },
}
CASES = [(world, name) for world, jobs in JOBS.items() for name in jobs if not name.startswith("reference")]


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[str, list[dict]]]:
    out = {}
    for world, jobs in JOBS.items():
        spawned = spawn(_worker, world, [job.plan for job in jobs.values()], list(jobs.values()), timeout_s=600)
        if spawned.errors:
            pytest.fail(f"{world} ranks failed: { {r: e.splitlines()[0] for r, e in spawned.errors.items()} }")
        out[world] = dict(zip(jobs, spawned.results))
    return out


def test_the_resume_points_are_mid_warmup_and_mid_decay():
    assert 0 < MID_WARMUP < SCHEDULE.warmup_steps
    assert SCHEDULE.warmup_steps < MID_DECAY < STEPS - 1
    assert SCHEDULE.min_lr < LR * SCHEDULE.factor(MID_DECAY) < LR * SCHEDULE.factor(SCHEDULE.warmup_steps) == LR


def test_every_technique_is_in_some_plan():
    plans = [job.plan for jobs in JOBS.values() for job in jobs.values() if job.plan is not None]
    techniques = {r.technique for p in plans for sp in p.stages for r in sp.rules}
    assert techniques >= {"recompute", "keep", "host", "d2d"}  # keep + recompute: op-level recompute
    assert any(r.tensor.startswith("optim:") and r.technique == t
               for p in plans for sp in p.stages for r in sp.rules for t in ("host", "d2d"))
    assert any(sp.optimizer_step == "host" for p in plans for sp in p.stages)
    assert {(job.world, job.schedule) for jobs in JOBS.values() for job in jobs.values()} == \
        {(2, "1f1b"), (2, "interleaved"), (4, "1f1b"), (4, "interleaved")}


@pytest.mark.parametrize("world,name", CASES, ids=[f"{w}-{n}" for w, n in CASES])
def test_runs_equal_the_torch_reference_bit_for_bit(runs, world, name):
    job = JOBS[world][name]
    refs = runs[world][f"reference-{job.schedule}"]
    for rank, (ref, run) in enumerate(zip(refs, runs[world][name])):
        assert run["losses"] == ref["losses"], rank
        assert run["lrs"] == ref["lrs"], rank
        assert ref["state"]["model"].keys() == run["state"]["model"].keys()
        for key, t in ref["state"]["model"].items():
            assert torch.equal(t, run["state"]["model"][key]), (rank, key)
        for key, per_param in ref["state"]["optimizer"]["state"].items():
            for part in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(per_param[part], run["state"]["optimizer"]["state"][key][part]), (rank, key, part)
        first = job.resume_after or 0  # the norms before a resume belong to the first job
        assert run["norms"][first:] == ref["norms"][first:], rank
        if run["executed"] is not None:
            executed, planned = run["executed"]
            assert executed == planned, rank
    if job.plan is not None:  # the plan did something: activations left the devices, layers were recomputed
        techniques = {r.technique for sp in job.plan.stages for r in sp.rules if not r.tensor.startswith("optim:")}
        assert (sum(r["swapped"] for r in runs[world][name]) > 0) == bool(techniques & {"host", "d2d"})
        assert (sum(r["recomputed"] for r in runs[world][name]) > 0) == ("recompute" in techniques)


def test_clipping_did_something_and_every_rank_agrees(runs):
    for world, jobs in runs.items():
        for name, per_rank in jobs.items():
            if name.startswith("reference"):
                norms = [r["norms"] for r in per_rank]
                assert all(n == norms[0] for n in norms), (world, name)
                assert all(n > MAX_NORM for n in norms[0]), (world, name, norms[0])
