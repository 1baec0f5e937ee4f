"""Measuring tiled and plain networks."""

from __future__ import annotations

import torch.nn.functional as F

from mpress.tiling.memory import LiveBytes


def step_peak_bytes(model, x, target) -> int:
    """Peak live tensor bytes of one training step (forward, MSE loss, backward), gradients
    cleared first."""
    for p in model.parameters():
        p.grad = None
    with LiveBytes() as tracker:
        F.mse_loss(model(x), target).backward()
    return tracker.peak_bytes
