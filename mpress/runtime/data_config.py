"""The `data:` section of a training config: where training (and validation) tokens come
from. `mpress.runtime.train_config.TrainConfig.data` holds one; `mpress.runtime.data`
builds the dataset it names (`mpress.runtime.text` for `kind: text`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mpress.config.limits import MAX_BRANCHING
from mpress.errors import ConfigError

SOURCE_PYTHON_STDLIB = "python-stdlib"
"""`data.source: python-stdlib`: the top-level `*.py` files of this Python's standard
library (`sysconfig.get_paths()["stdlib"]`), found at run time: real text on every machine."""

TOKENIZER_TRAIN = "train"
"""`data.tokenizer: train`: a byte-level BPE trained from the data's own files with
`tokenizers` (vocabulary = the model's `vocab_size`), cached beside the tokens."""


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where training tokens come from (see `mpress.runtime.data`)."""

    kind: Literal["synthetic", "file", "text"] = "synthetic"
    """synthetic: a fixed random Markov chain with a known loss floor; file: token ids in
    `path`; text: documents in `path` (or `source`) tokenized with `tokenizer`, packed into
    seq_len windows with an end-of-text token between documents (`mpress/runtime/text/`)."""
    path: str | None = None
    """kind: file: a token file (.bin flat uint16/uint32, .npy, .txt whitespace ints).
    kind: text: a .txt file (one document), a .jsonl file (one document per line, its
    `text_key` field) or a directory of them (searched recursively, in name order)."""
    source: Literal["python-stdlib"] | None = None
    """kind: text instead of `path`: python-stdlib = this Python's standard library's
    top-level .py files (one document each), found at run time."""
    text_key: str = "text"
    """kind: text, .jsonl files: the field of each line that holds the document."""
    tokenizer: str | None = None
    """kind: text: a `tokenizers` tokenizer.json, a Hugging Face model directory with
    tokenizer files (loaded with AutoTokenizer, local_files_only), or `train` (a byte-level
    BPE trained from the data's training files, vocabulary = the model's vocab_size, cached)."""
    eot_token: str | None = None
    """kind: text: the end-of-text token put between documents; default: the tokenizer's
    eos token, else `<|endoftext|>` (what `train` adds)."""
    cache_dir: str | None = None
    """kind: text: where the tokenizer and tokens are cached (keyed by a hash of the files'
    contents and the tokenizer); null = `.mpress-cache` beside the data (python-stdlib:
    ~/.cache/mpress/text)."""
    val_fraction: float = field(default=0.0, metadata={"min": 0, "max": 0.5})
    """kind: text: the share of the text (in characters) held out for validation, as whole
    documents (drawn by `seed`); a BPE trained here (`tokenizer: train`) never sees them;
    0 = no validation set."""
    token_dtype: Literal["uint16", "uint32"] | None = None
    """Element type of a .bin file; default from the file name (`*.uint32.bin`) or the vocabulary size."""
    branching: int = field(default=4, metadata={"min": 1, "max": MAX_BRANCHING})
    """Synthetic only: successors per token in the chain; the GPT loss floor is ln(branching) nats."""
    mask_prob: float = field(default=0.15, metadata={"gt": 0, "max": 1})
    """BERT (masked LM) only: probability that a position is masked and predicted."""

    def __post_init__(self) -> None:
        if self.kind == "file" and not self.path:
            raise ConfigError("", "path", "kind: file needs a path to a token file (.bin, .npy or .txt)")
        if self.kind == "synthetic" and self.path is not None:
            raise ConfigError("", "path", "only for kind: file or text (remove it, or set kind)")
        if self.kind == "text":
            if (self.path is None) == (self.source is None):
                raise ConfigError("", "path", "kind: text needs a path (a .txt/.jsonl file or a directory) "
                                              "or source: python-stdlib, exactly one")
            if self.tokenizer is None:
                raise ConfigError("", "tokenizer", "kind: text needs a tokenizer: a tokenizer.json, a Hugging Face "
                                                   "model directory, or train")
            if not self.text_key:
                raise ConfigError("", "text_key", "must name a field of the .jsonl lines, got an empty one")
            return
        for key in ("source", "tokenizer", "eot_token", "cache_dir"):
            if getattr(self, key) is not None:
                raise ConfigError("", key, "only for kind: text (remove it, or set kind: text)")
        if self.val_fraction:
            raise ConfigError("", "val_fraction", "only for kind: text (remove it, or set kind: text)")

    @property
    def has_validation(self) -> bool:
        """Whether a validation set is held out (kind: text with val_fraction > 0)."""
        return self.kind == "text" and self.val_fraction > 0
