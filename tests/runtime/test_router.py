"""The saved-tensor router in one process: identities, techniques, bit-identical
gradients, and the memory manager's accounting of device-resident saved bytes."""

from __future__ import annotations

import pytest
import torch

from mpress.model_config import load_model_config
from mpress.models import build_stage, example_batch, lm_loss
from mpress.plan import StagePlan, TensorRule
from mpress.runtime.memory.host_pool import PinnedHostPool
from mpress.runtime.memory.manager import Category, MemoryManager
from mpress.runtime.router import SavedTensorRouter
from mpress.runtime.swap.engine import SwapEngine

CFG = load_model_config("gpt-tiny")
NUM_MB = 3




def run(rules: list[TensorRule] | None):
    """GPipe-style: every forward, then every backward. Returns losses, grads, and the
    manager's peak of device-resident saved bytes (None without a plan)."""
    torch.manual_seed(0)
    model = build_stage(CFG, 0, CFG.num_layers + 2, seed=5)
    batches = [example_batch(CFG, 2, seed=m) for m in range(NUM_MB)]
    if rules is None:
        outs = [lm_loss(model(x), y) for x, y in batches]
        for loss in outs:
            loss.backward()
        return [o.item() for o in outs], {n: p.grad.clone() for n, p in model.named_parameters()}, None, None
    manager = MemoryManager(torch.device("cpu"), rank=0)
    engine = SwapEngine(PinnedHostPool(64 << 20), manager, torch.device("cpu"), rank=0, stage=0)
    router = SavedTensorRouter(model, StagePlan(stage=0, device=0, first_layer=0, end_layer=CFG.num_layers + 2,
                                                rules=rules), engine, rank=0, example_args=(batches[0][0],),
                               manager=manager)
    outs = []
    for m, (x, y) in enumerate(batches):
        with router.microbatch(m):
            outs.append(lm_loss(model(x), y))
        engine.wait_idle(10.0)  # swap-outs done: the peak below is deterministic
    peak = manager.peak_device_bytes(Category.ACTIVATION)
    for m, loss in enumerate(outs):
        router.prefetch(m)
        loss.backward()
        router.finish(m)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    stats = engine.stats
    router.close()
    engine.close()
    return [o.item() for o in outs], grads, peak, stats


def test_techniques_give_identical_gradients_with_dropout():
    losses, grads, _, _ = run(None)
    for rules in ([], [TensorRule(tensor="*", technique="keep")], [TensorRule(tensor="layers.1.**", technique="host")],
                  [TensorRule(tensor="layers.0.**", technique="recompute"),
                   TensorRule(tensor="layers.2.**", technique="host", microbatches="0,2"),
                   TensorRule(tensor="layers.2.**", technique="recompute", microbatches="1")],
                  [TensorRule(tensor="*", technique="host")]):
        l2, g2, _, _ = run(rules)
        assert l2 == losses
        for name, g in grads.items():
            assert torch.equal(g, g2[name]), (rules, name)


def test_swapping_lowers_the_device_resident_peak_by_the_swapped_bytes():
    # an explicit keep rule routes (and accounts) every saved tensor; a plan with no
    # activation rule installs no hooks at all
    _, _, keep_peak, _ = run([TensorRule(tensor="*", technique="keep")])
    _, _, swap_peak, stats = run([TensorRule(tensor="layers.1.**", technique="host")])
    # after each forward's swap-outs completed, all of layers.1's saved bytes are on host
    assert stats.bytes_out > 0
    assert keep_peak - swap_peak == stats.bytes_out


def test_identities_follow_the_profilers_naming():
    model = build_stage(CFG, 0, CFG.num_layers + 2, seed=5)
    rule = TensorRule(tensor="layers.0.attn.**", technique="keep")
    x, y = example_batch(CFG, 2, seed=0)
    router = SavedTensorRouter(model, StagePlan(stage=0, device=0, first_layer=0, end_layer=6, rules=[rule]),
                               None, rank=0, example_args=(x,))
    routed: list[str] = []
    name = router.namer.name

    def spy(t):  # what the router names each saved tensor as
        found = name(t)
        if found is not None:
            routed.append(found.id)
        return found

    router.namer.name = spy
    with router.microbatch(0):
        lm_loss(model(x), y)
    from mpress.static.analytic import layer_saved_tensors
    expected = [t.id for t in layer_saved_tensors(CFG, 1, 2)]  # layer 1 = layers.0
    # (the block itself saves nothing: its tensors all belong to its submodules)
    assert [t for t in routed if t.startswith("layers.0.")] == expected
    assert router.rules.layers[1].saved == tuple(expected)  # what the router's inspection saw
    router.close()


