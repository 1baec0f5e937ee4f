"""Data parallelism across nodes: the `dp` gradient reduction as emulator tasks (what it
holds on the device and what sharding changes in a stage's memory: `mpress/static/memory/data_parallel.py`).

One pipeline per node, replicated on `dp` = `num_nodes` nodes (`mpress.hardware.cluster`). The
emulator runs one replica (every replica runs the same program at the same time); what
the replicas add is the reduction of each stage's gradients with its `dp - 1` twins on
the other nodes, over the NIC of the stage's GPU (`Cluster.nic`; stages whose GPUs share
a NIC, or an interleaved rank's stages, share its bandwidth):

- ddp (torch DDP): during the stage's last backward (gradient sync on the last
  microbatch only, as `PipelineStage` runs DDP under `no_sync` before it), gradients
  are cut into buckets of `bucket_bytes` (DDP's `bucket_cap_mb=25`, in reverse layer
  order), and a bucket is all-reduced as soon as the layer holding its last gradient has
  finished its backward: buckets closed by one layer are one task, issued when that
  layer's backward task ends. A ring all-reduce of b bytes puts 2(dp-1)/dp x b on each
  NIC and takes 2(dp-1) ring steps (`Channel.latency_s`). DDP's buckets hold a copy
  of the gradients unless they are views into them
  (`cluster.DDP_GRADIENT_AS_BUCKET_VIEW`, what the runtime passes to DDP):
  `reduction_buffer_bytes`.
- fsdp (torch FSDP2 `fully_shard` per layer, `reshard_after_forward=False` as under
  pipelining): each layer's gradients are reduce-scattered when its backward of the last
  microbatch ends ((dp-1)/dp x b on the NIC, dp-1 steps); the optimizer steps its shard;
  then the updated parameters are all-gathered ((dp-1)/dp x parameter bytes), after the
  step, where nothing overlaps it (FSDP2 would hide part of it behind the next
  iteration's first forward: this is the conservative bound). Optimizer states and
  fp32 master weights are sharded (`shard_profile`: 1/dp of them per device, and
  1/dp of the optimizer's time); the reduce-scatter's input and output buffers of one
  layer, and without mixed precision the sharded parameter copy, are held on top
  (`reduction_buffer_bytes`).

The optimizer step of a stage waits for the stage's reductions (its `consumes`), so a
reduction that outlasts the backward shows as a stall blamed on `Cost.DATA_PARALLEL`.
The tasks use the OI action kind (a copy, with no microbatch, that only what names it
in `consumes` waits for: the next iteration's forward would wait for the gather, none in
this one) under tensor names `<stage>:optim:dp-reduce:<layer>` and
`<stage>:optim:dp-gather` (`reduce_name`, `gather_name`); they are emulator tasks only,
never plan actions. With dp = 1 nothing is added.

Units: bytes, seconds, GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import math
from dataclasses import replace

from mpress.contract.actions import Action, Kind
from mpress.static.emulate.emulator_result import EmulatorResult
from mpress.static.emulate.program import Channel, Cost, Program, Task, Transfer
from mpress.static.memory.data_parallel import DataParallel
from mpress.static.memory.stage_costs import StageCosts

REDUCE = "dp-reduce"
GATHER = "dp-gather"


def reduce_name(stage: int, layer: str) -> str:
    """Tensor name of the reduction of `layer`'s gradients: an optimizer unit's name
    (`actions.UnitId`, `{stage}:optim:...`) that no rewriter unit takes, so what reads
    stall names (the planner) sees model data, not activations."""
    return f"{stage}:optim:{REDUCE}:{layer}"


def gather_name(stage: int) -> str:
    """Tensor name of the all-gather of a stage's updated parameters (fsdp)."""
    return f"{stage}:optim:{GATHER}"


def ring_wire_bytes(nbytes: int, degree: int, *, all_reduce: bool) -> int:
    """Bytes a ring collective over `degree` ranks puts on each rank's link: 2(n-1)/n x b
    for an all-reduce, (n-1)/n x b for a reduce-scatter or an all-gather."""
    factor = 2 if all_reduce else 1
    return math.ceil(factor * (degree - 1) * nbytes / degree)


def nic_channel(dp: DataParallel, device: int) -> str:
    """Channel id of the NIC `device` reduces over."""
    return f"nic:{dp.cluster.nic(device)}"


def reduction_channels(dp: DataParallel) -> dict[str, Channel]:
    """One channel per NIC of the node; its latency is the ring's steps (all-reduce:
    2(dp-1), reduce-scatter and all-gather: dp-1) times the hop latency."""
    steps = (dp.degree - 1) * (1 if dp.sharded else 2)
    latency = steps * dp.cluster.network.hop_latency_s
    return {f"nic:{k}": Channel(f"nic:{k}", dp.cluster.nic_gbps, latency)
            for k in range(dp.cluster.network.num_nics)}


def bucket_bytes_by_layer(grad_bytes: list[int], dp: DataParallel) -> list[int]:
    """Per layer of a stage (in layer order), the gradient bytes whose reduction starts
    when that layer's backward ends: ddp, the buckets it closes (walking layers in
    reverse, a bucket closes when it holds `bucket_bytes`; the rest closes at the first
    layer); fsdp, the layer's own gradients."""
    if dp.sharded:
        return list(grad_bytes)
    out = [0] * len(grad_bytes)
    total = closed = 0
    for j in range(len(grad_bytes) - 1, -1, -1):
        total += grad_bytes[j]
        full = total // dp.bucket_bytes * dp.bucket_bytes if j else total
        out[j] = full - closed
        closed = full
    return out


