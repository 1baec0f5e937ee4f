"""Which parameters take weight decay (pure): the default categories on the GPT
reference model's stages, globs, tied copies, and the groups torch's optimizers get."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpress.config.model_config import load_model_config
from mpress.models import build_stage
from mpress.runtime.param_groups import (
    DEFAULT_NO_DECAY,
    build_optimizer,
    no_decay_names,
    param_groups,
)


def gpt_stages() -> list[nn.Module]:
    cfg = load_model_config("gpt-tiny")  # 6 layers: embed, layers.0-3, head
    return [build_stage(cfg, 0, 3, seed=0, device=torch.device("cpu")),
            build_stage(cfg, 3, 6, seed=0, device=torch.device("cpu"))]


def all_names(stages: list[nn.Module]) -> list[str]:
    return [n for m in stages for n, _p in m.named_parameters()]


def test_default_exempts_biases_norm_weights_and_embeddings_only():
    stages = gpt_stages()
    exempt = no_decay_names(stages, DEFAULT_NO_DECAY)
    names = all_names(stages)
    assert {"embed.tok.weight", "embed.pos.weight", "layers.0.ln1.weight", "layers.0.ln1.bias",
            "layers.0.attn.qkv.bias", "layers.3.mlp.fc2.bias"} <= exempt
    decayed = set(names) - exempt
    assert "layers.0.attn.qkv.weight" in decayed and "layers.3.mlp.fc1.weight" in decayed
    # every decayed parameter is a matrix of a Linear layer; every 1-D one is exempt
    params = {n: p for m in stages for n, p in m.named_parameters()}
    assert all(params[n].dim() == 2 for n in decayed)
    assert all(n in exempt for n, p in params.items() if p.dim() == 1)
    assert exempt <= set(names)


def test_each_category_alone_and_globs():
    stages = gpt_stages()
    names = all_names(stages)
    assert no_decay_names(stages, ["bias"]) == {n for n in names if n.endswith(".bias")}
    assert no_decay_names(stages, ["norm"]) == {n for n in names if ".ln" in n}
    assert no_decay_names(stages, ["embedding"]) == {"embed.tok.weight", "embed.pos.weight"}
    assert no_decay_names(stages, ["layers.1.*"]) == {n for n in names if n.startswith("layers.1.")}
    assert no_decay_names(stages, ["*.pos.weight", "bias"]) == \
        {"embed.pos.weight"} | {n for n in names if n.endswith(".bias")}
    assert no_decay_names(stages, []) == set()


def test_tied_copies_count_as_embeddings():
    head = nn.Sequential(nn.Linear(4, 4, bias=False))
    assert no_decay_names([head], ["embedding"], tied={"0.weight"}) == {"0.weight"}
    assert no_decay_names([head], ["bias"], tied={"0.weight"}) == set()


def test_groups_keep_order_and_split_only_with_weight_decay():
    ts = [torch.zeros(1) for _ in range(4)]
    names = ["a.weight", "a.bias", "b.weight", "b.bias"]
    groups = param_groups(names, ts, weight_decay=0.1, no_decay={"a.bias", "b.bias"})
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert groups[0]["params"] == [ts[0], ts[2]] and groups[1]["params"] == [ts[1], ts[3]]
    both_decay = param_groups(names, ts, weight_decay=0.1, no_decay=set())
    assert len(both_decay) == 2 and both_decay[1]["params"] == []  # the same groups on every rank
    assert param_groups(names, ts, weight_decay=0.0, no_decay={"a.bias"}) == [{"params": ts, "weight_decay": 0.0}]
    with pytest.raises(ValueError):
        param_groups(names, ts[:2], weight_decay=0.1, no_decay=set())


@pytest.mark.parametrize("kind, cls", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)])
def test_build_optimizer_steps_as_torch_does_with_the_same_groups(kind, cls):
    torch.manual_seed(0)
    w, b = torch.randn(3, 3), torch.randn(3)
    ours_t = [w.clone().requires_grad_(), b.clone().requires_grad_()]
    ref_t = [w.clone().requires_grad_(), b.clone().requires_grad_()]
    ours = build_optimizer(kind, ["l.weight", "l.bias"], ours_t, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                           weight_decay=0.1, no_decay={"l.bias"})
    ref = cls([{"params": [ref_t[0]], "weight_decay": 0.1}, {"params": [ref_t[1]], "weight_decay": 0.0}],
              lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    assert type(ours) is cls
    for _ in range(3):
        for ts, opt in ((ours_t, ours), (ref_t, ref)):
            for t in ts:
                t.grad = torch.ones_like(t)
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours_t, ref_t))
    with pytest.raises(ValueError):
        build_optimizer("sgd", [], [], lr=1.0, betas=(0.9, 0.9), eps=1e-8, weight_decay=0.0, no_decay=set())


def test_both_copies_of_a_tied_embedding_take_no_decay():
    pytest.importorskip("transformers")
    from mpress.models.hf_model import load_hf_model

    model = load_hf_model("gpt2-tiny", microbatch_size=2)
    stages = model.split([(0, 3), (3, 6)])
    tied = {name for g in model.tied_groups for _s, name in g}
    exempt = no_decay_names(stages, DEFAULT_NO_DECAY, tied=tied)
    assert {"embed.tokens.weight", "head.lm_head.weight"} <= exempt
    assert "head.lm_head.weight" not in no_decay_names(stages, ["bias", "norm"], tied=tied)
