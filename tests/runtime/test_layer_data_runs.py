"""Layers whose working parameters and gradients live in host memory (`param:LAYER` and
`grad:LAYER` host rules, `mpress/runtime/layer_data`) train as plain pipelining does:
on 2 and 4 CPU (gloo) ranks, under 1F1B, GPipe and (on 2) interleaved 1F1B, plans
keeping a random choice of each stage's layers' parameters and gradients on the host
(every stage stepping on the host, as the rules need) give losses and a final state `torch.equal` to plain pipelining's
(bf16, dropout on), hold none of those parameters' bytes on the device once started,
execute their program action for action (its fetches, evictions and drains included),
and measure on each rank's stand-in device (every byte, counted from construction) at
most the stage's predicted peak and at least 90% of it."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

from mpress.config.model_config import load_model_config
from mpress.contract.actions import Kind, UnitId, UnitKind
from mpress.contract.plan import Plan, TensorRule
from mpress.contract.plan_check import check_plan
from mpress.errors import PlanError
from mpress.launcher.job import start_job
from mpress.runtime.layer_data.host_layers import refuse_unrun
from mpress.runtime.trainer import JobSpec
from tests.support.compare import assert_states_equal
from tests.support.jobs import resumed, run_steps
from tests.support.plans import one_line, pipeline_plan
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
SCHEDULES = ("1f1b", "gpipe", "1f1b", "interleaved")
"""Per variant; interleaved 1F1B (two stages per rank) on 2 ranks only (the tiny model
has no split into 8 stages)."""
MIXED = 2
"""The variant whose plan also moves activations (host swap or recompute of a block per
stage) and which stops after its first step and resumes from its state."""
PRECISION = "bf16"
LAYERS = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]


def model():
    return dataclasses.replace(load_model_config(MODEL), precision=PRECISION)


def schedules(world: int) -> tuple[str, ...]:
    return SCHEDULES if world == 2 else SCHEDULES[:3]


def random_rules(stages: int, seed: int, activations: bool = False) -> dict[int, list[TensorRule]]:
    """Per stage, `param:`/`grad:` host rules for a random non-empty choice of its layers
    (each stage's parameters and gradients both leave the device somewhere); with
    `activations`, one block's saved tensors swapped to the host or recomputed too."""
    rng = random.Random(seed)
    rules = {}
    for s, (start, end) in enumerate(RANGES[stages]):
        layers = LAYERS[start:end]
        blocks = [x for x in layers if x.startswith("layers.")]
        moved = [TensorRule(tensor=f"{rng.choice(blocks)}.**", technique=rng.choice(["host", "recompute"]))] \
            if activations and blocks else []
        params = rng.sample(layers, rng.randint(1, len(layers)))
        grads = rng.sample(layers, rng.randint(1, len(layers)))
        rules[s] = moved + [TensorRule(tensor=f"param:{x}", technique="host") for x in sorted(params)] + \
                   [TensorRule(tensor=f"grad:{x}", technique="host") for x in sorted(grads)]
    return rules


def plans_for(world: int) -> list[Plan | None]:
    """Per schedule: plain pipelining, then the layer-data plan."""
    out: list[Plan | None] = []
    for k, schedule in enumerate(schedules(world)):
        out.append(None)
        out.append(pipeline_plan(schedule, world, NUM_MICROBATCHES, random_rules(num_stages_of(schedule, world), 11 * world + k, k == MIXED),
                                 model=model(), host_step=tuple(range(num_stages_of(schedule, world)))))
    return out


def _worker(rank: int, world: int, plan_paths: list[str | None]):
    for k, path in enumerate(plan_paths):
        schedule = SCHEDULES[k // 2]
        spec = JobSpec(model=model(), schedule=schedule, ranges=RANGES[num_stages_of(schedule, world)],
                       microbatch_size=MICROBATCH_SIZE,
                       num_microbatches=NUM_MICROBATCHES, seed=3)
        plan = Plan.load(path) if path else None
        torch.manual_seed(7 + rank)  # dropout draws: per rank, the same in every run
        job = start_job(spec, plan, torch.device("cpu"))
        first = None
        if plan is not None and k // 2 == MIXED:  # one step, then resumed from its state (held on the host)
            first = run_steps(job, plan, lambda step: batch(step, NUM_MICROBATCHES), 1)
            job = resumed(job, functools.partial(start_job, spec, plan, torch.device("cpu")), 1)
        # after start-up the host layers' parameters hold no device bytes, as counted
        kept = [p for rt in job.runtimes if rt.layer_data is not None
                for layer in rt.layer_data.param_layers for _n, p in rt.layer_data.params[layer]]
        counted = job.live.storage_bytes()
        startup_held = sum(counted.get(p.untyped_storage()._cdata, -1) for p in kept)
        steps = range(1, STEPS) if first is not None else range(STEPS)
        result = run_steps(job, plan, lambda step, steps=steps: batch(steps[step], NUM_MICROBATCHES), len(steps))
        if first is not None:
            result["losses"] = first["losses"] + result["losses"]
            result["peaks"] = first["peaks"] + result["peaks"]
        result["startup"] = job.startup_peak_bytes
        if rank == 0:  # a forward outside the program (an evaluation's) fetches what it needs and drops it again
            job.modules[0].eval()
            with torch.no_grad():
                result["evaluated"] = job.modules[0](batch(STEPS, NUM_MICROBATCHES)[0][:MICROBATCH_SIZE])
            result["held_after"] = sum(p.untyped_storage().nbytes() for p in kept)
        result["kept"], result["startup_held"] = len(kept), startup_held
        job.close()
        yield result


def test_the_runtime_runs_layer_data_plans():
    """The runtime check no longer refuses them (it refused them before it could run them)."""
    plan = plans_for(2)[1]
    check_plan(plan, runtime=True)
    moves = {(a.kind, UnitId.parse(a.tensor).kind) for r in range(2) for a in plan.program(r)
             if a.microbatch is not None and a.tensor and a.kind in (Kind.SI, Kind.SO)}
    assert moves == {(Kind.SI, UnitKind.PARAMS), (Kind.SO, UnitKind.PARAMS), (Kind.SO, UnitKind.GRADS)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_layer_data_plans_equal_plain_pipelining_and_their_predicted_peaks(world):
    plans = plans_for(world)
    spawned = spawn(_worker, world, plans)
    assert not spawned.errors, spawned.errors
    for k in range(0, len(plans), 2):
        plain, planned, plan = spawned.results[k], spawned.results[k + 1], plans[k + 1]
        for r in range(world):
            assert planned[r]["losses"] == plain[r]["losses"], (plan.schedule, r)
            assert_states_equal(planned[r]["state"], plain[r]["state"])
            assert planned[r]["extra"]["log"] == plan.actions[r], f"{plan.schedule}: rank {r} did not run its program"
            assert planned[r]["kept"] > 0 and planned[r]["startup_held"] == 0, (plan.schedule, r)
            predicted = plan.stages[r].predicted_peak_bytes
            measured, during = max(p for p in planned[r]["peaks"])
            assert 0.9 * predicted <= measured <= predicted, (plan.schedule, r, measured, predicted, during)
        assert torch.equal(planned[0]["evaluated"], plain[0]["evaluated"]) and planned[0]["held_after"] == 0


@pytest.mark.parametrize("job", [{"clipping": True}, {"replicas": True}, {"tied": True}])
def test_jobs_reading_device_gradients_refuse_host_sums(job):
    """Clipping, replicas' averaging and tied weights read the gradients on the device,
    where a `grad:` host rule no longer keeps them: refused in one line naming the rule."""
    plan = plans_for(2)[1]
    kw = {"clipping": False, "replicas": False, "tied": False, **job}
    with pytest.raises(PlanError) as info:
        refuse_unrun(plan, **kw)
    assert ".rules[" in one_line(info.value) and "grad:" in one_line(info.value)
    refuse_unrun(plan, clipping=False, replicas=False, tied=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_host_sums_are_scaled_with_the_devices_rounding(dtype):
    """torch's `scale_grads` divides each gradient by the microbatch count on its device;
    the host sums of a `grad:` layer are divided on the host with that device's rounding:
    on a CPU the division itself, on a GPU the product by the scalar's reciprocal that
    CUDA's kernel computes (which differs from the division by one bit for some values)."""
    from mpress.runtime.layer_data.host_layers import _divide_as_on
    values = torch.linspace(-3, 3, 4097, dtype=torch.float64).to(dtype)
    for factor in (3, 7, 12):
        cpu = values.clone()
        _divide_as_on(torch.device("cpu"), cpu, factor)
        assert torch.equal(cpu, values / factor)
        gpu = values.clone()
        _divide_as_on(torch.device("cuda", 0), gpu, factor)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        inv = (torch.tensor(1.0, dtype=acc) / factor)
        assert torch.equal(gpu, (values.to(acc) * inv).to(dtype))
    if torch.cuda.is_available():  # against the kernel itself
        for factor in (3, 7, 12):
            host = values.clone()
            _divide_as_on(torch.device("cuda", 0), host, factor)
            assert torch.equal(host, values.cuda().div_(factor).cpu())
