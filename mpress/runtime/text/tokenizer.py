"""Local tokenizers for text data: a `tokenizers` tokenizer.json, a Hugging Face model
directory's tokenizer (transformers' AutoTokenizer, local_files_only: nothing is
downloaded), or a small byte-level BPE trained here from local documents.

`TextTokenizer` is what packing needs: ids of many documents at once, the end-of-text
id put between documents, the vocabulary size and a fingerprint that keys the token cache.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpress.errors import UserError

EOT = "<|endoftext|>"
"""The end-of-text token a trained BPE carries (GPT-2's spelling)."""

_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
             "special_tokens_map.json", "vocab.txt")
"""The files of a model directory that make its tokenizer (hashed for the cache key)."""


@dataclass
class TextTokenizer:
    """A loaded tokenizer: `tokenizers.Tokenizer` or a transformers tokenizer."""

    backend: Any
    """The tokenizer object."""
    eot_id: int
    """Id of the end-of-text token put after every document."""
    vocab_size: int
    """Ids are in [0, vocab_size), special tokens included."""
    fingerprint: str
    """sha256 (hex) of what defines the tokenizer (its files' bytes) and the eot id."""
    hf: bool = False
    """The backend is a transformers tokenizer (else a `tokenizers.Tokenizer`)."""

    def encode(self, documents: list[str]) -> list[list[int]]:
        """The ids of each document, no special tokens added."""
        if self.hf:
            return list(self.backend(documents, add_special_tokens=False)["input_ids"])
        return [e.ids for e in self.backend.encode_batch(documents, add_special_tokens=False)]


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise UserError("data.tokenizer: needs the `tokenizers` package (pip install tokenizers)") from None
    return tokenizers


def _eot_id(ids: dict[str, int], wanted: str | None, default: str | None, where: str) -> int:
    name = wanted or default or EOT
    if name not in ids:
        raise UserError(f"{where}: no end-of-text token {name!r} in its vocabulary (set data.eot_token to one "
                        "of its special tokens)")
    return ids[name]


def load_tokenizer(path: str | Path, *, eot_token: str | None = None) -> TextTokenizer:
    """The tokenizer at `path`: a tokenizer.json file, or a model directory (its
    tokenizer.json through `tokenizers` when it has no tokenizer_config.json, else
    transformers' AutoTokenizer with local_files_only). Raises `UserError` naming the path."""
    p = Path(path)
    if p.is_dir() and (p / "tokenizer_config.json").is_file():
        return _load_hf(p, eot_token)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise UserError(f"data.tokenizer: {p}: no tokenizer.json or Hugging Face tokenizer files there")
    try:
        backend = _tokenizers().Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises plain Exceptions for a bad file
        raise UserError(f"data.tokenizer: {file}: not a tokenizers file ({str(exc).splitlines()[0]})") from None
    eot = _eot_id(backend.get_vocab(with_added_tokens=True), eot_token, None, f"data.tokenizer: {file}")
    digest = hashlib.sha256(file.read_bytes() + f"\neot={eot}".encode()).hexdigest()
    return TextTokenizer(backend, eot, backend.get_vocab_size(with_added_tokens=True), digest)


def _load_hf(directory: Path, eot_token: str | None) -> TextTokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError(f"data.tokenizer: {directory} is a Hugging Face directory, which needs transformers "
                        "(pip install 'mpress[hf]')") from None
    try:
        backend = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"data.tokenizer: {directory}: cannot load its tokenizer ({str(exc).splitlines()[0]})") \
            from None
    eot = _eot_id(backend.get_vocab(), eot_token, backend.eos_token, f"data.tokenizer: {directory}")
    h = hashlib.sha256(f"eot={eot}\n".encode())
    for name in _HF_FILES:
        if (directory / name).is_file():
            h.update(name.encode() + (directory / name).read_bytes())
    return TextTokenizer(backend, eot, len(backend), h.hexdigest(), hf=True)


def train_bpe(documents: Iterable[str], *, vocab_size: int, out: str | Path) -> Path:
    """Train a byte-level BPE of `vocab_size` ids (the 256 byte symbols, `EOT` and merges)
    on `documents` and write its tokenizer.json to `out` atomically. The same documents give
    the same file (tested); RAYON_NUM_THREADS=1 is set while training, which keeps the
    trainer on one thread where its pool has not started yet, so parallel merge counting
    cannot break ties in another order. Raises `UserError` for a vocabulary too small for the byte alphabet."""
    tk = _tokenizers()
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise UserError(f"a byte-level BPE needs vocab_size >= {len(alphabet) + 1} (256 bytes and {EOT}), "
                        f"got {vocab_size}")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=alphabet,
                                     show_progress=False)
    before = os.environ.get("RAYON_NUM_THREADS")
    os.environ["RAYON_NUM_THREADS"] = "1"
    try:
        tokenizer.train_from_iterator(documents, trainer)
    finally:
        if before is None:
            os.environ.pop("RAYON_NUM_THREADS", None)
        else:
            os.environ["RAYON_NUM_THREADS"] = before
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tokenizer.save(str(tmp))
    os.replace(tmp, out)
    return out
