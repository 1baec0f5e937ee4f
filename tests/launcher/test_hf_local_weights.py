"""Local weights through the documented commands (issue 28): a tiny Mistral with a
sliding window (4, shorter than its 16-token sequences) saved by `save_pretrained` goes
`mpress profile --hf-config DIR --fake` -> `mpress plan` -> a 2-rank `mpress train`, as
README.md shows. The fake profile and the launcher's check build the model on the meta
device from its config; the ranks load the weights, so step 0's loss is transformers'
loss of the saved model on the same batch (to the 4 decimals the log prints).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from mpress.contract.plan import Plan
from mpress.models.hf_config import batch, resolve_hf
from mpress.static.profile.profile import Profile
from tests.models.hf_families import family_configs
from tests.support.documented import run_documented

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf"
PROFILE = ["profile", "--hf-config", "my-model", "--microbatch-size", "2", "--fake", "--hardware", "cpu-local",
           "--out", "profile.yaml"]
PLAN = ["plan", "--profile", "profile.yaml", "--hardware", "cpu-local", "--num-stages", "2",
        "--num-microbatches", "4", "--out", "plan.yaml"]
TRAIN = ["train", "--config", "train.yaml", "--nproc-per-node", "2", "--hf-config", "my-model"]
"""README.md's local-weights commands (`examples/hf/train.yaml`: 4 microbatches of 2, seed 0)."""
NUM_MICROBATCHES, MICROBATCH_SIZE = 4, 2


def mpress(args: list[str], cwd: Path) -> str:
    """`mpress ARGS` in `cwd`: training in its own processes, profile and plan in this one."""
    code, out, err = run_documented(args, cwd=cwd, in_process=args[0] != "train")
    assert code == 0, f"mpress {' '.join(args)} failed:\n{out[-3000:]}\n{err[-3000:]}"
    return out


def test_the_readme_shows_these_commands():
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    for argv in (PROFILE, PLAN, TRAIN):
        assert f"mpress {' '.join(argv)}" in readme, argv


def _transformers_loss(weights: Path) -> float:
    """Transformers' loss of the saved model on step 0's batch: the mean over its
    microbatches, as the trainer reports it."""
    ids, targets = batch(resolve_hf(str(weights)), NUM_MICROBATCHES * MICROBATCH_SIZE, seed=0, step=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(weights), local_files_only=True).train()
    with torch.no_grad():
        losses = [model(x, labels=y).loss for x, y in zip(ids.chunk(NUM_MICROBATCHES), targets.chunk(NUM_MICROBATCHES))]
    return float(torch.stack(losses).mean())


def test_local_weights_profile_plan_and_train(tmp_path):
    config = family_configs()["mistral-sliding"]
    config.max_position_embeddings = 16  # the sequence: 16 tokens, 4 windows
    torch.manual_seed(11)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "my-model")
    shutil.copy(EXAMPLE / "train.yaml", tmp_path / "train.yaml")

    mpress(PROFILE, tmp_path)  # on the meta device: no weights read
    profile = Profile.load(tmp_path / "profile.yaml")
    assert profile.model == "hf:my-model" and profile.source == "fake"
    mpress(PLAN, tmp_path)
    assert Plan.load(tmp_path / "plan.yaml").model_fingerprint == profile.model_fingerprint
    out = mpress(TRAIN, tmp_path)
    step0 = re.search(r"^step 0: loss (\S+)", out, re.MULTILINE)
    assert step0 is not None, out[-2000:]
    assert step0.group(1) == f"{_transformers_loss(tmp_path / 'my-model'):.4f}"
