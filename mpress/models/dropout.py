"""Dropout that saves the same thing for backward on every device (shared by the model families).

`nn.Dropout` on the CPU multiplies by a float noise tensor and saves that (4 bytes per
element), while on CUDA it calls the fused `native_dropout` and saves a bool mask; calling
`native_dropout` everywhere makes CPU profiles match GPU ones.
"""

from __future__ import annotations

import torch
from torch import nn


class Dropout(nn.Module):
    """Dropout that saves a bool mask (1 byte/element) for backward on every device.

    With p == 0 or in eval mode it is the identity and saves nothing.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return torch.native_dropout(x, self.p, True)[0]

    def extra_repr(self) -> str:
        return f"p={self.p}"
