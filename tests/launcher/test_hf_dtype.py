"""An HF model in bf16 through the documented commands (issue 28): `mpress profile
--hf-config llama-tiny --dtype bf16` -> `mpress plan` -> `mpress train --dtype bf16` on 2
CPU ranks under a mixed plan (two techniques or more) is `torch.equal` to
plain pipelining of the same bf16 model, with bf16 parameters and fp32 master weights;
the plan records bf16, and a job training the model in fp32 under it is refused in one
line before any rank starts."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from mpress.launcher.checkpoints.checkpoint import read_step
from tests.support.compare import assert_states_equal
from tests.support.documented import one_line_error, run_documented

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf"
PROFILE = ["profile", "--hf-config", "llama-tiny", "--dtype", "bf16", "--microbatch-size", "2", "--fake",
           "--hardware", "cpu-local", "--out", "profile.yaml"]
PLAN = ["plan", "--profile", "profile.yaml", "--hardware", "cpu-local", "--num-stages", "2",
        "--num-microbatches", "4", "--device-memory", "420KB", "--out", "plan.yaml"]
"""420 KB: the optimizer steps on the host (fp32 masters there) and blocks recompute."""
TRAIN = ["train", "--config", "train.yaml", "--nproc-per-node", "2", "--hf-config", "llama-tiny"]


def mpress(args: list[str], cwd: Path) -> str:
    code, out, err = run_documented(args, cwd=cwd, in_process=args[0] != "train")
    assert code == 0, f"mpress {' '.join(args)} failed:\n{out[-3000:]}\n{err[-3000:]}"
    return out


def losses(stdout: str) -> list[str]:
    return re.findall(r"^step \d+: loss (\S+)", stdout, re.MULTILINE)


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The profile and plan both tests read, made once (each test writes its own
    checkpoint directory and reads the plan only)."""
    tmp_path = tmp_path_factory.mktemp("bf16")
    shutil.copy(EXAMPLE / "train.yaml", tmp_path / "train.yaml")
    mpress(PROFILE, tmp_path)
    mpress(PLAN, tmp_path)
    return tmp_path


def test_a_bf16_plan_trains_as_plain_bf16_pipelining(planned):
    plan = yaml.safe_load((planned / "plan.yaml").read_text())
    assert plan["dtype"] == "bf16"
    techniques = {r["technique"] for st in plan["stages"] for r in st.get("rules", [])}
    assert len(techniques - {"keep"}) >= 2, techniques  # a mixed plan

    mixed = mpress([*TRAIN, "--dtype", "bf16", "--checkpoint.dir", "ck-mixed"], planned)
    plain = mpress([*TRAIN, "--dtype", "bf16", "--plan", "none", "--checkpoint.dir", "ck-plain"], planned)
    assert "plan mpress" in mixed and "no plan" in plain
    assert len(losses(mixed)) == 3 and losses(mixed) == losses(plain)
    a = read_step(planned / "ck-mixed" / "step000002")
    b = read_step(planned / "ck-plain" / "step000002")
    assert sorted(a["model"]) == sorted(b["model"])
    assert_states_equal(a, b)
    assert all(t.dtype == torch.bfloat16 for t in a["model"].values())
    assert a["masters"] and all(t.dtype == torch.float32 for t in a["masters"].values())


def test_a_bf16_plan_refuses_an_fp32_job(planned):
    # refused before any rank starts: the same argv through `mpress.cli.main`, in this process
    code, _out, err = run_documented([*TRAIN, "--checkpoint.dir", "ck"], cwd=planned, in_process=True)
    one_line_error(code, err, "dtype", "bf16", "fp32")


def test_the_readme_shows_a_bf16_llama_2_7b_plan():
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    for line in (("mpress profile --hf-config llama-2-7b --seq-len 4096 --microbatch-size 1 --dtype bf16 --fake "
                  "--hardware dgx-a100 --out 7b-bf16.yaml"),
                 "mpress plan --profile 7b-bf16.yaml --hardware dgx-a100 --num-microbatches 16 --out 7b-bf16-plan.yaml"):
        assert line in readme, line
