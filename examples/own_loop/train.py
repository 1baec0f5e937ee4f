"""A plain torch.distributed.pipelining training loop -- its own model split, AdamW, LR
scheduler, data and checkpoints -- with mpress added (the lines marked `# mpress`).

    torchrun --standalone --nproc-per-node 2 train.py --plan plan.yaml --steps 6 --out run
    torchrun --standalone --nproc-per-node 2 train.py --steps 6 --out plain   # no mpress

Each rank builds the whole model under one seed and keeps its stage (the torchtitan
way); without a plan the layers are split evenly, with one the plan's stages are the
split. A checkpoint (`torch.distributed.checkpoint`) is written every `--save-every`
steps and at the end (`OUT/step<k>`, `OUT/final`); `--resume DIR` continues from one.
The inputs are the synthetic ones `mpress train` gives a module of its own (`make()` in
model.py; `mpress.models.user.UserModel.batch`), so the two can be compared.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from model import CLASSES, MICROBATCH, Net, loss  # model.py, beside this script
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.optim.lr_scheduler import LambdaLR

import mpress.own_loop as mpress  # mpress

SEED, MICROBATCHES = 0, 4
LR, MIN_LR, WARMUP, BETAS, WEIGHT_DECAY = 0.01, 0.001, 2, (0.9, 0.95), 0.1
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def warmup_cosine(total_steps: int):
    """Linear warmup to LR, then cosine down to MIN_LR at the last step (a LambdaLR factor)."""
    floor = MIN_LR / LR

    def factor(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / (WARMUP + 1)
        room = total_steps - 1 - WARMUP
        progress = 1.0 if room <= 0 else min(1.0, (step - WARMUP) / room)
        return floor + (1.0 - floor) * (0.5 * (1.0 + math.cos(math.pi * progress)))
    return factor


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s inputs (all microbatches) and dummy targets."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    x = torch.randn((MICROBATCH[0] * MICROBATCHES, *MICROBATCH[1:]), generator=g)
    return x, torch.zeros(x.shape[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", help="an mpress plan (mpress plan --module model:make ...)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", required=True, help="checkpoint directory")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", help="a checkpoint directory to continue from")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")

    torch.manual_seed(SEED)
    model = Net()
    layers = model.layer_names()
    plan = mpress.load_plan(args.plan) if args.plan else None  # mpress
    if plan is not None:  # mpress
        first, end = plan.stage(rank).first_layer, plan.stage(rank).end_layer  # mpress
    else:
        per = math.ceil(len(layers) / world)
        first, end = rank * per, min(len(layers), (rank + 1) * per)
    stage_module = model.keep(layers[first:end]).to(device)
    is_first, is_last = rank == 0, rank == world - 1
    x = torch.zeros(MICROBATCH, requires_grad=not is_first)
    y = torch.zeros(*MICROBATCH[:2], CLASSES if is_last else MICROBATCH[2], requires_grad=True)
    if plan is not None:  # mpress
        stage = mpress.apply_mpress(stage_module, plan, rank, device=device, input_args=x, output_args=y)  # mpress
    else:
        stage = PipelineStage(stage_module, rank, world, device, input_args=x, output_args=y)

    decay = [p for p in stage_module.parameters() if p.dim() >= 2]
    no_decay = [p for p in stage_module.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS)
    if plan is not None:  # mpress
        optimizer = mpress.wrap_optimizer(optimizer, stage)  # mpress
    scheduler = LambdaLR(optimizer, warmup_cosine(args.steps))

    def loss_fn(output: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
        return loss(output)
    if plan is not None:  # mpress
        schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=stage.route_loss(loss_fn))  # mpress
    else:
        schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)

    def state(step: int) -> dict:
        if plan is not None:  # mpress
            optim = optimizer.state_dict()  # mpress: by parameter name, offloaded state included
        else:
            optim = get_optimizer_state_dict(stage_module, optimizer, options=FLAT)
        return {"model": stage_module.state_dict(), "optim": optim, "scheduler": scheduler.state_dict(),
                "step": step}

    start = 0
    if args.resume:
        saved = state(0)
        dcp.load(saved, checkpoint_id=args.resume)
        stage_module.load_state_dict(saved["model"])
        if plan is not None:  # mpress
            optimizer.load_state_dict(saved["optim"])  # mpress
        else:
            set_optimizer_state_dict(stage_module, optimizer, saved["optim"], options=FLAT)
        scheduler.load_state_dict(saved["scheduler"])
        start = saved["step"]

    for step in range(start, args.steps):
        inputs, targets = batch(step)
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if is_first:
            schedule.step(inputs)
        elif is_last:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        scheduler.step()
        if is_last:
            print(f"step {step}: loss {torch.stack(losses).mean().item():.6f}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            dcp.save(state(step + 1), checkpoint_id=os.path.join(args.out, f"step{step + 1}"))
    dcp.save(state(args.steps), checkpoint_id=os.path.join(args.out, "final"))
    if plan is not None:  # mpress
        mpress.close([stage])  # mpress
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