def _cuda_run(host: bool):
    """Forwards of 4 microbatches, then backwards, on the GPU; returns grads and the
    peak allocated bytes during the forwards."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_stage(CFG, 0, CFG.num_layers + 2, seed=5, device=device)
    batches = [tuple(t.to(device) for t in example_batch(CFG, 8, seed=m)) for m in range(4)]
    rules = [TensorRule(tensor="layers.*.**", technique="host" if host else "keep")]
    manager = MemoryManager(device, rank=0)
    pool = PinnedHostPool(256 << 20)
    engine = SwapEngine(pool, manager, device, rank=0, stage=0)
    router = SavedTensorRouter(model, StagePlan(stage=0, device=0, first_layer=0, end_layer=CFG.num_layers + 2,
                                                rules=rules), engine, rank=0, example_args=(batches[0][0],),
                               manager=manager)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    outs = []
    for m, (x, y) in enumerate(batches):
        with router.microbatch(m):
            outs.append(lm_loss(model(x), y))
        engine.wait_idle(30.0)
    peak = torch.cuda.max_memory_allocated()
    for m, loss in enumerate(outs):
        router.prefetch(m)
        loss.backward()
        router.finish(m)
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    router.close()
    engine.close()
    return grads, peak, engine.stats, pool


@pytest.mark.cuda
def test_cuda_host_swap_is_identical_and_lowers_the_peak():
    keep, keep_peak, _, _ = _cuda_run(host=False)
    swap, swap_peak, stats, pool = _cuda_run(host=True)
    for name, g in keep.items():
        assert torch.equal(g, swap[name]), name
    assert stats.bytes_out > 0 and swap_peak < keep_peak
    assert pool.buffer.is_pinned()  # one pinned allocation, no pinning per tensor


def _runtime(budget_bytes: int):
    from mpress.plan import Plan
    from mpress.runtime.stage import StageRuntime

    model = build_stage(CFG, 0, CFG.num_layers + 2, seed=5)
    stage = StagePlan(stage=0, device=0, first_layer=0, end_layer=CFG.num_layers + 2,
                      rules=[TensorRule(tensor="layers.*.**", technique="host")], pinned_host_bytes=32 << 20)
    plan = Plan(strategy="test", model=CFG.name, model_fingerprint=CFG.fingerprint(), profile_fingerprint="-",
                hardware="cpu-local", hardware_fingerprint="-", num_devices=1, device_memory_bytes=budget_bytes,
                schedule="gpipe", num_stages=1, num_ranks=1, num_microbatches=3, microbatch_size=2,
                stage_to_device=[0], stages=[stage], fits=True)
    return model, StageRuntime(model, plan, 0, torch.device("cpu"), rank=0,
                               example_args=(example_batch(CFG, 2, seed=0)[0],))


@pytest.mark.parametrize("budget, early", [(1 << 40, True), (1, False)])
def test_capacity_policy_prefetches_as_early_as_the_budget_allows(budget, early):
    # GPipe order F0 F1 F2 B0 B1 B2 with lead 1: without room, microbatch 0 comes back only
    # when B0 is the next action (after F2); with room, right after its own forward.
    model, rt = _runtime(budget)
    for m in range(3):
        x, y = example_batch(CFG, 2, seed=m)
        with rt.router.microbatch(m):
            lm_loss(model(x), y)
        rt.after_compute()
        if m == 0:
            assert (rt.router.pending_bytes(0) == 0) is early
    assert rt.router.pending_bytes(0) == 0  # B0 is next: always on its way back
    rt.close()


def test_prefetch_before_the_forward_does_not_disable_it_and_finish_releases_copies():
    # a lead window can reach a backward whose forward has not run yet
    model, rt = _runtime(1 << 40)
    rt.router.prefetch(1)
    x, y = example_batch(CFG, 2, seed=1)
    with rt.router.microbatch(1):
        loss = lm_loss(model(x), y)
    assert rt.router.pending_bytes(1) > 0  # its swap-outs still count as waiting to come back
    rt.router.prefetch(1)
    assert rt.router.pending_bytes(1) == 0
    loss.backward()
    rt.router.finish(1)
    rt.engine.wait_idle(10.0)
    assert rt.manager.device_bytes(Category.ACTIVATION) == 0  # nothing of microbatch 1 stays
    rt.close()


def test_prefetch_brings_tensors_back_in_the_order_the_backward_needs_them():
    """The in worker copies in request order; the backward needs the last-saved tensor
    first, so a microbatch's swap-ins are requested in reverse forward order."""
    order: list[tuple[str, str]] = []
    model = build_stage(CFG, 0, CFG.num_layers + 2, seed=5)
    manager = MemoryManager(torch.device("cpu"), rank=0)
    engine = SwapEngine(PinnedHostPool(64 << 20), manager, torch.device("cpu"), rank=0, stage=0,
                        fault=lambda key, direction: order.append((direction, key.tensor)))
    router = SavedTensorRouter(model, StagePlan(stage=0, device=0, first_layer=0, end_layer=CFG.num_layers + 2,
                                                rules=[TensorRule(tensor="layers.*.**", technique="host")]),
                               engine, rank=0, example_args=(example_batch(CFG, 2, seed=0)[0],), manager=manager)
    x, y = example_batch(CFG, 2, seed=0)
    with router.microbatch(0):
        loss = lm_loss(model(x), y)
    engine.wait_idle(10.0)
    router.prefetch(0)
    engine.wait_idle(10.0)
    outs = [t for d, t in order if d == "out"]
    ins = [t for d, t in order if d == "in"]
    assert len(outs) > 4 and ins == outs[::-1]
    loss.backward()
    router.finish(0)
    router.close()
    engine.close()
