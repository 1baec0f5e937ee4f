"""A Hugging Face model as pipeline stages: `UserModel`'s contract, split without tracing.

`HFModel` is a `UserModel` (the trainer, the launcher and the profilers take it as they take
a user's module) whose module is an `HFChain` (`mpress.models.hf_layers`): a chain of
layers that each take and return one tensor. A chain needs no `pipeline()` trace to be
cut: stage s is the chain of its layer range (`HFChain.stage`), with the whole chain's
module paths, and the tensor between stages is the hidden state (B, T, C).

Tied weights (GPT-2's and BERT's output projection is the token embedding) are kept tied
across stages as Megatron does: the later stages holding a tied parameter get their own
copy (equal at the start), and `tied_groups` lists, per tied parameter, the (stage,
parameter name) of every copy; the trainer sums their gradients over those stages'
ranks before each optimizer step (`mpress.runtime.trainer`), so every copy takes the same
step and they stay equal. Within one stage the parameter stays one tensor.

Training data is synthetic token ids (`mpress.models.hf_config.batch`) and the loss the
language-modelling cross-entropy of the model's task (`lm_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpress.errors import ConfigError, UserError
from mpress.models.hf_config import HFSource, batch, lm_loss, resolve_hf
from mpress.models.hf_layers import HFChain
from mpress.models.user import UserModel, check_ranges

TiedGroup = list[tuple[int, str]]
"""The copies of one tied parameter: (stage, parameter name in that stage's module)."""


@dataclass
class HFModel(UserModel):
    """An HF model's chain, one example microbatch, its LM loss and its layers."""

    source: HFSource | None = None
    vocab_size: int = 0
    """Token ids of synthetic batches are uniform over [0, vocab_size)."""
    tied_groups: list[TiedGroup] = field(default_factory=list)
    """Set by `split`: the tied parameters held by more than one stage."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._identity = (self._identity[0], self.source.fingerprint(self.module))

    def factory(self) -> Callable[[], tuple[nn.Module, torch.Tensor, Callable]]:
        """The factory the profilers call (a fresh chain of one microbatch)."""
        return self.source.factory(self.microbatch_size)

    def split(self, ranges: Sequence[tuple[int, int]]) -> list[nn.Module]:
        """One `HFChain` per stage (see the module docstring); tied parameters held by
        several stages are copied into the later ones and listed in `tied_groups`."""
        if self.module is None:
            raise UserError(f"{self.spec}: split once per model (the whole module is let go after a split)")
        check_ranges(ranges, len(self.layers), self.spec)
        chain: HFChain = self.module  # type: ignore[assignment]
        stages = [chain.stage(self.layers[start:end]) for start, end in ranges]
        self.tied_groups = _untie_across(stages)
        for module in stages:
            module.train()
        self.module = None  # type: ignore[assignment]
        return stages

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The LM cross-entropy of the logits against the step's targets."""
        return lm_loss(output, target, masked=self.source.masked_lm)

    def text_shape(self) -> tuple[int, int]:
        """(seq_len, vocab_size) of the model on text (`UserModel.text_shape`)."""
        return self.source.seq_len, self.vocab_size

    def text_batch(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Text windows as a causal LM takes them: the ids are the targets too (the loss
        shifts them, as transformers' does), so a window's last next token goes unused."""
        if self.source.masked_lm:
            raise UserError(f"data.kind: text: {self.spec} is a masked LM; text trains a causal LM")
        return (ids,), ids

    def batch(self, *, step: int, num_microbatches: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Step `step`'s synthetic token ids (B*M, T) and their targets."""
        ids, targets = batch(self.source, self.microbatch_size * num_microbatches, seed=seed, step=step,
                             vocab_size=self.vocab_size)
        return (ids,), targets


def _untie_across(stages: list[nn.Module]) -> list[TiedGroup]:
    """Give each stage after the first its own copy of a parameter several stages hold;
    the groups of copies (see the module docstring)."""
    holders: dict[int, TiedGroup] = {}
    params: dict[int, nn.Parameter] = {}
    for s, module in enumerate(stages):
        for name, p in module.named_parameters():
            holders.setdefault(id(p), []).append((s, name))
            params[id(p)] = p
    groups = [g for g in holders.values() if len({s for s, _ in g}) > 1]
    for group in groups:
        first = group[0][0]
        original = params[id(stages[first].get_parameter(group[0][1]))]
        for s in sorted({s for s, _ in group} - {first}):
            copy = nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad)
            for sub in stages[s].modules():  # every slot of this stage holding it (a stage names it once)
                for key, value in list(sub._parameters.items()):
                    if value is original:
                        sub._parameters[key] = copy
    return [sorted({(s, n) for s, n in g}, key=lambda x: x[0]) for g in groups]


def load_hf_model(name: str, *, microbatch_size: int, seq_len: int | None = None,
                  layers: Sequence[str] | None = None, seed: int = 0, dtype: str = "fp32") -> HFModel:
    """Build `name` (see `mpress.models.hf_config`) under `seed` with its parameters in
    `dtype`, with one example microbatch of `microbatch_size` sequences."""
    source = resolve_hf(name, seq_len=seq_len, layers=layers, dtype=dtype)
    torch.manual_seed(seed)
    chain = source.build_chain()
    ids, targets = source.example(microbatch_size, seed=seed)
    masked = source.masked_lm
    return HFModel(spec=source.label, module=chain, example_input=(ids,),
                   loss_fn=lambda out: lm_loss(out, targets, masked=masked),
                   layers=chain.layer_names(), source=source, vocab_size=source.vocab_size())


def check_hf_model(name: str, *, seq_len: int | None, layers: Sequence[str] | None, source: str,
                   dtype: str = "fp32") -> int:
    """The number of layers of `name`, built on the meta device (nothing allocated: a
    launcher checks this before any rank starts); a problem is a one-line `ConfigError`
    naming `source` and the key."""
    try:
        hf = resolve_hf(name, seq_len=seq_len, layers=layers, dtype=dtype)
    except UserError as exc:
        key = ("seq_len" if str(exc).startswith("seq_len") or "set seq_len" in str(exc)
               else "dtype" if str(exc).startswith("dtype") else "hf_config")
        raise ConfigError(source, key, str(exc)) from None
    try:
        with torch.device("meta"):
            chain = hf.build_chain()
    except UserError as exc:
        raise ConfigError(source, "layers" if layers else "hf_config", str(exc)) from None
    return len(chain.layer_names())
