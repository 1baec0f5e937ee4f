"""One rank of a training job: train a model with pipeline parallelism under a plan.

`mpress train` starts the ranks (mpress/commands/train.py, launcher/launch.py); under
torchrun they are started as

    python3 -m torch.distributed.run --nproc-per-node 4 -m mpress.train \\
        --config configs/train/gpt-tiny-mixed.yaml [--steps 10 --optimizer.lr 1e-3 ...]

(`--<dotted.key> VALUE`: overrides of the config's keys, mpress/config/overrides.py).

One stage per rank (GPipe, 1F1B), or several (interleaved 1F1B), with torch.distributed.pipelining's schedules. The config names
the plan: a file from `mpress plan`, `auto` (rank 0 plans at start-up for the config's
hardware and broadcasts the plan) or `none` (plain pipelining, the baseline). Rank 0
shows a progress bar (step, loss, tokens/s, samples/s, MFU, per-rank peak) and a report
per rank at the end, and writes each logged step to the metrics file (`metrics`,
mpress/launcher/metrics_log.py). Without torchrun it runs as a single process (one stage). Bad input: one line,
exit status 2; a failure on any rank: one line naming the rank, exit status 1, and every
other rank stops within seconds with one line naming it (launcher/rank_watch.py).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from mpress.config.loader import write_text_atomic
from mpress.d2d.runtime.liveness import die_with_parent
from mpress.errors import UserError
from mpress.launcher import run_trace
from mpress.launcher.checkpoints.checkpoint import Checkpoints
from mpress.launcher.checkpoints.manifest import check_checkpoint_dir, step_folder
from mpress.launcher.checkpoints.directories import claim_for_rank
from mpress.launcher.control import (
    COLLECTIVE_TIMEOUT_S,
    broadcast,
    catch_interrupts,
    control_group,
    interrupted,
    is_own_failure,
    nccl_error_handling,
    root_cause,
    root_kind,
    single_process_env,
    rank_from_env,
    start_phase,
)
from mpress.launcher.devices import check_distinct_devices, claim_for, join_replicas
from mpress.launcher.evaluate import eval_batch_count, evaluate
from mpress.launcher.job import start_job
from mpress.launcher.metrics_log import MetricsLog, Throughput, rates_text
from mpress.launcher.rank_watch import CONSEQUENCE_WAIT_S, STOP_WAIT_S, RankWatch, early_rank_watch, start_rank_watch
from mpress.launcher.report import rank_report, report_tables
from mpress.launcher.startup import StartPlan, plan_for, rank_device, replicas_per_node
from mpress.config.overrides import parse_override_args
from mpress.config.model_config import ModelConfig
from mpress.models.hf_model import HFModel
from mpress.models.user import UserModel
from mpress.runtime.data import TokenDataset, batches, build_dataset
from mpress.runtime.text.dataset import TextData, build_text_data
from mpress.runtime.data_parallel import replica_control_group, replica_coordinates
from mpress.runtime.train_config import TrainConfig, check_world_size, load_train_config, model_config, resolve_backend
from mpress.runtime.lr_schedule import LrSchedule
from mpress.runtime.trainer import JobSpec, PipelineJob, StepResult
from mpress.ui import TaskProgress, make_console, phase_line, say_line
from mpress.config.units import fmt_bytes, pool_override


def train(cfg: TrainConfig, *, control: dist.ProcessGroup | None = None, watch: RankWatch | None = None) -> int:
    """Train under `cfg` on every rank. control: the gloo group for object collectives
    (None: made here); watch: this rank's watch over the others, stopped once every rank
    has finished (None: none)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    num_stages = check_world_size(cfg, world)
    model = model_config(cfg)
    if control is None:
        control = control_group()
    # dp replicas of the pipeline: this rank's place in its replica (the plan's rank), known
    # before the mesh so the device is chosen and bound first (init_device_mesh would
    # otherwise make LOCAL_RANK's GPU current, a context on a GPU the plan may not give it)
    dp_rank, pp_rank = replica_coordinates(rank, world, cfg.dp)
    pp_world = world // cfg.dp
    payload: object = None
    start_phase("plan", rank)
    if rank == 0:
        try:
            payload = plan_for(cfg, model, num_stages, pp_world, say=phase_line)
        except UserError as exc:
            payload = exc
    payload = broadcast(payload, control)
    if isinstance(payload, UserError):  # the same on every rank: rank 0 says it once
        if rank == 0:
            say_line(f"mpress.train: error: {payload}")
        return 2
    start: StartPlan = payload  # type: ignore[assignment]
    plan, ranges = start.plan, start.ranges
    # replica k runs on node k // per_node, in slot k % per_node of its GPUs; the bus ids
    # are rank 0's node's: another node numbers its GPUs as CUDA does
    per_node = replicas_per_node(pp_world)
    node_devices = start.replica_devices[dp_rank % per_node] if start.replica_devices else None
    device = rank_device(plan, pp_rank, pp_world, dist.get_backend() == "nccl",
                         plan_bus_ids=start.device_bus_ids if dp_rank < per_node else None, node_devices=node_devices)
    claims: list[object] = [None] * world
    dist.all_gather_object(claims, claim_for(rank, device), group=control)
    check_distinct_devices(claims)  # type: ignore[arg-type]  # before NCCL meets one GPU twice
    replicas = join_replicas(device, cfg.dp)  # the device current before the mesh; no world communicator
    opt = cfg.optimizer
    spec = JobSpec(model=model, schedule=cfg.schedule, ranges=list(ranges), microbatch_size=cfg.microbatch_size,
                   num_microbatches=cfg.num_microbatches, seed=cfg.seed, lr=opt.lr,
                   betas=tuple(opt.betas), eps=opt.eps,  # type: ignore[arg-type]
                   weight_decay=opt.weight_decay, optimizer=opt.name, no_decay=opt.no_decay,
                   lr_schedule=lr_schedule(cfg), clip_grad_norm=opt.clip_grad_norm,
                   max_skipped_steps=opt.max_skipped_steps, host_pool_bytes=pool_override("MPRESS_HOST_POOL_BYTES"),
                   peer_pool_bytes=pool_override("MPRESS_PEER_POOL_BYTES"), nvme_dir=cfg.nvme_dir,
                   device_capacity_bytes=cfg.device_memory_bytes if device.type == "cpu" else None)
    torch.manual_seed(cfg.seed * 1000 + rank)  # dropout stream of this rank
    if rank == 0:
        phase_line(f"data: {cfg.data.kind}" + (f" ({cfg.data.path or cfg.data.source}, tokenized once per node)"
                                              if cfg.data.kind == "text" else ""))
    # a preset trains on tokens (synthetic, a file or text); a user's module or HF model on
    # text, or on synthetic inputs shaped like its example microbatch (`UserModel.batch`)
    dataset, val, data_line = (None, None, "") if isinstance(model, UserModel) and cfg.data.kind != "text" \
        else _datasets(cfg, model, control)
    shuffle = cfg.seed if cfg.data.kind == "text" else None  # text windows in a per-epoch permutation
    batch_size = cfg.microbatch_size * cfg.num_microbatches
    num_eval = eval_batch_count(val, batch_size=batch_size, wanted=cfg.eval_batches) if val is not None else 0
    start_phase("build", rank)
    if rank == 0:
        phase_line(f"building {num_stages} stages on {world} ranks" + (" (pools, peers)" if plan is not None else ""))
    if replicas is None:
        job = start_job(spec, plan, device, control_group=control)
    else:  # peer pools stay inside a replica: their handshake on the replica's gloo group
        replica_control = replicas.pp_group if control is None else replica_control_group(replicas, COLLECTIVE_TIMEOUT_S)
        job = start_job(spec, plan, device, group=replicas.pp_group, control_group=replica_control,
                        dp_group=replicas.dp_group, node_devices=node_devices)
    checkpoints = Checkpoints(cfg, job, control, dp_rank=dp_rank)
    first = checkpoints.resume()
    job.next_step = first  # the learning rate follows from the step index alone
    console = make_console()
    if rank == 0:
        what = "no plan (plain pipelining)" if plan is None else f"plan {plan.strategy} ({cfg.plan})"
        console.print(f"mpress.train: {model.name}, {cfg.schedule}, {num_stages} stages x {cfg.num_microbatches} "
                      f"microbatches of {cfg.microbatch_size}"
                      + (f", {cfg.dp} replicas (dp x pp = {cfg.dp} x {pp_world} ranks)" if cfg.dp > 1 else "")
                      + f", {what}, backend {dist.get_backend()}"
                      + (f", resuming at step {first}" if first else ""))
        if data_line:
            console.print(data_line + (f"; evaluating {num_eval} batches" if num_eval else ""), soft_wrap=True)
    # rank 0's bar on a terminal; off one (a pipe, a log) the logged steps' lines carry its figures
    progress = TaskProgress(console, cfg.steps, "train", bar=True, keep=True, completed=first, enabled=rank == 0)
    metrics = MetricsLog(cfg.metrics if rank == 0 else None, first_step=first)
    throughput = throughput_for(cfg, model, start, world)
    peak, peak_at = 0, ""
    # What start-up made lives for the whole job: out of the cyclic collector's way, so a
    # full collection scans only what training makes (each step makes thousands of short-
    # lived objects -- swap records, events, saved-tensor names -- and full collections of
    # torch's start-up objects cost milliseconds per step; bench/swap_overhead.py)
    gc.freeze()
    if watch is not None and rank == 0:
        watch.training()  # a Ctrl-C to mpress train now stops the ranks at a step boundary
    stopped_after: int | None = None  # the step after which an interrupt stopped the job
    with progress:
        for step in range(first, cfg.steps):
            batch = step * cfg.dp + dp_rank  # replica k trains on batches k, dp + k, 2 dp + k, ...
            if dataset is None:
                x, y = model.batch(step=batch, num_microbatches=cfg.num_microbatches, seed=cfg.seed)
            else:
                x, y = batches(dataset, microbatch_size=cfg.microbatch_size, num_microbatches=cfg.num_microbatches,
                               step=batch, shuffle_seed=shuffle)
                if isinstance(model, UserModel):  # text windows as the module or HF model takes them
                    x, y = model.text_batch(x, y)
            tracing = cfg.trace is not None and step == cfg.steps - 1
            if tracing:
                run_trace.start(job)
            recorders = run_trace.start_recorders(cfg, rank, device) if step == cfg.steps - 1 else None
            t0 = time.perf_counter()
            result = job.step(x, y)
            run_trace.stop_recorders(recorders, say=progress.console.print if rank == 0 else None)
            # the last stage's loss and every rank's peak in one object collective on the
            # gloo group: on the default (NCCL) group it would copy through, and sync, the GPU
            # with whether it got SIGINT: every rank then stops after the same step
            stats: list[tuple[float | None, int, bool]] = [(None, 0, False)] * world
            dist.all_gather_object(stats, (result.loss, result.peak_bytes, interrupted()), group=control)
            # the mean over the replicas' last stages (replica k's ranks start at k * pp)
            loss = sum(float(stats[k * pp_world + job.last_rank][0] or 0.0) for k in range(cfg.dp)) / cfg.dp
            elapsed = time.perf_counter() - t0
            if result.peak_bytes >= peak:
                peak, peak_at = result.peak_bytes, result.peak_context
            peaks = [p for _, p, _ in stats]
            opt_info = _optimizer_info(cfg, result, job.guard.skipped_total)
            record = step_record(step, loss, result, elapsed, throughput, peaks)
            info = (f"loss {loss:.4f}  {rates_text(record)}  peak/rank "
                    + " ".join(fmt_bytes(p) for p in peaks) + opt_info)
            progress.advance(info=info)
            logged = step % cfg.log_every == 0 or step == cfg.steps - 1
            if rank == 0 and logged:
                progress.console.print(f"step {step}: loss {loss:.4f}{opt_info}" if progress.terminal else
                                       f"step {step}: {info}  ({step + 1}/{cfg.steps}, {progress.elapsed()})",
                                       soft_wrap=True)
            if tracing:
                traces: list[dict] = [{} for _ in range(world)]
                dist.all_gather_object(traces, run_trace.collect(job), group=control)
                if rank == 0:
                    progress.console.print(f"trace of step {step} written to "  # replica 0's, as planned
                                           f"{run_trace.write(cfg.trace, traces[:pp_world], step=step)}")
            if num_eval and ((cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step == cfg.steps - 1):
                result_eval = evaluate(job, val, microbatch_size=cfg.microbatch_size,
                                       num_microbatches=cfg.num_microbatches, num_batches=num_eval, dp=cfg.dp,
                                       dp_rank=dp_rank, control=control)
                if rank == 0:
                    progress.console.print(f"step {step}: val loss {result_eval.loss:.4f}  "
                                           f"ppl {result_eval.perplexity:.2f}", soft_wrap=True)
                record.update(val_loss=result_eval.loss, val_ppl=result_eval.perplexity)
                logged = True
            if logged:  # the step's line, with the validation loss where it was evaluated
                metrics.write(record)
            every = cfg.checkpoint.every_steps
            stop = any(asked for _, _, asked in stats)
            if (every and (step + 1) % every == 0) or step == cfg.steps - 1 or stop:
                checkpoints.save(step)
            if stop:
                stopped_after = step
                break
    metrics.close()
    if stopped_after is not None:
        return _interrupted(checkpoints, stopped_after, watch, job)
    rows: list[dict[str, object]] = [{} for _ in range(world)]
    row = rank_report(job, plan, predicted_bytes=start.predicted_peak_bytes[pp_rank], measured_bytes=peak,
                      measured_at=peak_at)
    row["rank"] = rank  # the job's (the plan's is the stage's place in its replica)
    dist.all_gather_object(rows, row, group=control)
    if rank == 0:
        for table in report_tables(rows):
            console.print(table)
        if cfg.report is not None:
            write_text_atomic(cfg.report, json.dumps(rows, indent=1))
        for r in rows:
            if r.get("cuda_check", "ok") != "ok":
                console.print(f"[red]accounting check failed[/]: {r['cuda_check']}")
    if watch is not None:
        watch.stop()  # this rank is done: its leaving is no failure
    job.close()
    return 0


def _interrupted(checkpoints: Checkpoints, step: int, watch: RankWatch | None, job: PipelineJob) -> int:
    """The job stopped after `step` on Ctrl-C (`control.catch_interrupts`), its checkpoint
    saved: every rank's line (`mpress train` prints it as its one line), status 130."""
    saved = (f"checkpoint of step {step} saved to {step_folder(checkpoints.root, step)}"
             if checkpoints.root is not None else "no checkpoint saved (checkpoint.dir is not set)")
    say_line(f"mpress.train: interrupted: after step {step}, {saved}")
    if watch is not None:
        watch.stop()  # leaving now is no failure
    job.close()
    return 130


def _datasets(cfg: TrainConfig, model: ModelConfig | UserModel,
              control: dist.ProcessGroup) -> tuple[TokenDataset, TokenDataset | None, str]:
    """(training set, validation set or None, rank 0's line about the data). Text data is
    tokenized (and its BPE trained) once per node, by the node's first rank, into the
    cache the other ranks then read."""
    if cfg.data.kind != "text":
        return build_dataset(cfg.data, model, seed=cfg.seed), None, ""  # type: ignore[arg-type]  # a preset
    # a module's or HF model's positions and vocabulary (before the job splits it)
    seq_len, vocab_size = (model.seq_len, model.vocab_size) if isinstance(model, ModelConfig) else model.text_shape()

    def build() -> TextData:
        return build_text_data(cfg.data, seq_len=seq_len, vocab_size=vocab_size, seed=cfg.seed)

    first_here = int(os.environ.get("LOCAL_RANK", "0")) == 0
    text: TextData | UserError | None = None  # set on every path below
    if first_here:
        try:
            text = build()
        except UserError as exc:
            text = exc
    dist.barrier(group=control)
    if not first_here:
        text = build()
    if not isinstance(text, TextData):
        raise text  # the node's first rank's UserError, which this rank met too
    train_n, val_n = text.num_docs
    line = (f"data: {cfg.data.path or cfg.data.source}: {train_n} + {val_n} documents, "
            f"{len(text.train)} training + {len(text.val) if text.val is not None else 0} validation windows, "
            f"vocabulary {text.tokenizer.vocab_size} "
            f"(tokens {'from the cache' if text.packed.cache_hit else 'cached now'})")
    return text.train, text.val, line


def lr_schedule(cfg: TrainConfig) -> LrSchedule | None:
    """The config's learning-rate schedule over its `steps`; None when the rate is constant."""
    opt = cfg.optimizer
    if opt.schedule == "constant" and not opt.warmup_steps:
        return None
    return LrSchedule(kind=opt.schedule, lr=opt.lr, total_steps=cfg.steps, warmup_steps=opt.warmup_steps,
                      min_lr=opt.min_lr)


def throughput_for(cfg: TrainConfig, model: ModelConfig | UserModel, start: StartPlan, world: int) -> Throughput:
    """What a step of the job processes: its global batch, the model's sequence length
    (presets and HF models), the profile's FLOPs of the step over every replica, and the
    peak FLOP/s of the job's `world` devices."""
    tokens = model.seq_len if isinstance(model, ModelConfig) else \
        model.source.seq_len if isinstance(model, HFModel) and model.source is not None else None
    per_mb = start.model_flops_per_microbatch
    peak = start.peak_flops_per_device
    return Throughput(samples_per_step=cfg.global_batch_size, tokens_per_sample=tokens,
                      model_flops_per_step=per_mb * cfg.num_microbatches * cfg.dp if per_mb else None,
                      peak_flops_per_s=peak * world if peak else None)


def step_record(step: int, loss: float, result: StepResult, step_s: float, throughput: Throughput,
                peaks: list[int]) -> dict[str, object]:
    """The metrics line of `step` (`mpress.launcher.metrics_log`): its loss, learning
    rate, gradient norm where clipping computed one, time, rates and each rank's peak."""
    record: dict[str, object] = {"step": step, "loss": loss}
    if result.lr is not None:
        record["lr"] = result.lr
    if result.grad_norm is not None:
        record["grad_norm"] = result.grad_norm
    if result.skipped:
        record["skipped"] = True
    record["step_s"] = step_s
    record.update(throughput.rates(step_s))
    record["peak_bytes"] = {str(r): p for r, p in enumerate(peaks)}
    return record


def _optimizer_info(cfg: TrainConfig, result: StepResult, skipped_total: int) -> str:
    """The progress line's optimizer figures: the rate under a schedule, the global
    gradient norm under clipping and the steps skipped so far (the same on every rank)."""
    parts = []
    if lr_schedule(cfg) is not None and result.lr is not None:
        parts.append(f"lr {result.lr:.3g}")
    if result.grad_norm is not None:
        parts.append(f"gnorm {result.grad_norm:.3g}" + (" (step skipped)" if result.skipped else ""))
    elif result.skipped:  # a non-finite loss without clipping
        parts.append("step skipped")
    if skipped_total:
        parts.append(f"{skipped_total} skipped")
    return "".join(f"  {p}" for p in parts)


def main(argv: list[str] | None = None) -> int:
    """One rank: `--config CFG [--<dotted.key> VALUE ...]` (the overrides `mpress train`
    checked before it launched this rank; mpress/config/overrides.py)."""
    die_with_parent()  # no rank outlives its launcher (mpress train, torchrun's agent)
    catch_interrupts()  # SIGINT: stop at the next step boundary, never a KeyboardInterrupt
    parser = argparse.ArgumentParser(prog="mpress.train", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", required=True, help="training config: configs/train/<name>.yaml or a name")
    args, rest = parser.parse_known_args(argv)
    try:
        rank = rank_from_env()
    except UserError as exc:  # every process says it: none knows its rank for sure
        say_line(f"mpress.train: error: {exc}")
        return 2
    single_process_env()
    try:  # watched from here on: a rank that dies or stops during start-up is named by the others
        watch = early_rank_watch(rank=rank, world=int(os.environ.get("WORLD_SIZE", "1")))
    except RuntimeError as exc:  # the launcher's store is not there (DistNetworkError, DistStoreError)
        say_line(f"mpress.train: rank {rank}: cannot reach the job's store at {os.environ.get('MASTER_ADDR')}:"
                 f"{os.environ.get('MASTER_PORT')}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc}")
        return 1
    start_phase("init", rank)
    try:
        cfg = load_train_config(args.config, parse_override_args(rest, args.config))
        check_checkpoint_dir(cfg)  # before any training: a bad directory or another run's checkpoint
        lock = claim_for_rank(cfg, rank)  # noqa: F841 -- held for the process's life (torchrun: no launcher's claim)
        run_trace.check_options(cfg, args.config)  # a memory snapshot needs CUDA
        nccl_error_handling()
        if rank == 0:
            phase_line(f"rendezvous: waiting for the {os.environ.get('WORLD_SIZE', '1')} ranks "
                       f"({resolve_backend(cfg)})")
        # a bounded timeout: with NCCL a hung peer would otherwise block the others for 10 minutes
        dist.init_process_group(resolve_backend(cfg), timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    except UserError as exc:
        if rank == 0:
            say_line(f"mpress.train: error: {exc}")
        if watch is not None:
            watch.stop()  # every rank found the same: its leaving is no failure
        return 2
    try:
        control = control_group()
        watch = watch or start_rank_watch(rank=rank, world=dist.get_world_size())
        code = train(cfg, control=control, watch=watch)
        watch.stop()  # also after an early return: every rank returned the same
        return code
    except UserError as exc:  # may concern one stage only (its plan part): every rank says its own
        return _stop(watch, f"mpress.train: rank {rank}: error: {exc}", type(exc).__name__, 2)
    except Exception as exc:  # a failure on any rank: one line naming the rank, never a hang
        if os.environ.get("MPRESS_DEBUG"):
            raise
        # not mpress's own error (a broken recv, a collective's): first look for a peer's failure that caused it
        others_first_s = 0.0 if is_own_failure(exc) else CONSEQUENCE_WAIT_S
        return _stop(watch, f"mpress.train: rank {rank}: {root_cause(exc)}", root_kind(exc), 1,
                     others_first_s=others_first_s)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop(watch: RankWatch | None, line: str, kind: str, code: int, *, others_first_s: float = 0.0) -> int:
    """This rank failed: its one line (or, when another rank's failure caused it, a line
    naming that rank: `RankWatch.fail`), the others told and waited for, then leave."""
    if watch is None:  # failed before the watch started
        say_line(line)
        return code
    if not watch.fail(line, kind, others_first_s=others_first_s):
        time.sleep(STOP_WAIT_S)  # the watch is stopping this rank for another's failure: it prints and exits
    # Leave without tearing the process groups down: under NCCL shutting a communicator
    # down waits for work that the stopped ranks will never finish.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
