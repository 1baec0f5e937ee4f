"""Training data: a learnable synthetic token stream, users' token files, and the global
batch of one training step.

A dataset maps a sample index to `(inputs, targets)`, two (T,) int64 tensors:

- objective "causal" (GPT): inputs are T consecutive tokens, targets the next token at
  every position (the same T + 1 token window shifted by one).
- objective "masked" (BERT, masked LM): inputs are T tokens in which each position is
  replaced by the mask token with probability `mask_prob` (at least one per sample);
  targets hold the original token at masked positions and `IGNORE_INDEX` elsewhere, which
  `mpress.models.lm_loss` (cross entropy's default ignore_index) leaves out of the mean.
  The mask token is `vocab_size - 1`, reserved: data never contains it. (No BERT-style
  80/10/10 replacement: every selected position becomes the mask token.)

Everything is a pure function of `(seed, index)` (numpy's `SeedSequence` of both), so
every rank and every process builds identical samples without communicating, and a run
can be resumed at any step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import torch

from mpress.errors import UserError
from mpress.config.model_config import ModelConfig
from mpress.runtime.train_config import DataConfig

Objective = Literal["causal", "masked"]

IGNORE_INDEX = -100
"""Target of a position that is not predicted (masked LM); cross entropy's default ignore_index."""

# Stream tags keep the random draws of different purposes independent for one seed.
_TABLE_STREAM = 0
_SAMPLE_STREAM = 1
_SHUFFLE_STREAM = 2

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class TokenDataset(Protocol):
    """What `batches` needs: fixed-length samples addressed by index."""

    seq_len: int
    """Tokens per sample (T)."""
    num_samples: int | None
    """Samples before indices wrap around; None = unbounded (every index is a fresh sample)."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (T,) int64."""
        ...


def _rng(seed: int, stream: int, *more: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, *more])


