"""Reference GPT/BERT models, stages and model presets."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from mpress.errors import UserError
from mpress.config.model_config import load_model_config, model_presets
from mpress.models.transformer import (
    build_model,
    build_stage,
    example_batch,
    layer_names,
    layer_num_parameters,
    lm_loss,
    num_parameters,
)


def _cfg(name: str, **changes):
    return dataclasses.replace(load_model_config(name), **changes)


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- parameter counts ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt-tiny", "bert-tiny"])
@pytest.mark.parametrize("changes", [{}, {"ffn_hidden_size": 96, "num_layers": 1}, {"num_heads": 1, "seq_len": 7}])
def test_num_parameters_equals_built_model(name, changes):
    cfg = _cfg(name, **changes)
    model = build_model(cfg, seed=0)
    assert num_parameters(cfg) == _numel(model)
    for i, layer in enumerate(layer_names(cfg)):
        assert layer_num_parameters(cfg, i) == _numel(model.get_submodule(layer))


def test_num_parameters_gpt_tiny_by_hand():
    # V=256, T=32, h=64, L=4, f=4h: embeddings V*h + T*h; block 12h^2 + 13h
    # (qkv 3h^2+3h, proj h^2+h, fc1/fc2 8h^2+5h, two LayerNorms 4h); head LN 2h + h*V.
    v, t, h, layers = 256, 32, 64, 4
    expected = v * h + t * h + layers * (12 * h * h + 13 * h) + 2 * h + h * v
    assert num_parameters(load_model_config("gpt-tiny")) == expected


GPT_BERT_PRESETS = [n for n in model_presets() if n.split("-")[0] in ("gpt", "bert")]
"""The Llama presets have their own published shapes (tests/models/test_llama.py)."""


@pytest.mark.parametrize("name", GPT_BERT_PRESETS)
def test_preset_shapes_and_meta_build(name):
    cfg = load_model_config(name)
    assert cfg.name == name
    assert cfg.hidden_size % cfg.num_heads == 0
    assert cfg.vocab_size == (50257 if cfg.family == "gpt" else 30522) or name.endswith("-tiny")
    model = build_model(cfg, device="meta")  # structure only: no memory for 25B parameters
    assert _numel(model) == num_parameters(cfg)


@pytest.mark.parametrize("name", [n for n in GPT_BERT_PRESETS if n.endswith("b")])
def test_billion_scale_presets_match_their_names(name):
    cfg = load_model_config(name)
    billions = float(re.search(r"-([0-9.]+)b$", name).group(1))
    assert abs(num_parameters(cfg) / 1e9 - billions) / billions < 0.03
    assert cfg.hidden_size % 128 == 0
    assert cfg.precision == "fp16" and cfg.mixed_precision
    assert cfg.seq_len == (512 if cfg.family == "bert" else 1024)


def test_billion_scale_presets_exist():
    names = set(model_presets())
    for n in ["bert-0.35b", "bert-0.64b", "bert-1.67b", "bert-4b", "bert-6.2b",
              "gpt-5.3b", "gpt-10.3b", "gpt-15.4b", "gpt-20.4b", "gpt-25.5b", "gpt-tiny", "bert-tiny"]:
        assert n in names


# -- structure and stages -------------------------------------------------------------------

def test_top_level_children_and_layer_names():
    cfg = load_model_config("gpt-tiny")
    model = build_model(cfg, seed=0)
    assert [n for n, _ in model.named_children()] == ["embed", "layers", "head"]
    assert layer_names(cfg) == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert model.layer_names() == layer_names(cfg)
    modules = dict(model.named_modules())
    for name in ["layers.2.attn.qkv", "layers.2.attn.attn_drop", "layers.2.mlp.act", "head.out", "embed.tok"]:
        assert name in modules


@pytest.mark.parametrize("name", ["gpt-tiny", "bert-tiny"])
def test_stage_paths_and_parameters_match_whole_model(name):
    cfg = load_model_config(name)
    whole = build_model(cfg, seed=7)
    full_state = whole.state_dict()
    full_modules = dict(whole.named_modules())
    for first, end in [(0, 2), (2, 4), (4, 6), (3, 4)]:
        stage = build_stage(cfg, first, end, seed=7)
        assert stage.layer_names() == layer_names(cfg)[first:end]
        for path, _ in stage.named_modules():
            if path:
                assert path in full_modules, path
        for key, value in stage.state_dict().items():
            assert torch.equal(value, full_state[key]), key


@pytest.mark.parametrize("name", ["gpt-tiny", "bert-tiny"])
def test_chained_stages_compute_the_whole_model(name):
    cfg = load_model_config(name)
    whole = build_model(cfg, seed=3).eval()
    stages = [build_stage(cfg, a, b, seed=3).eval() for a, b in [(0, 2), (2, 5), (5, 6)]]
    ids, _ = example_batch(cfg, 2)
    x = ids
    with torch.no_grad():
        for stage in stages:
            x = stage(x)
        assert torch.allclose(x, whole(ids), atol=1e-6)


def test_bad_layer_range_is_a_user_error():
    cfg = load_model_config("gpt-tiny")
    for first, end in [(0, 0), (3, 2), (0, 7), (-1, 2)]:
        with pytest.raises(UserError, match="layer range"):
            build_stage(cfg, first, end)


def test_init_is_deterministic_under_manual_seed():
    cfg = load_model_config("bert-tiny")
    torch.manual_seed(11)
    a = build_model(cfg)
    torch.manual_seed(11)
    b = build_model(cfg)
    c = build_model(cfg)  # RNG advanced: another seed
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.layers[0].attn.qkv.weight, c.layers[0].attn.qkv.weight)
    std = a.layers[0].mlp.fc1.weight.std().item()
    assert 0.015 < std < 0.025  # normal(0, 0.02) init


def test_mixed_precision_builds_half_parameters():
    cfg = _cfg("gpt-tiny", precision="bf16")
    model = build_model(cfg, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# -- behaviour ---------------------------------------------------------------------------

def test_gpt_is_causal_and_bert_is_bidirectional():
    for name, causal in [("gpt-tiny", True), ("bert-tiny", False)]:
        cfg = load_model_config(name)
        model = build_model(cfg, seed=0).eval()
        ids, _ = example_batch(cfg, 1)
        changed = ids.clone()
        changed[0, 20] = (changed[0, 20] + 1) % cfg.vocab_size
        with torch.no_grad():
            diff = (model(ids) - model(changed)).abs().amax(dim=-1)[0]  # (T,)
        assert diff[20:].gt(0).all()
        assert bool(diff[:20].eq(0).all()) == causal


def test_example_batch_targets():
    gpt = load_model_config("gpt-tiny")
    ids, targets = example_batch(gpt, 3, seed=1)
    assert ids.shape == targets.shape == (3, gpt.seq_len) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 1:], targets[:, :-1])  # next-token prediction
    ids, targets = example_batch(load_model_config("bert-tiny"), 3, seed=1)
    assert torch.equal(ids, targets) and ids.untyped_storage().data_ptr() != targets.untyped_storage().data_ptr()


def test_lm_loss_of_uniform_logits_is_log_vocab():
    logits = torch.zeros(2, 5, 17)
    targets = torch.randint(0, 17, (2, 5))
    assert lm_loss(logits, targets).item() == pytest.approx(math.log(17))


def test_train_mode_dropout_and_eval_identity():
    cfg = load_model_config("gpt-tiny")
    model = build_model(cfg, seed=0)
    ids, _ = example_batch(cfg, 2)
    with torch.no_grad():
        model.train()
        assert not torch.equal(model(ids), model(ids))  # dropout differs per call
        model.eval()
        assert torch.equal(model(ids), model(ids))


def test_tiny_gpt_learns_a_fixed_batch():
    torch.manual_seed(0)
    cfg = _cfg("gpt-tiny", dropout=0.0)
    model = build_model(cfg)
    ids, targets = example_batch(cfg, 4)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = lm_loss(model(ids), targets)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first == pytest.approx(math.log(cfg.vocab_size), rel=0.05)  # small init: near uniform
    assert loss.item() < 0.7 * first
