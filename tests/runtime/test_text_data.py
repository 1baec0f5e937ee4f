"""`data.kind: text` without torch.distributed: documents, the trained BPE, packing with
the separator, window boundaries, the validation split, the cache and resumable batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mpress.errors import ConfigError, UserError
from mpress.models.user import load_user_model
from mpress.runtime.data import batches
from mpress.runtime.data_config import DataConfig
from mpress.runtime.train_config import TrainConfig, load_train_config
from mpress.runtime.text.corpus import find_corpus, stdlib_files
from mpress.runtime.text.dataset import build_text_data
from mpress.runtime.text.packing import TextWindows, pack, split_documents
from mpress.runtime.text.tokenizer import EOT, load_tokenizer, train_bpe

pytest.importorskip("tokenizers")

DOCS = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 3) for i in range(12)]


def corpus_dir(tmp_path: Path) -> Path:
    """Eight .txt documents and a .jsonl file of four more, in a directory tree."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for i, doc in enumerate(DOCS[:8]):
        (root / ("sub" if i % 2 else "") / f"d{i:02d}.txt").write_text(doc)
    (root / "more.jsonl").write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS[8:])))
    return root


def text_config(root: Path, **kw: object) -> DataConfig:
    return DataConfig(kind="text", path=str(root), tokenizer="train", text_key="body",
                      cache_dir=str(root.parent / "cache"), **kw)


def test_a_directory_gives_its_documents_in_path_order_and_jsonl_lines(tmp_path):
    root = corpus_dir(tmp_path)
    corpus = find_corpus(root, text_key="body")
    assert [f.name for f in corpus.files] == ["d00.txt", "d02.txt", "d04.txt", "d06.txt", "more.jsonl",
                                              "d01.txt", "d03.txt", "d05.txt", "d07.txt"]
    docs = list(corpus.documents())
    assert len(docs) == 12 and docs[4:8] == DOCS[8:]
    (root / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:1: no string field 'body'.*data\.text_key"):
        list(find_corpus(root, text_key="body").documents())
    with pytest.raises(UserError, match="a text file must be .txt"):
        find_corpus(_touch(tmp_path / "x.md"))
    assert stdlib_files() and all(f.suffix == ".py" for f in stdlib_files())


def _touch(path: Path) -> Path:
    path.write_text("x")
    return path


def test_trained_bpe_is_byte_level_deterministic_and_has_the_separator(tmp_path):
    a, b = train_bpe(DOCS, vocab_size=300, out=tmp_path / "a.json"), train_bpe(DOCS, vocab_size=300,
                                                                               out=tmp_path / "b.json")
    assert a.read_bytes() == b.read_bytes()
    tok = load_tokenizer(a)
    assert 257 < tok.vocab_size <= 300 and tok.backend.id_to_token(tok.eot_id) == EOT  # merges run out first
    ids = tok.encode(["héllo ✓"])[0]
    assert tok.backend.decode(ids) == "héllo ✓"  # byte-level: any text round-trips
    with pytest.raises(UserError, match="vocab_size >= 257"):
        train_bpe(DOCS, vocab_size=256, out=tmp_path / "c.json")
    with pytest.raises(UserError, match="no end-of-text token '<eos>'.*data.eot_token"):
        load_tokenizer(a, eot_token="<eos>")


def test_packing_puts_the_separator_after_every_document_and_windows_tile_the_stream(tmp_path):
    root = corpus_dir(tmp_path)
    corpus = find_corpus(root, text_key="body")
    tok = load_tokenizer(train_bpe(corpus.documents(), vocab_size=300, out=tmp_path / "t.json"))
    packed = pack(corpus, tok, tmp_path / "cache")
    ids = tok.encode(list(corpus.documents()))
    expected = np.concatenate([[*doc, tok.eot_id] for doc in ids])
    assert np.array_equal(np.asarray(packed.tokens), expected)
    assert np.array_equal(packed.doc_ends, np.cumsum([len(d) + 1 for d in ids]))
    assert np.all(np.asarray(packed.tokens)[packed.doc_ends - 1] == tok.eot_id)
    windows = TextWindows(packed.tokens, 8)
    assert len(windows) == (len(expected) - 1) // 8
    for i in (0, 1, len(windows) - 1):
        x, y = windows[i]
        assert x.dtype == torch.int64 and x.shape == y.shape == (8,)
        assert torch.equal(x, torch.from_numpy(expected[i * 8:i * 8 + 8].astype(np.int64)))
        assert torch.equal(y, torch.from_numpy(expected[i * 8 + 1:i * 8 + 9].astype(np.int64)))  # shifted by one
    with pytest.raises(IndexError):
        windows[len(windows)]
    with pytest.raises(UserError, match="need at least 9"):
        TextWindows(expected[:8], 8)


def test_the_cache_hits_misses_and_is_invalidated_by_the_contents_or_the_tokenizer(tmp_path):
    root = corpus_dir(tmp_path)
    cfg = text_config(root)
    first = build_text_data(cfg, seq_len=8, vocab_size=300, seed=0)
    assert not first.packed.cache_hit
    cache = tmp_path / "cache"
    assert len(list(cache.glob("tokens-*.npy"))) == 1 and len(list(cache.glob("bpe-300-*.json"))) == 1
    again = build_text_data(cfg, seq_len=8, vocab_size=300, seed=0)
    assert again.packed.cache_hit and np.array_equal(again.packed.tokens, first.packed.tokens)
    moved = tmp_path / "moved"
    root.rename(moved)  # the key is the contents, not the paths
    assert build_text_data(text_config(moved), seq_len=8, vocab_size=300, seed=0).packed.cache_hit
    (moved / "d00.txt").write_text("x = 1\n")  # edited: a new tokenizer and new tokens
    edited = build_text_data(text_config(moved), seq_len=8, vocab_size=300, seed=0)
    assert not edited.packed.cache_hit and len(list(cache.glob("tokens-*.npy"))) == 2
    other_vocab = build_text_data(text_config(moved), seq_len=8, vocab_size=270, seed=0)  # another tokenizer
    assert not other_vocab.packed.cache_hit and other_vocab.tokenizer.vocab_size == 270


def test_the_validation_split_is_whole_documents_disjoint_and_deterministic(tmp_path):
    ends = np.cumsum([10, 20, 5, 40, 15, 10, 30, 20])
    train, val = split_documents(ends, val_fraction=0.2, seed=3)
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(8))
    assert not set(train) & set(val) and val.size >= 1
    held = np.diff(ends, prepend=0)[val].sum()
    assert held >= 0.2 * ends[-1]
    assert all(np.array_equal(a, b) for a, b in zip((train, val), split_documents(ends, val_fraction=0.2, seed=3)))
    assert split_documents(ends, val_fraction=0.0, seed=3)[1].size == 0
    with pytest.raises(UserError, match="one document"):
        split_documents(ends[:1], val_fraction=0.1, seed=0)

    root = corpus_dir(tmp_path)
    data = build_text_data(text_config(root, val_fraction=0.25), seq_len=4, vocab_size=300, seed=0)
    assert data.val is not None and sum(data.num_docs) == 12
    train_rows = {tuple(data.train[i][0].tolist()) for i in range(len(data.train))}
    # no training window is a validation window: the held-out documents are packed apart
    val_tokens = np.asarray(data.val.tokens)
    assert np.asarray(data.train.tokens).size + val_tokens.size == np.asarray(data.packed.tokens).size
    assert len(train_rows) > 0 and val_tokens[-1] == data.tokenizer.eot_id


