"""The own-loop API in one process (a world-1 gloo group): a user's AdamW and LambdaLR,
wrapped, under a one-stage plan that offloads optimizer state and keeps activations on the
host, train bit for bit as the same loop without mpress; a checkpoint through
`torch.distributed.checkpoint` resumes exactly; and what the loop cannot carry out is
refused at wrap time in one line. The multi-rank runs of the example are in
`test_own_loop_runs.py`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.optim.lr_scheduler import LambdaLR

import mpress.own_loop as mpress
from examples.own_loop.model import CLASSES, MICROBATCH, Net, loss
from mpress.errors import PlanError, UserError
from tests.support.plans import OWN_LOOP, own_loop_plan, rule

STEPS = 4


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """One stage holding the whole example model: its optimizer data offloaded to the host
    (every layer) and two blocks' activations swapped to the host, one recomputed; and the
    same with the optimizer stepped on the host."""
    out = tmp_path_factory.mktemp("plans")
    rules = {0: [rule("optim:*", "host"), rule("blocks.1.**", "host"), rule("blocks.2.**", "host"),
                 rule("blocks.3.**", "recompute")]}
    return {"offload": own_loop_plan(out / "offload.yaml", 1, rules),
            "host_step": own_loop_plan(out / "host_step.yaml", 1, {0: rules[0][1:]}, host_step=(0,)),
            "none": own_loop_plan(out / "none.yaml", 1, {})}


def factor(step: int) -> float:
    return (step + 1) / 3 if step < 2 else 0.5 * (1.0 + math.cos(math.pi * (step - 2) / (STEPS - 3)))


class Loop:
    """The user's loop on one rank, with or without mpress."""

    def __init__(self, plan, dtype: torch.dtype = torch.float32) -> None:
        torch.manual_seed(0)
        self.module = Net().to(dtype)
        self.plan, self.dtype = plan, dtype
        x = torch.zeros(MICROBATCH, dtype=dtype)
        y = torch.zeros(*MICROBATCH[:2], CLASSES, dtype=dtype, requires_grad=True)
        if plan is None:
            self.stage = PipelineStage(self.module, 0, 1, torch.device("cpu"), input_args=x, output_args=y)
        else:
            self.stage = mpress.apply_mpress(self.module, plan, 0, device="cpu", input_args=x, output_args=y)
        decay = [p for p in self.module.parameters() if p.dim() >= 2]
        rest = [p for p in self.module.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                      lr=0.01)
        self.optimizer = optimizer if plan is None else mpress.wrap_optimizer(optimizer, self.stage)
        self.scheduler = LambdaLR(self.optimizer, factor)
        fn = lambda out, _t: loss(out)
        self.schedule = Schedule1F1B(self.stage, 4, loss_fn=fn if plan is None else self.stage.route_loss(fn))

    def run(self, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(step)
            x = torch.randn((MICROBATCH[0] * 4, *MICROBATCH[1:]), generator=g).to(self.dtype)
            self.optimizer.zero_grad()
            self.schedule.step(x, target=torch.zeros(x.shape[0]))
            self.optimizer.step()
            self.scheduler.step()

    def state(self) -> dict:
        return {"model": self.module.state_dict(), "optim": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def close(self) -> None:
        if self.plan is not None:
            mpress.close([self.stage])
            self.optimizer.close()


def params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("kind", ["offload", "host_step"])
def test_wrapped_loop_equals_the_plain_loop_and_resumes_exactly(group, plans, kind, tmp_path):
    plain = Loop(None)
    whole = Loop(plans[kind])
    # the scheduler set the first step's rate in the user's groups, which the wrapper shares
    assert whole.optimizer.param_groups[0]["lr"] == plain.optimizer.param_groups[0]["lr"] == 0.01 * factor(0)
    plain.run(range(STEPS))
    whole.run(range(STEPS))
    want = params(plain.module)
    assert want.keys() == params(whole.module).keys()
    assert all(torch.equal(want[n], p) for n, p in params(whole.module).items())
    assert whole.scheduler.get_last_lr() == plain.scheduler.get_last_lr()
    # the offloaded states are away between steps, yet the state dict has them all
    saved = whole.optimizer.state_dict()
    offloaded = whole.optimizer._rank.offloads
    assert bool(offloaded) == (kind == "offload")
    if offloaded:
        assert all("exp_avg" not in whole.optimizer.state[t] for t in whole.optimizer.state)
    plain_state = plain.optimizer.state_dict()["state"]  # torch's: by index, in group order
    by_name = {n: plain_state[i] for i, n in enumerate(_group_names(plain, 0) + _group_names(plain, 1))}
    for name, st in saved["state"].items():
        assert all(torch.equal(st[k], by_name[name][k]) for k in ("exp_avg", "exp_avg_sq", "step")), name
    whole.close()

    # a checkpoint after 2 steps through torch.distributed.checkpoint, resumed in a new loop
    first = Loop(plans[kind])
    first.run(range(2))
    dcp.save(first.state(), checkpoint_id=tmp_path / "ckpt")
    first.close()
    resumed = Loop(plans[kind])
    template = resumed.state()  # a fresh loop's state dict: Adam's start, the shape dcp fills
    assert all(float(st["step"]) == 0 for st in template["optim"]["state"].values())
    dcp.load(template, checkpoint_id=tmp_path / "ckpt")
    resumed.module.load_state_dict(template["model"])
    resumed.optimizer.load_state_dict(template["optim"])
    resumed.scheduler.load_state_dict(template["scheduler"])
    assert resumed.optimizer.param_groups[0]["lr"] == 0.01 * factor(2)  # the saved rate, as torch's load does
    resumed.run(range(2, STEPS))
    assert all(torch.equal(want[n], p) for n, p in params(resumed.module).items())
    resumed.close()


def test_bf16_master_weights_offloaded_or_stepped_on_the_host_change_nothing(group, plans, tmp_path):
    """Under bf16 the wrapped optimizer steps fp32 masters (the user's AdamW, retargeted):
    kept on the device, offloaded with the optimizer states between steps, or stepped on
    the host, the parameters, masters and states are the same bits; a checkpoint carries
    the masters and resumes exactly."""
    runs = {}
    for kind in ("none", "offload", "host_step"):
        loop = Loop(plans[kind], torch.bfloat16)
        loop.run(range(STEPS))
        runs[kind] = (params(loop.module), loop.optimizer.state_dict())
        loop.close()
    want, want_state = runs["none"]
    assert set(want_state["masters"]) == set(want) and all(p.dtype == torch.bfloat16 for p in want.values())
    for kind in ("offload", "host_step"):
        got, state = runs[kind]
        assert all(torch.equal(want[n], p) for n, p in got.items()), kind
        assert all(torch.equal(want_state["masters"][n], m) for n, m in state["masters"].items()), kind
        assert all(torch.equal(want_state["state"][n][k], v) for n, st in state["state"].items()
                   for k, v in st.items()), kind
    first = Loop(plans["offload"], torch.bfloat16)
    first.run(range(2))
    dcp.save(first.state(), checkpoint_id=tmp_path / "ckpt")
    first.close()
    resumed = Loop(plans["offload"], torch.bfloat16)
    template = resumed.state()
    dcp.load(template, checkpoint_id=tmp_path / "ckpt")
    resumed.module.load_state_dict(template["model"])
    resumed.optimizer.load_state_dict(template["optim"])
    resumed.scheduler.load_state_dict(template["scheduler"])
    resumed.run(range(2, STEPS))
    assert all(torch.equal(want[n], p) for n, p in params(resumed.module).items())
    assert all(torch.equal(want_state["masters"][n], m)
               for n, m in resumed.optimizer.state_dict()["masters"].items())
    resumed.close()


def _group_names(loop: Loop, g: int) -> list[str]:
    name_of = {id(p): n for n, p in loop.module.named_parameters()}
    return [name_of[id(p)] for p in loop.optimizer.param_groups[g]["params"]]


def _wrap(plans, make_optimizer):
    torch.manual_seed(0)
    module = Net()
    x, y = torch.zeros(MICROBATCH), torch.zeros(*MICROBATCH[:2], CLASSES, requires_grad=True)
    stage = mpress.apply_mpress(module, plans["offload"], 0, device="cpu", input_args=x, output_args=y)
    try:
        return mpress.wrap_optimizer(make_optimizer(module), stage)
    finally:
        mpress.close([stage])


def _stepped(module):
    opt = torch.optim.AdamW(module.parameters())
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return opt


@pytest.mark.parametrize("make,says", [
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "SGD is not Adam or AdamW"),
    (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), "amsgrad=True"),
    (_stepped, "has stepped already"),
    (lambda m: torch.optim.AdamW(list(m.parameters())[1:]), "parameter embed.weight is in no parameter group"),
])
def test_an_optimizer_the_plan_cannot_drive_is_refused_in_one_line(group, plans, make, says):
    with pytest.raises(UserError) as e:
        _wrap(plans, make)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_plan_without_a_program_or_for_another_world_is_refused_in_one_line(group, plans, tmp_path):
    import dataclasses

    bare = tmp_path / "bare.yaml"
    dataclasses.replace(plans["offload"], actions=[]).save(bare)
    with pytest.raises(PlanError, match="no program") as e:
        mpress.load_plan(bare)
    assert "\n" not in str(e.value)
    two = own_loop_plan(tmp_path / "two.yaml", 2, {})
    x = torch.zeros(MICROBATCH)
    with pytest.raises(PlanError, match="made for 2 ranks, this job has 1") as e:
        mpress.apply_mpress(Net().keep(["embed", "blocks.0", "blocks.1", "blocks.2"]), two, 0, device="cpu",
                            input_args=x, output_args=x)
    assert "\n" not in str(e.value)
    with pytest.raises(PlanError, match="made for microbatches of 2, the stage's example input holds 4") as e:
        mpress.apply_mpress(Net(), plans["offload"], 0, device="cpu", input_args=torch.zeros(4, 8, 16),
                            output_args=torch.zeros(4, 8, CLASSES))
    assert "\n" not in str(e.value)
    with pytest.raises(PlanError, match="the stage module holds 3 layers") as e:  # not the plan's stage
        mpress.apply_mpress(Net().keep(["embed", "blocks.0", "blocks.1"]), plans["offload"], 0, device="cpu",
                            input_args=x, output_args=x)
    assert "\n" not in str(e.value)


