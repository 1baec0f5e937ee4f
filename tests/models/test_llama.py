"""The Llama-family reference model: presets with the published shapes, the config's Llama
keys, stages, eager and SDPA attention, rotary positions, grouped-query attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from mpress.errors import ConfigError
from mpress.config.model_config import MODELS_DIR, load_model_config, model_presets
from mpress.models.llama import apply_rotary, rotary_tables
from mpress.models.transformer import (
    build_model,
    build_stage,
    example_batch,
    layer_names,
    layer_num_parameters,
    lm_loss,
    num_parameters,
)

PUBLISHED_PARAMETERS = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
}
"""Parameter counts of Meta's checkpoints (the Hugging Face model cards' safetensors totals)."""

SHAPES = {  # layers, hidden, heads, kv heads, ffn, vocab, seq, rope base (Meta's params.json)
    "llama-2-7b": (32, 4096, 32, 32, 11008, 32000, 4096, 1e4),
    "llama-2-13b": (40, 5120, 40, 40, 13824, 32000, 4096, 1e4),
    "llama-2-70b": (80, 8192, 64, 8, 28672, 32000, 4096, 1e4),
    "llama-3-8b": (32, 4096, 32, 8, 14336, 128256, 8192, 5e5),
    "llama-3-70b": (80, 8192, 64, 8, 28672, 128256, 8192, 5e5),
}


def _cfg(name: str = "llama-tiny", **changes):
    return dataclasses.replace(load_model_config(name), **changes)


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- presets -------------------------------------------------------------------------------

def test_llama_presets_exist():
    assert {*PUBLISHED_PARAMETERS, "llama-tiny"} <= set(model_presets())


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_presets_have_the_published_shapes_and_parameter_counts(name):
    cfg = load_model_config(name)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.ffn, cfg.vocab_size, cfg.seq_len,
            cfg.rope_theta) == SHAPES[name]
    assert cfg.family == "llama" and cfg.precision == "bf16" and cfg.dropout == 0 and cfg.norm_eps == 1e-5
    assert num_parameters(cfg) == PUBLISHED_PARAMETERS[name]
    model = build_model(cfg, device="meta")  # structure only
    assert _numel(model) == num_parameters(cfg)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize("changes", [{}, {"num_kv_heads": 1, "ffn_hidden_size": 40, "num_layers": 1},
                                     {"num_kv_heads": None, "attention": "sdpa"}])
def test_layer_parameter_counts_equal_the_built_layers(changes):
    cfg = _cfg(**changes)
    model = build_model(cfg, seed=0)
    assert num_parameters(cfg) == _numel(model)
    for i, layer in enumerate(layer_names(cfg)):
        assert layer_num_parameters(cfg, i) == _numel(model.get_submodule(layer))
    assert not any(isinstance(m, torch.nn.Linear) and m.bias is not None for m in model.modules())  # no biases


def test_default_mlp_width_is_llamas_rule():
    # 8/3 h rounded up to a multiple of 256: Llama 2 7B's 11008 from h = 4096
    assert _cfg("llama-2-7b", ffn_hidden_size=None).ffn == 11008
    assert _cfg("gpt-tiny", ffn_hidden_size=None).ffn == 4 * 64  # other families: 4h as before


# -- config keys -----------------------------------------------------------------------------

def _write(tmp_path, data: dict):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("changes, key", [
    ({"num_kv_heads": 3}, "num_kv_heads"),
    ({"attention": "sdpa", "dropout": 0.1}, "dropout"),
    ({"attention": "flash"}, "attention"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"num_heads": 64}, "num_heads"),  # head width 1: odd, no rotary pairs
])
def test_bad_llama_keys_are_one_line_naming_file_and_key(tmp_path, changes, key):
    data = yaml.safe_load((MODELS_DIR / "llama-tiny.yaml").read_text())
    path = _write(tmp_path, {**data, **changes})
    with pytest.raises(ConfigError) as err:
        load_model_config(path)
    assert err.value.key == key and str(path) in str(err.value) and "\n" not in str(err.value)


def test_llama_keys_are_refused_for_other_families(tmp_path):
    data = yaml.safe_load((MODELS_DIR / "gpt-tiny.yaml").read_text())
    with pytest.raises(ConfigError, match="num_kv_heads: applies to family llama only"):
        load_model_config(_write(tmp_path, {**data, "num_kv_heads": 2}))


def test_gpt_and_bert_fingerprints_are_unchanged_by_the_llama_keys():
    # the fingerprints mpress wrote into plans and profiles before the Llama family existed
    assert load_model_config("gpt-tiny").fingerprint() == "57c0ae600d43035f"
    assert load_model_config("bert-tiny").fingerprint() == "971d1cb1a3e9d0e9"
    assert load_model_config("gpt-20.4b").fingerprint() == "a35a0931419fa8fa"


def test_llama_fingerprint_covers_its_keys():
    base = _cfg()
    prints = {base.fingerprint()} | {_cfg(**c).fingerprint() for c in [
        {"num_kv_heads": 4}, {"attention": "sdpa"}, {"rope_theta": 5e5}, {"norm_eps": 1e-6}]}
    assert len(prints) == 5
    assert _cfg(num_kv_heads=4).fingerprint() == _cfg(num_kv_heads=None).fingerprint()  # the same model


# -- stages and behaviour ------------------------------------------------------------------------

def test_stage_paths_and_parameters_match_the_whole_model():
    cfg = _cfg()
    whole = build_model(cfg, seed=7)
    modules = dict(whole.named_modules())
    for name in ["embed.tok", "layers.1.attn_norm", "layers.1.attn.k_proj", "layers.1.mlp.gate_proj", "head.norm",
                 "head.out"]:
        assert name in modules
    state = whole.state_dict()
    for first, end in [(0, 2), (2, 4), (4, 6), (3, 4)]:
        stage = build_stage(cfg, first, end, seed=7)
        assert stage.layer_names() == layer_names(cfg)[first:end]
        for key, value in stage.state_dict().items():
            assert torch.equal(value, state[key]), key


def test_chained_stages_compute_the_whole_model():
    cfg = _cfg()
    whole = build_model(cfg, seed=3).eval()
    ids, _ = example_batch(cfg, 2)
    x = ids
    with torch.no_grad():
        for a, b in [(0, 2), (2, 5), (5, 6)]:
            x = build_stage(cfg, a, b, seed=3).eval()(x)
        assert torch.equal(x, whole(ids))


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_eager_and_sdpa_attention_compute_the_same_model(kv):
    eager, sdpa = _cfg(num_kv_heads=kv), _cfg(num_kv_heads=kv, attention="sdpa")
    ids, targets = example_batch(eager, 2)
    out = []
    for cfg in (eager, sdpa):
        model = build_model(cfg, seed=5)
        loss = lm_loss(model(ids), targets)
        loss.backward()
        out.append((loss.detach(), model.layers[0].attn.k_proj.weight.grad))
    assert torch.allclose(out[0][0], out[1][0], atol=1e-5)
    assert torch.allclose(out[0][1], out[1][1], atol=1e-5)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_is_causal(attention):
    cfg = _cfg(attention=attention)
    model = build_model(cfg, seed=0).eval()
    ids, targets = example_batch(cfg, 1)
    assert torch.equal(ids[:, 1:], targets[:, :-1])  # next-token targets
    changed = ids.clone()
    changed[0, 20] = (changed[0, 20] + 1) % cfg.vocab_size
    with torch.no_grad():
        diff = (model(ids) - model(changed)).abs().amax(dim=-1)[0]  # (T,)
    assert diff[20:].gt(0).all() and diff[:20].eq(0).all()


def test_rotary_scores_depend_on_relative_position_only():
    torch.manual_seed(0)
    hd, t = 16, 12
    cos, sin = rotary_tables(t, hd, 10000.0, torch.float64, torch.device("cpu"))
    q, k = torch.randn(hd, dtype=torch.float64), torch.randn(hd, dtype=torch.float64)
    qs = apply_rotary(q.expand(1, 1, t, hd), cos, sin)[0, 0]  # q at every position
    ks = apply_rotary(k.expand(1, 1, t, hd), cos, sin)[0, 0]
    scores = qs @ ks.T  # (T, T): q at i against k at j
    for offset in range(-3, 4):
        diag = torch.diagonal(scores, offset)
        assert torch.allclose(diag, diag[0].expand_as(diag))
    assert not torch.allclose(torch.diagonal(scores, 0)[0], torch.diagonal(scores, 1)[0])
    assert torch.allclose(qs.norm(dim=-1), q.norm().expand(t))  # a rotation


def test_tiny_llama_learns_a_fixed_batch():
    torch.manual_seed(0)
    cfg = _cfg()
    model = build_model(cfg)
    ids, targets = example_batch(cfg, 4)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = lm_loss(model(ids), targets)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < 0.5 * losses[0]
