"""A split backward (I, then W) in the profile, the memory model, the emulator and the
rewriter: times split by FLOPs, what W reads kept from I to W, W off the critical path
between stages, and memory actions placed around the I."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.distributed.pipelining._backward import (
    stage_backward_input,
    stage_backward_weight,
)

from mpress.config.model_config import load_model_config
from mpress.config.vocabulary import ScheduleName
from mpress.contract.actions import Action, Kind, UnitId
from mpress.contract.plan import Stripe
from mpress.contract.selective import run_recomputed
from mpress.hardware.server import load_hardware
from mpress.models.transformer import build_stage
from mpress.static.emulate.program import Cost, walk_peaks
from mpress.static.memory.model import memory_model
from mpress.static.memory.stage_costs import stage_costs
from mpress.static.memory.stage_memory import (
    backward_steps,
    split_backward_steps,
    weight_grad_bytes,
)
from mpress.static.plan.evaluate import evaluate, setup_pipeline
from mpress.static.plan.plan_eval import evaluate_plan
from mpress.static.profile.analytic import analytic_profile
from tests.support.plans import rule
from tests.support.rewriter import FWD, Case

A100 = load_hardware("dgx-a100")


def test_analytic_profile_splits_by_flops() -> None:
    cfg = load_model_config("gpt-small")
    prof = analytic_profile(cfg, A100, 2)
    block = prof.layers[1]
    b, t, h, f = 2, cfg.seq_len, cfg.hidden_size, cfg.ffn
    projections = 2 * b * t * (4 * h * h + 2 * h * f)
    assert block.weight_grad_flops == projections
    # attention's products have no weights: the input-gradient half is the larger one
    assert block.weight_grad_time_s == pytest.approx(block.backward_time_s * projections / block.backward_flops)
    assert block.input_grad_time_s > block.weight_grad_time_s > 0
    # what the weight gradients read: the four linears' inputs
    assert sorted(x.what for x in block.saved if x.weight_grad) == [
        "attention output projection input", "fc1 input", "fc2 input", "qkv input"]
    assert weight_grad_bytes(block) == (3 * b * t * h + b * t * f) * cfg.dtype_bytes
    # a profile without the split (a measured one) takes half and half
    unsplit = replace(block, weight_grad_flops=-1.0)
    assert unsplit.weight_grad_time_s == unsplit.input_grad_time_s == block.backward_time_s / 2
    llama = analytic_profile(load_model_config("llama-tiny"), A100, 1).layers[1]
    assert 0 < llama.weight_grad_flops < llama.backward_flops / 2
    assert weight_grad_bytes(llama) > 0


@pytest.mark.parametrize("first", [True, False])
def test_split_backward_takes_and_gives_back_what_the_whole_does(first: bool) -> None:
    layers = analytic_profile(load_model_config("gpt-small"), A100, 2).layers[:5]
    for recomputed in ([None] * 5, [None, -1, None, -1, None]):
        whole = backward_steps(layers, recomputed, first_backward=first)
        inputs, weights = split_backward_steps(layers, recomputed, first_weight=first)
        net = sum(x.alloc_bytes - x.free_bytes for x in whole)
        assert sum(x.alloc_bytes - x.free_bytes for x in inputs + weights) == net
        for k, (i, w) in enumerate(zip(inputs, weights)):
            j = len(layers) - 1 - k
            mem = layers[j].memory if recomputed[j] is None else layers[j].recompute_memory
            # the parameters' gradients come with W; W gives back what torch's I left
            # for it (measured), at least what the weight gradients read
            assert w.alloc_bytes == (layers[j].grad_bytes if first else 0)
            if j > 0:  # (the embedding's input takes no gradient: nothing measured)
                assert mem.split_held_bytes >= weight_grad_bytes(layers[j]) * (recomputed[j] is None)
                assert w.free_bytes >= mem.split_held_bytes
            # I gives back only the incoming gradient it used (the graph stays), and at
            # its end (layer 0) what torch's detach frees
            if 0 < j < len(layers) - 1 and mem.input_end_bytes >= 0:
                assert i.free_bytes == mem.output_grad_freed_bytes
                assert i.alloc_bytes == mem.input_end_bytes
            # I peaks where torch's I does: higher than the whole backward, which frees as it goes
            assert i.alloc_bytes + i.transient_bytes >= whole[k].alloc_bytes + whole[k].transient_bytes - (
                layers[j].grad_bytes if first else 0)
        assert sum(w.free_bytes for w in weights) > 0


def _setup(name: str, stages: int, ranks: int | None):
    return setup_pipeline(load_model_config("gpt-20.4b"), A100, schedule=name, num_stages=stages,  # type: ignore[arg-type]
                          microbatch_size=2, num_microbatches=16, num_ranks=ranks)


def test_zero_bubble_fills_the_bubble() -> None:
    one_f_one_b = evaluate(_setup("1f1b", 8, None)).result
    zb_h1 = evaluate(_setup("interleaved-zb", 8, 8))
    zbv = evaluate(_setup("zbv", 16, None)).result
    # the same work, fewer idle slots
    assert zb_h1.result.iteration_s < 0.9 * one_f_one_b.iteration_s
    assert zbv.iteration_s < 0.9 * one_f_one_b.iteration_s
    # each W runs after its own I, and the stage before starts its I as soon as the input
    # gradient arrives: not after this stage's W
    program, res = zb_h1.program, zb_h1.result
    for r, tasks in enumerate(program.ranks):
        ends = {}
        for k, t in enumerate(tasks):
            a = t.action
            if a.kind is Kind.I:
                ends[(a.stage, a.microbatch)] = res.task_end_s[r][k]
            if a.kind is Kind.W:
                assert res.task_start_s[r][k] >= ends[(a.stage, a.microbatch)]
    i_end = {}
    w_end = {}
    i_start = {}
    for r, tasks in enumerate(program.ranks):
        for k, t in enumerate(tasks):
            key = (t.action.stage, t.action.microbatch)
            if t.action.kind is Kind.I:
                i_end[key] = max(i_end.get(key, 0.0), res.task_end_s[r][k])
                i_start.setdefault(key, res.task_start_s[r][k])
            elif t.action.kind is Kind.W:
                w_end[key] = max(w_end.get(key, 0.0), res.task_end_s[r][k])
    early = [(s, m) for (s, m) in i_start if s < 7 and i_start[(s, m)] < w_end[(s + 1, m)]]
    assert early  # some I of stage s starts before stage s+1's W of that microbatch ends
    assert all(i_start[(s, m)] >= i_end[(s + 1, m)] for (s, m) in i_start if s < 7)


def test_what_w_reads_stays_until_w() -> None:
    # ZB-H1's rank 0 at 16 microbatches holds as many microbatches as 1F1B's, and each
    # delayed W keeps its linears' inputs: its peak is not below 1F1B's
    plain = evaluate(_setup("1f1b", 8, None)).result
    zb = evaluate(_setup("interleaved-zb", 8, 8)).result
    assert max(zb.peak_bytes) >= max(plain.peak_bytes)


def _layer_in_stage(case: Case, action: Action) -> int:
    """The index within its stage of the layer an activation unit's action names."""
    layer = UnitId.parse(action.tensor or "").layer
    return [x.name for x in case.costs[action.stage].layers].index(layer)


