"""Model presets: GPT (decoder) and BERT (encoder) families as typed configs.

Loaded from `configs/models/<name>.yaml`. Shared by the static half (analytic profiler,
planner) and the runtime (reference models), so it lives outside both.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mpress.config import from_dict, load_yaml, to_dict
from mpress.errors import ConfigError
from mpress.hardware import CONFIG_DIR, resolve_config
from mpress.limits import MAX_LAYERS, MAX_VOCAB, MAX_WIDTH

MODELS_DIR = CONFIG_DIR / "models"

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """A transformer of the GPT or BERT family."""

    name: str
    """Preset name, e.g. gpt-5.3b."""
    family: Literal["gpt", "bert"]
    """gpt: causal decoder with LM head; bert: bidirectional encoder with MLM head."""
    num_layers: int = field(metadata={"min": 1, "max": MAX_LAYERS})
    """Transformer blocks."""
    hidden_size: int = field(metadata={"min": 1, "max": MAX_WIDTH})
    """Model width h."""
    num_heads: int = field(metadata={"min": 1, "max": MAX_WIDTH})
    """Attention heads; must divide hidden_size."""
    ffn_hidden_size: int | None = field(default=None, metadata={"min": 1, "max": 4 * MAX_WIDTH})
    """MLP inner width; default 4 x hidden_size."""
    seq_len: int = field(metadata={"min": 1, "max": MAX_WIDTH})
    """Tokens per sequence."""
    vocab_size: int = field(metadata={"min": 2, "max": MAX_VOCAB})
    """Vocabulary size."""
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    """fp32, or fp16/bf16 mixed precision with fp32 master weights."""
    optimizer: Literal["adam"] = "adam"
    """Optimizer; Adam keeps two fp32 states per parameter."""
    dropout: float = field(default=0.1, metadata={"min": 0, "max": 0.99})
    """Dropout probability (attention probabilities, attention output, MLP output, embeddings)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError("", "num_heads", f"must divide hidden_size ({self.hidden_size} % {self.num_heads} != 0)")

    @property
    def ffn(self) -> int:
        """MLP inner width."""
        return self.ffn_hidden_size or 4 * self.hidden_size

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
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def model_presets() -> list[str]:
    """Names of the shipped model presets."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """Load a model preset name or a YAML path."""
    path = resolve_config(name_or_path, MODELS_DIR, "model")
    return from_dict(ModelConfig, load_yaml(path), str(path))
