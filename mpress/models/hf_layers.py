"""A Hugging Face `transformers` model as a chain of layers that each take and return one tensor.

`HFChain` is what mpress profiles, plans and splits for an HF model: its layers are
`embed` (token ids -> hidden states), `blocks.0` ... `blocks.{N-1}` (one decoder/encoder
block each) and `head` (final norm(s) + output projection -> logits), in that order, and
its forward is the plain chain `head(blocks(...(embed(ids))))`. A stage is the same class
holding a contiguous range of those layers (`HFChain.stage`), so a stage's module paths
are the whole chain's (`blocks.3.block.mlp.fc_in`) and a plan made from the chain's
profile names the stage's tensors.

The contract: the chain computes what the transformers model computes, the same logits
for the same weights and ids (`tests/models/test_hf_equality.py`, per family). Side inputs
are made where they are needed, never passed between stages, from the model's config
(`mpress.models.hf_layout` says which): every block makes its own attention mask with
transformers' own helper for its attention kind (`create_causal_mask`,
`create_sliding_window_causal_mask`, `create_bidirectional_mask`; each follows the
config's attention implementation and is None where SDPA needs none) and its positions
(`0..T-1`), and a rotary block its rotary tables from its own copy of the model's rotary
module (no parameters; a buffer of head_dim/2 floats). Learned positions (GPT-2's, OPT's
offset ones) are added in `embed`; the head soft-caps the logits where the config says
so (Gemma2). Blocks are called with `use_cache=False` and no cache: training keeps no KV
cache, and between stages travels one plain tensor of shape (B, T, hidden). No padding
masks: every sequence of a microbatch is full length.
"""

from __future__ import annotations

import copy
import inspect
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mpress.models.hf_layout import BIDIRECTIONAL, FULL, SLIDING, HFLayout


def _mask_maker(kind: str) -> Callable[..., Any]:
    """transformers' mask helper for an attention kind (`mpress.models.hf_layout`)."""
    from transformers import masking_utils

    name = {FULL: "create_causal_mask", SLIDING: "create_sliding_window_causal_mask",
            BIDIRECTIONAL: "create_bidirectional_mask"}[kind]
    return getattr(masking_utils, name)


def _no_cache(maker: Callable[..., Any]) -> dict[str, None]:
    """The no-cache argument of a mask helper: `cache` from transformers 5.x on,
    `past_key_values` before (which 5.x still takes, with a FutureWarning)."""
    params = inspect.signature(maker).parameters
    if "cache" in params:
        return {"cache": None}
    return {"past_key_values": None} if "past_key_values" in params else {}


class Embed(nn.Module):
    """Token ids (B, T) int64 -> hidden states (B, T, C): the token embedding, projected
    where the model projects it (OPT's `project_in`), plus learned positions of 0..T-1
    where the model has them, then dropout where it has one."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None, dropout: nn.Module | None,
                 project_in: nn.Module | None = None) -> None:
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.project_in = project_in
        self.dropout = dropout
        # OPT's takes the padding mask first (unused when given positions) and adds its offset
        self._positions_by_id = positions is not None and "position_ids" in inspect.signature(
            positions.forward).parameters

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)  # (B, T, C)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.positions is not None:
            positions = torch.arange(ids.shape[1], device=ids.device)[None]  # (1, T)
            if self._positions_by_id:
                x = x + self.positions(torch.ones_like(ids), position_ids=positions)  # (1, T, C)
            else:
                x = x + self.positions(positions)  # (1, T, C)
        return self.dropout(x) if self.dropout is not None else x


class Block(nn.Module):
    """One HF block as hidden (B, T, C) -> hidden (B, T, C), making its side inputs: the
    mask for its attention kind, positions and rotary tables (see the module docstring)."""

    def __init__(self, block: nn.Module, config: object, *, attention: str, rotary: nn.Module | None) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.attention = attention
        self.config = config  # the model's PreTrainedConfig: the mask follows its attention implementation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        maker = _mask_maker(self.attention)
        # no position ids: they would be searched for packed sequences, which HF does
        # not do on fake tensors (it then builds a mask the real run leaves to SDPA)
        mask = maker(config=self.config, inputs_embeds=x, attention_mask=None, **_no_cache(maker))
        kwargs: dict[str, object] = {"attention_mask": mask}
        if self.attention != BIDIRECTIONAL:
            positions = torch.arange(x.shape[1], device=x.device)[None]  # (1, T)
            kwargs.update(position_ids=positions, use_cache=False)
            if self.rotary is not None:
                kwargs["position_embeddings"] = self.rotary(x, position_ids=positions)  # (cos, sin), no grad
        out = self.block(x, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class SoftCap(nn.Module):
    """Logit soft-capping, `cap * tanh(logits / cap)`, in transformers' op order (Gemma2)."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / self.cap) * self.cap

    def extra_repr(self) -> str:
        return f"cap={self.cap}"


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

    def stage(self, layers: Sequence[str]) -> HFChain:
        """The chain of `layers` (contiguous names of `layer_names()`), sharing its modules."""
        return HFChain(self.embed if "embed" in layers else None,
                       {i: b for i, b in self.blocks.items() if f"blocks.{i}" in layers},
                       self.head if "head" in layers else None)


def build_chain(model: nn.Module, layout: HFLayout) -> HFChain:
    """The chain of `model`'s modules as `layout` (a checked one: `find_layout`,
    `layout_from_patterns`) places them; the modules are shared, not copied: tied weights
    stay one parameter."""
    get = model.get_submodule
    rotary = get(layout.rotary) if layout.rotary is not None else None
    # each block's rotary copy shares the model's config (read only), as the blocks do: copies
    # of it would make alike blocks look unlike to the memory probe's signature
    shared = {id(model.config): model.config}
    blocks = {str(i): Block(get(path), model.config, attention=kind,
                            rotary=copy.deepcopy(rotary, dict(shared)) if rotary is not None else None)
              for i, (path, kind) in enumerate(zip(layout.blocks, layout.attention, strict=True))}
    optional = (layout.positions, layout.dropout, layout.project_in)
    if all(p is None for p in optional):
        embed = get(layout.embed)
    else:
        positions, dropout, project_in = (get(p) if p is not None else None for p in optional)
        embed = Embed(get(layout.embed), positions, dropout, project_in)
    parts = [(path.rpartition(".")[2], get(path)) for path in layout.head]
    if layout.logit_softcap is not None:
        parts.append(("softcap", SoftCap(layout.logit_softcap)))
    head = parts[0][1] if len(parts) == 1 else nn.Sequential(OrderedDict(parts))
    return HFChain(embed, blocks, head)
