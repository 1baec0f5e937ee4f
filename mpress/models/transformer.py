"""Reference GPT (causal decoder) and BERT (bidirectional encoder) models in plain PyTorch,
and the stage layout every family shares (Llama's layers are in `mpress/models/llama.py`).

Both families share one pre-LayerNorm block (as Megatron-LM builds GPT and BERT):

    x = x + Dropout(Proj(Attention(LN1(x))))
    x = x + Dropout(FC2(GELU(FC1(LN2(x)))))

Attention is written out (q @ k^T, scale, causal bias, softmax, dropout, @ v) instead of
calling SDPA, so that attention scores and probabilities are ordinary tensors autograd
saves, which the profilers can see and the runtime can swap or recompute.

Layer list (the names a `Profile` uses), from the model's top-level children:

    "embed"                       token (+ position, + BERT token-type) embeddings, dropout
    "layers.0" ... "layers.{L-1}" transformer blocks
    "head"                        GPT: LayerNorm + vocabulary projection
                                  BERT: dense + GELU + LayerNorm + vocabulary projection
                                  Llama: RMSNorm + vocabulary projection

`TransformerStage` takes each family's embedding, block and head (`_PARTS`), so stages,
`build_stage` and everything built on them (the runtime, the profilers) serve all families.

Layer index i (0 = embed, 1..L = blocks, L+1 = head) is what `build_stage` slices; a
stage's `named_modules()` paths are those of the whole model (a stage holding blocks 3..5
has `layers.3`, `layers.4`, `layers.5`), so plans and profiles name tensors the same way
in both. The LM head is untied from the token embedding so that stages are independent.

Parameter init is deterministic per layer: layer i draws from a generator seeded with
`(seed, i)`, so a stage built on its own holds exactly the parameters of the same layers
of the whole model built with the same seed. Without an explicit seed, the seed is drawn
from torch's global RNG (so `torch.manual_seed` fixes it).

Mixed precision (fp16/bf16) is "half model" style: `build_model` casts parameters to the
half dtype, and the fp32 master weights live in the optimizer (see the analytic profiler).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mpress.config.model_config import ModelConfig
from mpress.models import llama
from mpress.models.dropout import Dropout
from mpress.models.layer_counts import (  # noqa: F401  (the layer list's arithmetic, re-exported)
    NUM_TOKEN_TYPES,
    check_layer_range,
    layer_largest_parameter,
    layer_name,
    layer_names,
    layer_num_parameters,
    num_parameters,
)

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

INIT_STD = 0.02
"""Standard deviation of the normal init of linear and embedding weights (GPT-2/BERT)."""

class Embedding(nn.Module):
    """Token + learned position (+ BERT token-type) embeddings, then dropout.

    (B, T) int64 token ids -> (B, T, h). Position and token-type tables are indexed by a
    slice / a row, so autograd saves no index tensor for them; only `tok` saves its ids.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.token_type = nn.Embedding(NUM_TOKEN_TYPES, cfg.hidden_size) if cfg.family == "bert" else None
        self.drop = Dropout(cfg.dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tok(ids) + self.pos.weight[:t]  # (B, T, h)
        if self.token_type is not None:
            x = x + self.token_type.weight[0]  # single segment: every token has type 0
        return self.drop(x)


class Attention(nn.Module):
    """Multi-head self-attention with explicit score/probability tensors."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.head_dim = h // cfg.num_heads
        self.causal = cfg.family == "gpt"
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.attn_drop = Dropout(cfg.dropout)
        self.resid_drop = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        nh, hd = self.num_heads, self.head_dim
        q, k, v = self.qkv(x).split(h, dim=2)  # 3 x (B, T, h)
        # Scale q before the product (a multiply by a constant saves nothing). Heads are
        # made contiguous so the batched products save one (B*nh, ., .) tensor per
        # operand with storage of its own, whatever nh is (never a view of qkv).
        q = (q * (1.0 / math.sqrt(hd))).view(b, t, nh, hd).transpose(1, 2).contiguous()  # (B, nh, T, hd)
        k = k.view(b, t, nh, hd).transpose(1, 2).contiguous()  # (B, nh, T, hd)
        v = v.view(b, t, nh, hd).transpose(1, 2).contiguous()  # (B, nh, T, hd)
        scores = q @ k.transpose(-2, -1)  # (B, nh, T, T)
        if self.causal:
            # Additive 0/-inf bias built per call: an add saves nothing for backward
            # (masked_fill would save its mask), and no buffer has to survive meta init.
            bias = torch.full((t, t), float("-inf"), dtype=scores.dtype, device=scores.device).triu(1)
            scores = scores + bias
        probs = self.attn_drop(scores.softmax(dim=-1))  # (B, nh, T, T)
        y = (probs @ v).transpose(1, 2).reshape(b, t, h)  # (B, T, h)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """h -> ffn -> h with GELU and output dropout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden_size)
        self.drop = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: (B, T, h) -> (B, T, h)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """(B, T, h) -> (B, T, vocab) logits.

    GPT: final LayerNorm + projection without bias (GPT-2). BERT: the MLM transform
    (dense + GELU + LayerNorm) + projection with bias; since the blocks are pre-LN, the
    BERT head also starts with the final LayerNorm of the residual stream.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.ln = nn.LayerNorm(h)
        bert = cfg.family == "bert"
        self.dense = nn.Linear(h, h) if bert else None
        self.act = nn.GELU() if bert else None
        self.dense_ln = nn.LayerNorm(h) if bert else None
        self.out = nn.Linear(h, cfg.vocab_size, bias=bert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln(x)
        if self.dense is not None:
            x = self.dense_ln(self.act(self.dense(x)))
        return self.out(x)


class BlockList(nn.ModuleDict):
    """Transformer blocks keyed by their index in the whole model ("3", "4", ...).

    Acts like the `nn.ModuleList` of a whole model: `blocks[3]` (int or str key) is block
    3, iteration yields the blocks in order, so a stage's module paths read `layers.3...`.
    """

    def __getitem__(self, key: int | str) -> nn.Module:  # type: ignore[override]
        return super().__getitem__(str(key))

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


class TransformerStage(nn.Module):
    """Consecutive layers `[first_layer, end_layer)` of a reference model.

    Children keep the whole model's names: `embed`, `layers` (a `BlockList` keyed by the
    global block index, so paths read `layers.3...`), `head`; absent parts are None. The
    whole model is the stage `[0, L + 2)`.
    """

    def __init__(self, cfg: ModelConfig, first_layer: int, end_layer: int) -> None:
        super().__init__()
        check_layer_range(cfg, first_layer, end_layer)
        self.cfg = cfg
        self.first_layer = first_layer
        self.end_layer = end_layer
        last = cfg.num_layers + 1
        embed, block, head = _PARTS[cfg.family]
        self.embed = embed(cfg) if first_layer == 0 else None
        blocks = range(max(first_layer, 1) - 1, min(end_layer, last) - 1)
        self.layers = BlockList({str(i): block(cfg) for i in blocks})
        self.head = head(cfg) if end_layer == last + 1 else None

    def layer_names(self) -> list[str]:
        """Profile layer names held by this stage, in execution order."""
        return [layer_name(self.cfg, i) for i in range(self.first_layer, self.end_layer)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.layers.values():
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


_PARTS: dict[str, tuple[type[nn.Module], type[nn.Module], type[nn.Module]]] = {
    "gpt": (Embedding, Block, Head),
    "bert": (Embedding, Block, Head),
    "llama": (llama.Embedding, llama.Block, llama.Head),
}
"""Per family: (embedding, block, head) module classes, each built from a `ModelConfig`."""


def _layer_modules(stage: TransformerStage) -> list[tuple[int, nn.Module]]:
    out: list[tuple[int, nn.Module]] = []
    if stage.embed is not None:
        out.append((0, stage.embed))
    out += [(int(k) + 1, block) for k, block in stage.layers.items()]
    if stage.head is not None:
        out.append((stage.cfg.num_layers + 1, stage.head))
    return out


@torch.no_grad()
def _init_layer(module: nn.Module, generator: torch.Generator) -> None:
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            # Drawn in fp32 on the CPU so every dtype/device gets the same values.
            w = torch.empty(sub.weight.shape).normal_(0.0, INIT_STD, generator=generator)
            sub.weight.copy_(w)
            if isinstance(sub, nn.Linear) and sub.bias is not None:
                sub.bias.zero_()
        elif isinstance(sub, nn.LayerNorm):
            sub.weight.fill_(1.0)
            sub.bias.zero_()
        elif isinstance(sub, llama.RMSNorm):
            sub.weight.fill_(1.0)


def build_stage(cfg: ModelConfig, first_layer: int, end_layer: int, *, seed: int | None = None,
                device: torch.device | str | None = None) -> TransformerStage:
    """Layers `[first_layer, end_layer)` of the reference model for `cfg` (0 = embed,
    1..L = blocks, L+1 = head), with the whole model's module paths.

    Parameters equal those of `build_model(cfg, seed=seed)` for the same layers. On the
    meta device nothing is initialised. Parameters are in `cfg.precision`.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    target = torch.device(device if device is not None else "cpu")
    # Build on meta (no default init work), then allocate and initialise once.
    with torch.device("meta"):
        stage = TransformerStage(cfg, first_layer, end_layer)
    stage = stage.to(dtype=TORCH_DTYPES[cfg.precision])
    if target.type == "meta":
        return stage
    stage = stage.to_empty(device=target)
    for index, module in _layer_modules(stage):
        _init_layer(module, torch.Generator().manual_seed(seed * 100_003 + index))
    return stage


def build_model(cfg: ModelConfig, *, seed: int | None = None,
                device: torch.device | str | None = None) -> TransformerStage:
    """The whole reference model: (B, T) int64 token ids -> (B, T, vocab) logits."""
    return build_stage(cfg, 0, cfg.num_layers + 2, seed=seed, device=device)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the vocabulary: (B, T, V) logits, (B, T) int64 targets.

    Logits are upcast to fp32 first (as Megatron does), so under mixed precision the
    saved log-probabilities are fp32.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def example_batch(cfg: ModelConfig, microbatch_size: int, *, seed: int = 0,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random (ids, targets), each (B, T) int64.

    GPT, Llama: targets are the next tokens (ids shifted by one, from a T+1 token stream).
    BERT: targets are the tokens themselves (every position predicted; no masking).
    """
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, cfg.vocab_size, (microbatch_size, cfg.seq_len + 1), generator=g)
    # Separate storages, as a data loader would deliver them (profiles count bytes per storage).
    ids = stream[:, :-1].clone()
    targets = stream[:, 1:].clone() if cfg.causal else ids.clone()
    return ids.to(device), targets.to(device)
