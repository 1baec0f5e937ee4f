"""Hugging Face models as mpress chains (`mpress.models.hf_*`), in one process.

The chain of a GPT-2, Llama and BERT model computes what the HF model computes (its side
inputs -- causal masks, positions, rotary tables -- made where they are needed), for
eager and SDPA attention; stages of it chained compute the same; layers are found from
the model's structure or named for any family; tied embeddings become copies listed for
the trainer; fake-tensor profiles give the bytes a real run saves; a profile that finds
nothing saved for a trainable model is refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mpress.errors import ConfigError, UserError
from mpress.hardware.server import load_hardware
from mpress.models.hf_config import batch, resolve_hf
from mpress.models.hf_model import load_hf_model
from mpress.runtime.train_config import load_train_config, model_config
from mpress.static.profile.fake_profile import fake_profile, profile_hf_model

transformers = pytest.importorskip("transformers")

FAMILIES = ["gpt2-tiny", "llama-tiny", "bert-tiny"]
LAYERS = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]


def _hf_model(name: str, attention: str, seed: int = 0) -> nn.Module:
    source = resolve_hf(name)
    config = source.config()
    config._attn_implementation = attention
    auto = transformers.AutoModelForMaskedLM if source.masked_lm else transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    return auto.from_config(config).eval()


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_chain_and_its_stages_compute_the_hf_models_logits(name, attention):
    from mpress.models.hf_layers import build_chain
    from mpress.models.hf_layout import find_layout

    model = _hf_model(name, attention)
    chain = build_chain(model, find_layout(model)).eval()
    assert chain.layer_names() == LAYERS
    ids, _ = batch(resolve_hf(name), 2, seed=1)  # (2, 16)
    with torch.no_grad():
        expected = model(ids).logits  # the HF model's own masks, positions and rotary tables
        assert torch.equal(chain(ids), expected)
        x = ids
        for layers in (LAYERS[:2], LAYERS[2:5], LAYERS[5:]):
            x = chain.stage(layers)(x)
            assert isinstance(x, torch.Tensor)  # one plain tensor between stages, no cache
        assert torch.equal(x, expected)


def test_causal_blocks_are_masked():
    """A token's logits do not depend on later tokens (GPT-2 and Llama); BERT's do."""
    for name, causal in (("gpt2-tiny", True), ("llama-tiny", True), ("bert-tiny", False)):
        chain = load_hf_model(name, microbatch_size=1).module.eval()
        ids = torch.randint(0, 128, (1, 16))
        changed = ids.clone()
        changed[0, -1] = (ids[0, -1] + 1) % 128
        with torch.no_grad():
            same = torch.equal(chain(ids)[0, :-1], chain(changed)[0, :-1])
        assert same is causal, name


def test_layers_named_for_another_family_give_the_same_chain():
    auto = load_hf_model("llama-tiny", microbatch_size=1, seed=3)
    named = load_hf_model("llama-tiny", microbatch_size=1, seed=3,
                          layers=["model.embed_tokens", "model.layers.*", "model.norm", "lm_head"])
    assert named.layers == auto.layers and named.fingerprint() == auto.fingerprint()
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        assert torch.equal(named.module(ids), auto.module(ids))
    with pytest.raises(UserError, match="EMBED, BLOCKS"):
        load_hf_model("llama-tiny", microbatch_size=1, layers=["model.embed_tokens", "lm_head"])


def test_tied_embeddings_become_copies_the_trainer_sums():
    model = load_hf_model("gpt2-tiny", microbatch_size=2)
    stages = model.split([(0, 3), (3, 6)])
    assert model.tied_groups == [[(0, "embed.tokens.weight"), (1, "head.lm_head.weight")]]
    first = stages[0].get_parameter("embed.tokens.weight")
    last = stages[1].get_parameter("head.lm_head.weight")
    assert first is not last and torch.equal(first, last)
    one = load_hf_model("gpt2-tiny", microbatch_size=2)
    whole = one.split([(0, 6)])[0]  # one stage: the tie stays one tensor
    assert one.tied_groups == [] and whole.embed.tokens.weight is whole.head.lm_head.weight
    llama = load_hf_model("llama-tiny", microbatch_size=2)
    llama.split([(0, 3), (3, 6)])
    assert llama.tied_groups == []


@pytest.mark.parametrize("name", FAMILIES)
def test_fake_profile_saves_what_a_real_run_saves(name):
    hardware = load_hardware("cpu-local")
    fake = profile_hf_model(name, microbatch_size=2, hardware=hardware, fake=True)
    real = profile_hf_model(name, microbatch_size=2, hardware=hardware, fake=False, warmup=0, iters=1)
    assert fake.model == real.model == f"hf:{name}" and fake.model_fingerprint == real.model_fingerprint
    assert [x.name for x in fake.layers] == LAYERS
    for f, r in zip(fake.layers, real.layers):
        assert [(s.id, s.shape, s.bytes) for s in f.saved] == [(s.id, s.shape, s.bytes) for s in r.saved], f.name
        assert f.saved_bytes > 0


def test_a_profile_saving_nothing_for_trainable_layers_is_refused():
    class NothingSaved(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.w.sum()  # sum's backward needs only the shape: nothing saved

    with pytest.raises(UserError, match="0 saved bytes"):
        fake_profile(lambda: (NothingSaved(), torch.randn(2, 4)), model_name="nothing-saved",
                     hardware=load_hardware("cpu-local"))


def test_seq_len_is_part_of_the_identity():
    a = load_hf_model("llama-tiny", microbatch_size=1)
    b = load_hf_model("llama-tiny", microbatch_size=1, seq_len=8)
    assert b.example_input[0].shape == (1, 8) and a.fingerprint() != b.fingerprint()
    with pytest.raises(UserError, match="16 positions at most"):
        resolve_hf("llama-tiny", seq_len=17)


def test_train_config_takes_an_hf_config(tmp_path):
    config = json.loads(resolve_hf("llama-tiny").config_path.read_text())
    (tmp_path / "my-llama.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    (tmp_path / "train.yaml").write_text("hf_config: my-llama.json\nseq_len: 8\nmicrobatch_size: 2\n"
                                         "num_microbatches: 2\nnum_stages: 2\n")
    cfg = load_train_config(tmp_path / "train.yaml")
    assert cfg.hf_config == str(tmp_path / "my-llama.json")  # relative to the config file
    model = model_config(cfg)
    assert model.layers == ["embed", "blocks.0", "blocks.1", "head"] and model.microbatch_size == 2
    (x,), y = model.batch(step=0, num_microbatches=2, seed=0)
    assert x.shape == y.shape == (4, 8) and int(x.max()) < 128

    bad = {"hf_config: no-such-model\n": "hf_config", "hf_config: llama-tiny\nmodel: gpt-tiny\n": "model",
           "hf_config: llama-tiny\nnum_stages: 7\nnum_microbatches: 7\n": "num_stages",
           "model: gpt-tiny\nseq_len: 8\n": "seq_len", "hf_config: llama-tiny\nseq_len: 99\n": "seq_len"}
    for text, key in bad.items():
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(ConfigError) as exc:
            load_train_config(tmp_path / "bad.yaml")
        assert exc.value.key == key and "\n" not in str(exc.value), (text, str(exc.value))


def test_local_weights_are_loaded_not_drawn(tmp_path):
    model = _hf_model("gpt2-tiny", "sdpa", seed=7)
    model.save_pretrained(tmp_path / "weights")
    loaded = load_hf_model(str(tmp_path / "weights"), microbatch_size=1, seed=0)
    assert loaded.source.weights_dir == tmp_path / "weights"
    assert torch.equal(loaded.module.embed.tokens.weight, model.transformer.wte.weight)


def test_a_model_with_dropout_profiles_on_fake_tensors(tmp_path):
    """HF's GPT-2 defaults: dropout after the embedding and in every block (CPU dropout
    writes in place, which the layer probe's op-level recompute must not cache)."""
    config = json.loads(resolve_hf("gpt2-tiny").config_path.read_text())
    (tmp_path / "gpt2-dropout.json").write_text(json.dumps({**config, "embd_pdrop": 0.1, "resid_pdrop": 0.1}))
    path, hardware = str(tmp_path / "gpt2-dropout.json"), load_hardware("cpu-local")
    fake = profile_hf_model(path, microbatch_size=2, hardware=hardware, fake=True)
    real = profile_hf_model(path, microbatch_size=2, hardware=hardware, fake=False, warmup=0, iters=1)
    assert [x.saved_bytes for x in fake.layers] == [x.saved_bytes for x in real.layers]
    assert fake.layers[0].saved_bytes > 0  # the embedding's dropout mask


@pytest.mark.parametrize("label", ["mistral-sliding", "qwen2-sliding", "gemma2", "opt-projected", "roberta"])
def test_fake_profiles_of_more_families_save_what_a_real_run_saves(tmp_path, label):
    """Sliding-window masks, soft-capping, OPT's positions and projections and RoBERTa's
    positions made on fake tensors save the bytes a real run saves."""
    from tests.models.hf_families import family_configs, is_masked_lm

    config = family_configs()[label]
    if is_masked_lm(label):
        config.architectures = ["RobertaForMaskedLM"]
    config.save_pretrained(tmp_path)
    path, hardware = str(tmp_path / "config.json"), load_hardware("cpu-local")
    fake = profile_hf_model(path, microbatch_size=2, hardware=hardware, fake=True, seq_len=16)
    real = profile_hf_model(path, microbatch_size=2, hardware=hardware, fake=False, seq_len=16, warmup=0, iters=1)
    assert fake.model_fingerprint == real.model_fingerprint
    for f, r in zip(fake.layers, real.layers, strict=True):
        assert [(s.id, s.shape, s.bytes) for s in f.saved] == [(s.id, s.shape, s.bytes) for s in r.saved], f.name
