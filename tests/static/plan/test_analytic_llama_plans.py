"""Every Llama preset plans and emulates on the server it is trained on (hgx-h100), through
the commands the README shows: `mpress plan --out` writes a plan that fits, and `mpress
emulate` re-evaluates that plan file to the same verdict."""

from __future__ import annotations

import json

import pytest

from mpress.cli import main
from mpress.contract.plan import Plan

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name, balance", [
    ("llama-2-7b", "compute"), ("llama-2-13b", "compute"), ("llama-3-8b", "compute"), ("llama-2-70b", "compute"),
    # stage 0 holds 8 microbatches in flight: only the memory balance leaves it few enough blocks
    ("llama-3-70b", "memory"),
])
def test_llama_presets_plan_and_emulate_on_hgx_h100(tmp_path, capsys, name, balance):
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--model", name, "--hardware", "hgx-h100", "--balance", balance, "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.fits and plan.model == name and plan.num_stages == 8 and plan.strategy == "mpress"
    capsys.readouterr()
    assert main(["emulate", str(out), "--balance", balance, "--json"]) == 0
    emulated = json.loads(capsys.readouterr().out)
    assert emulated["fits"] and not emulated["devices_over"]
    assert emulated["iteration_s"] > 0 and emulated["model_tflops"] > 0
