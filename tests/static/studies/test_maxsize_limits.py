"""`maxsize` is bounded by the server's real limits and keeps the family's shape rule:
its plan pins no more than the preset can pin, peaks within usable device memory, and
the next size up fails for the reason it reports."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from mpress.config.model_config import LLAMA_FFN_MULTIPLE, load_model_config
from mpress.errors import UserError
from mpress.hardware.server import load_hardware
from mpress.models import num_parameters
from mpress.static.plan.balance_choice import minimum_need_bytes
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.studies.maxsize import Bound, family_ladder, family_rule, find_max_size, unmovable_why
from mpress.static.plan.planner import PlannerOptions, plan_strategy

DGX1 = load_hardware("dgx1-v100")
SHAPE = dict(schedule="1f1b", num_stages=8, microbatch_size=1, num_microbatches=8)


@pytest.mark.parametrize("family", ["gpt", "bert", "llama"])
def test_family_rule_grows_width_and_depth_together(family):
    rule = family_rule(family)
    widths = [rule.step * i for i in range(4, 200, 7)]
    depths = [rule.depth(w) for w in widths]
    assert rule.exponent > 0
    assert all(b >= a for a, b in zip(depths, depths[1:])) and depths[-1] > depths[0]
    sizes = [num_parameters(rule.model(w)) for w in widths]
    assert all(b > a for a, b in zip(sizes, sizes[1:]))
    # the rule is the presets' own trend: each preset's depth within a factor 2 of the rule's
    for cfg in family_ladder(family):
        assert 0.5 <= cfg.num_layers / rule.depth(cfg.hidden_size) <= 2.0
    m = rule.model(widths[5])
    assert m.hidden_size % m.num_heads == 0 and m.hidden_size // m.num_heads == rule.head_dim


def _check_limits(hw, row):
    res = row.result
    assert res is not None and res.fits
    assert res.host_bytes <= hw.pinnable_bytes
    assert max(res.evaluation.result.peak_bytes) <= hw.usable_memory_bytes
    rule = family_rule("gpt")
    assert row.model.num_layers == rule.depth(row.model.hidden_size)  # on the family's rule
    assert row.model.hidden_size % rule.head_dim == 0


def _next_up_fails_for(hw, row, strategy):
    """Plan the next size up; return the plan (it must not fit)."""
    rule = family_rule("gpt")
    bigger = rule.model(row.model.hidden_size + rule.step)
    setup = setup_pipeline(bigger, hw, **SHAPE)
    res = plan_strategy(setup, strategy, PlannerOptions(max_d2d_rounds=0))
    assert not res.fits
    return res


def test_host_swap_maxsize_is_bounded_by_pinnable_host():
    """Host swap alone on the DGX-1 pins more as models grow: the pinnable limit (not
    the whole of RAM) bounds it, and the next size up pins more than that."""
    row = find_max_size("gpt", DGX1, "host-swap", **SHAPE)
    _check_limits(DGX1, row)
    assert row.bound is Bound.PINNED_HOST
    over = _next_up_fails_for(DGX1, row, "host-swap")
    assert over.host_bytes > DGX1.pinnable_bytes


def test_a_tighter_pinnable_limit_gives_a_smaller_model():
    tight = replace(DGX1, pinnable_host_bytes=DGX1.pinnable_bytes // 4)
    row = find_max_size("gpt", tight, "host-swap", **SHAPE)
    _check_limits(tight, row)
    assert row.bound is Bound.PINNED_HOST
    assert row.result.host_bytes <= tight.pinnable_bytes


def test_recompute_maxsize_is_bounded_by_device_memory():
    row = find_max_size("gpt", DGX1, "recompute", **SHAPE)
    _check_limits(DGX1, row)
    assert row.bound is Bound.DEVICE_MEMORY
    over = _next_up_fails_for(DGX1, row, "recompute")
    floor_or_peak = max(over.evaluation.result.peak_bytes)
    assert floor_or_peak > DGX1.usable_memory_bytes or math.isinf(floor_or_peak)


def test_time_budget_bounds_the_search():
    row = find_max_size("gpt", DGX1, "recompute", time_budget_s=0.0, **SHAPE)
    assert row.bound is Bound.TIME


def test_d2d_short_of_peer_memory_is_bound_by_peer_memory():
    # the d2d strategy on a model whose overflow exceeds what peers can lend: what no peer
    # takes stays on its device and overflows it, but the cause is the peers' memory
    from mpress.config.model_config import load_model_config
    from mpress.static.plan.evaluate import setup_pipeline
    from mpress.static.studies.maxsize import Bound, plan_bound
    from mpress.static.plan.planner import plan_strategy
    hw = load_hardware("dgx1-v100")
    setup = setup_pipeline(load_model_config("gpt-10.3b"), hw, schedule="1f1b", num_stages=8,
                           microbatch_size=2, num_microbatches=16)
    result = plan_strategy(setup, "d2d")
    assert not result.fits and result.draft.unplaced_bytes > 0
    assert plan_bound(hw, result) is Bound.PEER_MEMORY


LLAMA_SHAPE = ("num_heads", "kv_heads", "ffn", "seq_len", "vocab_size", "precision", "attention", "rope_theta")
"""What a Llama config sets beside its width and depth."""


def _knobs(cfg):
    return {k: getattr(cfg, k) for k in LLAMA_SHAPE}


def test_llama_grows_with_its_own_knobs():
    """The family scales from its largest preset (Llama 3 70B): at 8B's width the rule's
    model has 8B's heads, key/value heads, MLP width, sequence and vocabulary, as Llama 3
    keeps 8 key/value heads; named instead, Llama 2 7B is the base: plain multi-head
    attention, and 13B's MLP width at 13B's width. Depth follows the family's rule."""
    rule = family_rule("llama")
    assert rule.base.name == "llama-3-70b" and rule.head_dim == 128
    for preset in ("llama-3-70b", "llama-3-8b"):
        cfg = load_model_config(preset)
        assert _knobs(rule.model(cfg.hidden_size)) == _knobs(cfg), preset
    llama2 = family_rule("llama-2-7b")
    assert (llama2.scale, llama2.exponent) == (rule.scale, rule.exponent)  # the family's depth rule
    for preset in ("llama-2-7b", "llama-2-13b"):
        cfg = load_model_config(preset)
        assert _knobs(llama2.model(cfg.hidden_size)) == _knobs(cfg), preset
    # grouped-query widths step by 8 heads, each with 8 key/value heads; Llama 2 7B's by one head
    assert (rule.step, llama2.step) == (8 * 128, 128)
    for width in range(rule.step, 16385, rule.step):
        m, m2 = rule.model(width), llama2.model(width)
        assert m.num_layers == m2.num_layers == rule.depth(width)
        assert m.kv_heads == 8 and m.num_heads == width // 128 and m2.kv_heads == m2.num_heads
        assert m.ffn % LLAMA_FFN_MULTIPLE == 0 and 0 <= m.ffn - 3.5 * width < LLAMA_FFN_MULTIPLE
    with pytest.raises(UserError, match="not a positive multiple of the llama 8 key/value heads x head size 1024"):
        rule.model(4096 + 128)


