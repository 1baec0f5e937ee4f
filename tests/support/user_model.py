"""A user's own model, as someone who is not mpress would write it: residual attention +
MLP blocks in a `ModuleList` (the root's forward is not a chain of its children), a CPU
scalar saved for backward, and a loss that closes over targets the factory made.

The example's SkipNet (`examples/own_model/mymodel.py`, `SKIPNET`) goes further: the
embedding's output skips every block to the head, so a split hands it across stages.

`make(...)` returns `(module, example_input, loss_fn)` as `mpress profile --module`
expects; `SOURCE` is this file's text, for tests that write it into a temporary directory
as the user's own module file.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SOURCE = Path(__file__).read_text()

SKIPNET = "examples.own_model.mymodel:make"
"""The example's factory, importable from the repository root."""

LAYERS = "embed,blocks.*,head"
"""The split points a user names for `--layers`."""


class Block(nn.Module):
    """x + attn(ln1(x)), then + mlp(ln2(x)); the attention output is scaled by a CPU scalar."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape  # (B, T, h)
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hd)
        probs = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        attn = (probs @ v).transpose(1, 2).reshape(b, t, h)
        # A host scalar (as a user might write a constant): autograd saves it for backward.
        x = x + self.proj(attn) * torch.tensor(0.5)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class UserModel(nn.Module):
    def __init__(self, *, vocab: int, hidden: int, heads: int, num_blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(num_blocks))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(*, vocab: int = 64, hidden: int = 32, heads: int = 2, num_blocks: int = 3,
         batch: int = 2, seq: int = 8):
    """The model, one microbatch of token ids and a cross-entropy loss over its targets."""
    torch.manual_seed(0)
    model = UserModel(vocab=vocab, hidden=hidden, heads=heads, num_blocks=num_blocks)
    ids = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    return model, ids, lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class SkipLM(UserModel):
    """`UserModel` whose embedding output also skips every block to the head, as the
    example's SkipNet does: a split hands two tensors across every stage boundary."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        skip = self.embed(ids)
        x = skip
        for block in self.blocks:
            x = block(x)
        return self.head(x + skip)


def make_text_lm():
    """A language model for text data (`data.kind: text`): SkipLM over 300 token ids (a
    byte-level BPE's 257 symbols and some merges), one microbatch of 2 x 8 ids, and a
    next-token loss on them (what the profiler runs; on text the trainer takes `lm_loss`)."""
    torch.manual_seed(0)
    model = SkipLM(vocab=300, hidden=16, heads=2, num_blocks=3)
    ids = torch.randint(0, 300, (2, 8))
    return model, ids, lambda logits: F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def make_10b():
    """About 10 billion parameters (50 blocks of width 4096): 40 GB of fp32 weights."""
    return make(vocab=1024, hidden=4096, heads=32, num_blocks=50, batch=2, seq=32)


def make_10b_one_block():
    """The same block, once: what this machine can run for real."""
    return make(vocab=1024, hidden=4096, heads=32, num_blocks=1, batch=2, seq=32)


class TiedSquare(nn.Module):
    """Autograd saves x twice (x * x) and a transposed view of the weight: storages
    shared between saved tensors, for the profilers' byte counts."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return (x * x) @ self.w.t()


def num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