SPLIT = [("interleaved-zb", {"num_ranks": 4}), ("interleaved-zb", {"num_ranks": 2}), ("zbv", {}),
         ("dualpipev", {})]


@pytest.mark.parametrize("name, kw", SPLIT)
def test_memory_actions_around_a_split_backward(name: str, kw: dict) -> None:
    rules = {
        0: [rule("layers.0.**", prefetch_lead=2),
            rule("layers.1.**", "d2d", stripes=[Stripe(device=3, fraction=0.5), Stripe(device=4, fraction=0.5)])],
        1: [rule("layers.2.**", "recompute")],
        2: [rule("layers.5.**", "recompute", microbatches="0-3")],
        3: [rule("layers.7.**", prefetch_lead=3)],
    }
    case = Case(name, [(0, 2), (2, 4), (4, 6), (6, 8)], 8, rules, **kw)
    assert case.schedule.name == ScheduleName(name)
    swapped = recomputed = 0
    for r, acts in enumerate(case.rw.schedule.ranks):
        where = {(a.kind, a.stage, a.microbatch, a.tensor): i for i, a in enumerate(acts)}
        for i, a in enumerate(acts):
            backward = where.get((Kind.I, a.stage, a.microbatch, None), where.get((Kind.B, a.stage, a.microbatch, None)))
            if a.kind in (Kind.SI, Kind.DI):
                swapped += 1
                # back before the I (so before the W that reads it too)
                assert i < backward, (r, str(a))
            elif a.kind is Kind.RC:
                recomputed += 1
                # inside the I (or full B), right after it
                assert backward < i and all(x.kind is Kind.RC for x in acts[backward + 1:i]), (r, str(a))
            if a.kind is Kind.W:
                assert where[(Kind.I, a.stage, a.microbatch, None)] < i
    assert swapped and recomputed
    ev = case.evaluation()  # a deadlock raises
    program, res = ev.program, ev.result
    for r, device in enumerate(program.rank_device):
        static = program.static_bytes[r]
        assert res.peak_bytes[device] == max(walk_peaks(program.ranks[r], static))
        # everything taken in the iteration was given back, what W kept included
        assert res.timeline[device][-1][1] == static, (name, r)
    # the W halves are tasks of their own, costed with the weight-gradient time
    # (the first stage's W is empty: torch's first stage makes no input gradient, and the
    # runtime runs its whole backward in its I)
    ws = [t for tasks in program.ranks for t in tasks if t.action.kind is Kind.W and t.action.stage > 0]
    grads = [t for t in ws if t.cost is Cost.COMPUTE]
    assert grads and all(t.compute_s == case.costs[t.action.stage].layers[t.layer].weight_grad_time_s for t in grads)
    # and each layer an I recomputed (its RC) is replayed before its weight gradient: once
    # here (the toy profile counts no replays, and its layers have parameters)
    replays = sorted((t.action.stage, t.action.microbatch, t.layer) for t in ws if t.cost is Cost.RECOMPUTE)
    split = {(a.stage, a.microbatch) for acts in case.rw.schedule.ranks for a in acts if a.kind is Kind.I}
    rcs = sorted((a.stage, a.microbatch, _layer_in_stage(case, a)) for acts in case.rw.schedule.ranks for a in acts
                 if a.kind is Kind.RC and a.stage > 0 and (a.stage, a.microbatch) in split)  # (not in a whole B)
    assert replays and replays == rcs
    assert all(t.compute_s == case.costs[t.action.stage].layers[t.layer].forward_time_s
               for t in ws if t.cost is Cost.RECOMPUTE)
    assert all(t.compute_s == 0 and t.alloc_bytes == t.free_bytes == 0
               for tasks in program.ranks for t in tasks if t.action.kind is Kind.W and t.action.stage == 0)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_the_profile_counts_the_replays_torch_runs_in_w(name: str) -> None:
    """A layer recomputed whole (non-reentrant checkpoint, as the runtime runs it) is
    replayed once by torch's I and again in W for every gradient pass W runs (one per
    group of parameters): the profile's count is what torch does, counted here apart."""
    cfg = load_model_config(name)
    block = build_stage(cfg, 1, 2, seed=0).train()
    runs = 0

    def forward(x: torch.Tensor) -> torch.Tensor:
        nonlocal runs
        runs += 1
        return block(x)

    x = torch.randn(1, cfg.seq_len, cfg.hidden_size, requires_grad=True)
    out = run_recomputed(forward, None, None, x)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], block.parameters())
    assert runs == 2  # the forward, and the I's replay
    del out
    stage_backward_weight(block.parameters(), groups)
    layer = analytic_profile(cfg, A100, 1).layers[1]
    assert layer.recompute_memory.weight_replays == runs - 2 == len(groups) > 1
    assert layer.memory.weight_replays == 0


