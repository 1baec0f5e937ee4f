"""The `megatron-selective` strategy: Megatron-LM's selective activation recompute
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1; Megatron's `--recompute-granularity selective`). Every transformer
layer of every stage, in every microbatch, drops the attention core's activations (the
softmax output, the attention dropout's mask and output: the tensors with two
sequence-length dimensions, the 5as/h term of the paper's per-layer activations
sbh(34 + 5as/h) bytes in fp16) and rebuilds them in the backward; everything else is kept,
and no other technique is used."""

from __future__ import annotations

import pytest
import torch

from mpress.hardware.server import load_hardware
from mpress.config.model_config import ModelConfig, load_model_config
from mpress.models import build_stage
from mpress.contract.selective import attention_core, attention_core_set, recompute_menu, trace_layer_ops
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.plan_draft import RECOMPUTE
from mpress.static.plan.planner import plan_strategy
from mpress.static.memory.stage_memory import WHOLE
from mpress.config.vocabulary import Strategy

CPU = load_hardware("cpu-local", num_devices=2)
MEGATRON = Strategy.MEGATRON_SELECTIVE
SMALL_FP16 = ModelConfig(name="gpt-small-fp16", family="gpt", num_layers=3, hidden_size=512, num_heads=8, seq_len=384,
                         vocab_size=128, precision="fp16", dropout=0.1)
"""A small GPT in fp16 (2-byte activations, as the paper counts), eager attention, wide and
long enough (h, s >= 256) that the checkpoint caches its projections' products (>= 256
FLOPs per byte: `selective.worth_caching`) and replays q @ k^T (head size 64)."""
SOFTMAX, DROPOUT = "aten._softmax.default", "aten.native_dropout.default"


def _setup(cfg: ModelConfig, hardware=CPU, microbatch_size: int = 2, num_microbatches: int = 4):
    return setup_pipeline(cfg, hardware, schedule="1f1b", num_stages=2, microbatch_size=microbatch_size,
                          num_microbatches=num_microbatches)


def _recomputed(result, setup) -> dict[str, list[int]]:
    """Per layer name: the saved-tensor positions the plan recomputes (every microbatch alike)."""
    out = {}
    d = result.draft
    for s, c in enumerate(setup.costs):
        for j, layer in enumerate(c.layers):
            techs = set(d.layer_tech[s][j])
            if techs == {RECOMPUTE}:
                choice = d.choice(s, j)
                assert choice != WHOLE, layer.name  # never the whole layer
                out[layer.name] = layer.recompute_options[choice].tensors
            else:
                assert len(techs) == 1, (layer.name, techs)  # all microbatches alike
    return out


def _core(layer, seq_len: int) -> set[int]:
    """The attention core by producing operator and shape: the softmax's output and the
    attention dropout's mask and output, each with two sequence-length dimensions."""
    return {p for p, t in enumerate(layer.saved) if t.op in (SOFTMAX, DROPOUT) and t.shape[-2:] == [seq_len, seq_len]}


@pytest.mark.parametrize("cfg", [SMALL_FP16, load_model_config("gpt-tiny"),
                                 ModelConfig(**{**load_model_config("gpt-tiny").__dict__, "seq_len": 16})],
                         ids=["fp16", "gpt-tiny", "gpt-tiny-s=h/a"])
def test_every_block_recomputes_the_attention_core_and_keeps_the_rest(cfg):
    """Each block's choice holds the attention core and, besides it, only the other
    dropout masks (the checkpoint replays random operators all together: replaying the
    attention dropout replays the others, which rebuilds their 1-byte masks); the
    projections' inputs, q, k, v, the norms' tensors and the GELU's stay. Embedding and
    head (no attention) are kept whole."""
    setup = _setup(cfg)
    result = plan_strategy(setup, MEGATRON)
    chosen = _recomputed(result, setup)
    blocks = {layer.name: layer for c in setup.costs for layer in c.layers if layer.name.startswith("layers.")}
    assert sorted(chosen) == sorted(blocks)
    for name, tensors in chosen.items():
        layer = blocks[name]
        core = _core(layer, cfg.seq_len)
        assert len(core) == 3, name  # softmax output, dropout mask, dropout output
        masks = {p for p, t in enumerate(layer.saved) if t.op == DROPOUT and t.dtype == "bool"}
        assert set(tensors) == core | masks, (name, [layer.saved[p].what for p in tensors])
    # the plan says so in its rules: each kept tensor named, then the layer recomputed
    for sp in result.plan.stages:
        recompute = [r.tensor for r in sp.rules if r.technique == RECOMPUTE]
        assert recompute == [f"{n}.**" for n in chosen if setup.profile.layer_names().index(n) in
                             range(sp.first_layer, sp.end_layer)]
        assert all(r.microbatches == "all" for r in sp.rules)


