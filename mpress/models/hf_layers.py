"""A Hugging Face `transformers` model as a chain of layers that each take and return one tensor.

`HFChain` is what mpress profiles, plans and splits for an HF model: its layers are
`embed` (token ids -> hidden states), `blocks.0` ... `blocks.{N-1}` (one decoder/encoder
block each) and `head` (final norm + output projection -> logits), in that order, and
its forward is the plain chain `head(blocks(...(embed(ids))))`. A stage is the same class
holding a contiguous range of those layers (`HFChain.stage`), so a stage's module paths
are the whole chain's (`blocks.3.block.mlp.fc_in`) and a plan made from the chain's
profile names the stage's tensors.

Side inputs are made where they are needed, never passed between stages: every block
computes its own causal mask (`transformers.masking_utils.create_causal_mask`, for the
config's attention implementation; None for SDPA without padding, which then runs causal)
and positions (`0..T-1`), and a rotary block its rotary tables from its own copy of the
model's rotary module (no parameters; a buffer of head_dim/2 floats). Blocks are called
with `use_cache=False` and no cache: training keeps no KV cache, and between stages
travels one plain tensor of shape (B, T, hidden). No padding masks: every sequence of a
microbatch is full length.

Which module is which comes from `HFLayout`: found from the model's structure for GPT-2,
Llama-style decoders (`model.embed_tokens`, `model.layers`, `model.norm`, `lm_head`:
Llama, Mistral, Qwen2, ...) and BERT masked LMs, or named by the user as four patterns
`[embed, blocks, norm, head]` (`layout_from_patterns`) for any other family whose blocks
take `(hidden, attention_mask=, position_ids=, position_embeddings=)` as HF's do.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mpress.errors import UserError
from mpress.models.user_module import select_layers


@dataclass(frozen=True)
class HFLayout:
    """Where an HF model keeps the parts of its chain, as module paths of the model."""

    embed: str
    """The token embedding module (GPT-2: `transformer.wte`; its `wpe` is found beside it)."""
    blocks: list[str]
    """Each block, in order."""
    head: list[str]
    """Final norm(s) then output projection, applied in order (BERT: `cls`)."""
    causal: bool
    """Blocks need a causal mask (decoders); False for encoders (BERT)."""
    rotary: str | None = None
    """The rotary embedding module whose tables blocks take as `position_embeddings`."""
    positions: str | None = None
    """A learned position embedding added to the token embedding (GPT-2's `wpe`)."""
    dropout: str | None = None
    """Dropout after the embedding (GPT-2's `drop`)."""


def find_layout(model: nn.Module) -> HFLayout:
    """The layout of a GPT-2 LM, a Llama-style causal LM or a BERT masked LM, from its
    structure; a `UserError` naming the way out (`layers:`) for any other."""
    names = dict(model.named_modules())
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if {"transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f", "lm_head"} <= names.keys():
        return HFLayout(embed="transformer.wte", positions="transformer.wpe", dropout="transformer.drop",
                        blocks=_numbered(model, "transformer.h"), head=["transformer.ln_f", "lm_head"], causal=True)
    if {"model.embed_tokens", "model.layers", "model.norm", "lm_head"} <= names.keys():
        return HFLayout(embed="model.embed_tokens", blocks=_numbered(model, "model.layers"),
                        head=["model.norm", "lm_head"], causal=True,
                        rotary="model.rotary_emb" if "model.rotary_emb" in names else None)
    if {"bert.embeddings", "bert.encoder.layer", "cls"} <= names.keys():
        return HFLayout(embed="bert.embeddings", blocks=_numbered(model, "bert.encoder.layer"), head=["cls"],
                        causal=False)
    raise UserError(f"{type(model).__name__} ({model_type}): mpress finds the layers of GPT-2, Llama-style and BERT "
                    "models itself; name this one's as layers: [EMBED, BLOCKS, NORM, HEAD] module paths "
                    "(e.g. [model.embed_tokens, \"model.layers.*\", model.norm, lm_head])")


def _numbered(model: nn.Module, path: str) -> list[str]:
    return [f"{path}.{name}" for name, _ in model.get_submodule(path).named_children()]


def layout_from_patterns(model: nn.Module, patterns: Sequence[str]) -> HFLayout:
    """The layout a user names: `[embed, blocks, norm..., head]` module paths, the blocks
    as one pattern with `*` (`model.layers.*`); causal unless the model's config says it
    is an encoder (`is_decoder` false on a masked LM), rotary tables from a module whose
    class name ends in `RotaryEmbedding`, if the model has one."""
    if len(patterns) < 3 or "*" not in patterns[1]:
        raise UserError(f"layers: {list(patterns)}: for a Hugging Face model give [EMBED, BLOCKS, NORM, HEAD] "
                        "(BLOCKS a pattern with *, e.g. \"model.layers.*\"; NORM may be left out)")
    embed, blocks, *head = (select_layers(model, [p]) for p in patterns)
    if len(embed) != 1 or any(len(h) != 1 for h in head):
        raise UserError(f"layers: {list(patterns)}: the embedding, norm and head must each name one module")
    rotary = next((n for n, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    causal = not type(model).__name__.endswith("ForMaskedLM")
    return HFLayout(embed=embed[0], blocks=blocks, head=[h[0] for h in head], causal=causal, rotary=rotary)


class Embed(nn.Module):
    """Token ids (B, T) int64 -> hidden states (B, T, C): the token embedding, plus a
    learned position embedding of positions 0..T-1 where the model has one, then dropout."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None, dropout: nn.Module | None) -> None:
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.dropout = dropout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)  # (B, T, C)
        if self.positions is not None:
            x = x + self.positions(torch.arange(ids.shape[1], device=ids.device)[None])  # (1, T, C)
        return self.dropout(x) if self.dropout is not None else x


class Block(nn.Module):
    """One HF block as hidden (B, T, C) -> hidden (B, T, C), making its side inputs: the
    causal mask (decoders), positions and rotary tables (see the module docstring)."""

    def __init__(self, block: nn.Module, config: object, *, causal: bool, rotary: nn.Module | None) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.causal = causal
        self.config = config  # the model's PreTrainedConfig: the mask follows its attention implementation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, object] = {}
        if self.causal:
            from transformers.masking_utils import create_causal_mask

            positions = torch.arange(x.shape[1], device=x.device)[None]  # (1, T)
            # no position ids: they would be searched for packed sequences, which HF does
            # not do on fake tensors (it then builds a mask the real run leaves to SDPA)
            mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None,
                                      past_key_values=None, position_ids=None)
            kwargs = {"attention_mask": mask, "position_ids": positions, "use_cache": False}
            if self.rotary is not None:
                kwargs["position_embeddings"] = self.rotary(x, position_ids=positions)  # (cos, sin), no grad
        out = self.block(x, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class HFChain(nn.Module):
    """`embed`, `blocks.<i>`, `head` of an HF model (or of a range of them: a stage) as a
    chain; `layer_names()` lists the layers it holds, in order."""

    def __init__(self, embed: nn.Module | None, blocks: dict[str, Block], head: nn.Module | None) -> None:
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleDict(blocks)
        self.head = head

    def layer_names(self) -> list[str]:
        return ([] if self.embed is None else ["embed"]) + [f"blocks.{i}" for i in self.blocks] + (
            [] if self.head is None else ["head"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)  # (B, T) ids -> (B, T, C)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.head is not None else x  # (B, T, vocab) logits at the end

    def stage(self, layers: Sequence[str]) -> "HFChain":
        """The chain of `layers` (contiguous names of `layer_names()`), sharing its modules."""
        return HFChain(self.embed if "embed" in layers else None,
                       {i: b for i, b in self.blocks.items() if f"blocks.{i}" in layers},
                       self.head if "head" in layers else None)


def build_chain(model: nn.Module, layout: HFLayout) -> HFChain:
    """The chain of `model`'s modules as `layout` places them (the modules are shared, not
    copied: tied weights stay one parameter)."""
    get = model.get_submodule
    rotary = get(layout.rotary) if layout.rotary is not None else None
    blocks = {str(i): Block(get(path), model.config, causal=layout.causal,
                            rotary=copy.deepcopy(rotary) if rotary is not None else None)
              for i, path in enumerate(layout.blocks)}
    if layout.positions is None and layout.dropout is None:
        embed = get(layout.embed)
    else:
        embed = Embed(get(layout.embed), get(layout.positions) if layout.positions else None,
                      get(layout.dropout) if layout.dropout else None)
    head = get(layout.head[0]) if len(layout.head) == 1 else nn.Sequential(
        OrderedDict((path.rpartition(".")[2], get(path)) for path in layout.head))
    return HFChain(embed, blocks, head)
