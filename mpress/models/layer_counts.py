"""The reference models' layer list and closed-form parameter counts, without torch.

Every family (GPT, BERT, Llama: `mpress/models/transformer.py`, `mpress/models/llama.py`)
shares one layer list, from the model's top-level children:

    index 0          "embed"      token (+ position, + BERT token-type) embeddings
    index 1 .. L     "layers.i"   transformer blocks (i = index - 1)
    index L + 1      "head"       final norm + vocabulary projection (+ BERT's transform)

What a layer of each family holds follows from its `ModelConfig` alone, so the counts
are arithmetic here: the analytic profiler and the planner read them without importing
torch (`mpress plan` on a warm probe cache never loads it), and the model modules
re-export them beside the layers they count (a test builds each layer and compares).

Units: parameters (elements); h = hidden size, f = MLP width, V = vocabulary,
T = sequence length.
"""

from __future__ import annotations

from mpress.config.model_config import ModelConfig
from mpress.errors import UserError

NUM_TOKEN_TYPES = 2
"""BERT segment vocabulary; inputs are a single segment (type 0)."""


def layer_name(cfg: ModelConfig, index: int) -> str:
    """Name of layer `index` (0 = embed, 1..L = blocks, L+1 = head)."""
    if index == 0:
        return "embed"
    if index == cfg.num_layers + 1:
        return "head"
    return f"layers.{index - 1}"


def check_layer_range(cfg: ModelConfig, first_layer: int, end_layer: int) -> None:
    """Raise `UserError` unless 0 <= first_layer < end_layer <= L + 2."""
    total = cfg.num_layers + 2
    if not 0 <= first_layer < end_layer <= total:
        raise UserError(
            f"model {cfg.name}: layer range [{first_layer}, {end_layer}) is invalid "
            f"(need 0 <= first < end <= {total}: embed, {cfg.num_layers} blocks, head)"
        )


def layer_names(cfg: ModelConfig) -> list[str]:
    """The layer list of the whole model: embed, layers.0 .. layers.{L-1}, head."""
    return [layer_name(cfg, i) for i in range(cfg.num_layers + 2)]


def llama_layer_num_parameters(cfg: ModelConfig, index: int) -> int:
    """Closed-form parameter count of Llama layer `index` (0 = embed, 1..L = blocks, L+1 = head)."""
    h, f, v = cfg.hidden_size, cfg.ffn, cfg.vocab_size
    if index == 0:
        return v * h
    if index == cfg.num_layers + 1:
        return h + h * v  # norm + out
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.kv_heads * cfg.head_dim
    # two norms + q, k, v, o + gate, up, down
    return 2 * h + (h * q + 2 * h * kv + q * h) + 3 * h * f


def llama_layer_largest_parameter(cfg: ModelConfig, index: int) -> int:
    """Elements of the largest parameter tensor of Llama layer `index`."""
    h = cfg.hidden_size
    if index in (0, cfg.num_layers + 1):
        return cfg.vocab_size * h
    return max(h * cfg.num_heads * cfg.head_dim, h * cfg.ffn)  # q/o or an MLP projection


def layer_num_parameters(cfg: ModelConfig, index: int) -> int:
    """Closed-form parameter count of layer `index` (0 = embed, 1..L = blocks, L+1 = head)."""
    if cfg.family == "llama":
        return llama_layer_num_parameters(cfg, index)
    h, f, v, t = cfg.hidden_size, cfg.ffn, cfg.vocab_size, cfg.seq_len
    bert = cfg.family == "bert"
    if index == 0:
        return v * h + t * h + (NUM_TOKEN_TYPES * h if bert else 0)
    if index == cfg.num_layers + 1:
        if bert:  # ln + dense + dense_ln + out (with bias)
            return 2 * h + (h * h + h) + 2 * h + (h * v + v)
        return 2 * h + h * v  # ln + out (no bias)
    # ln1 + qkv + proj + ln2 + fc1 + fc2
    return 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * f + f) + (f * h + h)


def layer_largest_parameter(cfg: ModelConfig, index: int) -> int:
    """Elements of the largest parameter tensor of layer `index` (0 = embed, 1..L =
    blocks, L+1 = head)."""
    if cfg.family == "llama":
        return llama_layer_largest_parameter(cfg, index)
    h, f, v, t = cfg.hidden_size, cfg.ffn, cfg.vocab_size, cfg.seq_len
    if index == 0:
        return max(v * h, t * h)
    if index == cfg.num_layers + 1:
        return h * v
    return max(3 * h * h, h * f)  # qkv or an MLP projection


def num_parameters(cfg: ModelConfig) -> int:
    """Closed-form parameter count of the whole reference model for `cfg`."""
    return sum(layer_num_parameters(cfg, i) for i in range(cfg.num_layers + 2))
