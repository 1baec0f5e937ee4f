"""AdamW with parameter groups, a warmup + cosine learning-rate schedule and global-norm
gradient clipping, on 2 CPU (gloo) ranks in one spawn: every mpress run -- plain, under
plans with recompute, host swap, optimizer-state offload and the host optimizer step,
and resumed mid-warmup -- must equal bit for bit (`torch.equal`) a reference written
with torch alone: `PipelineStage` + `Schedule1F1B`, `torch.optim.AdamW` over the same
groups, `LambdaLR` with the schedule's factor, and the global norm summed over the ranks.
Then a non-finite gradient: the step is skipped on every rank and counted, and too many
in a row stop the run naming the step."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from mpress.config.model_config import ModelConfig, load_model_config
from mpress.contract.plan import Plan, TensorRule
from mpress.errors import UserError
from mpress.models import build_stage, lm_loss
from mpress.runtime.lr_schedule import LrSchedule
from mpress.runtime.trainer import JobSpec, PipelineJob
from tests.support.compare import assert_masters_equal, assert_states_equal
from tests.support.jobs import resumed
from tests.support.plans import pipeline_plan
from tests.support.spawn import spawn
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES, batch

WORLD = 2
STEPS = 5
NUM_MICROBATCHES = 2
SEED = 3
LR = 1e-2
WEIGHT_DECAY = 0.1
MAX_NORM = 0.5
"""Small enough that clipping scales the gradients of every step (checked)."""
SCHEDULE = LrSchedule(kind="cosine", lr=LR, total_steps=STEPS, warmup_steps=3, min_lr=1e-3)
OFFLOAD = TensorRule(tensor="optim:*", technique="host")


def rule(tensor: str, technique: str) -> TensorRule:
    return TensorRule(tensor=tensor, technique=technique)


def model(precision: str) -> ModelConfig:
    return dataclasses.replace(load_model_config(MODEL), precision=precision)


def plan_of(rules: dict[int, list[TensorRule]], host_step: tuple[int, ...] = (), precision: str = "fp32") -> Plan:
    return pipeline_plan("1f1b", WORLD, NUM_MICROBATCHES, rules, host_step=host_step, model=model(precision))


@dataclasses.dataclass(frozen=True)
class Job:
    plan: Plan | None = None
    reference: bool = False
    """Run the torch-only reference instead of mpress."""
    resume_after: int | None = None
    """Save the state after this many steps, build a new job, load it and go on."""
    poison: tuple[int, ...] = ()
    """Steps at which rank 0 makes one gradient infinite."""
    max_skipped_steps: int = 3
    precision: str = "fp32"
    """bf16: half-precision parameters, fp32 masters (device masters, offloaded, host copies)."""


def spec(job: Job) -> JobSpec:
    return JobSpec(model=model(job.precision), schedule="1f1b", ranges=RANGES[WORLD],
                   microbatch_size=MICROBATCH_SIZE, num_microbatches=NUM_MICROBATCHES, seed=SEED, lr=LR,
                   betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY, optimizer="adamw", lr_schedule=SCHEDULE,
                   clip_grad_norm=MAX_NORM, max_skipped_steps=job.max_skipped_steps)


# ---- the reference: torch alone ----------------------------------------------------------

def _reference(rank: int) -> dict:
    """gpt-tiny's stage `rank` under torch's 1F1B, AdamW (no decay on 1-D parameters and
    embeddings: the default groups on this model), LambdaLR and a hand-written global clip."""
    cfg = load_model_config(MODEL)
    device = torch.device("cpu")
    torch.manual_seed(7 + rank)  # dropout draws: per rank, as in the mpress runs (seeded before building)
    start, end = RANGES[WORLD][rank]
    module = build_stage(cfg, start, end, seed=SEED, device=device)
    module.train()
    b, t = MICROBATCH_SIZE, cfg.seq_len
    first, last = rank == 0, rank == WORLD - 1
    x = (torch.zeros(b, t, dtype=torch.long) if first
         else torch.zeros(b, t, cfg.hidden_size, requires_grad=True))
    y = torch.zeros(b, t, cfg.vocab_size if last else cfg.hidden_size, requires_grad=True)
    stage = PipelineStage(module, rank, WORLD, device, input_args=x, output_args=y)
    schedule = Schedule1F1B(stage, NUM_MICROBATCHES, loss_fn=lm_loss)
    named = list(module.named_parameters())
    exempt = [p for n, p in named if p.dim() < 2 or n.startswith("embed.")]
    decay = [p for n, p in named if not (p.dim() < 2 or n.startswith("embed."))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": exempt, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, SCHEDULE.factor)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, targets = batch(step, NUM_MICROBATCHES)
        out: list[torch.Tensor] = []
        if first:
            schedule.step(inputs, return_outputs=False)
        else:
            schedule.step(target=targets, losses=out, return_outputs=False)
        params = [p for _n, p in named]
        total = torch.zeros(1)
        for p in params:
            n = torch.linalg.vector_norm(p.grad, 2, dtype=torch.float32)
            total += n * n
        dist.all_reduce(total)
        norm = torch.sqrt(total[0])
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(float(torch.stack(out).mean()) if out else None)
        norms.append(float(norm))
    state = {"model": {n: p.detach().clone() for n, p in module.state_dict().items()},
             "optimizer": {"state": {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in named}}}
    return {"losses": losses, "norms": norms, "state": state}


# ---- mpress -----------------------------------------------------------------------------

def _poison_hook(grad: torch.Tensor) -> torch.Tensor:
    return torch.full_like(grad, math.inf)


def _run(job: Job, plan_path: str | None, rank: int) -> dict:
    s = spec(job)
    plan = Plan.load(plan_path) if plan_path else None
    torch.manual_seed(7 + rank)
    pj = PipelineJob(s, plan, torch.device("cpu"))
    losses, norms, skipped, states = [], [], [], []
    try:
        for step in range(STEPS):
            if step == job.resume_after:
                pj = resumed(pj, lambda: PipelineJob(s, plan, torch.device("cpu")), step)
            hook = None
            if rank == 0 and step in job.poison:
                hook = next(pj.modules[0].parameters()).register_hook(_poison_hook)
            x, y = batch(step, NUM_MICROBATCHES)
            result = pj.step(x, y)
            if hook is not None:
                hook.remove()
            losses.append(result.loss)
            norms.append(result.grad_norm)
            skipped.append(result.skipped)
            if job.poison:
                states.append(pj.state())
    except UserError as exc:
        pj.close()
        return {"error": str(exc), "skipped": skipped}
    out = {"losses": losses, "norms": norms, "skipped": skipped, "state": pj.state(), "states": states,
           "skipped_total": pj.guard.skipped_total, "executed": None}
    if pj.program is not None:
        out["executed"] = ([str(a) for a in pj.program.last_log], [str(a) for a in pj.program.actions])
    pj.close()
    return out


def _worker(rank: int, world: int, plan_paths: list[str | None], jobs: list[Job]):
    for job, path in zip(jobs, plan_paths):
        yield _reference(rank) if job.reference else _run(job, path, rank)


JOBS = {
    "reference": Job(reference=True),
    "plain": Job(),
    "plain-resumed-mid-warmup": Job(resume_after=2),
    "recompute-swap-offload": Job(plan=plan_of({0: [rule("layers.0.**", "recompute"), rule("layers.1.**", "host"),
                                                    OFFLOAD],
                                                1: [rule("layers.2.**", "recompute"), rule("layers.3.**", "host"),
                                                    OFFLOAD]})),
    "host-step-and-offload": Job(plan=plan_of({0: [rule("layers.0.**", "recompute"), rule("layers.1.**", "host")],
                                               1: [OFFLOAD]}, host_step=(0,))),
    "host-step-resumed-mid-warmup": Job(plan=plan_of({1: [rule("layers.2.**", "host")]}, host_step=(0, 1)),
                                        resume_after=1),
    "bf16-plain": Job(precision="bf16"),
    "bf16-host-step-and-offload": Job(precision="bf16", plan=plan_of(
        {0: [rule("layers.0.**", "recompute"), rule("layers.1.**", "host")], 1: [OFFLOAD]}, host_step=(0,),
        precision="bf16")),
    "non-finite-skipped": Job(plan=plan_of({0: [OFFLOAD], 1: [rule("layers.3.**", "recompute")]}, host_step=(1,)),
                              poison=(1,)),
    "non-finite-stops": Job(poison=(1, 2, 3), max_skipped_steps=2),
    # the counts of skipped steps are part of the saved state: a resume counts on
    "non-finite-skipped-resumed": Job(plan=plan_of({0: [OFFLOAD], 1: [rule("layers.3.**", "recompute")]},
                                                   host_step=(1,)), poison=(1,), resume_after=3),
    "non-finite-stops-resumed": Job(poison=(1, 2, 3), max_skipped_steps=2, resume_after=2),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    spawned = spawn(_worker, WORLD, [job.plan for job in JOBS.values()], list(JOBS.values()), timeout_s=600)
    if spawned.errors:
        pytest.fail(f"ranks failed: { {r: e.splitlines()[0] for r, e in spawned.errors.items()} }")
    return dict(zip(JOBS, spawned.results))


def assert_equal_to_reference(ref: dict, run: dict) -> None:
    assert run["losses"] == ref["losses"]
    for name, t in ref["state"]["model"].items():
        assert torch.equal(t, run["state"]["model"][name]), name
    for name, per_param in ref["state"]["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(per_param[key], run["state"]["optimizer"]["state"][name][key]), (name, key)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "plain-resumed-mid-warmup", "recompute-swap-offload",
                                  "host-step-and-offload", "host-step-resumed-mid-warmup"])
def test_runs_equal_the_torch_reference_bit_for_bit(runs, name):
    for rank, (ref, run) in enumerate(zip(runs["reference"], runs[name])):
        assert_equal_to_reference(ref, run)
        assert run["skipped"] == [False] * STEPS, rank
        if name.endswith("resumed-mid-warmup"):
            continue  # the norms of the steps before the resume belong to the first job
        assert run["norms"] == ref["norms"], rank  # the same float on every rank, and as torch's
        if run["executed"] is not None:
            executed, planned = run["executed"]
            assert executed == planned, rank


@pytest.mark.slow
def test_bf16_masters_offloaded_or_on_the_host_take_the_device_masters_update(runs):
    """Under bf16 the gradients are clipped in bf16 and the fp32 masters stepped: the run
    that offloads stage 1's masters and steps stage 0 on the host equals the plain one
    (device masters) bit for bit, masters included."""
    for rank, (plain, run) in enumerate(zip(runs["bf16-plain"], runs["bf16-host-step-and-offload"])):
        assert run["losses"] == plain["losses"] and run["norms"] == plain["norms"], rank
        assert_states_equal(plain["state"], run["state"])
        assert_masters_equal(plain["state"], run["state"])
        assert plain["state"]["masters"], rank


@pytest.mark.slow
def test_clipping_and_the_schedule_did_something(runs):
    """The comparison is not vacuous: every step's norm is over the threshold (clipping
    scaled the gradients), and both ranks agree on it."""
    norms = [r["norms"] for r in runs["reference"]]
    assert norms[0] == norms[1]
    assert all(n > MAX_NORM for n in norms[0]), norms[0]


@pytest.mark.slow
def test_a_non_finite_gradient_skips_the_step_on_every_rank(runs):
    for rank, run in enumerate(runs["non-finite-skipped"]):
        assert run["skipped"] == [False, True, False, False, False], rank
        assert run["skipped_total"] == 1
        assert math.isinf(run["norms"][1]) and all(math.isfinite(n) for i, n in enumerate(run["norms"]) if i != 1)
        before, after = run["states"][0], run["states"][1]  # the skipped step changed nothing
        for name, t in before["model"].items():
            assert torch.equal(t, after["model"][name]), (rank, name)
        for name, per_param in before["optimizer"]["state"].items():
            for key, v in per_param.items():
                assert torch.equal(v, after["optimizer"]["state"][name][key]), (rank, name, key)
        assert not torch.equal(run["states"][2]["model"]["layers.2.ln1.weight" if rank else "embed.tok.weight"],
                               after["model"]["layers.2.ln1.weight" if rank else "embed.tok.weight"])


@pytest.mark.slow
def test_too_many_skips_in_a_row_stop_every_rank_naming_the_step(runs):
    for run in runs["non-finite-stops"]:
        assert run["skipped"] == [False, True]  # step 1 skipped, step 2 the second in a row
        assert run["error"].startswith("step 2: the gradient norm is inf, non-finite gradients on stage 0, 2 steps in "
                                       "a row (steps 1, 2 skipped)"), run["error"]


@pytest.mark.slow
def test_a_resume_counts_the_skipped_steps_on_as_an_uninterrupted_run(runs):
    """Resumed after the skipped step 1 (at 3), the run ends with the same state and count
    as the uninterrupted one; resumed between two skips in a row (at 2), it stops at the
    same step with the same line: the consecutive count came back too."""
    for rank, (whole, run) in enumerate(zip(runs["non-finite-skipped"], runs["non-finite-skipped-resumed"])):
        assert run["skipped"] == [False, True, False, False, False], rank
        assert run["skipped_total"] == whole["skipped_total"] == 1, rank
        assert_states_equal(whole["state"], run["state"])
        assert run["state"]["skips"] == whole["state"]["skips"] == \
            {"skipped_total": 1, "consecutive": 0, "skipped_steps": [1]}, rank
    for whole, run in zip(runs["non-finite-stops"], runs["non-finite-stops-resumed"]):
        assert run["skipped"] == whole["skipped"] and run["error"] == whole["error"]
