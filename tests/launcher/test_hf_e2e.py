"""Hugging Face models end to end through the documented commands (issue 19's done-when):
tiny GPT-2-, Llama- and BERT-style configs go `mpress profile --hf-config` -> `mpress plan
--profile` -> `mpress train` on CPU ranks under mixed plans, `torch.equal` to plain
pipelining of the same HF model (`--plan none`), and a tied embedding (GPT-2's and BERT's
output projection) is equal on the first and the last stage after training.

GPT-2 and BERT run on 2 and on 4 ranks (BERT's tie spans ranks 0 and 3, then 0 and 1),
Llama on 2: on 4 ranks the planner finds no memory at which it mixes techniques for the
tiny Llama (recompute alone, or host swap alone). The device memory of each plan is one
at which the planner mixes techniques.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from mpress.launcher.checkpoints.checkpoint import read_step
from tests.support.compare import assert_states_equal
from tests.support.documented import run_documented

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf"
PROFILE = ["profile", "--hf-config", "gpt2-tiny", "--microbatch-size", "2", "--fake", "--hardware", "cpu-local",
           "--out", "profile.yaml"]
PLAN = ["plan", "--profile", "profile.yaml", "--hardware", "cpu-local", "--num-stages", "2",
        "--num-microbatches", "4", "--device-memory", "700KB", "--out", "plan.yaml"]
TRAIN = ["train", "--config", "train.yaml", "--nproc-per-node", "2"]
"""README.md's commands for `examples/hf` (GPT-2); the other families run the same with
their name, rank count and memory in place of GPT-2's."""

CASES = [
    # (config, ranks, device memory the plan is made for, tied parameter on the first / last stage)
    ("gpt2-tiny", 2, "700KB", ("embed.tokens.weight", "head.lm_head.weight")),
    ("llama-tiny", 2, "500KB", None),
    ("bert-tiny", 4, "420KB", ("embed.word_embeddings.weight", "head.predictions.decoder.weight")),
    # the other rank counts: GPT-2 on 4 (D2D: since the peer quotas are the program's slots,
    # no budget gives D2D and recompute together there), BERT on 2 (host swap + recompute)
    ("gpt2-tiny", 4, "800KB", ("embed.tokens.weight", "head.lm_head.weight")),
    ("bert-tiny", 2, "500KB", ("embed.word_embeddings.weight", "head.predictions.decoder.weight")),
]


def mpress(args: list[str], cwd: Path) -> str:
    """`mpress ARGS` in `cwd`: training in its own processes, profile and plan in this one
    (the same argv through `mpress.cli.main`, without a second interpreter's start-up)."""
    code, out, err = run_documented(args, cwd=cwd, in_process=args[0] != "train")
    assert code == 0, f"mpress {' '.join(args)} failed:\n{out[-3000:]}\n{err[-3000:]}"
    return out


def losses(stdout: str) -> list[str]:
    return re.findall(r"^step \d+: loss (\S+)", stdout, re.M)


def for_case(argv: list[str], name: str, ranks: int, memory: str) -> list[str]:
    """README's GPT-2 command for another case: its config, ranks and device memory."""
    values = {"--hf-config": name, "--num-stages": str(ranks), "--nproc-per-node": str(ranks),
              "--device-memory": memory}
    return [values.get(flag, a) for flag, a in zip(["", *argv], argv)]


def test_the_readme_shows_these_commands():
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    for argv in (PROFILE, PLAN, TRAIN):
        assert f"mpress {' '.join(argv)}" in readme, argv


@pytest.mark.parametrize("name,ranks,memory,tied", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_hf_profile_plan_train_equals_plain_pipelining(tmp_path, name, ranks, memory, tied):
    shutil.copy(EXAMPLE / "train.yaml", tmp_path / "train.yaml")
    mpress(for_case(PROFILE, name, ranks, memory), tmp_path)
    mpress(for_case(PLAN, name, ranks, memory), tmp_path)
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    techniques = {r["technique"] for st in plan["stages"] for r in st.get("rules", [])}
    if (name, ranks) == ("gpt2-tiny", 4):
        assert "d2d" in techniques, techniques  # the case that runs the HF model with peer swaps
    else:
        assert len(techniques - {"keep"}) >= 2 and "recompute" in techniques, techniques  # a mixed plan

    train = [*for_case(TRAIN, name, ranks, memory), "--hf-config", name]  # the example's config, another model
    mixed = mpress([*train, "--checkpoint.dir", "ck-mixed"], tmp_path)
    plain = mpress([*train, "--plan", "none", "--checkpoint.dir", "ck-plain"], tmp_path)
    assert f"hf:{name}" in mixed and "plan mpress" in mixed and "no plan" in plain
    assert len(losses(mixed)) == 3 and losses(mixed) == losses(plain)
    a = read_step(tmp_path / "ck-mixed" / "step000002")
    b = read_step(tmp_path / "ck-plain" / "step000002")
    assert sorted(a["model"]) == sorted(b["model"])
    assert_states_equal(a, b)
    if tied is not None:
        first, last = (a["model"][n] for n in tied)
        assert torch.equal(first, last), "the tied embedding differs between the first and the last stage"
