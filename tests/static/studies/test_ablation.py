"""`mpress plan --ablate`: the mpress plan emulated with one D2D ingredient taken away."""

from __future__ import annotations

import json

import pytest

from mpress.contract.actions import Kind
from mpress.cli import main
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.static.studies.ablation import ablate
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.plan.planner import PlannerOptions, _Planner, plan_strategy


@pytest.fixture(scope="module")
def planned():
    """GPT-20.4B on the DGX-1 (asymmetric NVLink): the mpress plan swaps layers to peers."""
    setup = setup_pipeline(load_model_config("gpt-20.4b"), load_hardware("dgx1-v100"), schedule="1f1b",
                           num_stages=8, microbatch_size=1, num_microbatches=16)
    result = plan_strategy(setup, "mpress")
    assert result.fits and any(r.technique == "d2d" for sp in result.plan.stages for r in sp.rules)
    return setup, result


def _kinds(ev) -> set[Kind]:
    return {a.kind for rank in ev.schedule.ranks for a in rank}


def test_each_variant_takes_away_one_ingredient(planned):
    setup, result = planned
    assert Kind.DO in _kinds(result.evaluation)
    without, identity, one_peer = ablate(setup, result)
    # without D2D: no D2D action is left, and the plan's D2D units are host swaps instead
    assert Kind.DO not in _kinds(without.evaluation) and Kind.DI not in _kinds(without.evaluation)
    assert sum(a.kind is Kind.SO for r in without.evaluation.schedule.ranks for a in r) > \
        sum(a.kind is Kind.SO for r in result.evaluation.schedule.ranks for a in r)
    # identity mapping: stage s on device s, the D2D copies on the links that mapping has
    assert result.draft.stage_to_device != list(range(8))  # the mapper chose another one
    assert identity.draft.stage_to_device == list(range(8))
    # one peer: every D2D unit has one stripe
    stripes = [info.stripes for info in one_peer.evaluation.tensors.values() if info.stripes]
    assert stripes and all(len(s) == 1 for s in stripes)
    assert any(len(info.stripes) > 1 for info in result.evaluation.tensors.values())  # the plan striped


def test_plan_ablate_prints_each_slowdown(capsys):
    assert main(["plan", "--model", "gpt-20.4b", "--hardware", "dgx1-v100", "--ablate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [a["variant"] for a in data["ablations"]] == [
        "without D2D (host swap instead)", "identity device mapping", "one peer per stage (no striping)"]
    assert all(a["iteration_s"] > 0 for a in data["ablations"])



def test_what_no_peer_takes_stays_on_its_device():
    # GPT-20.4B at microbatch 2 on the DGX-1: under the identity mapping and with one peer
    # per stage, some stage's peers can take only part of its D2D data. The layers past
    # what its stripes hold must stay on the device (keep), so the emulation holds them
    # there, and its quotas must hold the rest. (The stripes used to be renormalised over
    # the placed bytes while every D2D layer still went to peers, whose pools were sized
    # for the placed part only.)
    setup = setup_pipeline(load_model_config("gpt-20.4b"), load_hardware("dgx1-v100"), schedule="1f1b",
                           num_stages=8, microbatch_size=2, num_microbatches=16)
    result = plan_strategy(setup, "mpress")
    planner = _Planner(setup, "mpress", PlannerOptions(), None)
    _without, identity, one_peer = ablate(setup, result)
    partial = 0
    for variant in (identity, one_peer):
        d = variant.draft
        for s in range(setup.schedule.num_stages):
            quota = sum(q for _dev, q in d.quotas[s])
            assert planner._d2d_bytes(d, s) <= quota, (variant.name, s)
            if quota and planner._d2d_bytes(result.draft, s) > quota:
                partial += 1
    assert partial  # the case arises here: some stage's peers take part of its data
