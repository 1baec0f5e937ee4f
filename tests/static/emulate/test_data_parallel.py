"""The data-parallel reduction across nodes on toy pipelines: its time against the ring
formulas, its overlap with the last backward, and one node equal to one server; replicas
sharing a node reduce over their GPUs' links first (times worked out by hand)."""

from __future__ import annotations

import pytest

from mpress.hardware.cluster import Cluster, NetworkSpec, NodeReplicas, Sharding, replica_devices
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


# -- several replicas on one node: their GPUs' links first, then the NICs -------------------------
PER_LINK_GBPS, NVLINK_EFF, NVLINK_LATENCY_S = 25.0, 0.8, 1e-5  # 20 GB/s per link as achieved
PCIE_LATENCY_S = 2e-5


def node(twin_links: tuple[int, int]) -> Hardware:
    """Four toy GPUs: the plan's pair 0-1 and its twin pair 2-3 one link each; GPU 0 to its
    twin 2 and GPU 1 to its twin 3 over `twin_links` links (0: PCIe only, 12 GB/s)."""
    a, b = twin_links
    links = [[0, 1, a, 0], [1, 0, 0, b], [a, 0, 0, 1], [0, b, 1, 0]]
    return Hardware(name="toy", num_devices=4, compute_efficiency=1.0,
                    device=DeviceSpec(name="toy", memory_bytes=10**12, peak_flops={"fp32": 1e12}),
                    host_memory_bytes=10**12, pcie_h2d_gbps=16.0, pcie_d2h_gbps=12.0, pcie_efficiency=1.0,
                    nvlink_links=links, nvlink_gbps_per_link=PER_LINK_GBPS, nvlink_efficiency=NVLINK_EFF,
                    pcie_latency_s=PCIE_LATENCY_S, nvlink_latency_s=NVLINK_LATENCY_S)


def on_one_node(twin_links: tuple[int, int], sharding: str = "ddp", *, nodes: int = 1, nic_gbps: float = 5.0,
                nics: list[int] | None = None) -> DataParallel:
    """Two replicas on each of `nodes` toy nodes (the plan's GPUs 0-1, the twins 2-3)."""
    hw = node(twin_links)
    local = NodeReplicas(hw, replica_devices(hw, 2, 2))
    assert local.devices == ((0, 1), (2, 3))
    cluster = None
    if nodes > 1:
        network = NetworkSpec(hardware="toy", num_nics=4, nic_gbps=nic_gbps, nic_of_device=nics or [0, 1, 2, 3],
                              efficiency=1.0, hop_latency_s=0.0)
        cluster = Cluster(num_nodes=nodes, hardware=hw, network=network)
    return DataParallel(cluster=cluster, local=local, sharding=Sharding(sharding))


def test_twins_on_one_node_all_reduce_over_their_nvlink():
    """dp 2 on one node: each stage's buckets go once (2(2-1)/2 = 1 x b) over the ring of
    its GPU and its twin, at that pair's NVLink (GPU 0-2: two links, 40 GB/s; 1-3: one,
    20 GB/s), two ring steps of latency; no NIC."""
    b0, b1 = 4 * DDP_BUCKET_BYTES, 8 * DDP_BUCKET_BYTES  # 104857600 and 209715200 bytes
    stages = [layer("a", grads=b0, bwd=0.1)], [layer("b", grads=b1, bwd=0.1)]
    res = run(*stages, on_one_node((2, 1)))
    (_, s0, e0), = reductions(res, 0)
    (_, s1, e1), = reductions(res, 1)
    assert e0 - s0 == pytest.approx(2e-5 + 104857600 / 40e9)  # 0.00264144 s
    assert e1 - s1 == pytest.approx(2e-5 + 209715200 / 20e9)  # 0.01050576 s
    assert not any(c.startswith("nic:") for c in res.program.channels)
    assert res.program.samples_per_iteration == 2 * run(*stages, None).program.samples_per_iteration


def test_twins_without_nvlink_reduce_over_pcie():
    """GPU 1 and its twin 3 share no link: their ring runs at the slower PCIe direction
    (12 GB/s) with PCIe's latency per step."""
    b1 = 8 * DDP_BUCKET_BYTES
    res = run([layer("a", grads=0, bwd=0.1)], [layer("b", grads=b1, bwd=0.1)], on_one_node((2, 0)))
    (_, s1, e1), = reductions(res, 1)
    assert e1 - s1 == pytest.approx(2 * 2e-5 + 209715200 / 12e9)  # 0.017516266... s


def test_fsdp_twins_reduce_scatter_half_the_bytes_in_one_step():
    b1 = 3 * MB
    res = run([layer("a", grads=0, bwd=0.1)], [layer("b", grads=b1, bwd=0.1)], on_one_node((2, 1), "fsdp"))
    (_, rs0, rs1), (_, ag0, ag1) = reductions(res, 1)
    assert rs1 - rs0 == pytest.approx(1e-5 + 1.5e6 / 20e9)  # (2-1)/2 x 3 MB, one step
    assert ag1 - ag0 == pytest.approx(1e-5 + 1.5e6 / 20e9)  # the parameters, as large


@pytest.mark.parametrize("nics, nic_bytes", [([0, 1, 2, 3], 104857600), ([0, 1, 0, 1], 209715200)])
def test_two_nodes_of_twins_send_each_twins_half_over_the_nics(nics, nic_bytes):
    """dp 4 = 2 nodes x 2 replicas. After the twins' reduce-scatter each twin holds half
    of b = 209715200; the nodes all-reduce it: 2(2-1)/2 x b/2 = 104857600 bytes on each
    twin's NIC, at 5 GB/s 0.0209715 s, slower than the twins' link (0.0105058 s), so the
    bucket lasts as long as its NIC. Twins on one NIC (GPU 1 and 3 on NIC 1) put both
    halves on it: twice as long."""
    b1 = 8 * DDP_BUCKET_BYTES
    res = run([layer("a", grads=0, bwd=0.1)], [layer("b", grads=b1, bwd=0.1)],
              on_one_node((2, 1), nodes=2, nics=nics))
    (_, s1, e1), = reductions(res, 1)
    assert e1 - s1 == pytest.approx(nic_bytes / 5e9)
    twin_s = 2e-5 + 209715200 / 20e9
    fast = run([layer("a", grads=0, bwd=0.1)], [layer("b", grads=b1, bwd=0.1)],
               on_one_node((2, 1), nodes=2, nic_gbps=1000.0))
    (_, f0, f1), = reductions(fast, 1)
    assert f1 - f0 == pytest.approx(twin_s)  # with fast NICs, the twins' link is the slower step
