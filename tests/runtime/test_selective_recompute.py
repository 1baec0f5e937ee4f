"""Op-level (selective) recompute, across the contract: the profile's choices, the
rewriter's reading of a plan that recomputes part of a layer, and the router running it:
results `torch.equal` to keeping everything (dropout on), refusals alike on both halves.
"""

from __future__ import annotations

import pytest
import torch

from mpress.contract.actions import Kind
from mpress.errors import PlanError
from mpress.contract.identity import StageRules, inspect_stage
from mpress.config.model_config import load_model_config
from mpress.models import build_stage, example_batch, lm_loss
from mpress.contract.plan import TensorRule
from mpress.runtime.program import RankProgram
from mpress.runtime.router import SavedTensorRouter
from mpress.contract.selective import closed_set
from mpress.static.memory.stage_memory import WHOLE
from tests.contract.test_identity import _plan, _rewritten, _run_program, profile_of

CFG = load_model_config("gpt-tiny")


def _profile():
    stage = build_stage(CFG, 0, CFG.num_layers + 2, seed=1)
    x, y = example_batch(CFG, 2, seed=0)
    return stage, x, profile_of(stage, x, lambda out: lm_loss(out, y))


def _rules(layer, positions) -> list[TensorRule]:
    return [TensorRule(tensor=layer.saved[p].id, technique="recompute") for p in positions]


def _plain_grads(num_mb: int):
    """Gradients and losses of gpt-tiny as one stage with nothing compacted."""
    stage = build_stage(CFG, 0, CFG.num_layers + 2, seed=1)
    batches = [example_batch(CFG, 2, seed=m) for m in range(num_mb)]
    torch.manual_seed(7)
    losses = [lm_loss(stage(x), y) for x, y in batches]
    for loss in losses:
        loss.backward()
    return [loss.detach() for loss in losses], {n: p.grad.clone() for n, p in stage.named_parameters()}


def test_profile_offers_closed_choices_that_keep_less_and_replay_less():
    """Every block offers op-level choices; each is a set the checkpoint recomputes alone
    (closed), keeps less than the plain layer and replays in less time than its forward."""
    stage, x, profile = _profile()
    tensors = inspect_stage(stage, (x,))
    for layer, traced in zip(profile.layers, tensors):
        if not layer.name.startswith("layers."):
            continue
        assert layer.recompute_options, layer.name
        assert [t.op_index for t in layer.saved] == [-1 if o is None else o for o in traced.ops.producers]
        for option in layer.recompute_options:
            assert closed_set(traced.ops, option.tensors) == frozenset(option.tensors)
            assert option.memory.kept_bytes < layer.memory.kept_bytes
            assert option.memory.kept_bytes > layer.recompute_memory.kept_bytes
            assert option.time_s < layer.forward_time_s


@pytest.mark.parametrize("option", [0, -1])
def test_part_of_a_layer_recomputed_is_equal_to_keeping_it(option):
    """A plan recomputing one measured choice of blocks 0 and 1 (each tensor named by its
    own rule) lowers to one DR/RC unit per layer carrying that choice, the router runs
    exactly that program, and losses and gradients are `torch.equal` to a plain run
    (gpt-tiny has dropout 0.1: the random stream is replayed alike)."""
    num_mb = 2
    _stage, _x, profile = _profile()
    blocks = [layer for layer in profile.layers if layer.name.startswith("layers.")][:2]
    rules = [r for layer in blocks for r in _rules(layer, layer.recompute_options[option].tensors)]
    stage, batches, plan, costs, rewritten = _rewritten(CFG, rules, num_mb)
    actions = list(rewritten.schedule.ranks[0])
    dropped = [a for a in actions if a.kind is Kind.DR]
    assert len(dropped) == 2 * num_mb
    chosen = len(blocks[0].recompute_options) - 1 if option == -1 else option
    assert {rewritten.tensors[a.tensor].recompute for a in dropped} == {chosen}
    torch.manual_seed(7)
    program, router, _swapped = _run_program(stage, batches, plan, actions)
    assert program.last_log == actions and router.layers_recomputed == 2 * num_mb
    _losses, grads = _plain_grads(num_mb)
    for name, p in stage.named_parameters():
        assert torch.equal(p.grad, grads[name]), name


def test_whole_layer_named_tensor_by_tensor_is_the_whole_recompute():
    """Rules naming every tensor an operator of the layer produced choose WHOLE."""
    _stage, _x, profile = _profile()
    layer = profile.layers[1]
    producible = [p for p, t in enumerate(layer.saved) if t.op_index >= 0]
    _stage2, _b, _plan2, _costs, rewritten = _rewritten(CFG, _rules(layer, producible), 1)
    assert {i.recompute for i in rewritten.tensors.values()} == {WHOLE}


def test_a_set_the_checkpoint_cannot_recompute_alone_is_refused_by_both_halves():
    """One dropout mask of a block recomputed and the others kept: the random stream
    would shift, so the runtime refuses it, and the profile offers no such choice."""
    stage, x, profile = _profile()
    layer = profile.layers[1]
    mask = next(p for p, t in enumerate(layer.saved) if t.id == "layers.0.attn.attn_drop#0")
    rules = _rules(layer, [mask])
    with pytest.raises(PlanError, match="also recomputes layers.0.attn#4, which it keeps .*random operators are "
                                        "replayed all together"):
        SavedTensorRouter(stage, _plan(CFG, rules, 1).stage(0), RankProgram([], rank=0), rank=0,
                          example_args=(x,), num_microbatches=1)
    with pytest.raises(PlanError, match="not a choice its profile measured"):
        _rewritten(CFG, rules, 1)


def test_part_recomputed_and_part_swapped_is_refused_by_both_halves():
    """A layer recomputed in part keeps the rest: a rule moving some of it is refused by
    the rules' one reading, at plan time and at run time."""
    stage, x, profile = _profile()
    layer = profile.layers[1]
    rules = _rules(layer, layer.recompute_options[0].tensors) + [TensorRule(tensor="layers.0.**", technique="host")]
    with pytest.raises(PlanError, match="a layer recomputed in part keeps the rest"):
        _rewritten(CFG, rules, 1)
    tensors = inspect_stage(stage, (x,))
    with pytest.raises(PlanError, match="a layer recomputed in part keeps the rest"):
        StageRules(_plan(CFG, rules, 1).stage(0), tensors).layer_groups(1, 0)
