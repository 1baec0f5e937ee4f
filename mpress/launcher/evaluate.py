"""Validation loss and perplexity: the job's stages run forward-only over a fixed
held-out set, under the same plan as training.

The forward runs the stage modules themselves under `torch.no_grad` and in eval mode (no
dropout), microbatch by microbatch, stage by stage in pipeline order; activations go
from rank to rank on the pipeline group with blocking send/recv (every rank walks the
same global order, so no cycle can wait on itself). The plan's memory decisions concern
what autograd saves for backward, and under no_grad nothing is saved: the router's
hooks stay idle (outside a training microbatch the layers run their own forwards),
no program action runs, and optimizer states offloaded between steps stay where the plan
put them. On CPU the forward is counted by the rank's live bytes against its capacity
like a step. Dropout's random streams are not drawn, so evaluating changes no training loss.

Eval batch j (a global batch, microbatch_size x num_microbatches windows, samples
j*B .. j*B + B - 1 of the validation windows in order) runs on replica j % dp; the loss is
the mean of the microbatch losses (`lm_loss`, a mean over each microbatch's tokens) over
every batch, the perplexity exp(loss).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mpress.errors import UserError
from mpress.models import lm_loss
from mpress.models.transformer import TORCH_DTYPES
from mpress.runtime.data import TokenDataset, batches
from mpress.runtime.trainer import PipelineJob


@dataclass(frozen=True)
class EvalResult:
    """One evaluation over the held-out set."""

    loss: float
    """Mean cross entropy in nats per token."""
    num_batches: int
    """Global batches evaluated."""

    @property
    def perplexity(self) -> float:
        """exp(loss)."""
        return math.exp(self.loss) if self.loss < 700 else math.inf


def eval_batch_count(val: TokenDataset, *, batch_size: int, wanted: int) -> int:
    """How many whole global batches of `batch_size` windows the evaluation runs: `wanted`,
    or fewer when the validation set is smaller. Raises `UserError` when it holds less
    than one batch."""
    if val.num_samples is None:
        raise UserError("evaluation needs a finite held-out set (data.val_fraction)")
    available = val.num_samples // batch_size
    if available < 1:
        raise UserError(f"data.val_fraction: the validation set holds {val.num_samples} windows, fewer than one "
                        f"batch of {batch_size} (microbatch_size x num_microbatches); raise val_fraction")
    return min(wanted, available)


def forward_losses(job: PipelineJob, inputs: torch.Tensor, targets: torch.Tensor,
                   num_microbatches: int) -> list[float]:
    """The pipeline's forward of one global batch, (B, T) inputs and targets, without
    autograd: the loss of each microbatch on the rank holding the last stage, [] elsewhere.
    Every rank of the pipeline calls it with the same batch."""
    spec, device = job.spec, job.device
    cfg = spec.model
    width, dtype = cfg.hidden_size, TORCH_DTYPES[cfg.precision]  # type: ignore[union-attr]
    rank_of = [s % job.world for s in range(job.num_stages)]
    xs, ys = inputs.tensor_split(num_microbatches), targets.tensor_split(num_microbatches)
    losses: list[float] = []
    for m in range(num_microbatches):
        local: torch.Tensor | None = None
        for s, module in zip(job.stage_ids, job.modules):
            if s == 0:
                x = xs[m].to(device)
            elif rank_of[s - 1] == job.rank:
                x = local
            else:
                x = torch.empty(xs[m].shape[0], xs[m].shape[1], width, dtype=dtype, device=device)
                dist.recv(x, group=job.group, group_src=rank_of[s - 1])
            out = module(x)  # (b, T, hidden), or (b, T, vocab) on the last stage
            if s == job.num_stages - 1:
                losses.append(float(lm_loss(out, ys[m].to(device))))
            elif rank_of[s + 1] == job.rank:
                local = out
            else:
                dist.send(out.contiguous(), group=job.group, group_dst=rank_of[s + 1])
    return losses


def evaluate(job: PipelineJob, val: TokenDataset, *, microbatch_size: int, num_microbatches: int,
             num_batches: int, dp: int = 1, dp_rank: int = 0,
             control: dist.ProcessGroup | None = None) -> EvalResult:
    """The validation loss over eval batches 0 .. num_batches - 1 (batch j on replica
    j % dp), the same on every rank of the job (one object all-gather on `control`)."""
    modes = [m.training for m in job.modules]
    live = job.live
    partial: tuple[float, int] = (0.0, 0)
    try:
        for m in job.modules:
            m.eval()
        with torch.no_grad(), torch.profiler.record_function("mpress:eval"), \
                (live.watch() if live is not None else contextlib.nullcontext()):
            if live is not None:
                live.context = "eval"
            total, count = 0.0, 0
            for j in range(dp_rank, num_batches, dp):
                x, y = batches(val, microbatch_size=microbatch_size, num_microbatches=num_microbatches, step=j)
                for loss in forward_losses(job, x, y, num_microbatches):
                    total, count = total + loss, count + 1
            partial = (total, count)
    finally:
        for m, mode in zip(job.modules, modes):
            m.train(mode)
    gathered: list[tuple[float, int]] = [(0.0, 0)] * dist.get_world_size(control)
    dist.all_gather_object(gathered, partial, group=control)
    total = sum(t for t, _ in gathered)
    count = sum(c for _, c in gathered)
    return EvalResult(loss=total / max(count, 1), num_batches=num_batches)
