"""The public stage API refuses what it cannot execute: a plan's model-data decisions
(`optim:`/`stash:` rules, the optimizer step on the host) need the job's optimizer, which
`PipelineJob` wires and a stage wrapped on its own does not have. Refused in one line,
never silently ignored."""

from __future__ import annotations

import pytest
import torch

from mpress.errors import PlanError
from mpress.config.model_config import load_model_config
from mpress.models import build_stage
from mpress.contract.plan import TensorRule
from mpress.runtime.stage import wrap_stage
from tests.support.plans import pipeline_plan
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL


def wrap(plan):
    cfg = load_model_config(MODEL)
    module = build_stage(cfg, 0, cfg.num_layers + 2, seed=0)
    x = torch.zeros(MICROBATCH_SIZE, cfg.seq_len, dtype=torch.long)
    stage = wrap_stage(module, plan, 0, device=torch.device("cpu"), input_args=x, model_fingerprint=cfg.fingerprint())
    stage.runtime.close()
    return stage


def test_activation_rules_are_what_a_wrapped_stage_executes(group):
    wrap(pipeline_plan("1f1b", 1, 2, {0: [TensorRule(tensor="layers.1.**", technique="host")]}))


@pytest.mark.parametrize("rules,host_step,says", [
    ([TensorRule(tensor="optim:layers.0", technique="host")], (), "rule 0 (optim:layers.0 -> host) moves model data"),
    ([], (0,), "optimizer_step: host"),
])
def test_model_data_decisions_are_refused_not_ignored(group, rules, host_step, says):
    plan = pipeline_plan("1f1b", 1, 2, {0: rules}, host_step=host_step)
    with pytest.raises(PlanError, match="PipelineJob") as e:
        wrap(plan)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_torch_is_given_meta_examples_not_a_microbatch_to_keep(group, monkeypatch):
    """torch <= 2.11's PipelineStage keeps the example tensors it is given for the stage's
    life (the last stage's B x T x vocab logits among them): a wrapped stage hands it meta
    tensors of the same shape, dtype, strides and requires_grad, after inspecting the
    stage with the real ones."""
    from torch.distributed.pipelining import PipelineStage

    given = {}
    init = PipelineStage.__init__

    def recording(self, *args, **kwargs):
        given.update(input_args=kwargs.get("input_args"), output_args=kwargs.get("output_args"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(PipelineStage, "__init__", recording)
    cfg = load_model_config(MODEL)
    module = build_stage(cfg, 0, cfg.num_layers + 2, seed=0)
    x = torch.zeros(MICROBATCH_SIZE, cfg.seq_len, dtype=torch.long)
    y = torch.zeros(MICROBATCH_SIZE, cfg.seq_len, cfg.vocab_size, requires_grad=True)
    plan = pipeline_plan("1f1b", 1, 2, {0: [TensorRule(tensor="layers.1.**", technique="host")]})
    stage = wrap_stage(module, plan, 0, device=torch.device("cpu"), input_args=x, output_args=y,
                       model_fingerprint=cfg.fingerprint())
    stage.runtime.close()
    meta_x, meta_y = given["input_args"], given["output_args"]
    for meta, real in ((meta_x, x), (meta_y, y)):
        assert meta.is_meta and meta.shape == real.shape and meta.dtype == real.dtype
        assert meta.stride() == real.stride() and meta.requires_grad == real.requires_grad