def test_the_readme_diff_is_the_examples_mpress_lines_in_full():
    """README.md's diff for a loop of your own: its `+` lines are the example's lines marked
    `# mpress` (all of them, but the `if plan is not None:` that lets one script run both
    ways), its `-` lines the example's lines without mpress, its context lines the
    example's own."""
    readme = (OWN_LOOP.parents[1] / "README.md").read_text()
    section = readme.split("## Your own training loop", 1)[1]
    diff = section.split("```diff\n", 1)[1].split("```", 1)[0].splitlines()
    code = [(line.split("  # mpress")[0].strip(), "  # mpress" in line)
            for line in (OWN_LOOP / "train.py").read_text().splitlines()]

    def marked(text: str) -> set[bool]:
        return {m for c, m in code if c.startswith(text)}

    added = [d[1:].strip() for d in diff if d.startswith("+")]
    for d in diff:
        text = d[1:].strip()
        if d.strip() == "...":
            continue
        assert marked(text), f"not in train.py: {d}"
        if d.startswith("+"):
            assert True in marked(text), f"not marked # mpress in train.py: {d}"
        if d.startswith("-"):
            assert False in marked(text), f"train.py runs this only with mpress: {d}"
    for c, m in code:
        if m and not c.startswith("if plan is not None"):
            assert any(c.startswith(a) for a in added), f"train.py's mpress line missing from the README diff: {c}"


