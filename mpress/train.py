"""The torchrun entry: train a reference model with pipeline parallelism under a plan.

    python3 -m torch.distributed.run --nproc-per-node 4 -m mpress.train \\
        --config configs/train/gpt-tiny-mixed.yaml

One stage per rank (GPipe, 1F1B), or several (interleaved 1F1B), with torch.distributed.pipelining's schedules. The config names
the plan: a file from `mpress plan`, `auto` (rank 0 plans at start-up for the config's
hardware and broadcasts the plan) or `none` (plain pipelining, the baseline). Rank 0
shows a progress bar (step, loss, samples/s, per-rank peak) and a report per rank at the
end. Without torchrun it runs as a single process (one stage). Bad input: one line,
exit status 2; a failure on any rank: one line naming the rank, exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mpress.d2d.topology import compare_topology, detect_local_hardware
from mpress.errors import MpressError, PlanError, TopologyError, UserError
from mpress.hardware import Hardware, load_hardware
from mpress.model_config import ModelConfig
from mpress.plan import Plan
from mpress.runtime.data import batches, build_dataset
from mpress.runtime.train_config import (
    HARDWARE_DETECT,
    TrainConfig,
    check_world_size,
    load_train_config,
    model_config,
    resolve_backend,
)
from mpress.runtime.trainer import JobSpec, PipelineJob, share_loss
from mpress.ui import make_console
from mpress.units import fmt_bytes, fmt_seconds

COLLECTIVE_TIMEOUT_S = 300
"""Longest a collective or pipeline send/recv may wait for a peer before the rank fails."""


def _single_process_env() -> None:
    """Let `python -m mpress.train` run without torchrun as a world of one."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def plan_for(cfg: TrainConfig, model: ModelConfig, num_stages: int,
             world: int) -> tuple[Plan | None, list[tuple[int, int]]]:
    """The plan (None for `plan: none`) and the stage layer ranges; rank 0 only."""
    from mpress.static.evaluate import setup_pipeline
    from mpress.static.planner import PlannerOptions, check_fits_at_all, plan_strategy

    cuda = dist.is_initialized() and dist.get_backend() == "nccl"
    if cfg.plan not in ("auto", "none"):
        plan = Plan.load(cfg.plan)
        if cuda:
            check_topology(load_hardware(plan.hardware, num_devices=plan.num_devices,
                                         memory_bytes=plan.device_memory_bytes))
        return plan, [(sp.first_layer, sp.end_layer) for sp in plan.stages]
    hardware = hardware_for(cfg, world, cuda)
    setup = setup_pipeline(model, hardware, schedule=cfg.schedule, num_stages=num_stages,  # type: ignore[arg-type]
                           num_ranks=world if cfg.schedule == "interleaved" else None,
                           microbatch_size=cfg.microbatch_size, num_microbatches=cfg.num_microbatches)
    if cfg.plan == "none":
        return None, setup.ranges
    check_fits_at_all(setup)
    result = plan_strategy(setup, cfg.strategy, PlannerOptions())
    if not result.fits:
        raise UserError(f"plan: auto: {model.name} does not fit {hardware.name}: {result.reason}")
    return result.plan, setup.ranges


def hardware_for(cfg: TrainConfig, world: int, cuda: bool) -> Hardware:
    """What `plan: auto` plans for: the config's preset (its device count and memory as
    the run has them), checked against this machine's GPUs on CUDA; or, with `hardware:
    detect`, the GPUs pynvml finds."""
    if cfg.hardware == HARDWARE_DETECT:
        topology, why = detect_local_hardware()
        if topology is None:
            raise TopologyError(f"hardware: detect: {why}")
        hardware = topology.hardware
        if cfg.device_memory_bytes is not None:
            hardware = dataclasses.replace(hardware, device=dataclasses.replace(
                hardware.device, memory_bytes=cfg.device_memory_bytes))
        return hardware
    hardware = load_hardware(cfg.hardware, num_devices=world, memory_bytes=cfg.device_memory_bytes)
    if cuda:
        check_topology(hardware)
    return hardware


