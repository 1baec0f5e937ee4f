"""Data parallelism on preset pipelines: one node is one server, exactly; DDP's buckets
copy the gradients; FSDP shards the optimizer states and master weights by the node
count and holds its reduce-scatter buffers."""

from __future__ import annotations

import pytest

from mpress.hardware.cluster import Sharding, make_cluster
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.static.memory.data_parallel import DataParallel
from mpress.static.plan.evaluate import evaluate, setup_pipeline

HW = load_hardware("dgx-a100")
MODEL = load_model_config("gpt-medium")


def setup(nodes: int | None, sharding: str = "ddp"):
    dp = None if nodes is None else DataParallel(cluster=make_cluster(HW, nodes), sharding=Sharding(sharding))
    return setup_pipeline(MODEL, HW, schedule="1f1b", num_stages=4, microbatch_size=2, num_microbatches=8,
                          data_parallel=dp)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_one_node_is_the_single_server_emulation(sharding):
    alone, one = evaluate(setup(None)), evaluate(setup(1, sharding))
    assert one.program == alone.program
    assert one.result.summary() == alone.result.summary()
    assert one.result.task_end_s == alone.result.task_end_s


def test_ddp_keeps_every_state_on_every_replica_and_its_buckets_copy_the_gradients():
    """mpress's DDP keeps torch's default gradient_as_bucket_view=False: its buckets are a
    second copy of the stage's gradients, held from the start."""
    alone, four = setup(None), setup(4)
    for full, replica, c in zip(alone.memory, four.memory, alone.costs):
        assert replica.model_state_bytes == full.model_state_bytes
        assert replica.buffer_bytes - full.buffer_bytes == sum(x.grad_bytes for x in c.layers) > 0
    added = [r - f for r, f in zip(evaluate(four).program.static_bytes, evaluate(alone).program.static_bytes)]
    assert added == [c.grad_bytes for c in alone.costs]


@pytest.mark.parametrize("nodes", [2, 4, 8])
def test_fsdp_shards_optimizer_states_and_master_weights_by_the_node_count(nodes):
    alone, sharded = setup(None), setup(nodes, "fsdp")
    for full, part, c in zip(alone.memory, sharded.memory, alone.costs):
        layers = len(c.layers)  # each layer's shard is rounded up to a whole byte
        assert full.optim_bytes > 0 and full.master_bytes > 0
        assert 0 <= part.optim_bytes - full.optim_bytes / nodes < layers
        assert 0 <= part.master_bytes - full.master_bytes / nodes < layers
        assert (part.param_bytes, part.grad_bytes) == (full.param_bytes, full.grad_bytes)  # unsharded in use
        largest_grads = max(x.grad_bytes for x in c.layers)
        # one layer's reduce-scatter input (its gradients) and output (their shard)
        assert part.buffer_bytes - full.buffer_bytes == largest_grads + -(-largest_grads // nodes)
    full_static = evaluate(alone).program.static_bytes
    part_static = evaluate(sharded).program.static_bytes
    for r, (f, p) in enumerate(zip(full_static, part_static)):
        m, s = alone.memory[r], sharded.memory[r]
        assert f - p == (m.optim_bytes + m.master_bytes - s.optim_bytes - s.master_bytes
                         - (s.buffer_bytes - m.buffer_bytes))
        assert p < f


def test_fsdp_steps_only_its_shard():
    alone, sharded = evaluate(setup(None)), evaluate(setup(4, "fsdp"))
    step = [t.compute_s for t in alone.program.ranks[0] if t.action.is_compute][-1]
    shard = [t.compute_s for t in sharded.program.ranks[0] if t.action.is_compute][-1]
    assert shard == pytest.approx(step / 4, rel=1e-3)
