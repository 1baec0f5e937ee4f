"""The contract of mpress's Hugging Face chains: they compute what transformers computes.

For every family mpress finds the layers of (`tests/models/hf_families.py`: GPT-2, Llama,
Mistral with a sliding window, Qwen2 with and without one, Phi, Phi-3 with and without
one, Gemma, Gemma2 with soft-capping, GPT-NeoX, OPT with and without projections, BERT,
RoBERTa; Mixtral, Qwen3 and Starcoder2 with windows, OLMo-2), under every attention implementation the family takes, the chain's logits
are `torch.equal` to `model(ids).logits` of the transformers model holding the same
weights, in fp32 on CPU -- bit for bit, since the chain calls the same modules with the
same side inputs in the same op order -- in eval mode and in train mode (the same dropout
draws under the same seed), and so are the stages of it chained, and mpress's loss
(`lm_loss`) is `torch.equal` to the model's own (`labels=`). Sequences are longer than
every sliding window. What the chain cannot carry is refused in one line naming the module
and the argument.
"""

from __future__ import annotations

import pytest
import torch

from mpress.errors import UserError
from mpress.models.hf_config import IGNORE_INDEX, lm_loss
from mpress.models.hf_layers import build_chain
from mpress.models.hf_layout import find_layout, layout_from_patterns

from .hf_families import SEQ_LEN, build_hf, family_configs, is_masked_lm

transformers = pytest.importorskip("transformers")
# transformers' mask helpers warn (FutureWarning) when called the pre-5.x way (`past_key_values=`)
pytestmark = pytest.mark.filterwarnings("error::FutureWarning")

CONFIGS = family_configs()
CASES = [(label, attention) for label in CONFIGS for attention in ("eager", "sdpa")
         if not (label == "gemma2" and attention == "sdpa")]  # Gemma2 refuses SDPA (soft-capping)


def _batch(label: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of `SEQ_LEN` ids (no pad ids) and their targets (masked LM: 1 in 4)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 128, (2, SEQ_LEN), generator=g)  # (B, T)
    if not is_masked_lm(label):
        return ids, ids.clone()
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, ::4] = ids[:, ::4]
    return ids, targets


def _model(label: str, attention: str, **overrides: object) -> torch.nn.Module:
    config = CONFIGS[label].__class__.from_dict({**CONFIGS[label].to_dict(), **overrides})
    config._attn_implementation = attention
    return build_hf(config)


@pytest.mark.parametrize("label,attention", CASES)
def test_the_chain_computes_the_transformers_logits_and_loss(label, attention):
    model = _model(label, attention)
    chain = build_chain(model, find_layout(model)).eval()
    ids, targets = _batch(label)
    masked = is_masked_lm(label)
    with torch.no_grad():
        ours, theirs = chain(ids), model(ids, labels=targets)
        assert torch.equal(ours, theirs.logits), (ours - theirs.logits).abs().max()
        assert torch.equal(lm_loss(ours, targets, masked=masked), theirs.loss)
        names = chain.layer_names()
        x = ids
        for layers in (names[:2], names[2:-1], names[-1:]):  # three stages, one tensor between them
            x = chain.stage(layers)(x)
        assert torch.equal(x, theirs.logits)


@pytest.mark.parametrize("label", ["gpt2", "phi", "gpt-neox", "opt", "bert"])
def test_the_chain_draws_the_same_dropout_in_training(label):
    """Dropout on: the chain calls the same dropout modules in the same order, so under
    one seed both draw the same masks."""
    rates = {"gpt2": {"embd_pdrop": 0.2, "resid_pdrop": 0.2, "attn_pdrop": 0.2},
             "phi": {"embd_pdrop": 0.2, "resid_pdrop": 0.2}, "gpt-neox": {"hidden_dropout": 0.2, "attention_dropout": 0.2}, "opt": {"dropout": 0.2},
             "bert": {"hidden_dropout_prob": 0.2}}[label]
    model = _model(label, "eager", **rates).train()
    chain = build_chain(model, find_layout(model)).train()
    ids, _ = _batch(label)
    with torch.no_grad():
        torch.manual_seed(5)
        ours = chain(ids)
        torch.manual_seed(5)
        theirs = model(ids).logits
        torch.manual_seed(6)
        other = chain(ids)
    assert torch.equal(ours, theirs) and not torch.equal(ours, other)


