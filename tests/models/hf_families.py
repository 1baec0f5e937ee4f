"""Tiny Hugging Face configs of every family mpress builds layer chains for (test data).

The families the issue names (GPT-2, Llama, Mistral, Qwen2, Phi, Phi-3, Gemma, Gemma2,
GPT-NeoX, OPT, BERT, RoBERTa) and a few more of the same structures (Mixtral, Qwen3,
Starcoder2, OLMo-2).

Each config is as small as the family allows (32 hidden, 3 blocks, a 128-token
vocabulary) and, where the family has sliding-window attention, a window (4) shorter than
the test sequence (`SEQ_LEN`), so a chain that attended to everything would differ.
"""

from __future__ import annotations

from typing import Any

SEQ_LEN = 16
"""Tokens per test sequence: longer than every sliding window below."""
WINDOW = 4
"""Sliding window of the families that have one."""
_SIZES = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 4, "max_position_embeddings": 64}


def family_configs() -> dict[str, Any]:
    """Family label -> a tiny `transformers` config (built here, never downloaded)."""
    import transformers as t

    causal = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    return {
        "gpt2": t.GPT2Config(vocab_size=128, n_embd=32, n_layer=3, n_head=4, n_positions=64, **causal),
        "llama": t.LlamaConfig(**_SIZES, num_key_value_heads=2, **causal),
        "mistral-sliding": t.MistralConfig(**_SIZES, num_key_value_heads=2, sliding_window=WINDOW, **causal),
        "qwen2": t.Qwen2Config(**_SIZES, num_key_value_heads=2, **causal),
        "qwen2-sliding": t.Qwen2Config(**_SIZES, num_key_value_heads=2, use_sliding_window=True,
                                       sliding_window=WINDOW, max_window_layers=1, **causal),
        "phi": t.PhiConfig(**_SIZES, **causal),
        "phi3": t.Phi3Config(**_SIZES, **causal),
        "phi3-sliding": t.Phi3Config(**_SIZES, sliding_window=WINDOW, **causal),
        "gemma": t.GemmaConfig(**_SIZES, head_dim=8, num_key_value_heads=2, **causal),
        "gemma2": t.Gemma2Config(**_SIZES, head_dim=8, num_key_value_heads=2, sliding_window=WINDOW,
                                 final_logit_softcapping=3.0, attn_logit_softcapping=5.0, **causal),
        "gpt-neox": t.GPTNeoXConfig(**_SIZES, **causal),
        "opt": t.OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=3, num_attention_heads=4,
                           max_position_embeddings=64, word_embed_proj_dim=32, **causal),
        "opt-projected": t.OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=3,
                                     num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=16,
                                     **causal),
        "mixtral-sliding": t.MixtralConfig(**_SIZES, num_key_value_heads=2, num_local_experts=2,
                                           sliding_window=WINDOW, **causal),
        "qwen3-sliding": t.Qwen3Config(**_SIZES, head_dim=8, num_key_value_heads=2, use_sliding_window=True,
                                       sliding_window=WINDOW, max_window_layers=1, **causal),
        "starcoder2-sliding": t.Starcoder2Config(**_SIZES, num_key_value_heads=2, sliding_window=WINDOW, **causal),
        "olmo2": t.Olmo2Config(**_SIZES, num_key_value_heads=2, **causal),
        "bert": t.BertConfig(**_SIZES, pad_token_id=0),
        "roberta": t.RobertaConfig(**_SIZES, pad_token_id=1),
    }


def is_masked_lm(label: str) -> bool:
    """The encoder families train as masked LMs."""
    return label in ("bert", "roberta")


def build_hf(config: Any, *, seed: int = 0) -> Any:
    """The family's LM head model with random weights under `seed`, in eval mode."""
    import torch
    import transformers as t

    masked = config.model_type in ("bert", "roberta")
    auto = t.AutoModelForMaskedLM if masked else t.AutoModelForCausalLM
    torch.manual_seed(seed)
    return auto.from_config(config).eval()
