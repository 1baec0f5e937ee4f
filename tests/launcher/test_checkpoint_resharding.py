"""Checkpoints through `mpress train`: a 4-rank checkpoint resumes on 2
ranks and a 2-rank one on 4, each under a plan that offloads every stage's optimizer
states to the host (fp32 one way, bf16 masters the other), with losses and final states
`==` an uninterrupted run's on the resume's world size; keep_last; a partial step and a
stale temporary folder passed over and cleaned; a checkpoint of another seed or dtype and
a directory that is a file refused in one line before training.

`dropout: 0`: dropout draws from each rank's generator, a stream tied to the ranks' stage
split, so a resume on another world size reseeds it (mpress.launcher.checkpoints.checkpoint) and
cannot equal an uninterrupted run's draws; without dropout nothing draws from it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from mpress.launcher.checkpoints.checkpoint import read_step
from mpress.launcher.checkpoints.manifest import TEMP_PREFIX
from mpress.launcher.checkpoints.directories import LOCK_FILE
from mpress.config.model_config import load_model_config
from mpress.contract.plan import TensorRule
from tests.launcher.test_train_launcher import ROOT, launch, losses
from tests.support.compare import assert_masters_equal, assert_states_equal
from tests.support.plans import pipeline_plan
from tests.support.tiny_pipeline import MICROBATCH_SIZE

NUM_MICROBATCHES = 4
SOURCE_STEPS = 3  # the checkpointed run: steps 0-2, keep_last 2 keeps steps 1 and 2
STEPS = 5  # the resumed and the uninterrupted runs: steps 3 and 4 compared


def model_file(tmp: Path, precision: str) -> Path:
    """gpt-tiny in `precision`, without dropout."""
    data = yaml.safe_load((ROOT / "configs/models/gpt-tiny.yaml").read_text())
    data.update(precision=precision, dropout=0.0)
    path = tmp / f"gpt-tiny-{precision}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def plan_file(tmp: Path, model: Path, world: int) -> Path:
    """Every stage's optimizer states (and bf16 masters) on the host, the first layer of
    each stage recomputed, as in configs/train/gpt-tiny-mixed.yaml's plan."""
    cfg = load_model_config(str(model))
    rules = {s: [TensorRule(tensor="optim:*", technique="host")] for s in range(world)}
    rules[0].append(TensorRule(tensor="layers.0.**", technique="recompute"))
    path = tmp / f"plan-{model.stem}-{world}.yaml"
    pipeline_plan("1f1b", world, NUM_MICROBATCHES, rules, model=cfg).save(path)
    return path


def config(tmp: Path, precision: str, world: int, steps: int, ckpt: dict, **kw: object) -> dict:
    """configs/train/gpt-tiny-mixed.yaml on `world` ranks under the offloading plan."""
    base = yaml.safe_load((ROOT / "configs/train/gpt-tiny-mixed.yaml").read_text())
    base.pop("device_memory")  # the plan's rules are fixed: no capacity to plan for
    base["data"] = {"kind": "synthetic"}  # gpt-tiny's 256 ids: the main job's text needs a 512-id model
    base.pop("eval_every")  # no validation set on synthetic data
    model = model_file(tmp, precision)
    return {**base, "model": str(model), "plan": str(plan_file(tmp, model, world)), "num_stages": world,
            "microbatch_size": MICROBATCH_SIZE, "num_microbatches": NUM_MICROBATCHES, "steps": steps,
            "log_every": 1, "checkpoint": ckpt, **kw}