@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 12),
                    reason="torch 2.11's schedules send stage 0's shapes to stage 1 at start-up even "
                           "when both are this rank's (a world of one here), and gloo has no pair to itself; "
                           "on several ranks a rank's stages are never neighbours")
@pytest.mark.parametrize("name", ["interleaved", "zbv"])
def test_a_rank_of_two_stages_walks_one_program(group, plans, tmp_path, name):
    """Interleaved 1F1B, and ZB-V (its backwards split into I and W), with both stages on
    one rank: `rank_program` shared by the two `apply_mpress` calls, one wrapped
    optimizer over both stages (optimizer offload on one, the host step on the other) --
    the same parameters as the plain loop."""
    import copy

    from torch.distributed.pipelining import (
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    plan = own_loop_plan(tmp_path / f"{name}.yaml", 1,
                        {0: [rule("optim:*", "host"), rule("blocks.0.**", "host")], 1: [rule("blocks.4.**", "recompute")]},
                        host_step=(1,), num_stages=2, schedule=name)
    torch.manual_seed(0)
    model = Net()
    layers = model.layer_names()
    modules = [copy.deepcopy(model).keep(layers[:4]), copy.deepcopy(model).keep(layers[4:])]
    program = mpress.rank_program(plan)
    x = torch.zeros(MICROBATCH)
    ys = [torch.zeros(MICROBATCH, requires_grad=True), torch.zeros(*MICROBATCH[:2], CLASSES, requires_grad=True)]
    stages = [mpress.apply_mpress(m, plan, s, device="cpu", input_args=x.requires_grad_(s > 0), output_args=ys[s],
                                  program=program) for s, m in enumerate(modules)]
    with pytest.raises(PlanError, match="steps the optimizer of stage 1, which was not passed") as e:
        mpress.wrap_optimizer(torch.optim.AdamW(modules[0].parameters()), stages[0])
    assert "\n" not in str(e.value)
    optimizer = mpress.wrap_optimizer(torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=0.01),
                                      stages)
    torch_schedule = ScheduleZBVZeroBubble if name == "zbv" else ScheduleInterleaved1F1B
    schedule = torch_schedule(stages, 4, loss_fn=stages[-1].route_loss(lambda out, _t: loss(out)))
    reference = Loop(None)  # the plain loop, with the optimizer used here: one group, a constant rate
    reference.optimizer = torch.optim.AdamW(reference.module.parameters(), lr=0.01)
    reference.scheduler = LambdaLR(reference.optimizer, lambda _s: 1.0)
    reference.run(range(STEPS))
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        optimizer.zero_grad()
        schedule.step(torch.randn((MICROBATCH[0] * 4, *MICROBATCH[1:]), generator=g), target=torch.zeros(8))
        optimizer.step()
    got = {n: p for m in modules for n, p in params(m).items()}
    want = params(reference.module)
    assert got.keys() == want.keys() and all(torch.equal(want[n], p) for n, p in got.items())
    mpress.close(stages)
    optimizer.close()
