"""A user's own model, end to end through the documented commands (issue 13's done-when):
`mpress profile --module` -> `mpress plan --profile` -> `mpress train` on 4 CPU ranks under
a mixed plan (host swap, recompute, optimizer state on the host), `torch.equal` to plain
pipelining of the same model.

The model (`tests/support/user_model.py`'s SkipNet) is not GPT/BERT: residual blocks, a
forward that is not a chain (the embedding's output skips every block to the head, so
it crosses every stage boundary) and a CPU scalar saved for backward. Its file lies in a
temporary directory, importable only because the commands run there (as a user's own
module would be)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from mpress.launcher.checkpoint import read_step
from tests.support import user_model
from tests.support.compare import assert_states_equal
from tests.support.documented import run_documented

pytestmark = pytest.mark.slow

PLAN_BUDGET = "60KB"
"""The device memory the plan is made for: below what plain pipelining needs on every
stage but the last (86 KB at its fullest), so the planner must compact."""
CAPACITY = "80KB"
"""The stand-in devices' capacity while training under the plan. Above the budget: for a
model whose stage boundaries carry more than one layer's output (the skip), the memory
model leaves those extra bytes out, and the run measures 112-118% of the prediction
(the closing note of issue 13 says so); the test is about equality, not the model."""


def mpress(args: list[str], cwd: Path) -> str:
    code, out, err = run_documented(args, cwd=cwd)
    assert code == 0, f"mpress {' '.join(args)} failed:\n{out[-3000:]}\n{err[-3000:]}"
    return out


def write_config(d: Path, name: str, plan: str, capacity: str) -> Path:
    cfg = {"module": "mymodel:make_skipnet", "layers": ["embed", "blocks.*", "head"], "microbatch_size": 2,
           "num_microbatches": 4, "steps": 4, "log_every": 1, "plan": plan, "hardware": "cpu-local",
           "device_memory": capacity, "checkpoint": {"dir": f"ckpt-{name}"}}
    path = d / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def losses(stdout: str) -> list[str]:
    return re.findall(r"^step \d+: loss (\S+)", stdout, re.M)


def test_own_module_profile_plan_train_equals_plain_pipelining(tmp_path):
    (tmp_path / "mymodel.py").write_text(user_model.SOURCE)
    mpress(["profile", "--module", "mymodel:make_skipnet", "--layers", "embed,blocks.*,head", "--fake",
            "--hardware", "cpu-local", "--out", "prof.yaml"], tmp_path)
    mpress(["plan", "--profile", "prof.yaml", "--hardware", "cpu-local", "--stages", "4", "--microbatches", "4",
            "--microbatch-size", "2", "--device-memory", PLAN_BUDGET, "--strategy", "mpress", "--out", "plan.yaml"],
           tmp_path)
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    rules = [(r["tensor"], r["technique"]) for st in plan["stages"] for r in st.get("rules", [])]
    techniques = {t for _, t in rules}
    assert {"host", "recompute"} <= techniques, rules  # a mixed plan
    assert any(tensor.startswith("optim:") and t == "host" for tensor, t in rules), rules  # optimizer offload

    mixed = mpress(["train", "--config", str(write_config(tmp_path, "mixed", "plan.yaml", CAPACITY)),
                    "--nproc-per-node", "4"], tmp_path)
    plain = mpress(["train", "--config", str(write_config(tmp_path, "plain", "none", "1MB")),
                    "--nproc-per-node", "4"], tmp_path)
    assert "plan mpress" in mixed and "no plan" in plain
    assert "host, recompute" in mixed  # the report's per-rank techniques: what ran
    assert len(losses(mixed)) == 4 and losses(mixed) == losses(plain)
    a = read_step(tmp_path / "ckpt-mixed" / "step000003")
    b = read_step(tmp_path / "ckpt-plain" / "step000003")
    assert sorted(a["model"]) == sorted(b["model"]) and len(a["model"]) == 40  # the model's own 40 parameters
    assert_states_equal(a, b)
