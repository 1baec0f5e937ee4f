"""Training data: determinism, shapes, the synthetic chain's loss floor and learnability,
token file formats and the errors bad files get."""

import dataclasses
import itertools
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from mpress.errors import UserError
from mpress.config.model_config import load_model_config
from mpress.models import build_model, lm_loss
from mpress.runtime.data import (
    IGNORE_INDEX,
    SyntheticTokens,
    TokenFile,
    batches,
    build_dataset,
    sample_indices,
)
from mpress.runtime.train_config import DataConfig


def is_chain_walk(ds: SyntheticTokens, seq: torch.Tensor) -> bool:
    return all(int(b) in ds.successors[int(a)] for a, b in itertools.pairwise(seq.tolist()))


# ---------------------------------------------------------------- synthetic tokens


def test_synthetic_is_deterministic_per_seed_and_index():
    a = SyntheticTokens(256, 32, seed=7)
    b = SyntheticTokens(256, 32, seed=7)
    c = SyntheticTokens(256, 32, seed=8)
    for i in (0, 1, 12345):
        assert torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1], b[i][1])
    assert not torch.equal(a[0][0], a[1][0])
    assert not torch.equal(a[0][0], c[0][0])
    # Reading out of order does not change a sample (no hidden RNG state).
    first = a[3][0].clone()
    _ = a[9], a[2]
    assert torch.equal(a[3][0], first)


def test_synthetic_is_identical_in_another_process():
    code = ("from mpress.runtime.data import SyntheticTokens, batches\n"
            "x, y = batches(SyntheticTokens(256, 32, seed=3), microbatch_size=2, num_microbatches=3, step=5)\n"
            "print(x.flatten().tolist(), y.flatten().tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    x, y = batches(SyntheticTokens(256, 32, seed=3), microbatch_size=2, num_microbatches=3, step=5)
    assert out.strip() == f"{x.flatten().tolist()} {y.flatten().tolist()}"


def test_causal_shapes_and_next_token_targets():
    ds = SyntheticTokens(256, 32, seed=0)
    x, y = batches(ds, microbatch_size=4, num_microbatches=8, step=0)
    assert x.shape == y.shape == (32, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])  # targets are the inputs shifted by one
    assert int(x.min()) >= 0 and int(x.max()) < 256
    for row in range(32):
        assert is_chain_walk(ds, torch.cat([x[row], y[row, -1:]]))
    assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()


def test_entropy_floor_is_that_of_the_chain():
    ds = SyntheticTokens(256, 32, seed=0, branching=4)
    assert ds.entropy_floor_nats == pytest.approx(math.log(4))
    assert ds.successors.shape == (256, 4)
    assert all(len(set(row)) == 4 for row in ds.successors.tolist())  # distinct successors
    # The successors are followed uniformly: an empirical check of the floor's premise.
    x, y = batches(ds, microbatch_size=64, num_microbatches=4, step=0)
    rank = torch.tensor([[list(ds.successors[a]).index(b) for a, b in zip(xr.tolist(), yr.tolist())]
                         for xr, yr in zip(x, y)])
    counts = torch.bincount(rank.flatten(), minlength=4).double()
    assert (counts / counts.sum() - 0.25).abs().max() < 0.03
    assert SyntheticTokens(256, 8, seed=0, objective="masked").entropy_floor_nats is None


def test_masked_variant():
    ds = SyntheticTokens(256, 32, seed=1, objective="masked", mask_prob=0.25)
    x, y = batches(ds, microbatch_size=8, num_microbatches=2, step=3)
    assert x.shape == y.shape == (16, 32) and y.dtype == torch.int64
    masked = x == ds.mask_token_id
    assert torch.equal(masked, y != IGNORE_INDEX)
    assert masked.any(dim=1).all()  # at least one prediction per sample
    assert 0.15 < masked.double().mean() < 0.35
    # Targets are the original tokens: rebuild each sample's walk.
    indices = sample_indices(None, batch_size=16, step=3)
    for row, i in enumerate(indices):
        original = torch.from_numpy(ds.tokens(i, 32))
        assert torch.equal(torch.where(masked[row], y[row], x[row]), original)
        assert int(original.max()) < ds.mask_token_id  # the chain never emits the mask id
    logits = torch.zeros(16, 32, 256)
    assert lm_loss(logits, y).item() == pytest.approx(math.log(256))  # ignored positions left out


