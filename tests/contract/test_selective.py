"""Op-level recompute's rules (`mpress.contract.selective`) on layers the reference models do not
have: in-place operators (ReLU(inplace=True), CPU's unfused dropout), SDPA (a random
operator that is a matrix product), a forward that leaves its trace. Each choice the
rules allow runs `torch.equal` to the plain layer, random streams included."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from mpress.errors import PlanError
from mpress.config.model_config import load_model_config
from mpress.models import build_stage
from mpress.contract.selective import cached_ops, closed_set, recompute_menu, run_recomputed, trace_layer_ops
from mpress.static.profile.memory_probe import probe


class InPlace(nn.Module):
    """LayerNorm, Linear, ReLU in place on the Linear's output, nn.Dropout (on CPU:
    bernoulli_ then div_ in place), Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1 = nn.LayerNorm(16), nn.Linear(16, 32)
        self.act, self.drop, self.fc2 = nn.ReLU(inplace=True), nn.Dropout(0.25), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


class Sdpa(nn.Module):
    """Attention through scaled_dot_product_attention, then native dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.proj = nn.LayerNorm(16), nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).view(x.shape[0], x.shape[1], 3, 2, 8).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)
        out = self.proj(a.transpose(1, 2).reshape(x.shape))
        return x + torch.native_dropout(out, 0.2, True)[0]


def _grads(layer: nn.Module, x: torch.Tensor, run) -> tuple[torch.Tensor, list[torch.Tensor]]:
    layer.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_(True)
    torch.manual_seed(11)
    out = run(layer, xi)
    out.pow(2).sum().backward()
    return out.detach(), [xi.grad] + [p.grad for p in layer.parameters()]


def _closed_sets(ops):
    """The menu's choices and every closed set of one or two producers' tensors."""
    seeds = [frozenset({p}) for p in ops.recomputable()]
    sets = {closed_set(ops, a | b) for a, b in itertools.combinations_with_replacement(seeds, 2)}
    return [s for s in {*sets, *recompute_menu(ops)} if s]


@pytest.mark.parametrize("make", [InPlace, Sdpa])
def test_every_closed_choice_runs_equal_to_the_plain_layer(make):
    torch.manual_seed(0)
    layer, x = make().train(), torch.randn(2, 6, 16)
    ops = trace_layer_ops(layer, (x,))
    plain_out, plain_grads = _grads(layer, x, lambda m, xi: m(xi))
    for chosen in _closed_sets(ops):
        cached = cached_ops(ops, chosen)
        assert closed_set(ops, chosen) == chosen
        assert all(o <= ops.last_op and ops.ops[o].cacheable for o in cached)
        out, grads = _grads(layer, x, lambda m, xi, c=cached: run_recomputed(m, ops, c, xi))
        assert torch.equal(out, plain_out), sorted(chosen)
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads)), sorted(chosen)


@pytest.mark.parametrize("make", [InPlace, Sdpa])
def test_probing_a_layer_with_in_place_or_random_products_measures_every_choice(make):
    """The probe runs each choice's backward (a cached tensor changed in place made it
    raise), and every choice it offers is closed, so the runtime accepts it."""
    torch.manual_seed(0)
    layer, x = make().train(), torch.randn(2, 6, 16, requires_grad=True)
    found = probe(layer, (x,))
    for tensors, memory in found.options:
        assert closed_set(found.ops, tensors) == tensors
        assert memory.kept_bytes < found.plain.kept_bytes


def test_a_forward_that_leaves_its_trace_is_refused_not_miscomputed():
    """Autocast inserts casts: the operators no longer line up with the trace's ordinals,
    so the policy refuses to cache by ordinal rather than caching the wrong outputs."""
    cfg = load_model_config("gpt-tiny")
    block = build_stage(cfg, 1, 2, seed=0).train()
    x = torch.randn(2, cfg.seq_len, cfg.hidden_size, requires_grad=True)
    ops = trace_layer_ops(block, (x,))
    chosen = recompute_menu(ops)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(PlanError, match="as its operator"):
        run_recomputed(block, ops, cached_ops(ops, chosen), x)


def test_a_cached_layer_output_counts_as_kept_until_the_backward():
    """A layer whose last operator is a cached matrix product keeps its output alive (the
    cache holds it): the probe says the layer saves its output, as the stage's memory
    walk must know to not free it at the next layer."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16)).train()
    x = torch.randn(4, 16, requires_grad=True)
    found = probe(layer, (x,))
    assert found.options
    for tensors, memory in found.options:
        if found.ops.output_op in cached_ops(found.ops, tensors):
            assert memory.saves_output


class _Op:
    """An operator as the policy sees it: only its name (`str(func)`) matters."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


def test_the_policy_answers_the_recompute_as_it_answered_the_forward(monkeypatch):
    """torch <= 2.11 (the GPU machines' torch) asks the policy again for every operator of
    the recompute, with `is_recompute=True` and the operators replayed from the first;
    each pass must count on its own and get the forward's answers (one shared count made
    the first backward stop with "ran ... as its operator N")."""
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    import mpress.contract.selective as selective

    monkeypatch.setattr(selective, "create_selective_checkpoint_contexts", lambda policy: policy)
    torch.manual_seed(0)
    layer, x = InPlace().train(), torch.randn(2, 6, 16)
    ops = trace_layer_ops(layer, (x,))
    cached = cached_ops(ops, recompute_menu(ops)[0])
    assert cached and len(cached) < len(ops.names)
    policy = selective.selective_contexts(cached, ops.names)
    expected = [CheckpointPolicy.MUST_SAVE if o in cached else CheckpointPolicy.PREFER_RECOMPUTE
                for o in range(len(ops.names))]
    forward = [policy(SelectiveCheckpointContext(is_recompute=False), _Op(n)) for n in ops.names]
    recompute = [policy(SelectiveCheckpointContext(is_recompute=True), _Op(n)) for n in ops.names]
    assert forward == expected
    assert recompute == expected
