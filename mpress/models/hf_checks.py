"""What a Hugging Face config must be before mpress builds it: checks on the raw config.json.

Each check reads the config's JSON (a dict) and raises a one-line `UserError` naming the
config and the key, before transformers builds anything (a negative size would otherwise
reach `nn.Linear` and end in a traceback, an encoder-decoder would be split as if it were
one chain):

- `check_config_values`: the sizes and counts a model is made of are positive integers,
  dropout probabilities lie in [0, 1];
- `check_supported`: the model is a language model mpress can chain: not an
  encoder-decoder (T5, BART), one with a causal or masked LM head in transformers (not
  ViT or CLIP's vision tower), and no block that takes an ALiBi bias (Falcon with
  `alibi: true`, BLOOM, MPT), which the chain does not make;
- `position_offset`: where a family's learned positions start (RoBERTa's at
  `pad_token_id + 1`), so the longest sequence is the table's rows less that offset.
"""

from __future__ import annotations

from typing import Any

from mpress.errors import UserError

POSITIVE_KEYS = (
    "vocab_size", "hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "ffn_dim",
    "num_hidden_layers", "n_layer", "num_layers", "num_attention_heads", "n_head", "num_key_value_heads",
    "head_dim", "max_position_embeddings", "n_positions", "n_ctx", "type_vocab_size",
)
"""Sizes and counts: each, where the config sets it (not null), a positive integer."""
PROBABILITY_SUFFIXES = ("dropout", "_pdrop", "dropout_prob")
"""Keys ending so are probabilities in [0, 1]."""
PADDING_OFFSET_TYPES = ("roberta", "xlm-roberta", "camembert", "roberta-prelayernorm", "data2vec-text", "xmod")
"""Families whose position ids start at `pad_token_id + 1` (RoBERTa's
`create_position_ids_from_input_ids`). OPT's learned positions start at 2 too, but its
table has `max_position_embeddings + 2` rows: all `max_position_embeddings` fit."""
ENCODER_DECODER_TYPES = ("t5", "mt5", "umt5", "longt5", "bart", "mbart", "pegasus", "pegasus_x", "marian",
                         "blenderbot", "blenderbot-small", "led", "m2m_100", "prophetnet", "switch_transformers",
                         "bigbird_pegasus", "plbart", "fsmt", "nllb-moe", "seamless_m4t", "whisper")


def check_config_values(data: dict[str, Any], name: str) -> None:
    """Refuse a size or count that is not a positive integer, or a dropout probability
    outside [0, 1], in one line naming `name` and the key."""
    for key in POSITIVE_KEYS:
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"hf_config {name}: {key} must be a positive integer, got {value!r}")
    for key, value in data.items():
        if key.endswith(PROBABILITY_SUFFIXES) and value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise UserError(f"hf_config {name}: {key} is a probability in [0, 1], got {value!r}")
    hidden = data.get("hidden_size", data.get("n_embd"))
    heads = data.get("num_attention_heads", data.get("n_head"))
    if hidden is not None and heads is not None and data.get("head_dim") is None and hidden % heads:
        key = "num_attention_heads" if "num_attention_heads" in data else "n_head"
        raise UserError(f"hf_config {name}: {key} {heads} does not divide the hidden size {hidden}")
    kv = data.get("num_key_value_heads")
    if kv is not None and heads is not None and heads % kv:
        raise UserError(f"hf_config {name}: num_key_value_heads {kv} does not divide num_attention_heads {heads}")


def check_supported(data: dict[str, Any], name: str) -> None:
    """Refuse, in one line, a model mpress cannot train as a chain of layers (see the
    module docstring). A user's own layout (`layers:`) does not lift these refusals: they
    are about the model's task and its blocks' inputs, not about finding its modules."""
    model_type = str(data.get("model_type"))
    if _is_encoder_decoder(data, model_type):
        raise UserError(f"hf_config {name}: encoder-decoder models are not supported (model_type {model_type}): "
                        "mpress trains a decoder-only causal LM or an encoder masked LM")
    masked = any(str(a).endswith("ForMaskedLM") for a in data.get("architectures") or [])
    heads = _lm_types(masked)
    if heads is not None and model_type not in heads:
        task = "masked" if masked else "causal"
        raise UserError(f"hf_config {name}: model_type {model_type} has no {task} language-model head in "
                        "transformers; mpress trains language models (a ...ForCausalLM or ...ForMaskedLM)")
    # BLOOM's and MPT's blocks always take one (transformers' MptModel builds it whatever
    # attn_config says); Falcon's where `alibi` is set
    alibi = model_type in ("bloom", "mpt") or (model_type == "falcon" and bool(data.get("alibi")))
    if alibi:
        key = "alibi" if model_type == "falcon" else "model_type"
        raise UserError(f"hf_config {name}: {model_type} blocks with ALiBi attention ({key}) take an alibi bias "
                        "the chain does not make; not supported" + (" (alibi: false is)" if model_type == "falcon"
                                                                    else ""))


def position_offset(data: dict[str, Any]) -> int:
    """Positions before the first one a sequence uses: `pad_token_id + 1` for the RoBERTa
    family (`PADDING_OFFSET_TYPES`), else 0."""
    if data.get("model_type") in PADDING_OFFSET_TYPES:
        pad = data.get("pad_token_id")
        return (pad if isinstance(pad, int) and pad >= 0 else 1) + 1
    return 0


def _is_encoder_decoder(data: dict[str, Any], model_type: str) -> bool:
    if "is_encoder_decoder" in data:
        return bool(data["is_encoder_decoder"])
    if model_type in ENCODER_DECODER_TYPES:
        return True
    try:
        from transformers import CONFIG_MAPPING

        return bool(CONFIG_MAPPING[model_type]().is_encoder_decoder)
    except Exception:  # no transformers, an unknown type: building it says so
        return False


def _lm_types(masked: bool) -> frozenset[str] | None:
    """The model types transformers has a causal (masked) LM class for; None without
    transformers (building the model then says it is missing)."""
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return None
    names = (modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES if masked
             else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return frozenset(names)