def test_bad_synthetic_arguments():
    with pytest.raises(UserError, match="branching"):
        SyntheticTokens(8, 4, seed=0, branching=9)
    with pytest.raises(UserError, match="seq_len"):
        SyntheticTokens(8, 0, seed=0)
    with pytest.raises(UserError, match="num_samples"):
        SyntheticTokens(8, 4, seed=0, num_samples=0)
    with pytest.raises(TypeError):
        len(SyntheticTokens(8, 4, seed=0))


def test_gpt_tiny_learns_the_chain():
    """Plain PyTorch, no pipelining: the loss falls from ln(vocab) towards ln(branching)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses, floor, vocab_size = train_gpt_tiny_on_chain()
    finally:
        torch.set_num_threads(threads)
    first = losses[0]
    last = sum(losses[-10:]) / 10  # every batch is fresh, so this is a held-out loss
    assert first == pytest.approx(math.log(vocab_size), abs=0.1)
    assert last < 0.5 * first, losses[::20]
    assert last < floor + 0.6, (last, floor)
    assert last > floor - 0.1, (last, floor)  # nothing beats the floor on fresh samples


def train_gpt_tiny_on_chain() -> tuple[list[float], float, int]:
    cfg = dataclasses.replace(load_model_config("gpt-tiny"), dropout=0.0)
    ds = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=0, branching=4)
    model = build_model(cfg, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(200):
        x, y = batches(ds, microbatch_size=16, num_microbatches=1, step=step)
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, ds.entropy_floor_nats, cfg.vocab_size


# ---------------------------------------------------------------- batches


def test_batches_are_per_step_and_split_into_microbatches():
    ds = SyntheticTokens(64, 8, seed=0)
    x0, _ = batches(ds, microbatch_size=3, num_microbatches=2, step=0)
    x1, _ = batches(ds, microbatch_size=3, num_microbatches=2, step=1)
    assert torch.equal(x0, batches(ds, microbatch_size=3, num_microbatches=2, step=0)[0])
    assert not torch.equal(x0, x1)
    # Step s holds samples s*B .. s*B + B - 1, microbatch m its rows m*mbs ..
    assert torch.equal(x1[3], ds[9][0])
    assert torch.equal(x0[0], ds[0][0]) and torch.equal(x0[5], ds[5][0])
    with pytest.raises(UserError):
        batches(ds, microbatch_size=0, num_microbatches=2, step=0)
    with pytest.raises(UserError):
        batches(ds, microbatch_size=1, num_microbatches=2, step=-1)


def test_sample_indices_wrap_and_shuffle_per_epoch():
    assert sample_indices(5, batch_size=3, step=1) == [3, 4, 0]
    assert sample_indices(None, batch_size=3, step=2) == [6, 7, 8]
    def epoch(steps):
        return [i for s in steps for i in sample_indices(10, batch_size=5, step=s, shuffle_seed=1)]

    epoch0, epoch1 = epoch((0, 1)), epoch((2, 3))
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != list(range(10)) and epoch0 != epoch1
    assert epoch0 == epoch((0, 1))


# ---------------------------------------------------------------- token files


TOKENS = np.arange(100, dtype=np.int64) * 7 % 250  # 100 tokens, ids < 250


@pytest.mark.parametrize("name, writer", [
    ("t.bin", lambda p: TOKENS.astype("<u2").tofile(p)),
    ("t.uint32.bin", lambda p: TOKENS.astype("<u4").tofile(p)),
    ("t.npy", lambda p: np.save(p, TOKENS.astype(np.int32))),
    ("t.txt", lambda p: p.write_text(" ".join(map(str, TOKENS[:50])) + "\n" + "\n".join(map(str, TOKENS[50:])))),
])
def test_token_file_formats(tmp_path, name, writer):
    path = tmp_path / name
    writer(path)
    ds = TokenFile(path, 8, vocab_size=256)
    assert len(ds) == (100 - 1) // 8 == ds.num_samples
    for i in (0, 1, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
        assert x.tolist() == TOKENS[8 * i:8 * i + 8].tolist()
        assert y.tolist() == TOKENS[8 * i + 1:8 * i + 9].tolist()
    x, y = batches(ds, microbatch_size=4, num_microbatches=3, step=1)  # wraps past 12 samples
    assert torch.equal(x[0], ds[0][0])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_bin_token_dtype(tmp_path):
    path = tmp_path / "t.bin"
    TOKENS.astype("<u4").tofile(path)
    assert TokenFile(path, 8, vocab_size=256, token_dtype="uint32")[1][0].tolist() == TOKENS[8:16].tolist()
    # Read as the default uint16, a uint32 file's ids interleave with zeros: not the data.
    assert TokenFile(path, 8, vocab_size=256)[0][0].tolist() != TOKENS[:8].tolist()
    big = tmp_path / "big.bin"
    np.array([70000, 1, 2, 3], dtype="<u4").tofile(big)
    assert TokenFile(big, 3, vocab_size=100_000)[0][0].tolist() == [70000, 1, 2]  # > 2**16 vocab: uint32
    named = tmp_path / "n.uint32.bin"
    TOKENS.astype("<u4").tofile(named)
    with pytest.raises(UserError, match="file name says uint32 but token_dtype is uint16"):
        TokenFile(named, 8, vocab_size=256, token_dtype="uint16")


def test_masked_token_file(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, TOKENS)
    ds = TokenFile(path, 10, vocab_size=256, objective="masked", mask_prob=0.3, seed=4)
    assert len(ds) == 10
    x, y = ds[2]
    masked = x == 255
    assert masked.any() and torch.equal(masked, y != IGNORE_INDEX)
    assert torch.where(masked, y, x).tolist() == TOKENS[20:30].tolist()
    assert torch.equal(ds[2][0], x)  # the mask is a function of (seed, index)
    reserved = tmp_path / "r.txt"
    reserved.write_text("1 2 255 3 4\n")
    with pytest.raises(UserError, match="token 2 is 255, the id reserved for the mask token"):
        TokenFile(reserved, 2, vocab_size=256, objective="masked")


def one_line_error(path, pattern, **kwargs):
    with pytest.raises(UserError, match=pattern) as info:
        TokenFile(path, kwargs.pop("seq_len", 4), vocab_size=kwargs.pop("vocab_size", 256), **kwargs)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_bad_token_files(tmp_path):
    ids = TOKENS.copy()
    ids[37] = 300
    np.save(tmp_path / "big.npy", ids)
    one_line_error(tmp_path / "big.npy", "token 37 is 300, not below vocab_size 256")
    ids.astype("<u2").tofile(tmp_path / "big.bin")
    one_line_error(tmp_path / "big.bin", "token 37 is 300, not below vocab_size 256")
    ids[37] = -2
    np.save(tmp_path / "neg.npy", ids)
    one_line_error(tmp_path / "neg.npy", "token 37 is -2; token ids must be >= 0")
    (tmp_path / "word.txt").write_text("1 2 3\n4 five 6\n")
    one_line_error(tmp_path / "word.txt", "token 4 is 'five', not an integer")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    one_line_error(tmp_path / "odd.bin", "3 bytes is not a whole number of uint16 tokens")
    np.save(tmp_path / "2d.npy", np.zeros((4, 4), dtype=np.int64))
    one_line_error(tmp_path / "2d.npy", "1-D integer array")
    np.save(tmp_path / "float.npy", np.zeros(10))
    one_line_error(tmp_path / "float.npy", "1-D integer array")
    (tmp_path / "t.csv").write_text("1,2,3")
    one_line_error(tmp_path / "t.csv", "unknown token file format '.csv'")
    (tmp_path / "short.txt").write_text("1 2 3 4")
    one_line_error(tmp_path / "short.txt", "4 tokens, need at least 5")
    one_line_error(tmp_path / "missing.bin", "no such token file")
    (tmp_path / "empty.bin").write_bytes(b"")
    one_line_error(tmp_path / "empty.bin", "0 tokens")


# ---------------------------------------------------------------- from a training config


def test_build_dataset_follows_the_model_family(tmp_path):
    gpt = load_model_config("gpt-tiny")
    bert = load_model_config("bert-tiny")
    ds = build_dataset(DataConfig(branching=2), gpt, seed=5)
    assert isinstance(ds, SyntheticTokens) and ds.objective == "causal" and ds.seq_len == 32
    assert ds.entropy_floor_nats == pytest.approx(math.log(2))
    mlm = build_dataset(DataConfig(mask_prob=0.5), bert, seed=5)
    assert mlm.objective == "masked" and mlm.mask_prob == 0.5
    path = tmp_path / "t.npy"
    np.save(path, TOKENS)
    ds = build_dataset(DataConfig(kind="file", path=str(path)), gpt, seed=0)
    assert isinstance(ds, TokenFile) and len(ds) == (100 - 1) // 32


@pytest.mark.parametrize("name, objective", [("gpt-tiny", "causal"), ("llama-tiny", "causal"), ("bert-tiny", "masked")])
def test_each_family_trains_on_its_objective(name, objective):
    """Decoders (GPT, Llama) predict the next token; encoders (BERT) the masked ones."""
    model = load_model_config(name)
    assert build_dataset(DataConfig(), model, seed=0).objective == objective
