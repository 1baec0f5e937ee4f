"""Per-rank checkpoints: stage and optimizer state and the RNG streams, one file per rank
per saved step; a resume loads the newest step every rank saved completely.

No checkpoint takes device memory the plan has not planned: the state is built on the
host one tensor at a time (offloaded optimizer data one layer's chunk at a time), a file
is read into host memory (`map_location="cpu"`, whatever device wrote it) and copied into
the job's tensors in place (`mpress.runtime.job_state`)."""

from __future__ import annotations

from pathlib import Path

import torch

from mpress.runtime.train_config import TrainConfig
from mpress.runtime.trainer import PipelineJob


def _checkpoint_dir(cfg: TrainConfig) -> Path | None:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None


def save_checkpoint(cfg: TrainConfig, job: PipelineJob, step: int) -> None:
    """Stage state, optimizer state and RNG of this rank, as host tensors, to
    `<dir>/step<step>/rank<rank>.pt` (written whole, then renamed)."""
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
            # to host memory: loading to the device that wrote it would put a second copy
            # of the model and optimizer beside the job's own (and needs that device)
            state = torch.load(folder / f"rank{job.rank}.pt", map_location="cpu", weights_only=False)
            job.load_state(state)
            torch.set_rng_state(state["rng"])
            if state.get("cuda_rng") is not None:  # dropout on the GPU draws from its own generator
                torch.cuda.set_rng_state(state["cuda_rng"], job.device)
            return int(state["step"]) + 1
    return 0