def test_w_charges_the_replays_of_what_its_i_recomputed() -> None:
    """On one rank everything runs in turn: the iteration of a plan recomputing stage 1's
    layers grows by exactly their forward time per replay W runs, per microbatch."""
    case = Case("interleaved-zb", [(0, 2), (2, 4)], 4,
                {1: [rule("layers.2.**", "recompute"), rule("layers.3.**", "recompute")]}, num_ranks=1)

    def iteration_s(replays: int) -> float:
        profile = replace(case.profile, layers=[
            replace(x, recompute_memory=replace(x.recompute_memory, weight_replays=replays))
            for x in case.profile.layers])
        costs = stage_costs(profile, case.ranges)
        setup = replace(case.setup, profile=profile, costs=costs,
                        memory=memory_model(costs, case.schedule, case.hardware, case.setup.stage_to_device))
        return evaluate_plan(setup, case.plan).result.iteration_s

    per_replay = 4 * (FWD[2] + FWD[3])  # 4 microbatches, each replaying layers 2 and 3
    base = iteration_s(0)
    assert iteration_s(1) == pytest.approx(base + per_replay, rel=1e-12)
    assert iteration_s(6) == pytest.approx(base + 6 * per_replay, rel=1e-12)


def test_a_stage_s_i_holds_what_its_composition_says_layer_by_layer() -> None:
    """Torch's I of a whole stage (gpt-tiny's last, with its loss), counted as the
    runtime counts it: when each layer's input gradient is out, the live bytes are what
    the composed I steps have taken and given back up to that layer, to the byte (torch
    frees nothing the forward kept until the stage's I ends); its peak is under the
    composed one."""
    from mpress.contract.live_bytes import LiveBytes
    from mpress.models.transformer import lm_loss

    cfg = load_model_config("gpt-tiny")
    names = ["layers.2", "layers.3", "head"]
    stage = build_stage(cfg, 3, 6, seed=0).train()
    x = torch.randn(2, cfg.seq_len, cfg.hidden_size, requires_grad=True)
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    live = LiveBytes()
    for t in [x, targets, *stage.parameters()]:
        live.adopt(t, "before")
    ends: list[int] = []
    for n in names:  # a hook on each layer's input: it fires when the I hands its gradient over
        stage.get_submodule(n).register_forward_pre_hook(
            lambda _m, a: a[0].register_hook(lambda _g: ends.append(live.live_bytes - start)) and None)
    start = 0
    with live.watch():  # gpt-tiny's dropout draws fresh masks: only the sizes count
        loss = lm_loss(stage(x), targets)
        start = live.live_bytes
        live.reset_peak()
        dinputs, groups = stage_backward_input([loss], None, [x], stage.parameters())
        peak = live.peak_bytes - start
    del dinputs, groups
    profile = {layer.name: layer for layer in analytic_profile(cfg, load_hardware("cpu-local"), 2).layers}
    inputs, _ = split_backward_steps([profile[n] for n in names], [None] * 3, first_weight=False)
    ended, taken, top = [], 0, 0  # the live bytes when each layer's I ends, composed; what the I steps hold
    for k, step in enumerate(inputs):
        used = profile[names[-1 - k]].memory.output_grad_freed_bytes if k > 0 else 0  # (the head's: its seed)
        top = max(top, taken + step.alloc_bytes + step.transient_bytes)
        ended.append(taken + step.alloc_bytes - used)
        taken += step.alloc_bytes - step.free_bytes
    assert ends == ended
    assert 0.95 * top <= peak <= top  # (over by the incoming gradient, which goes before the peak)
