"""Data-parallel replicas of the compacted pipeline, on torch's own stack.

A job of `dp` x `pp` ranks is a 2-D `DeviceMesh` with dims ("dp", "pp"): global rank
`r = dp_rank * pp + pp_rank`, so one replica's stages are consecutive ranks (one node,
NVLink between its GPUs under torchrun's rank order) and stage s of every replica sits
at the same place on each node. Along "pp" a replica runs its pipeline exactly as a
one-replica job does (its plan, its program, its host pools and D2D peers: nothing of a
replica's memory techniques reaches another replica); along "dp" the replicas of a
stage reduce their gradients.

The reduction is torch's `DistributedDataParallel` over the "dp" group, one DDP per
stage module. torch.distributed.pipelining knows DDP (`_PipelineStageBase.
forward_maybe_with_nosync` / `backward_maybe_with_nosync`): every forward and every
backward but a stage's last in a step run under `no_sync`, so gradients accumulate over
the microbatches; the last backward prepares the reducer and all-reduces the
accumulated gradients in buckets while that backward runs, averaging over `dp`. The
optimizer then steps identical gradients on every replica, so replicas stay identical.

Why DDP and not FSDP2's `fully_shard`: `fully_shard` replaces each parameter with a
DTensor shard over "dp" and gathers it around each forward and backward. mpress's
runtime addresses plain parameters by name -- the saved-tensor router never moves
tensors that share a parameter's storage, the master weights and the optimizer step
layer by layer over named parameters, optimizer-state offload by layer, DCP checkpoints
keyed by parameter name -- and an all-gathered parameter is a fresh tensor each
forward, whose storage the router would take for an activation. DDP leaves parameters
as they are: the wrapped module is the same module, with the same names and hooks.
"""

from __future__ import annotations

import datetime
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

from mpress.hardware.cluster import DDP_GRADIENT_AS_BUCKET_VIEW

DP, PP = "dp", "pp"

_NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                           if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                           else {"broadcast_buffers": False})
"""DDP's switch for not syncing buffers before every forward: `forward_sync_buffers`
from torch 2.13 (which deprecates `broadcast_buffers` with a FutureWarning), the only one
torch <= 2.12 has."""
"""The mesh's dimension names."""


@dataclass(frozen=True)
class Replicas:
    """This rank's place in a `dp` x `pp` job and the groups along each dimension."""

    mesh: DeviceMesh
    dp_size: int
    pp_size: int
    dp_rank: int
    """This rank's replica."""
    pp_rank: int
    """This rank's place in its replica's pipeline (the plan's rank)."""
    pp_group: dist.ProcessGroup
    """The replica's pipeline: send/recv between its stages."""
    dp_group: dist.ProcessGroup
    """This stage's replicas: the gradient reduction."""

    @property
    def global_rank(self) -> int:
        return self.dp_rank * self.pp_size + self.pp_rank


def replica_coordinates(rank: int, world: int, dp_size: int) -> tuple[int, int]:
    """(replica, place in the replica's pipeline) of global rank `rank`, as `make_replicas`'
    (dp, pp) mesh lays the ranks out (row-major: a replica's ranks are consecutive).
    Known before the mesh is made, so a rank can choose and bind its device first."""
    if dp_size < 1 or world % dp_size or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world} ranks is not in {dp_size} replicas of a pipeline")
    pp_size = world // dp_size
    return rank // pp_size, rank % pp_size


def make_replicas(dp_size: int, device_type: str) -> Replicas:
    """The job's `dp` x `pp` mesh over the default process group (its backend for both
    dimensions). A collective: call on every rank. The world must be a whole number of
    replicas (`mpress.runtime.train_config.pipeline_ranks` checks a config's `dp`)."""
    world = dist.get_world_size()
    if dp_size < 1 or world % dp_size:
        raise ValueError(f"{world} ranks are not {dp_size} replicas of a pipeline")
    pp_size = world // dp_size
    mesh = init_device_mesh(device_type, (dp_size, pp_size), mesh_dim_names=(DP, PP))
    coordinates = (mesh.get_local_rank(DP), mesh.get_local_rank(PP))
    if coordinates != replica_coordinates(dist.get_rank(), world, dp_size):  # the device was chosen by these
        raise RuntimeError(f"rank {dist.get_rank()}: the mesh puts it at (dp, pp) = {coordinates}, not at "
                           f"{replica_coordinates(dist.get_rank(), world, dp_size)}")
    return Replicas(mesh=mesh, dp_size=dp_size, pp_size=pp_size, dp_rank=coordinates[0], pp_rank=coordinates[1],
                    pp_group=mesh.get_group(PP), dp_group=mesh.get_group(DP))


def replica_control_group(replicas: Replicas, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of this rank's replica (its pipeline's ranks), for the object
    collectives that stay inside a replica (the peer pools' handshake) when the job's
    backend is NCCL. A collective: every rank makes every replica's group."""
    groups = [dist.new_group([k * replicas.pp_size + p for p in range(replicas.pp_size)], backend="gloo",
                             timeout=datetime.timedelta(seconds=timeout_s)) for k in range(replicas.dp_size)]
    return groups[replicas.dp_rank]


def replicate_stages(stages: list[PipelineStage], dp_group: dist.ProcessGroup, device: torch.device) -> None:
    """Wrap each stage's module in DDP over `dp_group`, in place: torch's pipeline
    schedules then reduce the stage's gradients across its replicas at the stage's last
    backward of each step (see the module docstring). The stage's other references to its
    module (the router's hooks, the optimizer's parameters) stay valid: DDP wraps the same
    module. A collective over `dp_group`: `check_replicas_agree` compares the replicas'
    parameters (shapes and values, built from one seed) in one small all-reduce, and DDP
    does not broadcast them again (its init sync copies them through 250 MiB buckets: a
    transient of up to 250 MiB on each device at start-up, for values that are equal)."""
    for stage in stages:
        check_replicas_agree(stage.submod, dp_group, device, stage.stage_index)
    for stage in stages:
        module = stage.submod
        if isinstance(module, DistributedDataParallel):
            raise ValueError(f"stage {stage.stage_index} is replicated already")
        # buffers are constants here (masks, position ids), equal on every replica: synced
        # once at init, not before every forward
        # gradient_as_bucket_view: the one the static half counts the buckets' memory by
        stage.submod = DistributedDataParallel(module, process_group=dp_group, **_NO_FORWARD_BUFFER_SYNC,
                                               gradient_as_bucket_view=DDP_GRADIENT_AS_BUCKET_VIEW,
                                               device_ids=[device] if device.type == "cuda" else None,
                                               init_sync=False)


def check_replicas_agree(module: torch.nn.Module, dp_group: dist.ProcessGroup, device: torch.device,
                         stage: int) -> None:
    """Raise when this stage's replicas differ in a parameter's shape or values (they are
    built from one seed, so they agree bit for bit): per parameter its element count and
    the float64 sum of its values, the most and the least over `dp_group` (two all-reduces
    of 2 x parameters numbers)."""
    tensors = list(module.parameters()) + list(module.buffers())
    mine = torch.tensor([float(t.numel()) for t in tensors] + [t.detach().double().sum().item() for t in tensors],
                        dtype=torch.float64, device=device)
    most, least = mine.clone(), mine.clone()
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=dp_group)
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=dp_group)
    if not torch.equal(most, least):
        names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
        first = int((most != least).nonzero()[0]) % len(tensors)
        raise RuntimeError(f"stage {stage}: its replicas differ in {names[first]} (shape or values): each replica "
                           "must build the stage from the same seed and checkpoint")