def check_topology(expected: Hardware, *, nvml: object = None) -> None:
    """Refuse to train when this machine's GPUs are not linked as `expected` says (a plan
    for another topology would stripe over links that do not exist). A subset of the
    machine's GPUs may be used: a larger machine is not a mismatch. `nvml` replaces the
    pynvml module (tests)."""
    topology, why = detect_local_hardware(nvml=nvml)
    if topology is None:
        raise TopologyError(f"cannot check the topology of {expected.name} against this machine: {why}")
    problems = [p for p in compare_topology(expected, topology.hardware)
                if not (p.startswith("device count") and expected.num_devices < topology.hardware.num_devices)]
    if problems:
        raise TopologyError(f"the plan's hardware {expected.name} does not match this machine: {'; '.join(problems)}")


def rank_device(plan: Plan | None, rank: int, world: int, cuda: bool) -> torch.device:
    """The device this rank trains on: on CUDA the plan's stage-to-device map decides
    (without a plan: LOCAL_RANK); gloo ranks all use the CPU."""
    if not cuda:
        return torch.device("cpu")
    if plan is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    devices = {plan.stage_to_device[s] for s in range(rank, plan.num_stages, world)}
    if len(devices) != 1:
        raise PlanError(f"plan puts the stages of rank {rank} on devices {sorted(devices)}; a rank has one device")
    index = devices.pop()
    if index >= torch.cuda.device_count():
        raise PlanError(f"plan maps rank {rank} to GPU {index}, this process sees {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def _pool_override(variable: str) -> int | None:
    """$MPRESS_HOST_POOL_BYTES (pinned pool per stage) or $MPRESS_PEER_POOL_BYTES (peer
    pool per importer device) instead of the plan's, for sizing experiments and fault
    tests; unset = the plan's."""
    value = os.environ.get(variable)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{variable}: expected a whole number of bytes, got {value!r}") from None


def _broadcast(obj: object, group: dist.ProcessGroup | None) -> object:
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def control_group() -> dist.ProcessGroup | None:
    """A gloo group for object collectives before the device is known (the plan's
    broadcast, the peer pools' handshake); None = the default group, when it is gloo."""
    if dist.get_backend() != "nccl":
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


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


def rank_report(job: PipelineJob, plan: Plan | None) -> dict[str, object]:
    """This rank's figures for the final table (summed over its stages)."""
    out: dict[str, object] = {"rank": job.rank, "stage": ",".join(map(str, job.stage_ids)),
                              "cuda_peak": torch.cuda.max_memory_allocated(job.device)
                              if job.device.type == "cuda" else None}
    if plan is not None:
        parts = [plan.stage(s) for s in job.stage_ids]
        # a stage's need is its own; its predicted peak is its device's (shared by the rank's stages)
        out.update(need=sum(sp.need_bytes for sp in parts), planned=max(sp.predicted_peak_bytes for sp in parts),
                   rules=", ".join(sorted({r.technique for sp in parts for r in sp.rules})) or "keep")
    runtimes = job.runtimes
    if runtimes:
        engines = [rt.engine.stats for rt in runtimes if rt.engine is not None]
        d2d = [rt.d2d_engine.stats for rt in runtimes if rt.d2d_engine is not None]
        if job.device.type == "cuda":
            out["cuda_check"] = next((rt.stats.extra["cuda_check"] for rt in runtimes
                                      if "cuda_check" in rt.stats.extra), "ok")
        out.update(tracked_peak=_tracked_peak(job), swapped=sum(rt.stats.tensors_swapped for rt in runtimes),
                   recomputed=sum(rt.stats.microbatches_recomputed for rt in runtimes),
                   bytes_out=sum(st.bytes_out for st in engines), peer_out=sum(st.bytes_out for st in d2d),
                   wait_s=sum(st.wait_s for st in engines + d2d))
    if job.peer_pools is not None:
        usage = job.peer_pools.pool_usage().values()
        out["pool"] = (sum(u["high_water_bytes"] for u in usage), sum(u["capacity_bytes"] for u in usage))
    return out


def report_tables(rows: list[dict[str, object]]) -> list[Table]:
    """The end-of-run report: memory per rank, then what mpress moved and recomputed."""
    def b(r: dict[str, object], key: str) -> str:
        v = r.get(key)
        return fmt_bytes(v) if isinstance(v, int) and v else "-"

    memory = Table(title="per rank: memory")
    # need/peak: the plan's figures without and with compaction; tracked peak: saved
    # tensors + optimizer data on the device as the memory manager saw them
    for c in ["rank", "stage", "plan", "need w/o mpress (planned)", "peak with mpress (planned)",
              "tracked peak (saved + optimizer)", "CUDA peak"]:
        memory.add_column(c, justify="right")
    traffic = Table(title="per rank: swaps and recompute")
    for c in ["rank", "tensors swapped", "bytes to host", "bytes to peers", "peer pool held (high water / size)",
              "microbatches recomputed", "swap wait"]:
        traffic.add_column(c, justify="right")
    for r in rows:
        memory.add_row(str(r["rank"]), str(r["stage"]), str(r.get("rules", "none")), b(r, "need"), b(r, "planned"),
                       b(r, "tracked_peak"), b(r, "cuda_peak"))
        traffic.add_row(str(r["rank"]), str(r.get("swapped", "-")), b(r, "bytes_out"), b(r, "peer_out"),
                        _pool_cell(r.get("pool")), str(r.get("recomputed", "-")),
                        fmt_seconds(float(r.get("wait_s", 0.0))))  # type: ignore[arg-type]
    return [memory, traffic]


def _pool_cell(pool: object) -> str:
    if not pool:
        return "-"
    high, size = pool  # type: ignore[misc]
    if not size:
        return "-"
    return f"{fmt_bytes(high)} / {fmt_bytes(size)}"


class PeerWatch:
    """Stops this rank, naming the dead one, when another rank of a D2D job dies.

    A rank blocked in a pipeline recv from a dead rank would otherwise wait for the
    collective timeout and, on NCCL, be aborted by its watchdog without a word. Runs while
    the job trains; `stop` it before the ranks part (they leave at different times).
    """

    def __init__(self, job: PipelineJob, interval_s: float = 1.0) -> None:
        self._job = job
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpress-peer-watch", daemon=True)
        if job.peer_pools is not None:
            self._thread.start()

    def _run(self) -> None:
        pools = self._job.peer_pools
        while not self._stopped.wait(self._interval_s):
            dead = pools.dead_ranks()
            if dead and not self._stopped.is_set():
                stages = ",".join(map(str, self._job.stage_ids))
                print(f"mpress.train: rank {self._job.rank}: SwapError: rank {self._job.rank} stage {stages}: "
                      f"{'; '.join(dead)}; stopping", file=sys.stderr, flush=True)
                os._exit(1)  # the training thread may be stuck in a collective with the dead rank

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()


def train(cfg: TrainConfig) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    num_stages = check_world_size(cfg, world)
    model = model_config(cfg)
    control = control_group()
    payload: object = None
    if rank == 0:
        try:
            payload = plan_for(cfg, model, num_stages, world)
        except UserError as exc:
            payload = exc
    payload = _broadcast(payload, control)
    if isinstance(payload, UserError):  # the same on every rank: rank 0 says it once
        if rank == 0:
            print(f"mpress.train: error: {payload}", file=sys.stderr)
        return 2
    plan, ranges = payload  # type: ignore[misc]
    device = rank_device(plan, rank, world, dist.get_backend() == "nccl")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = JobSpec(model=model, schedule=cfg.schedule, ranges=list(ranges), microbatch_size=cfg.microbatch_size,
                   num_microbatches=cfg.num_microbatches, seed=cfg.seed, lr=cfg.optimizer.lr,
                   betas=tuple(cfg.optimizer.betas), eps=cfg.optimizer.eps,  # type: ignore[arg-type]
                   weight_decay=cfg.optimizer.weight_decay, host_pool_bytes=_pool_override("MPRESS_HOST_POOL_BYTES"),
                   peer_pool_bytes=_pool_override("MPRESS_PEER_POOL_BYTES"))
    torch.manual_seed(cfg.seed * 1000 + rank)  # dropout stream of this rank
    dataset = build_dataset(cfg.data, model, seed=cfg.seed)
    job = PipelineJob(spec, plan, device, control_group=control)
    watch = PeerWatch(job)
    first = resume(cfg, job)
    console = make_console()
    if rank == 0:
        what = "no plan (plain pipelining)" if plan is None else f"plan {plan.strategy} ({cfg.plan})"
        console.print(f"mpress.train: {model.name}, {cfg.schedule}, {num_stages} stages x {cfg.num_microbatches} "
                      f"microbatches of {cfg.microbatch_size}, {what}, backend {dist.get_backend()}"
                      + (f", resuming at step {first}" if first else ""))
    progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                        disable=rank != 0)
    with progress:
        task = progress.add_task("train", total=cfg.steps, completed=first, info="")
        for step in range(first, cfg.steps):
            x, y = batches(dataset, microbatch_size=cfg.microbatch_size, num_microbatches=cfg.num_microbatches,
                           step=step)
            t0 = time.perf_counter()
            result = job.step(x, y)
            loss = share_loss(result.loss, job)
            elapsed = time.perf_counter() - t0
            peaks = [0] * world
            dist.all_gather_object(peaks, result.peak_bytes or _tracked_peak(job))
            info = (f"loss {loss:.4f}  {cfg.global_batch_size / elapsed:.1f} samples/s  peak/rank "
                    + " ".join(fmt_bytes(p) for p in peaks))
            progress.update(task, advance=1, info=info)
            if rank == 0 and (step % cfg.log_every == 0 or step == cfg.steps - 1):
                progress.console.print(f"step {step}: loss {loss:.4f}")
            every = cfg.checkpoint.every_steps
            if (every and (step + 1) % every == 0) or step == cfg.steps - 1:
                save_checkpoint(cfg, job, step)
    rows: list[dict[str, object]] = [{} for _ in range(world)]
    dist.all_gather_object(rows, rank_report(job, plan))
    if rank == 0:
        for table in report_tables(rows):
            console.print(table)
        for r in rows:
            if r.get("cuda_check", "ok") != "ok":
                console.print(f"[red]accounting check failed[/]: {r['cuda_check']}")
    watch.stop()  # every rank got here (the gather above): none has left yet
    job.close()
    return 0


