"""Which GPU each rank trains on, named by PCI bus id.

NVML numbers every GPU of the machine in PCI order; CUDA numbers only the GPUs this
process may use (CUDA_VISIBLE_DEVICES, as SLURM and container runtimes set it), in its
own order (CUDA_DEVICE_ORDER, fastest first by default). The two numberings agree only by
chance, so the launcher never carries an index from one to the other: a plan's device d
is the GPU with the d-th PCI bus id of the CUDA devices rank 0 saw when it planned, and
each rank looks that bus id up among its own CUDA devices.

Also here: the check that no two ranks train on one GPU, and binding a rank to its
device (with the collective that makes NCCL's communicator of its pipeline there) before
the replicas' mesh is made (`join_replicas`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mpress.errors import PlanError
from mpress.runtime.data_parallel import Replicas, make_replicas


def cuda_bus_ids() -> list[str] | None:
    """PCI bus id (`dddd:bb:dd.0`, as `normalize_bus_id` writes it) of each CUDA device
    this process sees, in CUDA index order; None when it sees none (a CPU run)."""
    count = torch.cuda.device_count()
    if count == 0:
        return None
    ids = []
    for i in range(count):
        # the same three numbers torch.numa.binding reads; CUDA devices are PCI function 0
        p = torch.cuda.get_device_properties(i)
        ids.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
    return ids


def cuda_index_of(bus_id: str, local_bus_ids: list[str] | None, *, rank: int, plan_device: int) -> int:
    """This process's CUDA index of the GPU with `bus_id` (the plan's device
    `plan_device`); PlanError, one line naming the rank, the GPU and what this process
    sees, when it cannot see that GPU."""
    if local_bus_ids and bus_id in local_bus_ids:
        return local_bus_ids.index(bus_id)
    sees = ", ".join(local_bus_ids) if local_bus_ids else "no GPU"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise PlanError(f"rank {rank}: the plan's GPU {plan_device} (PCI {bus_id}) is not visible to this process "
                    f"(it sees {sees}; CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'})")


@dataclass(frozen=True)
class DeviceClaim:
    """The device one rank trains on, as the ranks gather it to check each other."""

    rank: int
    host: str
    """The machine (host name): GPUs of two hosts never collide."""
    gpu: str | None
    """The GPU's PCI bus id; None for a CPU rank (CPU ranks share the host's memory)."""


def claim_for(rank: int, device: torch.device) -> DeviceClaim:
    """This rank's claim on `device` (its bus id read from CUDA)."""
    if device.type != "cuda":
        return DeviceClaim(rank=rank, host=socket.gethostname(), gpu=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    ids = cuda_bus_ids() or []
    gpu = ids[index] if index < len(ids) else f"cuda:{index}"
    return DeviceClaim(rank=rank, host=socket.gethostname(), gpu=gpu)


def check_distinct_devices(claims: list[DeviceClaim]) -> None:
    """PlanError, one line naming both ranks, when two ranks train on one GPU of one host
    (NCCL does not support two ranks of a communicator on one device, and both ranks'
    memory plans would count the whole GPU as their own). CPU ranks are not checked."""
    taken: dict[tuple[str, str], int] = {}
    for c in sorted(claims, key=lambda c: c.rank):
        if c.gpu is None:
            continue
        other = taken.setdefault((c.host, c.gpu), c.rank)
        if other != c.rank:
            raise PlanError(f"ranks {other} and {c.rank} both train on GPU {c.gpu} of {c.host}; each rank needs "
                            "its own GPU (check CUDA_VISIBLE_DEVICES and the plan's stage_to_device)")


def select_device(device: torch.device) -> None:
    """Make `device` this process's current device (a CUDA one), before anything makes a
    CUDA context: torch's `init_device_mesh` sets LOCAL_RANK's GPU when none is current."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def bind_device(device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    """Make `device` this rank's, then run one collective over `group` (default: the
    job's default group) with a tensor on it.

    With NCCL that collective creates the full group's communicator on this device, with
    every rank taking part. Otherwise it would first be made inside the pipeline's first
    batched send/recv, which only two neighbours take part in, and torch's
    `batch_isend_irecv` requires every rank of the group in its first call. Call on every
    rank of `group`, right after the device is chosen.
    """
    select_device(device)
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def join_replicas(device: torch.device, dp: int) -> Replicas | None:
    """Make `device` current, then (dp > 1) the job's dp x pp mesh, then warm the
    pipeline's group on it (`bind_device`); the replicas, or None for one. A collective:
    call on every rank with its own device.

    In that order because torch's `init_device_mesh` makes LOCAL_RANK's GPU current when
    no device is (a CUDA context on a GPU the plan may give another rank: a replica in
    slot k > 0 of a node, or a plan whose devices are not LOCAL_RANK's). The groups made
    are the ones the job uses: the mesh's pipeline group of each replica and `dp` group of
    each stage; with replicas, nothing runs on the world group, so NCCL never builds its
    communicator.
    """
    select_device(device)
    replicas = make_replicas(dp, device.type) if dp > 1 else None
    bind_device(device, replicas.pp_group if replicas is not None else None)
    return replicas