def add_reduction(program: Program, costs: list[StageCosts], dp: DataParallel | None) -> Program:
    """`program` with the `dp` reduction of every stage (module docstring), the NIC
    channels, and the samples and FLOPs of all `dp` replicas; `program` itself for dp = 1."""
    if dp is None or dp.degree == 1:
        return program
    ranks = tuple(_rank_with_reduction(tasks, costs, program.rank_device[r], dp)
                  for r, tasks in enumerate(program.ranks))
    return replace(program, ranks=ranks, channels={**program.channels, **reduction_channels(dp)},
                   samples_per_iteration=program.samples_per_iteration * dp.degree,
                   model_flops_per_iteration=program.model_flops_per_iteration * dp.degree)


def _rank_with_reduction(tasks: tuple[Task, ...], costs: list[StageCosts], device: int,
                         dp: DataParallel) -> tuple[Task, ...]:
    last_mb: dict[int, tuple[Kind, int]] = {}  # stage -> its last B or W (what makes gradients) on this rank
    last_opt: dict[int, int] = {}  # stage -> index of its last optimizer task
    for i, t in enumerate(tasks):
        a = t.action
        if a.kind in (Kind.B, Kind.W):
            last_mb[a.stage] = (a.kind, a.microbatch)  # type: ignore[assignment]
        elif a.kind is Kind.OPT:
            last_opt[a.stage] = i
    channel = nic_channel(dp, device)
    issued: dict[int, list[str]] = {}  # stage -> reductions the step waits for
    waited: set[int] = set()
    out: list[Task] = []
    for i, t in enumerate(tasks):
        a = t.action
        if a.kind is Kind.OPT and a.stage in issued and a.stage not in waited:
            waited.add(a.stage)
            t = replace(t, consumes=t.consumes + tuple(issued[a.stage]))
        out.append(t)
        if t.layer is not None and last_mb.get(a.stage) == (a.kind, a.microbatch):
            c = costs[a.stage]
            nbytes = bucket_bytes_by_layer([x.grad_bytes for x in c.layers], dp)[t.layer]
            if nbytes:
                name = reduce_name(a.stage, c.layers[t.layer].name)
                wire = ring_wire_bytes(nbytes, dp.degree, all_reduce=not dp.sharded)
                out.append(Task(Action(a.stage, Kind.OI, None, name), transfers=(Transfer(channel, wire),),
                                cost=Cost.DATA_PARALLEL))
                issued.setdefault(a.stage, []).append(name)
        if dp.sharded and last_opt.get(a.stage) == i and costs[a.stage].param_bytes:
            wire = ring_wire_bytes(costs[a.stage].param_bytes, dp.degree, all_reduce=False)
            out.append(Task(Action(a.stage, Kind.OI, None, gather_name(a.stage)),
                            transfers=(Transfer(channel, wire),), cost=Cost.DATA_PARALLEL))
    return tuple(out)


def is_reduction(task: Task) -> bool:
    """A task `add_reduction` made."""
    return task.cost is Cost.DATA_PARALLEL


def exposed_reduction_s(result: EmulatorResult) -> float:
    """How long the reduction holds up the slowest rank: per rank, for each optimizer step
    that waits for reductions, the time between when everything else it waits for was
    ready (the compute task before it, its other copy-ins) and the later of its start and
    its reductions' end; plus the time its reductions run past its last compute task. The
    most over the ranks; 0 without reductions. (What this costs the iteration is at most
    this: the rank may not be the one that ends last.)"""
    worst = 0.0
    for r, tasks in enumerate(result.program.ranks):
        starts, ends = result.task_start_s[r], result.task_end_s[r]
        dp_end = {t.action.tensor or "": ends[i] for i, t in enumerate(tasks) if is_reduction(t)}
        if not dp_end:
            continue
        in_end: dict[str, float] = {}  # latest end of each other copy-in issued so far
        exposed, previous_end = 0.0, 0.0
        for i, t in enumerate(tasks):
            if not t.action.is_compute:
                if not is_reduction(t):
                    in_end[t.action.tensor or ""] = ends[i]
                continue
            ready = max((dp_end[x] for x in t.consumes if x in dp_end), default=None)
            if ready is not None:
                others = max([previous_end] + [in_end[x] for x in t.consumes if x in in_end])
                exposed += max(0.0, min(starts[i], ready) - others)
            previous_end = ends[i]
        exposed += max(0.0, max(dp_end.values()) - previous_end)
        worst = max(worst, exposed)
    return worst


def reduction_busy_s(result: EmulatorResult) -> float:
    """The longest a rank's reductions take from the first one's start to the last one's
    end (overlapped or not)."""
    spans = []
    for r, tasks in enumerate(result.program.ranks):
        idx = [i for i, t in enumerate(tasks) if is_reduction(t)]
        if idx:
            spans.append(max(result.task_end_s[r][i] for i in idx) - min(result.task_start_s[r][i] for i in idx))
    return max(spans, default=0.0)
