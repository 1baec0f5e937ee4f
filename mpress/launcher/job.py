"""This rank's job: the peer pools the plan needs (a collective), then the pipeline job
that uses them. The launcher and the multi-process tests build jobs this way."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpress.d2d.runtime.peer_pool import setup_peer_pools
from mpress.contract.plan import Plan
from mpress.runtime.trainer import JobSpec, PipelineJob


def start_job(spec: JobSpec, plan: Plan | None, device: torch.device, *, group: dist.ProcessGroup | None = None,
              control_group: dist.ProcessGroup | None = None,
              dp_group: dist.ProcessGroup | None = None,
              node_devices: tuple[int, ...] | None = None) -> PipelineJob:
    """This rank's `PipelineJob` under `plan`. When the plan reserves peer pools or
    D2D-swaps, every rank of the job sets the pools up first, over `control_group` (a gloo
    group when `group` is NCCL; default `group`), and the job owns them.

    With several replicas of the pipeline (`mpress.runtime.data_parallel`), `group` and
    `control_group` are this rank's replica's and `dp_group` its stage's replicas: the
    peer pools stay inside a replica, the gradients are averaged over `dp_group`;
    `node_devices` (a slot of `StartPlan.replica_devices`) puts its pools and peers on
    the replica's own GPUs when several share a node.

    Call on every rank of the job: the peer-pool set-up is a collective.
    """
    peers = None
    if plan is not None and plan.uses_peer_pools:
        rank = dist.get_rank(group)
        peers = setup_peer_pools(plan, plan.stages_of_rank(rank), device, group=control_group or group,
                                 pool_override_bytes=spec.peer_pool_bytes, node_devices=node_devices)
    try:
        return PipelineJob(spec, plan, device, group=group, peers=peers, dp_group=dp_group)
    except BaseException:
        if peers is not None:
            peers.close()
        raise
