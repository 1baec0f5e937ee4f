"""The model of the own-loop example: residual MLP blocks, written to be cut into pipeline
stages the torchtitan way (build the whole model, delete what another stage holds).

`Net.layer_names()` names the layers the stages are made of, so `mpress profile
--module model:make` and the plan name the same units the stage modules keep. `make()`
is the factory `mpress profile`, `mpress plan` and `mpress train` take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, DEPTH, CLASSES = 16, 6, 4
MICROBATCH = (2, 8, WIDTH)
"""One microbatch: 2 sequences of 8 positions of width 16."""


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """embed -> blocks -> head. A stage keeps some of them: the others are None or
    deleted from `blocks` (a `ModuleDict`, so the kept ones keep their names)."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH, classes: int = CLASSES) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Linear(width, width)
        self.blocks = nn.ModuleDict({str(i): Block(width) for i in range(depth)})
        self.head: nn.Module | None = nn.Linear(width, classes)

    def layer_names(self) -> list[str]:
        """The layers this module holds, in order."""
        return ([] if self.embed is None else ["embed"]) + [f"blocks.{k}" for k in self.blocks] + \
            ([] if self.head is None else ["head"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def keep(self, layers: list[str]) -> Net:
        """This module as a stage holding only `layers` (the rest deleted)."""
        if "embed" not in layers:
            self.embed = None
        for k in list(self.blocks):
            if f"blocks.{k}" not in layers:
                del self.blocks[k]
        if "head" not in layers:
            self.head = None
        return self


def loss(output: torch.Tensor) -> torch.Tensor:
    """A regression towards zero: the mean square of the outputs."""
    return output.float().pow(2).mean()


def make() -> tuple[nn.Module, torch.Tensor, object]:
    """The model, one microbatch's example input and the loss (what `mpress` takes)."""
    return Net(), torch.randn(MICROBATCH), loss