def test_the_batch_of_step_k_is_the_same_after_a_restart(tmp_path):
    root = corpus_dir(tmp_path)
    cfg = text_config(root, val_fraction=0.25)
    run = build_text_data(cfg, seq_len=4, vocab_size=300, seed=7)
    restarted = build_text_data(cfg, seq_len=4, vocab_size=300, seed=7)  # a new process reads the cache
    for k in (0, 5, 31):
        a = batches(run.train, microbatch_size=2, num_microbatches=2, step=k, shuffle_seed=7)
        b = batches(restarted.train, microbatch_size=2, num_microbatches=2, step=k, shuffle_seed=7)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    shuffled = batches(run.train, microbatch_size=2, num_microbatches=2, step=0, shuffle_seed=8)
    in_order = batches(run.train, microbatch_size=2, num_microbatches=2, step=0, shuffle_seed=7)
    assert not torch.equal(shuffled[0], in_order[0])  # the seed draws the epoch's order


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="path.*or source: python-stdlib, exactly one"):
        DataConfig(kind="text", tokenizer="train")
    with pytest.raises(ConfigError, match="tokenizer.*kind: text needs a tokenizer"):
        DataConfig(kind="text", source="python-stdlib")
    with pytest.raises(ConfigError, match="val_fraction.*only for kind: text"):
        DataConfig(val_fraction=0.1)
    with pytest.raises(ConfigError, match="tokenizer.*only for kind: text"):
        DataConfig(tokenizer="train")
    with pytest.raises(ConfigError, match="eval_every.*needs a validation set"):
        TrainConfig(model="gpt-tiny", eval_every=10)
    assert TrainConfig(model="gpt-tiny", eval_every=10, data=DataConfig(kind="text", source="python-stdlib",
                                                                       tokenizer="train", val_fraction=0.1))


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    root = corpus_dir(tmp_path)
    path = train_bpe(find_corpus(root, text_key="body").documents(), vocab_size=300, out=tmp_path / "t.json")
    cfg = DataConfig(kind="text", path=str(root), tokenizer=str(path), text_key="body", cache_dir=str(tmp_path / "c"))
    with pytest.raises(UserError, match="ids do not fit the model's vocab_size 256"):
        build_text_data(cfg, seq_len=4, vocab_size=256, seed=0)