def test_llamas_largest_size_keeps_the_limits():
    """Recompute on an H100 server: the largest Llama fits its devices, on the family's
    rule and knobs, and the next size up does not."""
    hw = load_hardware("hgx-h100")
    row = find_max_size("llama", hw, "recompute", **SHAPE)
    rule = family_rule("llama")
    assert row.model == rule.model(row.model.hidden_size) and row.model.kv_heads == 8
    assert row.result.fits and max(row.result.evaluation.result.peak_bytes) <= hw.usable_memory_bytes
    bigger = rule.model(row.model.hidden_size + rule.step)
    assert not plan_strategy(setup_pipeline(bigger, hw, **SHAPE), "recompute", PlannerOptions(max_d2d_rounds=0)).fits
    assert row.bound is Bound.DEVICE_MEMORY



def test_mpress_on_the_drive_moves_layers_parameters_and_gradients_as_mpress_does():
    """A search for mpress-nvme rules a size out by the same floor as mpress's: the
    planner moves layers' parameters and gradients under both. On a DGX A100 whose usable
    memory lies between the two floors of the family's first size, both fit that size;
    the search had ruled mpress-nvme out there by the floor that keeps them on the device."""
    hw = load_hardware("dgx-a100")
    rule = family_rule("gpt")
    cfg = rule.model(family_ladder("gpt")[0].hidden_size // rule.step * rule.step)
    setup = setup_pipeline(cfg, hw, **SHAPE)
    moved, kept = max(minimum_need_bytes(setup, True)), max(minimum_need_bytes(setup, False))
    small = replace(hw, device=replace(hw.device, memory_bytes=hw.device.memory_bytes - hw.usable_memory_bytes
                                       + (moved + kept) // 2))
    small_setup = setup_pipeline(cfg, small, **SHAPE)
    assert unmovable_why(small_setup, "mpress") is None and unmovable_why(small_setup, "recompute") is not None
    rows = {s: find_max_size("gpt", small, s, time_budget_s=0, **SHAPE) for s in ("mpress", "mpress-nvme")}
    assert rows["mpress"].model == cfg and rows["mpress-nvme"].model == cfg
