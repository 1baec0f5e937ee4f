"""Global-norm gradient clipping (pure, one process: no reduction) against torch's
`clip_grad_norm_`, and the count of skipped steps."""

from __future__ import annotations

import math

import pytest
import torch

from mpress.errors import UserError
from mpress.runtime.grad_clip import (
    StepGuard,
    clip_by_norm,
    global_grad_norm,
    local_sum_of_squares,
)


def params_with_grads(scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 7, 3)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return ps


@pytest.mark.parametrize("scale", [0.01, 10.0])
def test_norm_and_clipped_gradients_match_torch(scale):
    ours, ref = params_with_grads(scale), params_with_grads(scale)
    norm = global_grad_norm(ours, torch.device("cpu"))
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0)
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
    clip_by_norm(ours, norm, 1.0)
    for a, b in zip(ours, ref):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=0)
    if scale < 1:  # under the threshold: untouched
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, params_with_grads(scale)))
    # a rank whose loss is not finite makes the norm nan (every rank then skips the step)
    assert math.isnan(float(global_grad_norm(ours, torch.device("cpu"), poisoned=True)))


def test_skipped_parameters_and_missing_gradients_add_nothing():
    ps = params_with_grads(1.0)
    ps[1].grad = None
    total = local_sum_of_squares(ps, torch.device("cpu"), skip={id(ps[2])})
    assert torch.allclose(total, (ps[0].grad ** 2).sum().reshape(1), rtol=1e-6, atol=0)


def test_a_half_precision_gradient_is_summed_in_fp32():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.full((4,), 300.0, dtype=torch.bfloat16)
    total = local_sum_of_squares([p], torch.device("cpu"))
    assert total.dtype == torch.float32 and float(total) == 4 * 300.0 ** 2


def test_guard_counts_skips_and_stops_after_max_consecutive():
    guard = StepGuard(max_skipped=2)
    guard.taken()
    guard.skip(1, "the gradient norm is inf")
    guard.taken()  # a good step resets the run of skips
    guard.skip(3, "the loss is not finite on stage 1")
    assert guard.skipped_total == 2 and guard.skipped_steps == [1, 3] and guard.consecutive == 1
    saved = guard.state_dict()
    again = StepGuard(max_skipped=2)
    again.load_state_dict(saved)  # what a resume loads: the run of skips goes on
    for g in (guard, again):
        with pytest.raises(UserError, match=r"step 4: the gradient norm is nan, 2 steps in a row "
                                            r"\(steps 3, 4 skipped\)"):
            g.skip(4, "the gradient norm is nan")


def test_a_weight_tied_across_stages_is_counted_once_on_its_first_stage():
    """gpt2-tiny's token embedding (stage 0) and output projection (stage 1) are copies of
    one tensor holding the same summed gradient: the norm counts the first copy only."""
    pytest.importorskip("transformers")
    from mpress.models.hf_model import load_hf_model
    from mpress.runtime.tied_grads import TiedGrads

    model = load_hf_model("gpt2-tiny", microbatch_size=2)
    stages = model.split([(0, 3), (3, 6)])
    first = stages[0].get_parameter("embed.tokens.weight")
    last = stages[1].get_parameter("head.lm_head.weight")
    both = TiedGrads(model.tied_groups, stage_ids=[0, 1], modules=stages, world=1)  # interleaved on one rank
    assert both.repeated() == {id(last)}
    assert TiedGrads(model.tied_groups, stage_ids=[1], modules=[stages[1]], world=2).repeated() == {id(last)}
    assert TiedGrads(model.tied_groups, stage_ids=[0], modules=[stages[0]], world=2).repeated() == set()
    first.grad = torch.ones_like(first)
    last.grad = torch.ones_like(last)
    once = local_sum_of_squares([first, last], torch.device("cpu"), skip=both.repeated())
    assert float(once) == first.numel()
