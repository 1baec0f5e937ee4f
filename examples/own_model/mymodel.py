"""A model of your own for mpress: any nn.Module, here one whose forward is not a chain.

`make()` is the factory mpress takes (`--module mymodel:make`, train config `module:`):
it returns the module, an example input of ONE microbatch and a loss (output -> scalar).
The layers stages are made of are named by pattern (`--layers "embed,blocks.*,head"`).

SkipNet: pre-norm residual MLP blocks; the embedding's output skips every block to the
head (so it crosses every stage boundary), and the forward multiplies by a CPU scalar that
autograd saves for backward. See README.md, "Your own model", for the three commands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block with dropout."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class SkipNet(nn.Module):
    """embed -> blocks -> head(blocks' output + embed output) * a CPU scalar."""

    def __init__(self, width: int = 16, depth: int = 6, classes: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(MLPBlock(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.embed(x)
        h = skip
        for block in self.blocks:
            h = block(h)
        return self.head(h + skip) * torch.tensor(0.5)


def loss(output: torch.Tensor) -> torch.Tensor:
    """A regression towards zero: the square of the logits, mean."""
    return output.float().pow(2).mean()


def make() -> tuple[nn.Module, torch.Tensor, object]:
    """SkipNet of width 16 and depth 6, a microbatch of 2 sequences of 8 positions."""
    return SkipNet(), torch.randn(2, 8, 16), loss