def mask_tokens(ids: np.ndarray, *, mask_token_id: int, mask_prob: float,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Masked-LM pair from (T,) token ids: (inputs with masked positions set to
    `mask_token_id`, targets = ids at masked positions and `IGNORE_INDEX` elsewhere).

    At least one position is masked so a microbatch's loss is never an empty mean.
    """
    masked = rng.random(ids.shape[0]) < mask_prob
    if not masked.any():
        masked[rng.integers(ids.shape[0])] = True
    inputs = np.where(masked, mask_token_id, ids)
    targets = np.where(masked, ids, IGNORE_INDEX)
    return inputs, targets


def _pair(window: np.ndarray, *, objective: Objective, seq_len: int, mask_token_id: int, mask_prob: float,
          seed: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of sample `index` from its window of T + 1 (causal) or T (masked) tokens."""
    window = window.astype(np.int64)
    if objective == "causal":
        inputs, targets = window[:seq_len], window[1:seq_len + 1]
    else:
        inputs, targets = mask_tokens(window[:seq_len], mask_token_id=mask_token_id, mask_prob=mask_prob,
                                      rng=_rng(seed, _SAMPLE_STREAM, index, 1))
    # Separate storages, as a data loader delivers them.
    return (torch.from_numpy(np.ascontiguousarray(inputs)).clone(),
            torch.from_numpy(np.ascontiguousarray(targets)).clone())


class SyntheticTokens:
    """Token sequences from a fixed random first-order Markov chain with low entropy.

    The chain is drawn once from `seed`: every token `a` gets `branching` distinct
    successor tokens, each followed with probability 1 / branching. A sample starts at a
    uniformly drawn token and walks the chain. The chain uses all `vocab_size` tokens for
    the causal objective and `vocab_size - 1` for the masked one (the last id is the mask).

    Entropy floor (causal): every target is the successor of the input token at the same
    position, so the best achievable cross entropy is exactly ln(branching) nats per
    token (1.386 for the default 4), against ln(vocab_size) for an untrained model
    (5.545 for 256). For the masked objective the best loss depends on both neighbours
    (and on which of them are masked too); it has no simple closed form but is at most
    ln(branching) where the left neighbour is visible.

    Sample `i` depends only on `(seed, i)`; with `num_samples` set, indices wrap around
    (`batches` does the wrapping), otherwise every index is a fresh sample.
    """

    def __init__(self, vocab_size: int, seq_len: int, *, seed: int, num_samples: int | None = None,
                 branching: int = 4, objective: Objective = "causal", mask_prob: float = 0.15) -> None:
        num_tokens = vocab_size - (1 if objective == "masked" else 0)
        if seq_len < 1:
            raise UserError(f"synthetic data: seq_len must be >= 1, got {seq_len}")
        if num_samples is not None and num_samples < 1:
            raise UserError(f"synthetic data: num_samples must be >= 1, got {num_samples}")
        if not 1 <= branching <= num_tokens:
            raise UserError(f"synthetic data: branching must be in [1, {num_tokens}] "
                            f"for vocab_size {vocab_size} ({objective}), got {branching}")
        if objective == "masked" and not 0 < mask_prob <= 1:
            raise UserError(f"synthetic data: mask_prob must be in (0, 1], got {mask_prob}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = num_samples
        self.branching = branching
        self.objective: Objective = objective
        self.mask_prob = mask_prob
        self.mask_token_id = vocab_size - 1
        table_rng = _rng(seed, _TABLE_STREAM)
        # (num_tokens, branching): row a lists a's successors.
        self.successors = np.stack([table_rng.choice(num_tokens, size=branching, replace=False)
                                    for _ in range(num_tokens)])

    @property
    def entropy_floor_nats(self) -> float | None:
        """Best achievable mean cross entropy (causal objective), or None (masked)."""
        return math.log(self.branching) if self.objective == "causal" else None

    def tokens(self, index: int, length: int) -> np.ndarray:
        """The first `length` tokens of the chain walk of sample `index`, int64."""
        rng = _rng(self.seed, _SAMPLE_STREAM, index)
        start = int(rng.integers(self.successors.shape[0]))
        choices = rng.integers(self.branching, size=length - 1)
        out = np.empty(length, dtype=np.int64)
        out[0] = start
        table = self.successors
        for t in range(1, length):  # sequential by nature; T is small
            out[t] = table[out[t - 1], choices[t - 1]]
        return out

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            raise IndexError(f"sample index must be >= 0, got {index}")
        causal = self.objective == "causal"
        window = self.tokens(index, self.seq_len + (1 if causal else 0))
        return _pair(window, objective=self.objective, seq_len=self.seq_len, mask_token_id=self.mask_token_id,
                     mask_prob=self.mask_prob, seed=self.seed, index=index)

    def __len__(self) -> int:
        if self.num_samples is None:
            raise TypeError("an unbounded SyntheticTokens has no length (num_samples is None)")
        return self.num_samples


def _dtype_for_bin(path: Path, token_dtype: str | None, vocab_size: int) -> np.dtype:
    """Element type of a header-less .bin: explicit `token_dtype`, else a `.uint16.bin` /
    `.uint32.bin` name, else uint16 when the vocabulary fits in 16 bits, else uint32."""
    named = next((name for name in TOKEN_DTYPES if path.name.endswith(f".{name}.bin")), None)
    if token_dtype is not None:
        if token_dtype not in TOKEN_DTYPES:
            raise UserError(f"{path}: token_dtype must be uint16 or uint32, got {token_dtype!r}")
        if named is not None and named != token_dtype:
            raise UserError(f"{path}: the file name says {named} but token_dtype is {token_dtype}")
        return np.dtype(TOKEN_DTYPES[token_dtype])
    if named is not None:
        return np.dtype(TOKEN_DTYPES[named])
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _read_txt(path: Path) -> np.ndarray:
    words = path.read_text().split()
    try:
        return np.array([int(w) for w in words], dtype=np.int64)
    except (ValueError, OverflowError):
        for pos, w in enumerate(words):
            try:
                np.int64(int(w))
            except (ValueError, OverflowError):
                raise UserError(f"{path}: token {pos} is {w!r}, not an integer token id") from None
        raise


def load_tokens(path: str | Path, *, vocab_size: int, token_dtype: str | None = None,
                max_id: int | None = None) -> np.ndarray:
    """A token file as a flat array (memory-mapped for .bin/.npy), validated.

    Formats: `.bin` header-less little-endian uint16/uint32 (see `_dtype_for_bin`),
    `.npy` a 1-D integer array, `.txt` whitespace-separated integers. Every id must be in
    [0, max_id) (default vocab_size); the first offending one is a one-line `UserError`
    naming the file, its position and value.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such token file")
    suffix = p.suffix.lower()
    try:
        if suffix == ".bin":
            dtype = _dtype_for_bin(p, token_dtype, vocab_size).newbyteorder("<")
            size = p.stat().st_size
            if size % dtype.itemsize:
                raise UserError(f"{p}: {size} bytes is not a whole number of {dtype.name} tokens "
                                f"({dtype.itemsize} bytes each); is token_dtype right?")
            tokens = np.memmap(p, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
        elif suffix == ".npy":
            tokens = np.load(p, mmap_mode="r", allow_pickle=False)
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise UserError(f"{p}: expected a 1-D integer array, got shape {tokens.shape} of {tokens.dtype}")
        elif suffix == ".txt":
            tokens = _read_txt(p)
        else:
            raise UserError(f"{p}: unknown token file format {suffix or '(no suffix)'!r} (use .bin, .npy or .txt)")
    except (OSError, ValueError) as exc:
        raise UserError(f"{p}: cannot read tokens: {exc}") from None
    _check_ids(p, tokens, vocab_size, vocab_size if max_id is None else max_id)
    return tokens


def _check_ids(path: Path, tokens: np.ndarray, vocab_size: int, max_id: int) -> None:
    chunk = 1 << 22  # scan big memory-mapped files in pieces, not all at once
    for start in range(0, tokens.shape[0], chunk):
        part = np.asarray(tokens[start:start + chunk])
        bad = np.flatnonzero((part < 0) | (part >= max_id))
        if bad.size:
            pos = start + int(bad[0])
            value = int(part[bad[0]])
            if value < 0:
                raise UserError(f"{path}: token {pos} is {value}; token ids must be >= 0")
            if value < vocab_size:  # only the reserved mask id lands here
                raise UserError(f"{path}: token {pos} is {value}, the id reserved for the mask token "
                                f"(masked LM); ids must be < {max_id}")
            raise UserError(f"{path}: token {pos} is {value}, not below vocab_size {vocab_size}")


class TokenFile:
    """A user's token file cut into consecutive, non-overlapping windows.

    Causal: window i is tokens [i*T, i*T + T] (T + 1 tokens; consecutive windows share
    one token), giving (num_tokens - 1) // T samples. Masked: window i is tokens
    [i*T, (i+1)*T), giving num_tokens // T samples, masked per `(seed, i)`; ids must be
    below `vocab_size - 1` (the mask token). Leftover tokens at the end are unused.
    """

    def __init__(self, path: str | Path, seq_len: int, *, vocab_size: int, token_dtype: str | None = None,
                 objective: Objective = "causal", mask_prob: float = 0.15, seed: int = 0) -> None:
        self.path = Path(path)
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.objective: Objective = objective
        self.mask_prob = mask_prob
        self.mask_token_id = vocab_size - 1
        self.seed = seed
        if seq_len < 1:
            raise UserError(f"{self.path}: seq_len must be >= 1, got {seq_len}")
        max_id = vocab_size - 1 if objective == "masked" else vocab_size
        self.tokens = load_tokens(self.path, vocab_size=vocab_size, token_dtype=token_dtype, max_id=max_id)
        n = int(self.tokens.shape[0])
        self.num_samples = (n - 1) // seq_len if objective == "causal" else n // seq_len
        if self.num_samples < 1:
            need = seq_len + (1 if objective == "causal" else 0)
            raise UserError(f"{self.path}: {n} tokens, need at least {need} (seq_len {seq_len})")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"{self.path}: sample {index} out of range [0, {self.num_samples})")
        causal = self.objective == "causal"
        start = index * self.seq_len
        window = np.asarray(self.tokens[start:start + self.seq_len + (1 if causal else 0)])
        return _pair(window, objective=self.objective, seq_len=self.seq_len, mask_token_id=self.mask_token_id,
                     mask_prob=self.mask_prob, seed=self.seed, index=index)


def sample_indices(num_samples: int | None, *, batch_size: int, step: int,
                   shuffle_seed: int | None = None) -> list[int]:
    """Dataset indices of step `step`'s global batch: positions step*B .. step*B + B - 1
    of the sample stream. A finite dataset is walked in epochs; with `shuffle_seed` each
    epoch visits the samples in a permutation drawn from (shuffle_seed, epoch)."""
    if step < 0:
        raise UserError(f"step must be >= 0, got {step}")
    positions = range(step * batch_size, (step + 1) * batch_size)
    if num_samples is None:
        return list(positions)
    out: list[int] = []
    perms: dict[int, np.ndarray] = {}
    for pos in positions:
        epoch, i = divmod(pos, num_samples)
        if shuffle_seed is None:
            out.append(i)
            continue
        if epoch not in perms:
            perms[epoch] = _rng(shuffle_seed, _SHUFFLE_STREAM, epoch).permutation(num_samples)
        out.append(int(perms[epoch][i]))
    return out


def batches(dataset: TokenDataset, *, microbatch_size: int, num_microbatches: int, step: int,
            shuffle_seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of training step `step`: (inputs, targets), each (B, T) int64 with
    B = microbatch_size * num_microbatches.

    Microbatch m is rows [m * microbatch_size, (m + 1) * microbatch_size), which is how
    torch.distributed.pipelining splits a batch along dim 0. Deterministic in
    (dataset, step, shuffle_seed): every rank computes the same batch; rank 0 feeds the
    inputs to the first stage and the last rank gives the targets to the loss.
    """
    if microbatch_size < 1 or num_microbatches < 1:
        raise UserError(f"microbatch_size and num_microbatches must be >= 1, got "
                        f"{microbatch_size} and {num_microbatches}")
    indices = sample_indices(dataset.num_samples, batch_size=microbatch_size * num_microbatches,
                             step=step, shuffle_seed=shuffle_seed)
    with torch.profiler.record_function("mpress.data.batch"):
        pairs = [dataset[i] for i in indices]
        inputs = torch.stack([p[0] for p in pairs])  # (B, T)
        targets = torch.stack([p[1] for p in pairs])  # (B, T)
    return inputs, targets


def build_dataset(data: DataConfig, model: ModelConfig, *, seed: int) -> TokenDataset:
    """The (training) dataset a training config asks for, shaped for `model`: decoders
    (GPT, Llama: `ModelConfig.causal`) train on the causal objective, BERT on the masked
    one; sequences have the model's seq_len. Text data's validation part:
    `mpress.runtime.text.dataset.build_text_data`."""
    objective: Objective = "causal" if model.causal else "masked"
    if data.kind == "text":
        from mpress.runtime.text.dataset import build_text_data  # tokenizers only where text is read

        return build_text_data(data, seq_len=model.seq_len, vocab_size=model.vocab_size, seed=seed).train
    if data.kind == "synthetic":
        return SyntheticTokens(model.vocab_size, model.seq_len, seed=seed, branching=data.branching,
                               objective=objective, mask_prob=data.mask_prob)
    if data.path is None:
        raise UserError("data.path: kind: file needs a token file")
    return TokenFile(data.path, model.seq_len, vocab_size=model.vocab_size, token_dtype=data.token_dtype,
                     objective=objective, mask_prob=data.mask_prob, seed=seed)
