"""Where a Hugging Face model keeps the parts of mpress's layer chain, and what the chain cannot carry.

`HFLayout` names, as module paths of the model, the token embedding and what the model adds
to it (learned positions, an input projection, dropout), each block, the head (final
norms, output projections, logit soft-capping) and the rotary module blocks take tables
from, and each block's attention (`ATTENTION_KINDS`). `find_layout` finds it from the
model's structure for the families in `_PATTERNS` (GPT-2; Llama-style decoders: Llama,
Mistral, Qwen2, Phi, Phi-3, Gemma, Gemma2, ...; GPT-NeoX; OPT) and for BERT-style
encoders (BERT, RoBERTa); `layout_from_patterns` takes one a user names.

Side inputs come from the model's own config, never guessed per family: each block's
attention is `config.layer_types[i]` where the config has it (Qwen2, Gemma2), else
sliding-window attention for every block where `config.sliding_window` is set (Mistral,
Phi-3), else full causal attention (bidirectional for an encoder); the head soft-caps the
logits by `config.final_logit_softcapping` where set (Gemma2).

`check_layout` refuses, in one line naming the module and the argument (a `UserError`),
what the chain would otherwise drop in silence: a module of the model that is in no part
of the chain (OPT's `embed_positions` under a user's layers), a block or rotary argument
without a default that the chain does not make, a block that takes rotary tables in a
model with no rotary module, an attention kind the chain cannot mask, a sliding window the
model's code makes no mask for without `layer_types` to say where, random layer drop
(`layerdrop`), and config scalings the model's own forward applies outside its modules
(`_UNCARRIED_SCALINGS`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from mpress.errors import UserError
from mpress.models.user_module import select_layers

FULL, SLIDING, BIDIRECTIONAL = "full_attention", "sliding_attention", "bidirectional"
ATTENTION_KINDS = (FULL, SLIDING, BIDIRECTIONAL)
"""A block's attention: causal, causal within `config.sliding_window`, or an encoder's."""
BLOCK_ARGS = frozenset({"hidden_states", "attention_mask", "position_ids", "position_embeddings", "use_cache"})
"""What the chain passes a block (its first argument is the hidden states)."""
_UNCARRIED_SCALINGS = ("logits_scaling", "logit_scale", "embedding_multiplier", "scale_emb")
"""Config fields whose scaling a family's model forward applies outside any module
(Granite, Cohere, MiniCPM): the chain, made of modules, would leave them out (refused
unless 1, which scales nothing)."""


@dataclass(frozen=True)
class HFLayout:
    """Where an HF model keeps the parts of its chain, as module paths of the model."""

    embed: str
    """The token embedding module (GPT-2: `transformer.wte`)."""
    blocks: list[str]
    """Each block, in order."""
    head: list[str]
    """Final norm(s), projections and the output projection, applied in order (BERT: `cls`)."""
    causal: bool
    """Blocks need a causal mask (decoders); False for encoders (BERT)."""
    rotary: str | None = None
    """The rotary embedding module whose tables blocks take as `position_embeddings`."""
    positions: str | None = None
    """A learned position embedding added to the token embedding (GPT-2's `wpe`, OPT's
    `embed_positions`, which offsets the positions itself)."""
    project_in: str | None = None
    """A projection of the token embedding before the positions are added (OPT's)."""
    dropout: str | None = None
    """Dropout after the embedding (GPT-2's `drop`, Phi's `embed_dropout`)."""
    attention: list[str] = field(default_factory=list)
    """Each block's attention kind (`ATTENTION_KINDS`), from the config; [] before
    `with_side_inputs`."""
    logit_softcap: float | None = None
    """The head's logit soft-capping, `cap * tanh(logits / cap)` (Gemma2's
    `final_logit_softcapping`), or None."""

    def parts(self) -> list[str]:
        """Every module path the chain holds."""
        optional = (self.rotary, self.positions, self.project_in, self.dropout)
        return [self.embed, *self.blocks, *self.head, *(p for p in optional if p is not None)]


@dataclass(frozen=True)
class _Pattern:
    """A family's structure: paths of its parts; a part absent from a model is left out,
    except `embed`, `blocks` and the last of `head`, which make the pattern match."""

    embed: str
    blocks: str
    head: tuple[str, ...]
    positions: str | None = None
    project_in: str | None = None
    dropout: str | None = None
    rotary: str | None = None


_PATTERNS = (
    _Pattern(embed="transformer.wte", positions="transformer.wpe", dropout="transformer.drop", blocks="transformer.h",
             head=("transformer.ln_f", "lm_head")),  # GPT-2
    _Pattern(embed="model.embed_tokens", dropout="model.embed_dropout", blocks="model.layers",
             head=("model.norm", "model.final_layernorm", "lm_head"), rotary="model.rotary_emb"),  # Llama-style, Phi
    _Pattern(embed="gpt_neox.embed_in", dropout="gpt_neox.emb_dropout", blocks="gpt_neox.layers",
             head=("gpt_neox.final_layer_norm", "embed_out", "lm_head"), rotary="gpt_neox.rotary_emb"),  # GPT-NeoX
    _Pattern(embed="model.decoder.embed_tokens", positions="model.decoder.embed_positions",
             project_in="model.decoder.project_in", blocks="model.decoder.layers",
             head=("model.decoder.final_layer_norm", "model.decoder.project_out", "lm_head")),  # OPT
)


def find_layout(model: nn.Module) -> HFLayout:
    """The checked layout (`check_layout`) of a model of a family in `_PATTERNS` or of a
    BERT-style masked LM, from its structure; a `UserError` naming the way out (`layers:`)
    for any other."""
    names = dict(model.named_modules())
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    for pattern in _PATTERNS:
        heads = [p for p in pattern.head if p in names]
        if pattern.embed in names and pattern.blocks in names and pattern.head[-1] in heads[-1:]:
            present = {k: p if p in names else None for k, p in
                       (("positions", pattern.positions), ("project_in", pattern.project_in),
                        ("dropout", pattern.dropout), ("rotary", pattern.rotary))}
            layout = HFLayout(embed=pattern.embed, blocks=_numbered(model, pattern.blocks), head=heads,
                              causal=True, **present)
            return check_layout(model, with_side_inputs(model, layout))
    prefix = getattr(model, "base_model_prefix", "")
    head = [p for p in ("cls", "lm_head") if p in names]
    if {f"{prefix}.embeddings", f"{prefix}.encoder.layer"} <= names.keys() and len(head) == 1:
        layout = HFLayout(embed=f"{prefix}.embeddings", blocks=_numbered(model, f"{prefix}.encoder.layer"),
                          head=head, causal=False)
        return check_layout(model, with_side_inputs(model, layout))
    raise UserError(f"{type(model).__name__} ({model_type}): mpress finds the layers of GPT-2, Llama-style, GPT-NeoX, "
                    "OPT and BERT-style models itself; name this one's as layers: [EMBED, BLOCKS, NORM, HEAD] module "
                    "paths (e.g. [model.embed_tokens, \"model.layers.*\", model.norm, lm_head])")


def _numbered(model: nn.Module, path: str) -> list[str]:
    return [f"{path}.{name}" for name, _ in model.get_submodule(path).named_children()]


def layout_from_patterns(model: nn.Module, patterns: Sequence[str]) -> HFLayout:
    """The checked layout a user names: `[embed, blocks, norm..., head]` module paths, the
    blocks as one pattern with `*` (`model.layers.*`); causal unless the model is a masked
    LM, rotary tables from a module whose class name ends in `RotaryEmbedding`, if the
    model has one."""
    if len(patterns) < 3 or "*" not in patterns[1]:
        raise UserError(f"layers: {list(patterns)}: for a Hugging Face model give [EMBED, BLOCKS, NORM, HEAD] "
                        "(BLOCKS a pattern with *, e.g. \"model.layers.*\"; NORM may be left out)")
    embed, blocks, *head = (select_layers(model, [p]) for p in patterns)
    if len(embed) != 1 or any(len(h) != 1 for h in head):
        raise UserError(f"layers: {list(patterns)}: the embedding, norm and head must each name one module")
    rotary = next((n for n, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    causal = not type(model).__name__.endswith("ForMaskedLM")
    layout = HFLayout(embed=embed[0], blocks=blocks, head=[h[0] for h in head], causal=causal, rotary=rotary)
    return check_layout(model, with_side_inputs(model, layout))


def with_side_inputs(model: nn.Module, layout: HFLayout) -> HFLayout:
    """`layout` with each block's attention kind and the head's soft-capping, from the
    model's config (see the module docstring)."""
    config = model.config
    num_blocks = len(layout.blocks)
    if not layout.causal:
        kinds = [BIDIRECTIONAL] * num_blocks
    elif getattr(config, "layer_types", None) is not None:
        kinds = [str(k) for k in config.layer_types][:num_blocks]
    elif getattr(config, "sliding_window", None) is not None and _makes_sliding_masks(model):
        kinds = [SLIDING] * num_blocks
    else:
        kinds = [FULL] * num_blocks
    cap = getattr(config, "final_logit_softcapping", None)
    return replace(layout, attention=kinds, logit_softcap=float(cap) if cap else None)


def _makes_sliding_masks(model: nn.Module) -> bool:
    """Whether the model's modeling code uses transformers' sliding-window mask (Mistral's
    and Phi-3's do for every block when `config.sliding_window` is set)."""
    return hasattr(sys.modules.get(type(model).__module__), "create_sliding_window_causal_mask")


def check_layout(model: nn.Module, layout: HFLayout) -> HFLayout:
    """`layout`, or a one-line `UserError` naming the module and the argument the chain
    cannot carry (see the module docstring)."""
    config, where = model.config, type(model).__name__
    _check_covered(model, layout)
    window = getattr(config, "sliding_window", None)
    if layout.causal and window is not None and getattr(config, "layer_types", None) is None \
            and not _makes_sliding_masks(model):
        raise UserError(f"{where}: config.sliding_window={window} without config.layer_types, in a model whose "
                        "code makes no sliding-window mask: mpress cannot tell which blocks slide")
    if len(layout.attention) != len(layout.blocks):
        raise UserError(f"{where}: config.layer_types names {len(layout.attention)} layers, "
                        f"the model has {len(layout.blocks)} blocks")
    for path, kind in zip(layout.blocks, layout.attention):
        if kind not in ATTENTION_KINDS:
            raise UserError(f"{path}: config.layer_types says {kind!r}; mpress's chain makes masks for "
                            f"{FULL} and {SLIDING} only")
        block = model.get_submodule(path)
        _check_args(path, block, BLOCK_ARGS)
        if "position_embeddings" in _params(block) and layout.rotary is None:
            raise UserError(f"{path}: {type(block).__name__} takes position_embeddings (rotary tables) but mpress "
                            "finds no module named *RotaryEmbedding to make them")
    if layout.rotary is not None:
        _check_args(layout.rotary, model.get_submodule(layout.rotary), {"x", "position_ids"})
    if getattr(config, "layerdrop", 0.0) or 0.0:
        parent = layout.blocks[0].rpartition(".")[0] if layout.blocks else where
        raise UserError(f"{parent}: config.layerdrop={config.layerdrop} skips blocks at random in training; "
                        "mpress's chain runs every block (set layerdrop to 0)")
    for name in _UNCARRIED_SCALINGS:
        value = getattr(config, name, None)
        if value is not None and not isinstance(value, bool) and value != 1:  # x * 1.0 and x / 1.0 are x
            raise UserError(f"{where}: config.{name}={value} scales outside the model's modules; mpress's chain "
                            "would leave it out")
    return layout


def _check_covered(model: nn.Module, layout: HFLayout) -> None:
    """Every module of the model is a part of the chain, inside one, or holds one."""
    parts = layout.parts()
    for name, module in model.named_modules():
        if not name or any(name == p or name.startswith(p + ".") or p.startswith(name + ".") for p in parts):
            continue
        raise UserError(f"{name}: {type(model).__name__}'s {type(module).__name__} is in no part of mpress's chain "
                        "(embed, blocks, head), which would leave it out of what the model computes")


def _params(module: nn.Module) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(module.forward).parameters)


def _check_args(path: str, module: nn.Module, given: Any) -> None:
    """Every argument of `module.forward` without a default, past the first, is one the
    chain gives (`given`)."""
    params = list(_params(module).values())[1:]
    for p in params:
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in given:
            raise UserError(f"{path}: {type(module).__name__}.forward needs {p.name}, which mpress's chain does "
                            "not make")
