"""What a checkpoint directory holds and which step resumes (no torch.distributed): a
step is complete only with a manifest whose files are all there at their sizes;
keep_last keeps the newest complete steps and removes temporary folders; a manifest of
another run is one line naming its file and field; the start-up check refuses a
directory that is a file or cannot be made. The steps here are written by DCP itself, in
one process, so their files are what a job's are."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mpress.errors import ConfigError
from mpress.launcher.checkpoints.manifest import (
    MANIFEST,
    TEMP_PREFIX,
    Manifest,
    check_checkpoint_dir,
    check_resumable,
    identity,
    newest_complete,
    prune,
    publish,
    step_folder,
    temp_folder,
    write_manifest,
)
from mpress.config.model_config import load_model_config
from mpress.runtime.train_config import CheckpointConfig, TrainConfig
from tests.support.plans import one_line

MODEL = load_model_config("gpt-tiny")


def save_step(root: Path, step: int, *, run_id: str = "run", seed: int = 0, lineage: str = "") -> Path:
    """A complete step as a save makes it: DCP's files in a temporary folder, the
    manifest, the rename."""
    tmp = temp_folder(root, run_id, step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP in one process
        dcp.save({"model.w": torch.full((4,), float(step))}, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    write_manifest(tmp, Manifest(step=step, run_id=run_id, model=MODEL.name, **identity(MODEL, seed),
                                 plan_fingerprint=None, world_size=1, stage_split=[[0, 6]], schedule="1f1b",
                                 config={}, lineage=lineage))
    publish(tmp, step_folder(root, step))
    return step_folder(root, step)


def test_a_step_lists_every_file_dcp_wrote_and_is_complete(tmp_path):
    folder = save_step(tmp_path, 3)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp"]
    assert manifest["files"]["__0_0.distcp"] == (folder / "__0_0.distcp").stat().st_size
    found, m, skipped = newest_complete(tmp_path)
    assert (found, m.step, skipped) == (folder, 3, [])


@pytest.mark.parametrize("damage, why", [
    (lambda f: (f / MANIFEST).unlink(), "no manifest.json"),
    (lambda f: (f / "__0_0.distcp").unlink(), "__0_0.distcp listed in manifest.json is missing"),
    (lambda f: (f / "__0_0.distcp").write_bytes(b"\0" * 3), "__0_0.distcp is 3 bytes"),
    (lambda f: (f / MANIFEST).write_text("{"), "unreadable manifest.json"),
])
def test_an_incomplete_step_is_passed_over_for_the_newest_complete_one(tmp_path, damage, why):
    save_step(tmp_path, 1)
    damage(save_step(tmp_path, 2))
    found, m, skipped = newest_complete(tmp_path)
    assert found == step_folder(tmp_path, 1) and m.step == 1
    assert len(skipped) == 1 and skipped[0].startswith("step000002 (") and why in skipped[0]


def test_a_killed_save_leaves_only_a_temporary_folder_which_is_never_resumed(tmp_path):
    save_step(tmp_path, 1)
    tmp = temp_folder(tmp_path, "killed", 2)  # written, manifest too, but not renamed
    dcp.save({"model.w": torch.zeros(4)}, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    assert newest_complete(tmp_path)[1].step == 1


def test_keep_last_keeps_the_newest_complete_steps_and_removes_temporary_entries(tmp_path):
    for step in range(5):
        save_step(tmp_path, step)
    (tmp_path / "step000009").mkdir()  # not this format's: left alone
    temp_folder(tmp_path, "killed", 7).mkdir()
    (tmp_path / f"{TEMP_PREFIX}{MANIFEST}").write_bytes(b"")  # a 0-byte temporary file
    removed = prune(tmp_path, keep_last=2, lineage="run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000003", "step000004", "step000009"]
    assert len(removed) == 5


def test_keep_last_never_removes_another_runs_steps_or_this_runs_newest(tmp_path):
    """An older run's steps 100-300 and a new run numbered from 0: keep_last counts this
    run's lineage only, so its newest step is never pruned for the older run's higher numbers."""
    for step in (100, 200, 300):
        save_step(tmp_path, step, run_id="old")
    save_step(tmp_path, 9, run_id="new")
    assert prune(tmp_path, keep_last=3, lineage="new") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000009", "step000100", "step000200", "step000300"]


def test_a_step_saved_again_replaces_the_earlier_one_whole(tmp_path):
    save_step(tmp_path, 2, run_id="first")
    save_step(tmp_path, 2, run_id="second")
    found, m, _ = newest_complete(tmp_path)
    assert m.run_id == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000002"]


@pytest.mark.parametrize("field, model, seed", [
    ("dtype", dataclasses.replace(MODEL, precision="bf16"), 0),
    ("model_fingerprint", dataclasses.replace(MODEL, hidden_size=2 * MODEL.hidden_size), 0),
    ("seed", MODEL, 1),
])
def test_a_checkpoint_of_another_run_is_one_line_naming_manifest_and_field(tmp_path, field, model, seed):
    folder = save_step(tmp_path, 2)
    _, manifest, _ = newest_complete(tmp_path)
    with pytest.raises(ConfigError) as err:
        check_resumable(manifest, folder, identity(model, seed))
    line = one_line(err.value)
    assert line.startswith(f"{folder / MANIFEST}: {field}: ")
    check_resumable(manifest, folder, identity(MODEL, 0))  # its own run: fine


def train_config(path: Path, **kw: object) -> TrainConfig:
    return TrainConfig(model="gpt-tiny", checkpoint=CheckpointConfig(dir=str(path), **kw))


def test_start_up_refuses_a_checkpoint_dir_that_is_a_file(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("x")
    with pytest.raises(ConfigError) as err:
        check_checkpoint_dir(train_config(path))
    assert one_line(err.value) == f"checkpoint.dir: {path} is an existing file, not a directory"


def test_start_up_refuses_a_checkpoint_dir_that_cannot_be_made(tmp_path):
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "ckpt"
    with pytest.raises(ConfigError) as err:
        check_checkpoint_dir(train_config(path))
    assert one_line(err.value) == f"checkpoint.dir: cannot write under {path.parent}: it is a file, not a directory"


def test_start_up_checks_the_step_to_resume(tmp_path):
    path = tmp_path / "a" / "ckpt"
    check_checkpoint_dir(train_config(path, resume=True))  # nothing to resume yet: fine
    save_step(path, 4, seed=1)
    with pytest.raises(ConfigError, match="checkpoint.resume: false, but the directory holds complete checkpoints "
                                          r"\(newest step000004"):
        check_checkpoint_dir(train_config(path))  # a new run would mix its steps with these
    with pytest.raises(ConfigError, match="manifest.json: seed: "):
        check_checkpoint_dir(train_config(path, resume=True))
