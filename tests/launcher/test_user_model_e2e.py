"""A user's own model, end to end through the documented commands (issue 13's done-when),
exactly as README.md's "Your own model" runs `examples/own_model`:
`mpress profile --module` -> `mpress plan --profile` -> `mpress train` on 4 CPU ranks under
a mixed plan (host swap, recompute, optimizer state on the host), `torch.equal` to plain
pipelining of the same model.

The model (SkipNet) is not GPT/BERT: residual blocks, a forward that is not a chain (the
embedding's output skips every block to the head, so it crosses every stage boundary) and
a CPU scalar saved for backward. The example's files are copied to a temporary directory,
where the model is importable only because the commands run there (as a user's own
module is)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from mpress.launcher.checkpoints.checkpoint import read_step
from tests.support.compare import assert_states_equal
from tests.support.documented import run_documented

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_model"
PROFILE = ["profile", "--module", "mymodel:make", "--layers", "embed,blocks.*,head", "--fake", "--hardware",
           "cpu-local", "--out", "profile.yaml"]
PLAN = ["plan", "--profile", "profile.yaml", "--hardware", "cpu-local", "--num-stages", "4",
        "--num-microbatches", "4", "--device-memory", "60KB", "--out", "plan.yaml"]
TRAIN = ["train", "--config", "train.yaml", "--nproc-per-node", "4"]
"""README.md's commands for the example (the test checks the README shows them)."""


def mpress(args: list[str], cwd: Path) -> str:
    code, out, err = run_documented(args, cwd=cwd)
    assert code == 0, f"mpress {' '.join(args)} failed:\n{out[-3000:]}\n{err[-3000:]}"
    return out


def losses(stdout: str) -> list[str]:
    return re.findall(r"^step \d+: loss (\S+)", stdout, re.M)


def test_the_readme_shows_these_commands():
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    for argv in (PROFILE, PLAN, TRAIN):
        shown = " ".join(f'"{a}"' if "*" in a else a for a in argv)
        assert f"mpress {shown}" in readme, shown


def test_own_module_profile_plan_train_equals_plain_pipelining(tmp_path):
    for f in ("mymodel.py", "train.yaml"):
        shutil.copy(EXAMPLE / f, tmp_path / f)
    mpress(PROFILE, tmp_path)
    mpress(PLAN, tmp_path)
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    rules = [(r["tensor"], r["technique"]) for st in plan["stages"] for r in st.get("rules", [])]
    assert {"host", "recompute"} <= {t for _, t in rules}, rules  # a mixed plan
    assert any(tensor.startswith("optim:") and t == "host" for tensor, t in rules), rules  # optimizer offload

    short = ["--steps", "4", "--log-every", "1"]
    mixed = mpress([*TRAIN, *short, "--checkpoint.dir", "ckpt-mixed"], tmp_path)
    plain = mpress([*TRAIN, *short, "--plan", "none", "--device-memory", "1MB", "--checkpoint.dir", "ckpt-plain"],
                   tmp_path)
    assert "plan mpress" in mixed and "no plan" in plain
    assert "host, recompute" in mixed  # the report's per-rank techniques: what ran
    assert len(losses(mixed)) == 4 and losses(mixed) == losses(plain)
    a = read_step(tmp_path / "ckpt-mixed" / "step000003")
    b = read_step(tmp_path / "ckpt-plain" / "step000003")
    assert sorted(a["model"]) == sorted(b["model"]) and len(a["model"]) == 40  # the model's own 40 parameters
    assert_states_equal(a, b)
