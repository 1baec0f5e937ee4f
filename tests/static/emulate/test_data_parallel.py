"""The data-parallel reduction across nodes on toy pipelines: its time against the ring
formulas, its overlap with the last backward, and one node equal to one server."""

from __future__ import annotations

import pytest

from mpress.hardware.cluster import Cluster, NetworkSpec, Sharding
from mpress.hardware.server import DeviceSpec, Hardware
from mpress.config.model_config import load_model_config
from mpress.static.emulate.dp_reduction import exposed_reduction_s, is_reduction
from mpress.static.memory.data_parallel import DDP_BUCKET_BYTES, DataParallel
from mpress.static.plan.evaluate import evaluate, setup_pipeline
from mpress.static.profile.profile import LayerMemory, LayerProfile, Profile

TINY = load_model_config("gpt-tiny")  # only its fingerprint ties the toy profile to a model
NIC_GBPS = 10.0
MB = 10**6


def layer(name: str, *, grads: int, bwd: float, fwd: float = 0.01) -> LayerProfile:
    """A layer with `grads` bytes of parameters (and as many of gradients) that keeps and
    hands on 1 MB."""
    memory = LayerMemory(kept_bytes=MB, forward_peak_bytes=MB, backward_peak_bytes=MB, input_grad_bytes=MB,
                         output_bytes=MB)
    return LayerProfile(name=name, forward_flops=1e9, backward_flops=2e9, forward_time_s=fwd, backward_time_s=bwd,
                        param_bytes=grads, grad_bytes=grads, output_bytes=MB, memory=memory)


HW = Hardware(name="toy", num_devices=2, compute_efficiency=1.0,
              device=DeviceSpec(name="toy", memory_bytes=10**12, peak_flops={"fp32": 1e12}),
              host_memory_bytes=10**12, pcie_h2d_gbps=100.0, pcie_d2h_gbps=100.0, pcie_efficiency=1.0,
              nvlink_links=[[0, 1], [1, 0]], nvlink_gbps_per_link=100.0, nvlink_efficiency=1.0,
              pcie_latency_s=0.0, nvlink_latency_s=0.0)


def data_parallel(nodes: int, sharding: str = "ddp", *, nics: list[int] | None = None) -> DataParallel:
    """`nodes` x the toy server, one 10 GB/s NIC per GPU, no latency, full efficiency."""
    nic_of_device = nics or [0, 1]
    network = NetworkSpec(hardware="toy", num_nics=max(nic_of_device) + 1, nic_gbps=NIC_GBPS,
                          nic_of_device=nic_of_device, efficiency=1.0, hop_latency_s=0.0)
    return DataParallel(cluster=Cluster(num_nodes=nodes, hardware=HW, network=network), sharding=Sharding(sharding))


def run(stage0: list[LayerProfile], stage1: list[LayerProfile], dp: DataParallel | None):
    layers = stage0 + stage1
    profile = Profile(model="gpt-tiny", model_fingerprint=TINY.fingerprint(), source="analytic", device="toy",
                      dtype="fp32", microbatch_size=1, layers=layers)
    setup = setup_pipeline(TINY, HW, schedule="1f1b", num_stages=2, microbatch_size=1, num_microbatches=4,
                           profile=profile, ranges=[(0, len(stage0)), (len(stage0), len(layers))], data_parallel=dp)
    return evaluate(setup).result


def reductions(result, rank: int) -> list[tuple[str, float, float]]:
    """(tensor, start, end) of the rank's reduction tasks."""
    return [(t.action.tensor, result.task_start_s[rank][i], result.task_end_s[rank][i])
            for i, t in enumerate(result.program.ranks[rank]) if is_reduction(t)]


@pytest.mark.parametrize("nodes", [2, 3, 4, 8])
def test_an_all_reduce_alone_takes_the_ring_formula(nodes):
    grads = 8 * DDP_BUCKET_BYTES  # whole buckets: all of it starts when the stage's one layer ends
    res = run([layer("a", grads=0, bwd=0.1)], [layer("b", grads=grads, bwd=0.1)], data_parallel(nodes))
    (tensor, start, end), = reductions(res, 1)
    assert tensor == "1:optim:dp-reduce:b"
    byte_s = 1 / (NIC_GBPS * 1e9)  # the wire bytes are rounded up to a whole byte
    assert end - start == pytest.approx(2 * (nodes - 1) / nodes * grads * byte_s, abs=byte_s)
    assert reductions(res, 0) == []  # a stage without gradients reduces nothing