def _tracked_peak(job: PipelineJob) -> int:
    """Tracked peaks of this rank's stages, added (an upper bound when it holds several)."""
    return sum(rt.manager.peak_device_bytes() for rt in job.runtimes)


def root_cause(exc: BaseException) -> str:
    """One line for a failure: torch wraps stage failures in generic errors, so follow the
    causes to mpress's own error (it names rank, stage, microbatch and tensor) or, if
    there is none, to the innermost cause."""
    while exc.__cause__ is not None and not isinstance(exc, MpressError):
        exc = exc.__cause__
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpress.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="training config: configs/train/<name>.yaml or a name")
    args = parser.parse_args(argv)
    _single_process_env()
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_train_config(args.config)
        # a bounded timeout: with NCCL a dead peer would otherwise block the others for 10 minutes
        dist.init_process_group(resolve_backend(cfg), timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    except UserError as exc:
        if rank == 0:
            print(f"mpress.train: error: {exc}", file=sys.stderr)
        return 2
    try:
        return train(cfg)
    except UserError as exc:  # may concern one stage only (its plan part): every rank says its own
        print(f"mpress.train: rank {rank}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a failure on any rank: one line naming the rank, never a hang
        if os.environ.get("MPRESS_DEBUG"):
            raise
        print(f"mpress.train: rank {rank}: {root_cause(exc)}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
