"""Per-rank checkpoints: stage and optimizer state (offloaded states brought home first)
and the RNG streams, one file per rank per saved step; a resume loads the newest step
every rank saved completely."""

from __future__ import annotations

from pathlib import Path

import torch

from mpress.runtime.train_config import TrainConfig
from mpress.runtime.trainer import PipelineJob


def _checkpoint_dir(cfg: TrainConfig) -> Path | None:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None


def save_checkpoint(cfg: TrainConfig, job: PipelineJob, step: int) -> None:
    """Stage state, optimizer state (offloaded states brought home) and RNG per rank."""
    root = _checkpoint_dir(cfg)
    if root is None:
        return
    folder = root / f"step{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    state = {"step": step, **job.state(), "rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state(job.device) if job.device.type == "cuda" else None}
    tmp = folder / f".rank{job.rank}.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(folder / f"rank{job.rank}.pt")


def resume(cfg: TrainConfig, job: PipelineJob) -> int:
    """Load the newest complete checkpoint; returns the next step (0 if none)."""
    root = _checkpoint_dir(cfg)
    if root is None or not cfg.checkpoint.resume or not root.is_dir():
        return 0
    for folder in sorted(root.glob("step*"), reverse=True):
        if all((folder / f"rank{r}.pt").is_file() for r in range(job.world)):
            state = torch.load(folder / f"rank{job.rank}.pt", weights_only=False)
            job.load_state(state)
            torch.set_rng_state(state["rng"])
            if state.get("cuda_rng") is not None:  # dropout on the GPU draws from its own generator
                torch.cuda.set_rng_state(state["cuda_rng"], job.device)
            return int(state["step"]) + 1
    return 0