@pytest.mark.parametrize("nodes", [2, 4])
def test_fsdp_reduce_scatters_then_all_gathers_the_parameters(nodes):
    grads = 3 * MB
    res = run([layer("a", grads=0, bwd=0.1)], [layer("b", grads=grads, bwd=0.1)], data_parallel(nodes, "fsdp"))
    (rs, rs_start, rs_end), (ag, ag_start, ag_end) = reductions(res, 1)
    ring = (nodes - 1) / nodes * grads / (NIC_GBPS * 1e9)
    assert (rs, ag) == ("1:optim:dp-reduce:b", "1:optim:dp-gather")
    assert rs_end - rs_start == pytest.approx(ring, rel=1e-9)
    assert ag_end - ag_start == pytest.approx(ring, rel=1e-9)  # parameters as large as gradients
    tasks = res.program.ranks[1]
    step = max(i for i, t in enumerate(tasks) if t.action.is_compute)
    assert str(tasks[step].action) == "1OPT"
    assert ag_start == res.task_end_s[1][step]  # the gather follows the sharded step


def test_stages_sharing_a_nic_share_its_bandwidth():
    grads = 80 * DDP_BUCKET_BYTES
    layers = [layer("a", grads=grads, bwd=0.1)], [layer("b", grads=grads, bwd=0.1)]
    alone = run(*layers, data_parallel(2, nics=[0, 1]))
    shared = run(*layers, data_parallel(2, nics=[0, 0]))
    one = grads / (NIC_GBPS * 1e9)  # 2(n-1)/n = 1 for two nodes
    (_, start0, end0), = reductions(shared, 0)
    (_, start1, end1), = reductions(shared, 1)
    (_, a0, b0), = reductions(alone, 0)
    assert b0 - a0 == pytest.approx(one)
    assert start1 < start0 < end1  # stage 1 finishes its backwards first, stage 0 joins it on the NIC
    assert end0 - start1 == pytest.approx(2 * one)  # together they move twice the bytes at the NIC's rate


def test_the_reduction_hides_behind_a_long_enough_backward():
    grads = 80 * DDP_BUCKET_BYTES  # 2.1 GB: 0.21 s at 10 GB/s on two nodes
    stage0 = [layer("a", grads=0, bwd=0.3)]
    stage1 = [layer("b0", grads=0, bwd=0.5), layer("b1", grads=grads, bwd=0.1)]
    one_server = run(stage0, stage1, None)
    res = run(stage0, stage1, data_parallel(2))
    (tensor, start, end), = reductions(res, 1)
    assert tensor == "1:optim:dp-reduce:b1"  # issued when b1's backward ends, before b0's runs
    assert end - start == pytest.approx(grads / (NIC_GBPS * 1e9))
    assert exposed_reduction_s(res) == 0.0
    assert res.iteration_s == one_server.iteration_s
    assert res.samples_per_s == pytest.approx(2 * one_server.samples_per_s)


def test_the_reduction_is_exposed_behind_a_short_backward():
    grads = 80 * DDP_BUCKET_BYTES
    reduce_s = grads / (NIC_GBPS * 1e9)
    stage0 = [layer("a", grads=0, bwd=0.01)]
    stage1 = [layer("b0", grads=0, bwd=0.05), layer("b1", grads=grads, bwd=0.1)]
    one_server = run(stage0, stage1, None)
    res = run(stage0, stage1, data_parallel(2))
    assert exposed_reduction_s(res) == pytest.approx(reduce_s - 0.05)  # the step waits for what b0 did not hide
    assert res.iteration_s > one_server.iteration_s
    assert res.stall_s_by_cost.get("dp-reduce", 0.0) == pytest.approx(reduce_s - 0.05)


def test_buckets_close_in_reverse_layer_order():
    """Gradients of 1.5 buckets per layer: b2 closes one bucket, b1 two (1.5 + 1.5 = 3), the
    first layer the half left."""
    per_layer = DDP_BUCKET_BYTES * 3 // 2
    stage1 = [layer(f"b{j}", grads=per_layer, bwd=1.0) for j in range(3)]
    res = run([layer("a", grads=0, bwd=0.1)], stage1, data_parallel(2))
    spans = reductions(res, 1)
    assert [name for name, _s, _e in spans] == ["1:optim:dp-reduce:b2", "1:optim:dp-reduce:b1",
                                                "1:optim:dp-reduce:b0"]
    sizes = [(end - start) * NIC_GBPS * 1e9 for _n, start, end in spans]
    assert sizes == pytest.approx([DDP_BUCKET_BYTES, 2 * DDP_BUCKET_BYTES, 3 * per_layer - 3 * DDP_BUCKET_BYTES])
