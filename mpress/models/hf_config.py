"""A Hugging Face model from a config, never from the hub: what `--hf-config` / `hf_config:` names.

`hf_config` is one of
- a built-in tiny config's name (`configs/hf/<name>.json`: gpt2-tiny, llama-tiny,
  bert-tiny, and llama-2-7b, the Llama-2-7B shape for planning on fake tensors);
- a `config.json` path: the model is built from it with random weights (under the job's
  seed, so every rank builds the same);
- a directory holding `config.json` and weights (`model.safetensors`,
  `pytorch_model.bin`): the model is loaded from them (`from_pretrained(...,
  local_files_only=True)`).

Nothing is ever downloaded. The task follows the config's `architectures` (a
`...ForMaskedLM` is a masked LM, anything else a causal LM); the model trains with its
KV cache off (`use_cache=False`), its parameters in `dtype` (`fp32`, or `bf16`/`fp16`:
"half model" mixed precision, the trainer stepping fp32 master weights as it does for a
preset's, `mpress.runtime.master_weights`). `seq_len` defaults to the config's maximum
positions (`n_positions`, `max_position_embeddings`) less the offset of its first position
(RoBERTa's positions start at `pad_token_id + 1`).

`HFSource.factory(microbatch_size)` is a factory in the sense of
`mpress.models.user_module` (module, one microbatch of token ids, loss), so the fake-tensor
and measured profilers take an HF model as they take a user's module.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpress.config.presets import CONFIG_DIR
from mpress.config.loader import input_file_problem
from mpress.errors import UserError
from mpress.models.hf_checks import check_config_values, check_supported, position_offset
from mpress.models.hf_layers import HFChain, build_chain
from mpress.models.hf_layout import find_layout, layout_from_patterns
from mpress.models.user_module import module_fingerprint

HF_CONFIG_DIR = CONFIG_DIR / "hf"
IGNORE_INDEX = -100
"""Target of a position the loss skips (torch's `cross_entropy` default)."""
MASK_PROB = 0.15
"""Masked LM: share of positions masked and predicted (BERT's)."""
HF_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""`dtype` words and the parameters' torch dtype."""
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")


RANK_IMPORTS = ("transformers.modeling_utils", "transformers.models.auto.modeling_auto")
"""What a rank building a Hugging Face model imports from transformers, past its
configs (about 2 s of CPU): `mpress train`'s rank starter imports them once for every
rank."""


def hf_presets() -> list[str]:
    """Names of the built-in configs (configs/hf/)."""
    return sorted(p.stem for p in HF_CONFIG_DIR.glob("*.json"))


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise UserError("hf_config: Hugging Face models need the transformers package: "
                        "pip install 'mpress[hf]' (or pip install transformers)") from None
    return transformers


@dataclass(frozen=True)
class HFSource:
    """Where an HF model comes from and how one microbatch of it looks."""

    name: str
    """As the user gave it (`gpt2-tiny`, a path)."""
    config_path: Path
    weights_dir: Path | None
    """The directory of local weights, or None for random init."""
    seq_len: int
    layers: tuple[str, ...] | None = None
    """User-named layout patterns (`layout_from_patterns`), or None to find it."""
    dtype: str = "fp32"
    """The parameters' and activations' precision: fp32, bf16 or fp16 (`HF_DTYPES`)."""

    @property
    def label(self) -> str:
        """The model's name in profiles, plans and logs."""
        return f"hf:{self.name}"

    @property
    def masked_lm(self) -> bool:
        archs = _read_json(self.config_path).get("architectures") or []
        return any(str(a).endswith("ForMaskedLM") for a in archs)

    def config(self) -> Any:
        transformers = _transformers()
        try:
            cfg = transformers.AutoConfig.from_pretrained(str(self.config_path), local_files_only=True)
        except Exception as exc:  # a config transformers cannot read: the user's file
            raise UserError(f"hf_config {self.name}: transformers cannot read {self.config_path}: "
                            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None
        cfg.use_cache = False
        return cfg

    def build_model(self) -> nn.Module:
        """The HF model in training mode: random init from the config (the caller seeds
        torch), or the local weights. Under the meta device (fake profiles, a launcher's
        check before any rank starts) it is built from the config alone, local weights or
        not: meta tensors hold no data to load, only the shapes the config gives (and
        transformers refuses `from_pretrained` there); the ranks load the weights."""
        transformers = _transformers()
        auto = transformers.AutoModelForMaskedLM if self.masked_lm else transformers.AutoModelForCausalLM
        try:
            if self.weights_dir is not None and not _on_meta():
                model = auto.from_pretrained(str(self.weights_dir), config=self.config(), local_files_only=True,
                                             dtype=HF_DTYPES[self.dtype])
            else:
                model = auto.from_config(self.config(), dtype=HF_DTYPES[self.dtype])
        except UserError:
            raise
        except Exception as exc:  # an architecture this transformers does not know, a bad weight file
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise UserError(f"hf_config {self.name}: cannot build the model: {type(exc).__name__}: {first}") from None
        return model.train()

    def build_chain(self) -> HFChain:
        """The model as `embed`, `blocks.*`, `head` (`mpress.models.hf_layers`)."""
        model = self.build_model()
        layout = layout_from_patterns(model, self.layers) if self.layers else find_layout(model)
        return build_chain(model, layout).train()

    def vocab_size(self) -> int:
        return int(self.config().vocab_size)

    def example(self, microbatch_size: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One microbatch (ids, targets), each (B, T) int64 (`batch`)."""
        return batch(self, microbatch_size, seed=seed)

    def factory(self, microbatch_size: int) -> Callable[[], tuple[nn.Module, torch.Tensor, Callable]]:
        """A user-module factory (see the module docstring) of one microbatch of
        `microbatch_size` sequences; its loss closes over that microbatch's targets."""
        ids, targets = self.example(microbatch_size)

        def make() -> tuple[nn.Module, torch.Tensor, Callable]:
            masked = self.masked_lm
            return self.build_chain(), ids, lambda logits: lm_loss(logits, targets.to(logits.device), masked=masked)

        return make

    def fingerprint(self, module: nn.Module) -> str:
        """The chain's structure and the sequence length: a profile of another length is
        another model's."""
        text = f"{module_fingerprint(module)}:seq_len={self.seq_len}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _on_meta() -> bool:
    """Whether tensors are made on the meta device here (`with torch.device("meta")`)."""
    return torch.empty(0).device.type == "meta"


def _read_json(path: Path) -> dict:
    problem = input_file_problem(path)  # a FIFO would hold the read; a huge file would fill memory
    if problem is not None:
        raise UserError(f"hf_config {path}: {problem}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"hf_config {path}: not a readable JSON config ({exc})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UserError(f"hf_config {path}: not a transformers config.json (no model_type)")
    return data


def resolve_hf(name: str, *, seq_len: int | None = None, layers: Sequence[str] | None = None,
               base: Path | None = None, dtype: str = "fp32") -> HFSource:
    """The `HFSource` that `name` names (see the module docstring); `base`: the directory a
    relative path is taken from (default: the current one). A config mpress cannot train
    (an encoder-decoder, a model without a language-model head, nonsense sizes) is a
    one-line `UserError` here, before anything is built."""
    if dtype not in HF_DTYPES:
        raise UserError(f"dtype {dtype!r}: use one of {', '.join(HF_DTYPES)}")
    path = Path(name).expanduser()
    if not path.is_absolute() and (base is not None):
        path = base / path
    if name in hf_presets() and not path.exists():
        config_path, weights = HF_CONFIG_DIR / f"{name}.json", None
    elif path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise UserError(f"hf_config {name}: the directory has no config.json")
        weights = path if any((path / w).is_file() for w in WEIGHT_FILES) else None
    elif path.is_file():
        config_path, weights = path, None
    elif path.exists():  # a FIFO, a socket, a device
        raise UserError(f"hf_config {name}: {input_file_problem(path)}")
    else:
        raise UserError(f"hf_config {name}: no such config.json, directory or built-in config "
                        f"(built-in: {', '.join(hf_presets())})")
    data = _read_json(config_path)
    check_config_values(data, name)
    check_supported(data, name)
    positions = data.get("n_positions") or data.get("max_position_embeddings")
    # the longest sequence: the table's rows less those before the first position
    longest = positions - position_offset(data) if isinstance(positions, int) else None
    length = seq_len if seq_len is not None else longest
    if not isinstance(length, int) or length < 1:
        raise UserError(f"hf_config {name}: the config gives no maximum positions; set seq_len")
    if isinstance(longest, int) and length > longest:
        offset = position_offset(data)
        why = f" (a table of {positions}, the first used at {offset})" if offset else ""
        raise UserError(f"seq_len {length}: {name} has {longest} positions at most{why}")
    return HFSource(name=name, config_path=config_path.resolve(), weights_dir=weights, seq_len=length,
                    layers=tuple(layers) if layers else None, dtype=dtype)


def batch(source: HFSource, num_sequences: int, *, seed: int, step: int = 0,
          vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`num_sequences` synthetic sequences (ids, targets), each (B, T) int64, deterministic
    in (seed, step): ids uniform over the vocabulary. Causal LM: targets are the ids (the
    loss predicts token t+1 from positions <= t). Masked LM: `MASK_PROB` of the positions
    (and always the first) are replaced by the mask token (`mask_token_id`) and are the
    only targets; the others are `IGNORE_INDEX`."""
    vocab = vocab_size if vocab_size is not None else source.vocab_size()
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ids = torch.randint(0, vocab, (num_sequences, source.seq_len), generator=g)  # (B, T)
    if not source.masked_lm:
        return ids, ids.clone()
    masked = torch.rand(ids.shape, generator=g) < MASK_PROB
    masked[:, 0] = True  # at least one target per sequence: a mean over none is NaN
    targets = torch.where(masked, ids, torch.full_like(ids, IGNORE_INDEX))
    mask_id = mask_token_id(source, vocab)
    return torch.where(masked, torch.full_like(ids, mask_id), ids), targets


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, *, masked: bool) -> torch.Tensor:
    """Cross-entropy (fp32) of logits (B, T, V) against targets (B, T): next-token for a
    causal LM (targets are the ids: position t predicts t+1), or, `masked`, at the
    targets that are not `IGNORE_INDEX`. Computed as transformers computes its loss
    (`ForCausalLMLoss`: the targets shifted left and padded with `IGNORE_INDEX`, one mean
    over all B*T positions), so the two are `torch.equal`, not merely close: a mean over
    B*(T-1) rows sums in another order."""
    logits = logits.float()
    if not masked:
        targets = F.pad(targets, (0, 1), value=IGNORE_INDEX)[:, 1:]  # (B, T): position t predicts t+1
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def mask_token_id(source: HFSource, vocab_size: int) -> int:
    """The masked LM's mask token: the config's `mask_token_id` where it has one, else the
    `[MASK]`/`<mask>` token of the tokenizer files beside the config (BERT's vocab.txt,
    RoBERTa's tokenizer.json or special_tokens_map + vocab.json), else the last id of the
    vocabulary (RoBERTa's `<mask>` is its last token). Never the pad token: a padded
    position is one attention and the loss skip, not one the model learns to fill in."""
    data = _read_json(source.config_path)
    found = data.get("mask_token_id")
    if not isinstance(found, int):
        found = _tokenizer_mask_id(source.config_path.parent)
    if not isinstance(found, int):
        found = vocab_size - 1
    if not 0 <= found < vocab_size:
        raise UserError(f"hf_config {source.name}: mask_token_id {found} is outside the vocabulary "
                        f"(vocab_size {vocab_size})")
    return found


def _tokenizer_mask_id(folder: Path) -> int | None:
    """The mask token's id in the tokenizer files of `folder`, or None."""
    try:
        if (folder / "tokenizer.json").is_file():
            tok = json.loads((folder / "tokenizer.json").read_text())
            for added in tok.get("added_tokens") or []:
                if added.get("content") in ("[MASK]", "<mask>"):
                    return int(added["id"])
            vocab = (tok.get("model") or {}).get("vocab")
            if isinstance(vocab, dict):
                for word in ("[MASK]", "<mask>"):
                    if isinstance(vocab.get(word), int):
                        return vocab[word]
        if (folder / "vocab.json").is_file():
            vocab = json.loads((folder / "vocab.json").read_text())
            for word in ("<mask>", "[MASK]"):
                if isinstance(vocab.get(word), int):
                    return vocab[word]
        if (folder / "vocab.txt").is_file():
            words = (folder / "vocab.txt").read_text().splitlines()
            for word in ("[MASK]", "<mask>"):
                if word in words:
                    return words.index(word)
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return None
