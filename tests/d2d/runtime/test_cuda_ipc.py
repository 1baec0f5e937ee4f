"""CUDA IPC across processes: an exporter rank swaps a tensor out to importer ranks'
peer pools and back (cuda-marked: skipped where no GPU is present)."""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mpress.d2d.runtime.peer_pool import PeerPools, setup_peer_pools
from mpress.d2d.runtime.peer_store import PeerStore
from mpress.d2d.runtime.pool_layout import plan_quotas
from mpress.d2d.runtime.stripe_table import StripeState
from mpress.runtime.memory.manager import MemoryManager
from mpress.runtime.swap.engine import SwapEngine
from tests.support.keys import key
from tests.support.peers import MiB, find, round_up
from tests.support.plans import d2d_plan
from tests.support.tensors import random_tensor


def _cuda_worker(rank: int, world: int, init: str, out: str, stage_to_device: list[int],
                 weights: dict[int, float], nbytes: int) -> None:
    """Rank 0 runs stage 0, the exporter; ranks 1.. run the importer stages. Plan device d
    runs on GPU d % device_count, so one GPU can host both ends of the IPC path."""
    device = torch.device("cuda", stage_to_device[rank] % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    pool_bytes = 2 * nbytes
    plan = d2d_plan(stage_to_device, stripes={0: weights}, num_ranks=world,
                    pools={s: pool_bytes for s in range(1, world)})
    pools = setup_peer_pools(plan, [rank], device)
    result: dict = {"device": stage_to_device[rank]}
    if rank == 0:
        result.update(_export(pools, device, weights, nbytes))
    else:
        box = [None]
        dist.barrier()  # the exporter's swap-out completed
        dist.broadcast_object_list(box, src=0)
        entry, expected = box[0]
        my_device = stage_to_device[rank]
        result["usage"] = pools.pool_usage()[my_device]
        result["allocated"] = torch.cuda.memory_allocated(device)
        quota = next(q for q in plan_quotas(plan)[my_device] if q.stage == 0)
        home = pools._local_buffers[my_device]  # the importer's own pool (no public accessor)
        result["holds"] = all(
            torch.equal(home[quota.offset_bytes + s.block.offset_bytes:][:s.nbytes].cpu(),
                        expected[s.tensor_offset_bytes:s.tensor_offset_bytes + s.nbytes])
            for s in entry.stripes if s.peer == my_device)
        dist.barrier()  # importers have looked
    gc.collect()
    if rank == 0:
        pools.close()  # the exporter unmaps before the importers free their pools
    dist.barrier()
    if rank != 0:
        pools.close()
    dist.barrier()
    dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"{rank}.pt"))


def _export(pools: PeerPools, device: torch.device, weights: dict[int, float], nbytes: int) -> dict:
    manager = MemoryManager(device, rank=0)
    store = PeerStore(pools, 0, device, tuple(weights.items()))
    with SwapEngine(store, manager, device, rank=0, stage=0, timeout_s=60) as engine:
        tensor = random_tensor(torch.float32, (nbytes // 4,), device=device)
        expected = tensor.cpu().view(torch.uint8)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        handle = engine.swap_out(key("x#0"), tensor)
        del tensor
        engine.wait_idle()
        after_out = torch.cuda.memory_allocated(device)
        entry = find(store, str(key("x#0")))
        peer_bytes = {p: manager.peer_bytes(p) for p in weights}
        dist.barrier()
        dist.broadcast_object_list([(entry, expected)], src=0)
        dist.barrier()  # importers have looked
        back = engine.fetch(handle)
        torch.cuda.synchronize(device)
        after_in = torch.cuda.memory_allocated(device)
        identical = torch.equal(back.cpu().view(torch.uint8), expected)
        del back, handle
    return {"before": before, "after_out": after_out, "after_in": after_in, "identical": identical,
            "stripes": [(s.peer, s.nbytes) for s in entry.stripes], "peer_bytes": peer_bytes,
            "state": entry.state}


def run_cuda_job(tmp_path: Path, stage_to_device: list[int], weights: dict[int, float],
                 nbytes: int) -> list[dict]:
    world = len(stage_to_device)
    mp.start_processes(_cuda_worker, args=(world, str(tmp_path / "init"), str(tmp_path), stage_to_device,
                                           weights, nbytes), nprocs=world, join=True, start_method="spawn")
    return [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(world)]


def check_cuda_job(results: list[dict], weights: dict[int, float], nbytes: int) -> None:
    exporter, importers = results[0], results[1:]
    assert exporter["identical"]
    assert exporter["state"] is StripeState.ON_PEERS
    # the exporter's device memory fell by the tensor while it was on the peers
    assert exporter["after_out"] <= exporter["before"] - nbytes
    assert exporter["after_in"] >= exporter["after_out"] + nbytes
    stripes = dict(exporter["stripes"])
    assert sum(stripes.values()) == nbytes and set(stripes) == set(weights)
    assert exporter["peer_bytes"] == stripes
    for imp in importers:  # each importer's pool held its stripe
        assert imp["usage"]["in_use_bytes"] == round_up(stripes[imp["device"]])
        assert imp["allocated"] >= imp["usage"]["capacity_bytes"]
        assert imp["holds"]


@pytest.mark.cuda
def test_cuda_ipc_two_processes_on_one_gpu(tmp_path):
    # rank 0: stage 0 on plan device 1, the exporter; rank 1: stage 1 on plan device 0,
    # the importer. With one GPU both run on cuda:0 and the pool goes through CUDA IPC.
    nbytes = 16 * MiB
    results = run_cuda_job(tmp_path, [1, 0], {0: 1.0}, nbytes)
    check_cuda_job(results, {0: 1.0}, nbytes)


@pytest.mark.cuda
def test_cuda_stripes_go_over_peer_links(tmp_path):
    # the exporter (plan device 2) stripes 3:1 to devices 0 and 1, each a process of its
    # own; with two GPUs the exporter shares GPU 0 and only the stripe to 1 crosses a link
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("needs two GPUs")
    exporter_gpu = 2 % n
    for peer in (0, 1):
        if peer != exporter_gpu and not torch.cuda.can_device_access_peer(exporter_gpu, peer):
            pytest.skip(f"GPU {exporter_gpu} has no peer access to GPU {peer}")
    nbytes = 64 * MiB
    weights = {0: 0.75, 1: 0.25}
    results = run_cuda_job(tmp_path, [2, 0, 1], weights, nbytes)
    check_cuda_job(results, weights, nbytes)
    assert dict(results[0]["stripes"]) == {0: 48 * MiB, 1: 16 * MiB}
