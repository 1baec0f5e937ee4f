"""Validation loss and perplexity: the job's stages run forward-only over a fixed
held-out set, under the same plan as training.

The forward runs the stage modules themselves under `torch.no_grad` and in eval mode (no
dropout), microbatch by microbatch, stage by stage in pipeline order; activations go
from rank to rank on the pipeline group with blocking send/recv (every rank walks the
same global order, so no cycle can wait on itself). The plan's memory decisions concern
what autograd saves for backward, and under no_grad nothing is saved: the router's
hooks stay idle (outside a training microbatch the layers run their own forwards),
no program action runs, and optimizer states offloaded between steps stay where the plan
put them; a layer whose parameters the plan keeps on the host fetches them for its
forward and drops them after (`mpress/runtime/layer_data`). On CPU the forward is counted by the rank's live bytes against its capacity
like a step. Dropout's random streams are not drawn, so evaluating changes no training loss.

Any model the trainer runs evaluates alike: a preset, a user's module or a Hugging Face
model (`mpress.models.user`), each stage called on its positional inputs (a user's split
may pass several tensors between stages: each is sent in order, received into buffers
shaped as the stage's example inputs, `PipelineJob.inputs_meta`), the loss the job's own
(`PipelineJob.loss`: `lm_loss` for a preset and a module on text, the HF model's LM loss),
the text windows given to the model as training gives them (`text_batch`).

Eval batch j (a global batch, microbatch_size x num_microbatches windows, samples
j*B .. j*B + B - 1 of the validation windows in order) runs on replica j % dp; the loss is
the mean of the microbatch losses (a mean over each microbatch's tokens) over every
batch, the perplexity exp(loss).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mpress.errors import UserError
from mpress.models.user import UserModel
from mpress.models.user_module import as_args
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


def forward_losses(job: PipelineJob, inputs: torch.Tensor | tuple[torch.Tensor, ...], targets: torch.Tensor,
                   num_microbatches: int) -> list[float]:
    """The pipeline's forward of one global batch, the first stage's positional inputs
    (one tensor or several, batch first) and the targets, without autograd: the loss of
    each microbatch on the rank holding the last stage, [] elsewhere. Every rank of the
    pipeline calls it with the same batch."""
    device = job.device
    rank_of = [s % job.world for s in range(job.num_stages)]
    xs = [t.tensor_split(num_microbatches) for t in (inputs if isinstance(inputs, tuple) else (inputs,))]
    ys = targets.tensor_split(num_microbatches)
    losses: list[float] = []
    for m in range(num_microbatches):
        local: tuple[torch.Tensor, ...] = ()
        for s, module in zip(job.stage_ids, job.modules):
            if s == 0:
                args = tuple(x[m].to(device) for x in xs)
            elif rank_of[s - 1] == job.rank:
                args = local
            else:
                args = tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in job.inputs_meta[s])
                for t in args:
                    dist.recv(t, group=job.group, group_src=rank_of[s - 1])
            out = as_args(module(*args))  # (b, T, hidden), or (b, T, vocab) on the last stage
            if s == job.num_stages - 1:
                losses.append(float(job.loss(out[0] if len(out) == 1 else out, ys[m].to(device))))
            elif rank_of[s + 1] == job.rank:
                local = out
            else:
                for t in out:
                    dist.send(t.contiguous(), group=job.group, group_dst=rank_of[s + 1])
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
                inputs, targets = job.spec.model.text_batch(x, y) if isinstance(job.spec.model, UserModel) \
                    else (x, y)
                for loss in forward_losses(job, inputs, targets, num_microbatches):
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