def test_a_hugging_face_tokenizer_directory_loads_locally(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = train_bpe(DOCS, vocab_size=290, out=tmp_path / "t.json")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOT)
    hf.save_pretrained(tmp_path / "model")  # tokenizer_config.json, tokenizer.json: as a model directory has them
    tok = load_tokenizer(tmp_path / "model")
    plain = load_tokenizer(path)
    assert tok.hf and tok.eot_id == plain.eot_id and tok.vocab_size == plain.vocab_size
    assert tok.encode(DOCS[:3]) == plain.encode(DOCS[:3])
    root = corpus_dir(tmp_path)
    cfg = DataConfig(kind="text", path=str(root), tokenizer=str(tmp_path / "model"), text_key="body",
                     cache_dir=str(tmp_path / "c"))
    data = build_text_data(cfg, seq_len=4, vocab_size=512, seed=0)
    assert data.tokenizer.hf and np.asarray(data.packed.tokens)[-1] == plain.eot_id


def test_a_text_config_loads_with_paths_relative_to_its_file(tmp_path):
    root = corpus_dir(tmp_path)
    (tmp_path / "train.yaml").write_text("model: gpt-text-tiny\ndata: {kind: text, path: corpus, tokenizer: train, "
                                         "cache_dir: cache, val_fraction: 0.1}\neval_every: 5\n")
    cfg = load_train_config(tmp_path / "train.yaml")
    assert cfg.data.path == str(root) and cfg.data.cache_dir == str(tmp_path / "cache") and cfg.eval_every == 5
    (tmp_path / "bad.yaml").write_text("model: bert-tiny\ndata: {kind: text, path: corpus, tokenizer: train}\n")
    with pytest.raises(ConfigError, match="data.kind.*text trains a causal decoder"):
        load_train_config(tmp_path / "bad.yaml")
    (tmp_path / "gone.yaml").write_text("model: gpt-text-tiny\ndata: {kind: text, path: nope, tokenizer: train}\n")
    with pytest.raises(ConfigError, match="data.path.*no such file or directory"):
        load_train_config(tmp_path / "gone.yaml")


def test_a_module_or_hf_model_on_text_must_be_a_causal_lm(tmp_path):
    """An HF masked LM is refused text (and any HF model a token file) before any rank
    starts; `text_shape`: the positions and vocabulary a module trains on text with, from
    its example and one forward; a module of another shape is refused in one line."""
    pytest.importorskip("transformers")
    corpus_dir(tmp_path)
    (tmp_path / "hf.yaml").write_text("hf_config: bert-tiny\ndata: {kind: text, path: corpus, tokenizer: train}\n")
    with pytest.raises(ConfigError, match="data.kind.*text trains a causal LM; bert-tiny is a masked LM"):
        load_train_config(tmp_path / "hf.yaml")
    (tmp_path / "file.yaml").write_text("hf_config: gpt2-tiny\ndata: {kind: file, path: corpus}\n")
    with pytest.raises(ConfigError, match="data.kind.*a token file feeds a model preset"):
        load_train_config(tmp_path / "file.yaml")
    lm = load_user_model("tests.support.user_model:make_text_lm", layers=["embed", "blocks.*", "head"])
    assert lm.text_shape() == (8, 300)
    skipnet = load_user_model("examples.own_model.mymodel:make", layers=["embed", "blocks.*", "head"])
    with pytest.raises(UserError, match=r"example input must be one \(batch, seq_len\) tensor of token ids, got "
                                        r"\[\(\(2, 8, 16\), 'torch.float32'\)\]"):
        skipnet.text_shape()


def test_the_trained_bpe_never_sees_the_validation_documents(tmp_path):
    """`tokenizer: train` learns its merges from the training documents alone: its file is
    byte for byte the BPE `train_bpe` makes from them (deterministic, tested above), and not
    the one the whole corpus makes; the held-out documents still get tokenized with it."""
    root = corpus_dir(tmp_path)
    data = build_text_data(text_config(root, val_fraction=0.25), seq_len=4, vocab_size=300, seed=0)
    train_docs, val_docs = data.split
    assert val_docs.size and not set(train_docs.tolist()) & set(val_docs.tolist())
    docs = list(find_corpus(root, text_key="body").documents())
    (trained,) = (tmp_path / "cache").glob("bpe-300-*.json")
    only_train = train_bpe([docs[i] for i in train_docs], vocab_size=300, out=tmp_path / "train-only.json")
    every = train_bpe(docs, vocab_size=300, out=tmp_path / "every.json")
    assert trained.read_bytes() == only_train.read_bytes()
    assert trained.read_bytes() != every.read_bytes()
    assert data.val is not None and np.asarray(data.val.tokens).size > 0
    # another split (seed) trains another BPE, cached beside the first
    build_text_data(text_config(root, val_fraction=0.25), seq_len=4, vocab_size=300, seed=1)
    assert len(list((tmp_path / "cache").glob("bpe-300-*.json"))) == 2
