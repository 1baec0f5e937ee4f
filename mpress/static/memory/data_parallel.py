"""Data parallelism as the memory model sees it: the replicas (`DataParallel`, across
nodes and several on a node), what sharding (FSDP) changes in a stage's model states
(`shard_profile`) and the buffers the reduction holds on the device
(`reduction_buffer_bytes`). How the reduction runs and what it costs in time is the
emulator's (`mpress/static/emulate/dp_reduction.py`, whose
docstring describes ddp and fsdp as modelled).

Units: bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mpress.hardware.cluster import DDP_GRADIENT_AS_BUCKET_VIEW, Cluster, NodeReplicas, Sharding, make_cluster
from mpress.hardware.server import Hardware
from mpress.static.memory.stage_costs import StageCosts
from mpress.static.profile.profile import Profile

DDP_BUCKET_BYTES = 25 * (1 << 20)
"""torch DDP's default `bucket_cap_mb=25` (its first bucket, 1 MiB, is not modelled)."""

@dataclass(frozen=True, kw_only=True)
class DataParallel:
    """Replicas of the pipeline: one or several (`local`) on each node of `cluster`, or
    several on one node (no `cluster`)."""

    cluster: Cluster | None = None
    """The nodes and their NICs; None: every replica is on one node (`local`)."""
    local: NodeReplicas | None = None
    """The replicas that share each node and their GPUs; None: one replica per node."""
    sharding: Sharding = Sharding.DDP
    """How replicas hold model states and reduce gradients (`mpress.hardware.cluster.Sharding`)."""
    bucket_bytes: int = field(default=DDP_BUCKET_BYTES)
    """ddp: gradient bytes per all-reduce bucket."""

    def __post_init__(self) -> None:
        if self.cluster is None and self.local is None:
            raise ValueError("data parallelism needs nodes (a cluster) or several replicas on a node")

    @property
    def nodes(self) -> int:
        """Nodes the replicas span."""
        return self.cluster.num_nodes if self.cluster is not None else 1

    @property
    def per_node(self) -> int:
        """Replicas on each node."""
        return self.local.per_node if self.local is not None else 1

    @property
    def degree(self) -> int:
        """Replicas: `per_node` on each of the `nodes`."""
        return self.nodes * self.per_node

    @property
    def sharded(self) -> bool:
        return self.sharding is Sharding.FSDP and self.degree > 1


def replicas_of(hardware: Hardware, nodes: int, local: NodeReplicas | None = None,
                sharding: Sharding = Sharding.DDP) -> DataParallel | None:
    """`nodes` nodes of `hardware` (`local.node`, the whole node, where several replicas
    share it), each running `local.per_node` replicas (one without `local`), joined by the
    node's network preset where there are several; None for a single replica. A one-line
    `UserError` where the node's hardware has no network preset and the replicas span nodes."""
    per_node = local.per_node if local is not None else 1
    if nodes * per_node == 1:
        return None
    cluster = make_cluster(local.node if local is not None else hardware, nodes) if nodes > 1 else None
    return DataParallel(cluster=cluster, local=local if per_node > 1 else None, sharding=sharding)


def shard_profile(profile: Profile, dp: DataParallel) -> Profile:
    """The profile one device sees under `dp`: with fsdp, each layer's optimizer states,
    master weights and largest optimizer tensor are 1/dp (rounded up); otherwise the
    profile itself."""
    if not dp.sharded:
        return profile
    n = dp.degree
    layers = [replace(x, optim_bytes=-(-x.optim_bytes // n), master_bytes=-(-x.master_bytes // n),
                      largest_param_bytes=-(-x.largest_param_bytes // n)) for x in profile.layers]
    return replace(profile, layers=layers)


def reduction_buffer_bytes(costs: StageCosts, dp: DataParallel | None) -> int:
    """Device bytes a stage holds for the whole iteration because of `dp` (> 1), beyond
    its (sharded) model states: ddp, its buckets, a copy of the stage's gradients (none
    when they are views into them, `cluster.DDP_GRADIENT_AS_BUCKET_VIEW`); fsdp, one
    layer's reduce-scatter input (its unsharded gradients) and output (their shard), and,
    without master weights, its 1/dp shard of the parameters beside the unsharded ones."""
    if dp is None or dp.degree == 1:
        return 0
    if not dp.sharded:
        return 0 if DDP_GRADIENT_AS_BUCKET_VIEW else costs.grad_bytes
    n = dp.degree
    largest = max((x.grad_bytes for x in costs.layers), default=0)
    shard_copy = 0 if costs.master_bytes else -(-costs.param_bytes // n)
    return largest + -(-largest // n) + shard_copy