def run(cfg: dict, tmp: Path, world: int):
    res = launch(cfg, tmp, nproc=world, timeout=400, torchrun=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def saved_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("checkpoint of step")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Per (precision, world): the checkpoint directory of a SOURCE_STEPS-step run."""
    out = {}
    for precision, world in (("fp32", 4), ("bf16", 2)):
        tmp = tmp_path_factory.mktemp(f"source-{precision}-{world}")
        res = run(config(tmp, precision, world, SOURCE_STEPS,
                         {"dir": str(tmp / "ckpt"), "every_steps": 1, "keep_last": 2}), tmp, world)
        out[precision, world] = (tmp / "ckpt", res.stdout)
    return out


@pytest.mark.slow
def test_keep_last_keeps_the_newest_complete_steps_and_no_temporary_files(sources):
    root, stdout = sources["fp32", 4]
    lines = saved_lines(stdout)
    assert [line.split(" saved")[0] for line in lines] == [f"checkpoint of step {s}" for s in range(SOURCE_STEPS)]
    assert all(line.endswith(" MB)") for line in lines)
    assert sorted(p.name for p in root.iterdir()) == [LOCK_FILE, "step000001", "step000002"]  # rank 0 held it
    assert sorted(p.name for p in (root / "step000002").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "manifest.json"]


@pytest.mark.slow
@pytest.mark.parametrize("precision, saved_on, resumed_on", [("fp32", 4, 2), ("bf16", 2, 4)])
def test_a_checkpoint_resumes_on_another_world_size_as_an_uninterrupted_run(sources, tmp_path, precision,
                                                                            saved_on, resumed_on):
    source, _ = sources[precision, saved_on]
    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    shutil.copytree(source / "step000002", resume_dir / "step000002")
    # a newer step cut short (one rank's file missing), and a save killed before its rename
    partial = resume_dir / "step000003"
    shutil.copytree(source / "step000002", partial)
    (partial / "__1_0.distcp").unlink()
    stale = resume_dir / f"{TEMP_PREFIX}0123456789ab-step000003"
    shutil.copytree(source / "step000002", stale)

    reference = run(config(tmp_path, precision, resumed_on, STEPS, {"dir": str(tmp_path / "ref")}),
                    tmp_path, resumed_on)
    resumed = run(config(tmp_path, precision, resumed_on, STEPS, {"dir": str(resume_dir), "resume": True}),
                  tmp_path, resumed_on)
    line = next(x for x in resumed.stdout.splitlines() if x.startswith("resuming from"))
    assert "step000002 (step 2 of run" in line and f"saved on {saved_on} ranks" in line
    assert f"now {resumed_on} ranks" in line and "resharded by parameter name" in line
    assert "passed over step000003 (__1_0.distcp listed in manifest.json is missing)" in line
    assert "resuming at step 3" in resumed.stdout
    a, r = losses(reference.stdout), losses(resumed.stdout)
    assert sorted(r) == [3, 4]
    assert [a[s] for s in (3, 4)] == [r[s] for s in (3, 4)]
    x, y = read_step(tmp_path / "ref" / "step000004"), read_step(resume_dir / "step000004")
    assert_states_equal(x, y)
    assert_masters_equal(x, y)
    assert (precision == "bf16") == bool(x["masters"])
    # the stale temporary folder is gone; the incomplete step is not this format's to delete
    assert sorted(p.name for p in resume_dir.iterdir()) == [LOCK_FILE, "step000002", "step000003", "step000004"]


def one_line_before_training(res, *needles: str) -> str:
    """The one line of output naming every needle; no training step ran."""
    lines = [x for x in (res.stdout + res.stderr).splitlines() if all(n in x for n in needles)]
    assert len(lines) == 1, (res.stdout + res.stderr)[-3000:]
    assert res.returncode != 0 and not losses(res.stdout)
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("field, change", [("seed", {"seed": 5}), ("dtype", {"precision": "bf16"})])
def test_a_checkpoint_of_another_run_is_one_line_naming_its_manifest_and_field(sources, tmp_path, field, change):
    source, _ = sources["fp32", 4]
    precision = change.get("precision", "fp32")
    extra = {k: v for k, v in change.items() if k != "precision"}
    res = launch(config(tmp_path, precision, 2, STEPS, {"dir": str(source), "resume": True}, **extra), tmp_path,
                 nproc=2, torchrun=False)
    line = one_line_before_training(res, "manifest.json")
    assert f"{source / 'step000002' / 'manifest.json'}: {field}:" in line


@pytest.mark.slow
def test_a_checkpoint_dir_that_is_a_file_is_refused_before_training(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    res = launch(config(tmp_path, "fp32", 2, STEPS, {"dir": str(path)}), tmp_path, nproc=2, torchrun=False)
    line = one_line_before_training(res, "checkpoint.dir")
    assert f"{path} is an existing file, not a directory" in line
