"""Op-level recompute in profiles: the three profilers agree on which operator produced
each saved tensor and on the choices they offer, and the choices of a billion-scale
block free what the cheap operators saved without replaying a matrix product."""

from __future__ import annotations

import pytest

from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.contract.selective import OpCost
from mpress.static.profile.analytic import analytic_profile
from mpress.static.profile.fake_profile import fake_model_profile
from mpress.static.profile.measured import measure_model_profile
from mpress.static.profile.recompute_options import op_time_s

CPU = load_hardware("cpu-local")
V100 = load_hardware("dgx1-v100")


def _ops(profile):
    return [[(t.id, t.op, t.op_index, t.op_flops, t.op_bytes) for t in layer.saved] for layer in profile.layers]


def _choices(profile):
    """Each layer's choices: tensors, replay cost, and the bytes each keeps less than the
    plain layer (the fake device keeps BERT's head statistics in another dtype than CPU:
    both of its memories differ from the others' by the same bytes)."""
    return [[(o.tensors, o.flops, o.bytes_moved, layer.memory.kept_bytes - o.memory.kept_bytes)
             for o in layer.recompute_options] for layer in profile.layers]


@pytest.mark.parametrize("name", ["gpt-tiny", "bert-tiny"])
def test_analytic_fake_and_measured_profiles_agree_on_producers_and_choices(name):
    cfg = load_model_config(name)
    analytic = analytic_profile(cfg, CPU, 2)
    fake = fake_model_profile(cfg, 2, CPU)
    measured = measure_model_profile(cfg, 2, warmup=0, iters=1)
    assert _ops(analytic) == _ops(fake) == _ops(measured)
    assert any(t.op_index >= 0 for layer in analytic.layers for t in layer.saved)
    assert _choices(analytic) == _choices(fake) == _choices(measured)
    assert [[o.memory for o in x.recompute_options] for x in analytic.layers] == \
        [[o.memory for o in x.recompute_options] for x in measured.layers]
    assert any(layer.recompute_options for layer in analytic.layers)
    # analytic and fake price a replay with the same hardware model
    assert [[o.time_s for o in x.recompute_options] for x in analytic.layers] == \
        [[o.time_s for o in x.recompute_options] for x in fake.layers]


def test_a_gpt_20b_block_frees_cheap_tensors_without_replaying_a_projection():
    """Saved tensors of norms, softmax, activations and dropout are recomputed from the
    cached projections; only the attention scores' product (2 x head size FLOPs per
    element it would hold) is replayed: most of the block's memory freed for a few percent
    of its FLOPs and a replay far shorter than its forward; a costlier choice frees more;
    all keep more than the whole layer recomputed."""
    cfg = load_model_config("gpt-20.4b")
    block = analytic_profile(cfg, V100, 2).layers[1]
    options = block.recompute_options
    assert options
    b, t, h = 2, cfg.seq_len, cfg.hidden_size
    scores = 2 * b * t * t * h  # q @ k^T over all heads: the one product replayed
    assert all(o.flops == scores for o in options)
    kept = [o.memory.kept_bytes for o in options]
    assert kept == sorted(kept, reverse=True) and kept[-1] < 0.35 * block.memory.kept_bytes
    assert all(block.recompute_memory.kept_bytes < k < block.memory.kept_bytes for k in kept)
    assert all(0 < o.time_s < 0.15 * block.forward_time_s for o in options)
    by_op = {t.op for p in options[-1].tensors for t in [block.saved[p]]}
    assert "aten.addmm.default" not in by_op and "aten.native_dropout.default" in by_op


def test_an_operator_takes_the_longer_of_its_compute_and_its_memory_traffic():
    matmul = OpCost(name="aten.mm.default", flops=2e12, bytes_moved=10**6, random=False)
    norm = OpCost(name="aten.native_layer_norm.default", flops=0.0, bytes_moved=9 * 10**9, random=False)
    rate = V100.peak_flops("fp16") * V100.compute_efficiency
    assert op_time_s(matmul, V100, "fp16") == pytest.approx(2e12 / rate)
    assert op_time_s(norm, V100, "fp16") == pytest.approx(9e9 / (V100.device.memory_gbps * 1e9))
