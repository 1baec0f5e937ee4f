"""The pipeline that the multi-process runtime tests train: gpt-tiny on CPU ranks, a few
steps of fixed batches."""

from __future__ import annotations

import torch

from mpress.config.model_config import load_model_config

MODEL = "gpt-tiny"  # 6 layers: embed, layers.0-3, head; dropout 0.1
STEPS = 3
MICROBATCH_SIZE = 2
RANGES = {1: [(0, 6)], 2: [(0, 3), (3, 6)], 4: [(0, 2), (2, 3), (3, 4), (4, 6)]}
"""Layer ranges of the stages, by number of stages."""
POOL_BYTES = 64 << 20
"""Pinned host pool of each stage in the plans."""


def num_stages_of(schedule: str, world: int) -> int:
    """Stages of the tiny pipeline on `world` ranks: two per rank under interleaved 1F1B
    looped BFS and the V schedules, one otherwise (interleaved zero bubble is then ZB-H1)."""
    return 2 * world if schedule in ("interleaved", "looped-bfs", "zbv", "dualpipev") else world


def batch(step: int, num_microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) of `step`: the same on every rank and in every run."""
    cfg = load_model_config(MODEL)
    g = torch.Generator().manual_seed(1000 + step)
    stream = torch.randint(0, cfg.vocab_size, (MICROBATCH_SIZE * num_microbatches, cfg.seq_len + 1), generator=g)
    return stream[:, :-1].clone(), stream[:, 1:].clone()
