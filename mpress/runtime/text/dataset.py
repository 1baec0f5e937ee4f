"""`data.kind: text` end to end: corpus -> validation split -> tokenizer (loaded, or
trained on the training documents only and cached) -> packed, cached stream -> training
and validation windows (`TextData`).

The split comes first and is by the documents' sizes in characters, so it does not depend
on the tokenizer: a BPE trained here (`tokenizer: train`) sees the training documents and
never the held-out ones, whose text would otherwise leak into the vocabulary the
validation loss is measured with.

Every rank may call `build_text_data`; the expensive parts (training the BPE, tokenizing)
run once per cache: `mpress.train` lets each node's first rank build the cache before the
others read it. Everything after the cache is a pure function of (files, tokenizer, seed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpress.errors import UserError
from mpress.runtime.data_config import TOKENIZER_TRAIN, DataConfig
from mpress.runtime.text.corpus import Corpus, default_cache_dir, find_corpus
from mpress.runtime.text.packing import Packed, TextWindows, gather, pack, split_documents
from mpress.runtime.text.tokenizer import TextTokenizer, load_tokenizer, train_bpe


@dataclass
class TextData:
    """The training and validation windows of a text data set."""

    train: TextWindows
    """Training windows (documents not held out)."""
    val: TextWindows | None
    """Validation windows (whole held-out documents); None without val_fraction."""
    tokenizer: TextTokenizer
    """The tokenizer the stream was made with."""
    packed: Packed
    """The whole stream (cache_hit says whether it came from the cache)."""
    num_docs: tuple[int, int]
    """Documents in (training, validation)."""
    split: tuple[np.ndarray, np.ndarray]
    """The corpus's document indices in (training, validation), each sorted."""


def cache_dir_of(data: DataConfig) -> Path:
    """`data.cache_dir`, or the default beside the data (`corpus.default_cache_dir`)."""
    return Path(data.cache_dir) if data.cache_dir is not None else default_cache_dir(data.path, data.source)


def document_sizes(corpus: Corpus) -> np.ndarray:
    """(D,) int64: the end of each document in characters, documents one after another
    (what `split_documents` splits by)."""
    return np.cumsum(np.asarray([len(doc) for doc in corpus.documents()], dtype=np.int64))


def trained_tokenizer_path(corpus: Corpus, vocab_size: int, cache_dir: Path, train_docs: np.ndarray) -> Path:
    """The cached BPE trained on the documents `train_docs` (sorted indices) of `corpus`
    at `vocab_size`: trained now when it is not there. Its name hashes the corpus and
    which documents it was trained on."""
    key = hashlib.sha256(f"{corpus.content_hash()}\ndocs={','.join(map(str, train_docs.tolist()))}".encode())
    path = cache_dir / f"bpe-{vocab_size}-{key.hexdigest()[:24]}.json"
    if not path.is_file():
        keep = set(train_docs.tolist())
        documents = (doc for i, doc in enumerate(corpus.documents()) if i in keep)
        try:
            train_bpe(documents, vocab_size=vocab_size, out=path)
        except OSError as exc:
            raise UserError(f"data.cache_dir: cannot write the tokenizer in {cache_dir}: {exc.strerror} "
                            "(set data.cache_dir to a writable directory)") from None
    return path


def resolve_tokenizer(data: DataConfig, corpus: Corpus, *, vocab_size: int, train_docs: np.ndarray) -> TextTokenizer:
    """The tokenizer `data.tokenizer` names (`train`: trained on the documents
    `train_docs`), checked against the model's vocabulary."""
    if data.tokenizer == TOKENIZER_TRAIN:
        path = trained_tokenizer_path(corpus, vocab_size, cache_dir_of(data), train_docs)
        where = f"the BPE trained in {path}"
    else:
        path = Path(data.tokenizer)  # type: ignore[arg-type]
        where = f"data.tokenizer {path}"
    tokenizer = load_tokenizer(path, eot_token=data.eot_token)
    if tokenizer.vocab_size > vocab_size:
        raise UserError(f"{where}: {tokenizer.vocab_size} ids do not fit the model's vocab_size {vocab_size} "
                        "(use a model with a larger vocabulary or a smaller tokenizer)")
    return tokenizer


def build_text_data(data: DataConfig, *, seq_len: int, vocab_size: int, seed: int) -> TextData:
    """Training and validation windows of seq_len tokens for `data` (kind: text), for a
    model of `vocab_size` ids. Raises `UserError` naming the file or key at fault."""
    corpus = find_corpus(data.path, source=data.source, text_key=data.text_key)
    sizes = document_sizes(corpus)
    if sizes.size == 0:
        raise UserError(f"data: no documents in {', '.join(str(f) for f in corpus.files[:3])}")
    train_docs, val_docs = split_documents(sizes, val_fraction=data.val_fraction, seed=seed)
    tokenizer = resolve_tokenizer(data, corpus, vocab_size=vocab_size, train_docs=train_docs)
    packed = pack(corpus, tokenizer, cache_dir_of(data))
    what = data.path or data.source
    train = TextWindows(gather(packed, train_docs), seq_len, what=f"{what} (training part)")
    val = TextWindows(gather(packed, val_docs), seq_len, what=f"{what} (validation part)") \
        if val_docs.size else None
    return TextData(train=train, val=val, tokenizer=tokenizer, packed=packed,
                    num_docs=(int(train_docs.size), int(val_docs.size)), split=(train_docs, val_docs))