def test_sliding_windows_come_from_the_config():
    """Mistral: every block slides; Qwen2: the blocks `layer_types` names; Gemma2 too, and its
    head soft-caps."""
    mistral, qwen2, gemma2 = (_model(label, "eager") for label in ("mistral-sliding", "qwen2-sliding", "gemma2"))
    assert find_layout(mistral).attention == ["sliding_attention"] * 3
    assert find_layout(qwen2).attention == ["full_attention", "sliding_attention", "sliding_attention"]
    layout = find_layout(gemma2)
    assert layout.attention == ["sliding_attention", "full_attention", "sliding_attention"]
    assert layout.logit_softcap == 3.0
    assert find_layout(_model("qwen2", "eager")).attention == ["full_attention"] * 3


def test_a_module_the_chain_would_drop_is_refused():
    """OPT's learned positions under user-named layers that leave them out."""
    model = _model("opt", "sdpa")
    layers = ["model.decoder.embed_tokens", "model.decoder.layers.*", "model.decoder.final_layer_norm", "lm_head"]
    with pytest.raises(UserError, match=r"^model\.decoder\.embed_positions: .*no part of mpress's chain"):
        layout_from_patterns(model, layers)


def test_an_attention_kind_without_a_mask_is_refused():
    model = _model("qwen2", "sdpa")
    model.config.layer_types = ["full_attention", "chunked_attention", "full_attention"]
    with pytest.raises(UserError, match=r"^model\.layers\.1: config\.layer_types says 'chunked_attention'"):
        find_layout(model)


def test_random_layer_drop_is_refused():
    with pytest.raises(UserError, match=r"^model\.decoder\.layers: config\.layerdrop=0\.1"):
        find_layout(_model("opt", "sdpa", layerdrop=0.1))


def test_a_scaling_outside_the_modules_is_refused():
    """Granite scales its logits in its model's forward (`logits_scaling`), no module does;
    a scale of 1 scales nothing, and the chain computes Granite's logits."""
    if not hasattr(transformers, "GraniteConfig"):
        pytest.skip("this transformers has no Granite")
    sizes = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "max_position_embeddings": 64}
    with pytest.raises(UserError, match=r"^GraniteForCausalLM: config\.logits_scaling=4\.0"):
        find_layout(build_hf(transformers.GraniteConfig(**sizes, logits_scaling=4.0)))
    model = build_hf(transformers.GraniteConfig(**sizes))  # every multiplier 1
    ids, _ = _batch("granite")
    with torch.no_grad():
        assert torch.equal(build_chain(model, find_layout(model)).eval()(ids), model(ids).logits)


def test_a_block_argument_the_chain_does_not_make_is_refused():
    class NeedsMemory(torch.nn.Module):
        def forward(self, hidden_states: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
            return hidden_states + memory

    model = _model("llama", "sdpa")
    model.model.layers[1] = NeedsMemory()
    with pytest.raises(UserError, match=r"^model\.layers\.1: NeedsMemory\.forward needs memory"):
        find_layout(model)


def test_rotary_tables_without_a_rotary_module_are_refused():
    model = _model("llama", "sdpa")
    del model.model.rotary_emb
    with pytest.raises(UserError, match=r"^model\.layers\.0: LlamaDecoderLayer takes position_embeddings"):
        find_layout(model)


def test_a_sliding_window_the_model_code_does_not_place_is_refused():
    """Llama's code makes no sliding-window mask: a `sliding_window` in its config says
    nothing about which blocks slide."""
    model = _model("llama", "sdpa")
    model.config.sliding_window = 4
    with pytest.raises(UserError, match=r"^LlamaForCausalLM: config\.sliding_window=4 without config\.layer_types"):
        find_layout(model)