def test_saved_memory_per_block_is_the_papers_attention_term():
    """Korthikanti et al., eq. (1): a layer keeps sbh(34 + 5as/h) bytes in fp16; the
    attention core is the 5as/h term: 5as^2b bytes = softmax output (2 bytes per element of
    b x a x s x s) + dropout mask (1) + dropout output (2). The block's choice drops exactly
    those tensors' bytes plus the two other dropout masks (sbh each, 1 byte per element).
    What the probe measures the layer keeping less is that, less the outputs of the
    projections the checkpoint caches that the plain layer does not keep (the qkv product
    3sbh, probs @ v sbh, the attention projection sbh and fc2 sbh, 2 bytes per element):
    s b h (5as/h + 2 - 12) bytes."""
    cfg = SMALL_FP16
    b, s, h, a = 2, cfg.seq_len, cfg.hidden_size, cfg.num_heads
    setup = _setup(cfg, microbatch_size=b)
    result = plan_strategy(setup, MEGATRON)
    chosen = _recomputed(result, setup)
    layers = {layer.name: layer for c in setup.costs for layer in c.layers}
    attention_term = 5 * a * s * s * b  # sbh * 5as/h
    assert attention_term == s * b * h * 5 * a * s // h
    for name, tensors in chosen.items():
        layer = layers[name]
        core = _core(layer, s)
        assert sum(layer.saved[p].bytes for p in core) == attention_term
        assert sum(layer.saved[p].bytes for p in tensors) == attention_term + 2 * s * b * h
        option = next(o for o in layer.recompute_options if o.tensors == tensors)
        assert layer.memory.kept_bytes - option.memory.kept_bytes == attention_term + (2 - 12) * s * b * h
        # what the backward replays: q @ k^T (2 b s^2 h FLOPs over all heads), not a projection
        assert option.flops == 2 * b * s * s * h


def test_it_fits_where_the_saving_is_enough_and_says_why_not_where_it_is_not():
    """With the device between Megatron's peak and the plain peak, megatron-selective fits
    where `none` does not; below its own peak it does not fit, and says which device
    peaks over what is usable."""
    cfg = load_model_config("gpt-tiny")
    big = _setup(cfg, load_hardware("cpu-local", num_devices=2, memory_bytes=1 << 30))
    plain = max(plan_strategy(big, "none").evaluation.result.peak_bytes)
    megatron = max(plan_strategy(big, MEGATRON).evaluation.result.peak_bytes)
    assert megatron < plain
    reserve = CPU.device.reserve_bytes

    def at(usable: int):
        return _setup(cfg, load_hardware("cpu-local", num_devices=2, memory_bytes=usable + reserve))

    between = at((megatron + plain) // 2)
    assert not plan_strategy(between, "none").fits
    fits = plan_strategy(between, MEGATRON)
    assert fits.fits and fits.reason == "" and fits.plan.fits
    short = plan_strategy(at(megatron - 1), MEGATRON)
    assert not short.fits and not short.plan.fits
    assert "peaks at" in short.reason and "usable" in short.reason
    # a fixed policy: what it recomputes does not depend on the memory
    assert _recomputed(short, short.evaluation.setup) == _recomputed(fits, between)


def test_attention_without_saved_scores_is_kept():
    """A Llama with SDPA attention saves no (s, s) tensor: Megatron's selective recompute
    has nothing to drop there, and the plan keeps every layer (no rules)."""
    cfg = ModelConfig(**{**load_model_config("llama-tiny").__dict__, "attention": "sdpa"})
    setup = _setup(cfg)
    assert not any(t.shape[-2:] == [cfg.seq_len, cfg.seq_len] for c in setup.costs for x in c.layers
                   for t in x.saved)
    result = plan_strategy(setup, MEGATRON)
    assert _recomputed(result, setup) == {}
    assert [sp.rules for sp in result.plan.stages] == [[], []]


@pytest.mark.parametrize(("seq_len", "num_heads"), [(64, 4), (32, 4), (16, 4), (64, 1)],
                         ids=["s=h", "s=h/2", "s=h/a", "s=h=h/a"])
def test_the_attention_core_is_told_by_where_it_sits_whatever_the_shapes(seq_len, num_heads):
    """`selective.attention_core` on a traced block (h = 64): the softmax output and the
    attention dropout's mask and output (the last saved as probs @ v's operand), also when
    the sequence length equals the width (s = h: the (b, s, h) dropout masks look alike) or
    the head size (s = h/a: q, k, v's (b a, s, h/a) copies and the score tensors hold as
    many elements as the layer's input, b a s s = b s h), or both (one head)."""
    cfg = ModelConfig(**{**load_model_config("gpt-tiny").__dict__, "seq_len": seq_len, "num_heads": num_heads})
    block = build_stage(cfg, 1, 2, seed=0).layers[0]
    ops = trace_layer_ops(block, (torch.randn(2, seq_len, cfg.hidden_size, requires_grad=True),))
    core = attention_core(ops)
    assert sorted(ops.saved_shapes[p] for p in core) == ([(2, num_heads, seq_len, seq_len)] * 2
                                                         + [(2 * num_heads, seq_len, seq_len)])
    assert sorted(ops.ops[ops.producers[p]].name for p in core) == sorted([SOFTMAX, DROPOUT, DROPOUT])
    assert attention_core_set(ops) in recompute_menu(ops)


def test_a_llama_core_is_its_softmax_not_its_rotary_tensors_when_the_head_is_as_long_as_the_sequence():
    """Llama (eager attention, no dropout) with s = h/a: rotary embedding saves (b, a, s,
    h/a) tensors, s x s like the scores; the core is the softmax's output only (saved by
    the softmax and, as a (b a, s, s) view, by probs @ v)."""
    base = load_model_config("llama-tiny")
    seq_len = base.hidden_size // base.num_heads
    cfg = ModelConfig(**{**base.__dict__, "seq_len": seq_len})
    block = build_stage(cfg, 1, 2, seed=0).layers[0]
    ops = trace_layer_ops(block, (torch.randn(2, seq_len, cfg.hidden_size, requires_grad=True),))
    core = attention_core(ops)
    assert sorted(ops.saved_shapes[p] for p in core) == sorted([(2, cfg.num_heads, seq_len, seq_len),
                                                                (2 * cfg.num_heads, seq_len, seq_len)])
    assert {ops.ops[ops.producers[p]].name for p in core} == {SOFTMAX}
