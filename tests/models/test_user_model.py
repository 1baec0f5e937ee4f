"""A user's model split into stages by torch's `pipeline()`: the split runs what the eager
model runs, bit for bit, and saves the tensors under the names the profiler gives them."""

from __future__ import annotations

import pytest
import torch

from mpress.errors import UserError
from mpress.contract.identity import inspect_stage
from mpress.models.user import load_user_model
from mpress.models.user_module import select_layers

SPEC = "examples.own_model.mymodel:make"
LAYERS = ["embed", "blocks.*", "head"]


def test_patterns_name_the_outermost_matching_modules_in_order():
    user = load_user_model(SPEC, layers=LAYERS)
    assert user.layers == ["embed"] + [f"blocks.{i}" for i in range(6)] + ["head"]
    with pytest.raises(UserError, match="'blockz.*' names no module"):
        select_layers(user.module, ["blockz.*"])


def test_a_forward_that_is_not_a_chain_needs_named_layers():
    with pytest.raises(UserError, match="does not chain its children"):
        load_user_model(SPEC)


def _run(modules, x):
    out = x
    for m in modules:
        out = m(*out) if isinstance(out, tuple) else m(out)
    return out


@pytest.mark.parametrize("ranges", [[(0, 8)], [(0, 3), (3, 8)], [(0, 1), (1, 4), (4, 7), (7, 8)]])
def test_split_stages_equal_the_eager_model(ranges):
    eager = load_user_model(SPEC, layers=LAYERS, seed=3)
    split = load_user_model(SPEC, layers=LAYERS, seed=3)
    x = eager.example_input[0]
    loss_eager = eager.loss_fn(eager.module(x))
    loss_eager.backward()
    stages = split.split(ranges)
    loss_split = split.loss_fn(_run(stages, x))
    loss_split.backward()
    assert torch.equal(loss_eager, loss_split)
    grads = {n: p.grad for n, p in eager.module.named_parameters()}
    names = [n for m in stages for n, _ in m.named_parameters()]
    assert sorted(names) == sorted(grads)  # the whole model's paths, each in one stage
    for m in stages:
        for n, p in m.named_parameters():
            assert torch.equal(p.grad, grads[n]), n


def test_split_stages_save_what_the_eager_model_saves_under_the_same_names():
    user = load_user_model(SPEC, layers=LAYERS)
    full = inspect_stage(user.module, user.example_input, user.layers)
    stages = user.split([(0, 3), (3, 8)])
    io = user.stage_io(stages)
    split = [t for m, (inputs, _) in zip(stages, io) for t in inspect_stage(m, inputs)]
    assert [(t.name, t.saved) for t in split] == [(t.name, t.saved) for t in full]
    assert "#0" in full[-1].saved  # the CPU scalar the root's glue saves, in the last layer


def test_stage_io_passes_the_skip_connection_across_the_boundary():
    user = load_user_model(SPEC, layers=LAYERS)
    io = user.stage_io(user.split([(0, 3), (3, 8)]))
    (in0, out0), (in1, out1) = io
    assert len(out0) == 2 and [t.shape for t in in1] == [t.shape for t in out0]
    assert all(t.requires_grad for t in in1) and not in0[0].requires_grad
    assert out1[0].shape == (2, 8, 4)


def test_synthetic_batches_are_deterministic_and_shaped_like_the_example():
    user = load_user_model(SPEC, layers=LAYERS)
    (a,), ta = user.batch(step=5, num_microbatches=3, seed=1)
    (b,), _ = user.batch(step=5, num_microbatches=3, seed=1)
    (c,), _ = user.batch(step=6, num_microbatches=3, seed=1)
    assert a.shape == (6, 8, 16) and ta.shape == (6,)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_stage_state_dicts_hold_the_models_own_names_only():
    """The CPU scalar the forward makes is lifted into the stage as a constant; it is not
    model state, so checkpoints never see it (two stages' constants would share a name)."""
    user = load_user_model(SPEC, layers=LAYERS)
    own = set(user.module.state_dict())
    stages = user.split([(0, 3), (3, 8)])
    keys = [k for m in stages for k in m.state_dict()]
    assert sorted(keys) == sorted(own)
    assert any("lifted" in n for m in stages for n, _ in m.named_buffers())  # still there to compute with


# ---- what a split cannot do is refused, not done wrong ---------------------------------------

class _Chain(torch.nn.Module):
    """a -> b -> c; `returns_early` also returns a's output; `tied` makes c share a's weight;
    a second input that the forward ignores."""

    def __init__(self, returns_early: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))
        if tied:
            self.c.weight = self.a.weight
        self.returns_early = returns_early

    def forward(self, x, unused):
        h = self.a(x)
        out = self.c(self.b(h))
        return (out, h) if self.returns_early else out


def _user(module):
    from mpress.models.user import UserModel
    return UserModel(spec="test:chain", module=module, example_input=(torch.randn(2, 4), torch.zeros(2)),
                     loss_fn=lambda o: o.sum(), layers=["a", "b", "c"])


def test_an_input_no_layer_uses_still_reaches_the_first_stage():
    user = _user(_Chain())
    stages = user.split([(0, 1), (1, 2), (2, 3)])
    (in0, _), *_ = user.stage_io(stages)
    assert len(in0) == 2


def test_an_output_an_earlier_stage_computes_is_refused():
    with pytest.raises(UserError, match="earlier stage"):
        _user(_Chain(returns_early=True)).split([(0, 1), (1, 2), (2, 3)])


def test_a_weight_shared_across_stages_is_refused():
    with pytest.raises(UserError, match="held by stages 0 and 2"):
        _user(_Chain(tied=True)).split([(0, 1), (1, 2), (2, 3)])
