"""Data parallelism: the `dp` gradient reduction as emulator tasks (what it holds on the
device and what sharding changes in a stage's memory: `mpress/static/memory/data_parallel.py`).

The pipeline is replicated `per_node` times on each of `nodes` nodes (`DataParallel`;
`mpress.hardware.cluster`), dp = nodes x per_node replicas. The emulator runs one
replica (every replica runs the same program at the same time); what the replicas add is
the reduction of each stage's gradients with its `dp - 1` twins. It is hierarchical, as
NCCL's rings and trees run over NVLink inside a node and over the NICs between nodes:

1. over the node's replicas: a ring through the stage's GPU in each replica slot
   (`NodeReplicas.twins`), on the node's links between them -- the slowest hop's
   NVLink bandwidth (`Hardware.nvlink_gbps`) and `nvlink_latency_s` per ring step, or
   the node's PCIe and `pcie_latency_s` where a hop has no NVLink (channel
   `dp-link:<device>`, one per device of the plan, not shared with the pipeline's own
   NVLink traffic);
2. across nodes, of the 1/per_node share of the gradients each twin holds after step
   1's reduce-scatter: a ring between the nodes over the NIC of each twin's GPU
   (`Cluster.nic`; stages whose GPUs share a NIC, or an interleaved rank's stages,
   share its bandwidth; twins on one NIC put their shares on it together).

An all-reduce of b bytes is step 1's reduce-scatter, step 2's all-reduce of the b /
per_node shares, and step 1's all-gather: 2(r-1)/r x b on each node link (r =
per_node, 2(r-1) steps) and 2(n-1)/n x b/r on each NIC (n = nodes, 2(n-1) steps); a
reduce-scatter or an all-gather half of each. The two steps run at once (NCCL pipelines
a message in chunks through them), so a collective lasts as its slower link does; with
one node there is no NIC step, with one replica per node no node-link step.

- ddp (torch DDP): during the stage's last backward (gradient sync on the last
  microbatch only, as `PipelineStage` runs DDP under `no_sync` before it), gradients
  are cut into buckets of `bucket_bytes` (DDP's `bucket_cap_mb=25`, in reverse layer
  order), and a bucket is all-reduced as soon as the layer holding its last gradient has
  finished its backward: buckets closed by one layer are one task, issued when that
  layer's backward task ends. DDP's buckets hold a copy of the gradients unless they
  are views into them (`cluster.DDP_GRADIENT_AS_BUCKET_VIEW`, what the runtime passes
  to DDP): `reduction_buffer_bytes`.
- fsdp (torch FSDP2 `fully_shard` per layer, `reshard_after_forward=False` as under
  pipelining): each layer's gradients are reduce-scattered when its backward of the last
  microbatch ends; the optimizer steps its shard; then the updated parameters are
  all-gathered, after the step, where nothing overlaps it (FSDP2 would hide part of it
  behind the next iteration's first forward: this is the conservative bound).
  Optimizer states and fp32 master weights are sharded (`shard_profile`: 1/dp of them
  per device, and 1/dp of the optimizer's time); the reduce-scatter's input and output
  buffers of one layer, and without mixed precision the sharded parameter copy, are
  held on top (`reduction_buffer_bytes`).

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
from mpress.hardware.cluster import NodeReplicas
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


def link_channel(device: int) -> str:
    """Channel id of the node links the twins of the plan's `device` reduce over."""
    return f"dp-link:{device}"


def twin_ring(local: NodeReplicas, device: int) -> tuple[float, float]:
    """(GB/s, seconds per ring step) of the ring over the twins of the plan's `device`
    (step 1 of the module docstring): the slowest hop's NVLink, or the node's PCIe
    where a hop has none."""
    ring, node = local.twins(device), local.node
    hops = [(a, ring[(k + 1) % len(ring)]) for k, a in enumerate(ring)]
    if all(node.links(a, b) for a, b in hops):
        return min(node.nvlink_gbps(a, b) for a, b in hops), node.nvlink_latency_s
    return min(node.pcie_gbps("h2d"), node.pcie_gbps("d2h")), node.pcie_latency_s


def reduction_channels(dp: DataParallel) -> dict[str, Channel]:
    """The channels of the reduction: with several
    nodes, one per NIC of a node, its latency the ring's steps between the nodes
    (all-reduce: 2(nodes-1), reduce-scatter and all-gather: nodes-1) times the hop
    latency; with several replicas per node, one per device for its twins' ring, its
    latency that ring's steps (2(per_node-1) or per_node-1) times its step latency."""
    factor = 1 if dp.sharded else 2
    out: dict[str, Channel] = {}
    if dp.cluster is not None and dp.nodes > 1:
        latency = factor * (dp.nodes - 1) * dp.cluster.network.hop_latency_s
        out.update({f"nic:{k}": Channel(f"nic:{k}", dp.cluster.nic_gbps, latency)
                    for k in range(dp.cluster.network.num_nics)})
    if dp.local is not None and dp.per_node > 1:
        for d in range(len(dp.local.devices[0])):  # the plan's devices
            gbps, step_s = twin_ring(dp.local, d)
            out[link_channel(d)] = Channel(link_channel(d), gbps, factor * (dp.per_node - 1) * step_s)
    return out


def reduction_transfers(dp: DataParallel, device: int, nbytes: int, *, all_reduce: bool) -> tuple[Transfer, ...]:
    """What a collective of `nbytes` of the plan's `device` puts on each channel (module
    docstring): (r-1)/r x b on its twins' ring (twice for an all-reduce), and (n-1)/n of
    the b/r share (twice for an all-reduce) on the NIC of each twin."""
    out: dict[str, int] = {}
    if dp.per_node > 1:
        out[link_channel(device)] = ring_wire_bytes(nbytes, dp.per_node, all_reduce=all_reduce)
    if dp.cluster is not None and dp.nodes > 1:
        share = ring_wire_bytes(-(-nbytes // dp.per_node), dp.nodes, all_reduce=all_reduce)
        for gpu in dp.local.twins(device) if dp.local is not None else [device]:
            nic = f"nic:{dp.cluster.nic(gpu)}"
            out[nic] = out.get(nic, 0) + share
    return tuple(Transfer(channel, nbytes) for channel, nbytes in out.items())


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
                out.append(Task(Action(a.stage, Kind.OI, None, name), cost=Cost.DATA_PARALLEL,
                                transfers=reduction_transfers(dp, device, nbytes, all_reduce=not dp.sharded)))
                issued.setdefault(a.stage, []).append(name)
        if dp.sharded and last_opt.get(a.stage) == i and costs[a.stage].param_bytes:
            out.append(Task(Action(a.stage, Kind.OI, None, gather_name(a.stage)), cost=Cost.DATA_PARALLEL,
                            transfers=reduction_transfers(dp, device, costs[a.stage].param_bytes, all_reduce=False)))
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
