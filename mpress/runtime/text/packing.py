"""Text documents -> one cached token stream -> training and validation windows.

Packing: every document's ids are followed by the end-of-text id and the documents are
concatenated in corpus order (`doc0 EOT doc1 EOT ...`), so a window may span a document
boundary with the separator telling the model where one ends. The stream and each
document's end offset are cached as `.npy` files named by a sha256 of the files' contents,
the tokenizer's fingerprint and this format's version: a change to any of them misses the
cache and tokenizes again (the old files stay, harmless).

The validation split is by whole documents: the documents are permuted by the seed and
taken, in that order, into the validation set until it holds `val_fraction` of the
text (its characters: the split is made before any tokenizer, `mpress.runtime.text.dataset`;
at least one document, never all). Each side is packed on its own, in corpus
order, so no window mixes training and validation text. `TextWindows` cuts one side into
non-overlapping causal windows like `mpress.runtime.data.TokenFile`: window i is tokens
[i*T, i*T + T] (T + 1 tokens, neighbours share one), inputs the first T, targets the last T.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mpress.errors import UserError
from mpress.runtime.text.corpus import Corpus
from mpress.runtime.text.tokenizer import TextTokenizer

CACHE_VERSION = 1
"""Bumped when the cached layout changes (part of the cache key)."""

_SPLIT_STREAM = 3
"""The numpy stream tag of the split's permutation (`mpress.runtime.data` uses 0-2)."""


@dataclass(frozen=True)
class Packed:
    """A corpus's token stream: documents separated by the end-of-text id."""

    tokens: np.ndarray
    """(N,) the stream, uint16 or uint32 (memory-mapped from the cache)."""
    doc_ends: np.ndarray
    """(D,) int64: document d is tokens [doc_ends[d-1], doc_ends[d]), its separator included."""
    eot_id: int
    """The separator's id."""
    cache_hit: bool
    """Whether the stream came from the cache (False: tokenized now and written)."""


def cache_key(corpus: Corpus, tokenizer: TextTokenizer) -> str:
    """The cache key: 24 hex digits of sha256(contents, tokenizer, format version)."""
    h = hashlib.sha256(f"v{CACHE_VERSION}\n{corpus.content_hash()}\n{tokenizer.fingerprint}\n".encode())
    return h.hexdigest()[:24]


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def pack(corpus: Corpus, tokenizer: TextTokenizer, cache_dir: str | Path) -> Packed:
    """The corpus's packed stream, from `cache_dir` when it holds this key's files, else
    tokenized (one batch of documents at a time) and written there atomically."""
    cache = Path(cache_dir)
    key = cache_key(corpus, tokenizer)
    tokens_path, ends_path = cache / f"tokens-{key}.npy", cache / f"doc-ends-{key}.npy"
    if tokens_path.is_file() and ends_path.is_file():
        return Packed(np.load(tokens_path, mmap_mode="r"), np.load(ends_path), tokenizer.eot_id, cache_hit=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    parts: list[np.ndarray] = []
    lengths: list[int] = []
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer.encode(batch):
            parts.append(np.asarray([*ids, tokenizer.eot_id], dtype=dtype))
            lengths.append(len(ids) + 1)
        batch.clear()

    for doc in corpus.documents():
        batch.append(doc)
        if len(batch) == 256:
            flush()
    flush()
    if not parts:
        raise UserError(f"data: no documents in {', '.join(str(f) for f in corpus.files[:3])}")
    tokens = np.concatenate(parts)
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    try:
        cache.mkdir(parents=True, exist_ok=True)
        _save_atomic(tokens_path, tokens)
        _save_atomic(ends_path, ends)
    except OSError as exc:
        raise UserError(f"data.cache_dir: cannot write the token cache in {cache}: {exc.strerror} "
                        "(set data.cache_dir to a writable directory)") from None
    return Packed(tokens, ends, tokenizer.eot_id, cache_hit=False)


def split_documents(doc_ends: np.ndarray, *, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) document indices, each sorted: the documents in the order of
    a permutation drawn from `seed` go to validation until it holds at least
    `val_fraction` of the total size. `doc_ends`: each document's end offset with the
    documents one after another, in any unit (characters, tokens). No validation set for val_fraction 0; otherwise at least
    one document each (`UserError` for a corpus of one document)."""
    num_docs = int(doc_ends.shape[0])
    every = np.arange(num_docs)
    if val_fraction <= 0:
        return every, every[:0]
    if num_docs < 2:
        raise UserError("data.val_fraction: the text has one document; a validation split needs at least two "
                        "(set val_fraction: 0 or add documents)")
    lengths = np.diff(doc_ends, prepend=0)
    order = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(num_docs)
    held = np.cumsum(lengths[order])
    count = int(np.searchsorted(held, val_fraction * int(doc_ends[-1]))) + 1
    count = min(max(count, 1), num_docs - 1)
    val = np.sort(order[:count])
    train = np.setdiff1d(every, val)
    return train, val


def gather(packed: Packed, docs: np.ndarray) -> np.ndarray:
    """The stream of the documents `docs` (sorted indices), each with its separator."""
    starts = np.concatenate([[0], packed.doc_ends[:-1]])
    if docs.shape[0] == packed.doc_ends.shape[0]:
        return packed.tokens
    return np.concatenate([np.asarray(packed.tokens[starts[d]:packed.doc_ends[d]]) for d in docs])


class TextWindows:
    """Causal (inputs, targets) windows over a packed stream (see the module docstring);
    a `mpress.runtime.data.TokenDataset`."""

    def __init__(self, tokens: np.ndarray, seq_len: int, *, what: str = "text") -> None:
        if seq_len < 1:
            raise UserError(f"{what}: seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        n = int(tokens.shape[0])
        self.num_samples = (n - 1) // seq_len
        if self.num_samples < 1:
            raise UserError(f"{what}: {n} tokens, need at least {seq_len + 1} for one window of seq_len {seq_len}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"text window {index} out of range [0, {self.num_samples})")
        start = index * self.seq_len
        window = np.asarray(self.tokens[start:start + self.seq_len + 1]).astype(np.int64)  # (T + 1,)
        return torch.from_numpy(window[:-1].copy()), torch.from_numpy(window[1:].copy())
