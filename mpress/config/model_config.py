"""Model presets: GPT (decoder), BERT (encoder) and Llama (decoder) families as typed configs.

Loaded from `configs/models/<name>.yaml`. Shared by the static half (analytic profiler,
planner) and the runtime (reference models), so it lives outside both.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from mpress.config.loader import from_dict, load_yaml, to_dict
from mpress.errors import ConfigError
from mpress.config.presets import CONFIG_DIR, resolve_config
from mpress.config.limits import MAX_LAYERS, MAX_VOCAB, MAX_WIDTH

MODELS_DIR = CONFIG_DIR / "models"

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}

LLAMA_KEYS = ("num_kv_heads", "attention", "rope_theta", "norm_eps")
"""Keys only the Llama family reads: other families must leave them at their defaults, and
they enter the fingerprint of Llama models only (so GPT/BERT fingerprints never change)."""

LLAMA_FFN_MULTIPLE = 256
"""Llama's default MLP width: 2/3 x 4h rounded up to a multiple of this (Meta's `multiple_of`)."""


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """A transformer of the GPT, BERT or Llama family."""

    name: str
    """Preset name, e.g. gpt-5.3b."""
    family: Literal["gpt", "bert", "llama"]
    """gpt: causal decoder with LM head; bert: bidirectional encoder with MLM head; llama:
    causal decoder with RMSNorm, rotary positions, SwiGLU MLP and grouped-query attention."""
    num_layers: int = field(metadata={"min": 1, "max": MAX_LAYERS})
    """Transformer blocks."""
    hidden_size: int = field(metadata={"min": 1, "max": MAX_WIDTH})
    """Model width h."""
    num_heads: int = field(metadata={"min": 1, "max": MAX_WIDTH})
    """Attention heads; must divide hidden_size."""
    ffn_hidden_size: int | None = field(default=None, metadata={"min": 1, "max": 4 * MAX_WIDTH})
    """MLP inner width; default 4 x hidden_size (llama: 8/3 x hidden_size rounded up to a
    multiple of 256)."""
    seq_len: int = field(metadata={"min": 1, "max": MAX_WIDTH})
    """Tokens per sequence."""
    vocab_size: int = field(metadata={"min": 2, "max": MAX_VOCAB})
    """Vocabulary size."""
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    """fp32, or fp16/bf16 mixed precision with fp32 master weights."""
    optimizer: Literal["adam"] = "adam"
    """Optimizer; Adam keeps two fp32 states per parameter."""
    dropout: float = field(default=0.1, metadata={"min": 0, "max": 0.99})
    """Dropout probability (gpt/bert: attention probabilities, attention output, MLP output,
    embeddings; llama: attention probabilities only, as Hugging Face's attention_dropout)."""
    num_kv_heads: int | None = field(default=None, metadata={"min": 1, "max": MAX_WIDTH})
    """llama: key/value heads of grouped-query attention; must divide num_heads; default
    num_heads (plain multi-head attention)."""
    attention: Literal["eager", "sdpa"] = "eager"
    """llama: eager (explicit softmax(q k^T) v, whose scores and probabilities autograd
    saves) or sdpa (`scaled_dot_product_attention`, which saves q, k, v, its output and
    the log-sum-exp)."""
    rope_theta: float = field(default=10000.0, metadata={"gt": 0})
    """llama: base of the rotary position embedding frequencies (Llama 2: 1e4, Llama 3: 5e5)."""
    norm_eps: float = field(default=1e-5, metadata={"gt": 0, "max": 1})
    """llama: epsilon added to the mean square in RMSNorm."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError("", "num_heads", f"must divide hidden_size ({self.hidden_size} % {self.num_heads} != 0)")
        if self.family != "llama":
            for key in LLAMA_KEYS:
                if getattr(self, key) != _DEFAULTS[key]:
                    raise ConfigError("", key, f"applies to family llama only (remove it for family {self.family})")
            return
        if self.num_heads % self.kv_heads:
            raise ConfigError("", "num_kv_heads", f"must divide num_heads ({self.num_heads} % {self.kv_heads} != 0)")
        if self.head_dim % 2:
            raise ConfigError("", "num_heads", f"hidden_size / num_heads must be even for rotary embeddings "
                              f"(got {self.head_dim})")
        if self.attention == "sdpa" and self.dropout > 0:
            raise ConfigError("", "dropout", "must be 0 with attention: sdpa (its dropout saves a different "
                              "random state on each device; use attention: eager for dropout)")

    @property
    def ffn(self) -> int:
        """MLP inner width."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.family == "llama":
            return -(-(8 * self.hidden_size // 3) // LLAMA_FFN_MULTIPLE) * LLAMA_FFN_MULTIPLE
        return 4 * self.hidden_size

    @property
    def kv_heads(self) -> int:
        """Key/value heads (num_heads unless grouped-query attention)."""
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head: hidden_size / num_heads."""
        return self.hidden_size // self.num_heads

    @property
    def causal(self) -> bool:
        """Whether the model is a causal decoder (trained to predict the next token)."""
        return self.family in ("gpt", "llama")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per activation / model-weight element."""
        return DTYPE_BYTES[self.precision]

    @property
    def mixed_precision(self) -> bool:
        return self.precision != "fp32"

    def fingerprint(self) -> str:
        """Stable short hash of everything that shapes the model (not its name)."""
        data = {k: v for k, v in to_dict(self).items() if k != "name"}
        data["ffn_hidden_size"] = self.ffn
        if self.family != "llama":  # the Llama keys are defaults here (checked): hashes stay as they were
            for key in LLAMA_KEYS:
                del data[key]
        else:
            data["num_kv_heads"] = self.kv_heads
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def model_presets() -> list[str]:
    """Names of the shipped model presets."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """Load a model preset name or a YAML path."""
    path = resolve_config(name_or_path, MODELS_DIR, "model")
    return from_dict(ModelConfig, load_yaml(path), str(path))


_DEFAULTS = {f.name: f.default for f in fields(ModelConfig)}
