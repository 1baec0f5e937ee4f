"""Damaged checkpoints, shared directories and a full disk, met through `mpress train`
(2 gloo ranks, gpt-tiny, no plan). One run saves steps 0-5; each case damages a copy:

- newer steps damaged in every way a disk, a copy or a hand can (same-size byte flips in
  a rank file and in `.metadata`, random bytes, a truncated and an empty rank file, a
  manifest that disagrees, a step missing one rank's file, another step's rank file of
  the same size, garbage `.metadata` the manifest was rewritten to match): the resume
  passes over each, naming the step, the file and why, in its one line, resumes from the
  newest step that verifies, and its next step equals the undamaged run's step bit for
  bit (state and loss: the parameters it loaded are the ones saved at the step it names;
  any other state would train to another one);
- every step damaged: exit 2 and one line naming each, no step trained;
- a checkpoint of another seed: one line naming the manifest and the field, exit 2;
  one of another world size: carried (resharded by parameter name), the line says so;
- a second run on a checkpoint or run directory in use: refused in one line, exit 2;
- a dangling symlink as `checkpoint.dir`: refused, nothing made where it points;
- a full disk during a save (a tmpfs of 5 MB in a user and mount namespace): one line
  naming the path, exit 1, no partial folder left, the earlier step intact.

The damages are grouped: one launch resumes over four or five damaged steps at once."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mpress.launcher.checkpoints.checkpoint import read_step
from mpress.launcher.checkpoints.manifest import (
    MANIFEST,
    METADATA,
    TEMP_PREFIX,
    file_digest,
    step_folder,
)
from mpress.launcher.checkpoints.directories import DirectoryLock
from tests.faults.run import TrainRun
from tests.launcher.test_checkpoint_integrity import flip, rewrite_manifest
from tests.support.compare import assert_states_equal
from tests.support.documented import REPO, one_line_error, run_documented

SAVED = 6  # the source run's steps 0-5, every one kept
RANK0, RANK1 = "__0_0.distcp", "__1_0.distcp"


def config(tmp: Path, ckpt: Path, steps: int, job: dict | None = None, **checkpoint: object) -> Path:
    cfg = {"model": "gpt-tiny", "schedule": "1f1b", "num_stages": 2, "microbatch_size": 2, "num_microbatches": 4,
           "steps": steps, "plan": "none", "seed": 0, "log_every": 1, **(job or {}),
           "checkpoint": {"dir": str(ckpt), "every_steps": 1, "keep_last": 10, **checkpoint}}
    path = tmp / f"train-{ckpt.name}-{steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(cfg: Path, run_dir: Path, *, in_process: bool = False) -> tuple[int, str, str]:
    return run_documented(["train", "--config", str(cfg), "--run-dir", str(run_dir)], in_process=in_process)


def losses(stdout: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+): loss (\S+)", stdout, re.MULTILINE)}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, dict[int, str]]:
    """The undamaged checkpoint directory (steps 0-5) and the losses of its run."""
    tmp = tmp_path_factory.mktemp("source")
    code, out, err = train(config(tmp, tmp / "ck", SAVED), tmp / "run")
    assert code == 0, err[-3000:]
    assert sorted(p.name for p in (tmp / "ck").iterdir() if p.name.startswith("step")) == \
        [f"step{s:06d}" for s in range(SAVED)]
    return tmp / "ck", losses(out)


# ---- damages: each changes step folder `f` (`src`: the undamaged directory) ----------------


def _random_bytes(f: Path, src: Path) -> str:
    (f / RANK1).write_bytes(os.urandom(4096))
    return f"{RANK1} is 4096 bytes"


def _truncated(f: Path, src: Path) -> str:
    size = (f / RANK0).stat().st_size
    with open(f / RANK0, "r+b") as fh:
        fh.truncate(size // 2)
    return f"{RANK0} is {size // 2} bytes"


def _empty(f: Path, src: Path) -> str:
    (f / RANK1).write_bytes(b"")
    return f"{RANK1} is 0 bytes"


def _manifest_disagrees(f: Path, src: Path) -> str:
    size = (f / RANK0).stat().st_size
    rewrite_manifest(f, lambda d: d["files"].__setitem__(RANK0, size + 1))
    return f"{RANK0} is {size} bytes, manifest.json lists {size + 1}"


def _missing_rank_file(f: Path, src: Path) -> str:
    (f / RANK1).unlink()
    return f"{RANK1} listed in manifest.json is missing"


def _flip_rank_file(f: Path, src: Path) -> str:
    flip(f / RANK1, count=64)
    return f"{RANK1} does not match its sha256 in manifest.json"


def _flip_metadata(f: Path, src: Path) -> str:
    flip(f / METADATA, count=64)
    return f"{METADATA} does not match its sha256 in manifest.json"


def _another_steps_file(f: Path, src: Path) -> str:
    other = step_folder(src, 0) / RANK1  # saved by a run too, of the same keys and shapes: the same size
    assert other.stat().st_size == (f / RANK1).stat().st_size
    shutil.copyfile(other, f / RANK1)
    return f"{RANK1} does not match its sha256 in manifest.json"


def _garbage_metadata_rehashed(f: Path, src: Path) -> str:
    (f / METADATA).write_bytes(os.urandom(300))
    rewrite_manifest(f, lambda d: (d["files"].__setitem__(METADATA, 300),
                                   d["sha256"].__setitem__(METADATA, file_digest(f / METADATA))))
    return f"{METADATA} is not torch.distributed.checkpoint metadata"


GROUPS = {  # step -> damage; the resume takes the newest undamaged step
    "flips-manifest-missing": {5: _flip_rank_file, 4: _flip_metadata, 3: _manifest_disagrees, 2: _missing_rank_file},
    "replaced-files": {5: _random_bytes, 4: _truncated, 3: _empty, 2: _another_steps_file,
                       1: _garbage_metadata_rehashed},
}


def damaged_copy(src: Path, dest: Path, damages: dict) -> dict[int, str]:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".mpress.lock"))
    return {step: damage(step_folder(dest, step), src) for step, damage in damages.items()}


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_a_resume_passes_over_every_damaged_step_and_continues_from_the_one_it_names(source, tmp_path, group):
    src, src_losses = source
    ck = tmp_path / "ck"
    why = damaged_copy(src, ck, GROUPS[group])
    resumed_from = min(why) - 1
    # one step after the one resumed from, keep_last 2: the lineage's steps count, whichever run saved them
    code, out, err = train(config(tmp_path, ck, resumed_from + 2, resume=True, keep_last=2), tmp_path / "run")
    assert code == 0, err[-3000:]
    lines = [x for x in out.splitlines() if x.startswith("resuming from ")]
    assert len(lines) == 1, out
    line = lines[0]
    said = int(re.match(r"resuming from \S+ \(step (\d+) of run ", line).group(1))
    assert said == resumed_from and line.startswith(f"resuming from {step_folder(ck, said)} ")
    for step, reason in why.items():
        assert f"step{step:06d} ({reason}" in line, (step, line)
    assert "Traceback" not in out + err
    # the one step trained equals the undamaged run's: the state loaded was step `said`'s
    assert losses(out) == {said + 1: src_losses[said + 1]}
    assert_states_equal(read_step(step_folder(src, said + 1)), read_step(step_folder(ck, said + 1)))
    kept = sorted(p.name for p in ck.iterdir() if p.name.startswith("step"))
    assert kept[:2] == [f"step{said:06d}", f"step{said + 1:06d}"], kept  # older steps of the lineage pruned
    assert not [p for p in ck.iterdir() if p.name.startswith(TEMP_PREFIX)]


@pytest.mark.slow
def test_no_step_that_verifies_is_one_line_and_exit_2_before_any_step(source, tmp_path):
    ck = tmp_path / "ck"
    why = damaged_copy(source[0], ck, {s: _flip_rank_file for s in range(SAVED)})
    code, out, err = train(config(tmp_path, ck, SAVED + 2, resume=True), tmp_path / "run")
    line = one_line_error(code, err, f"{ck}: checkpoint.resume: no complete checkpoint to resume from: ",
                          *(f"step{s:06d} ({r}" for s, r in why.items()))
    assert not losses(out), line


@pytest.mark.slow
def test_a_checkpoint_of_another_seed_is_refused_and_another_world_size_is_carried(source, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(source[0], ck, ignore=shutil.ignore_patterns(".mpress.lock"))
    code, out, err = train(config(tmp_path, ck, SAVED + 1, {"seed": 5}, resume=True), tmp_path / "run")
    one_line_error(code, err, f"{step_folder(ck, SAVED - 1) / MANIFEST}: seed: the checkpoint's is 0, this run's 5")
    assert not losses(out)
    code, out, err = train(config(tmp_path, ck, SAVED + 1, {"num_stages": 1}, resume=True), tmp_path / "run")
    assert code == 0, err[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("resuming from "))
    assert f"(step {SAVED - 1} of run " in line and "saved on 2 ranks" in line and "now 1 ranks" in line
    assert "resharded by parameter name" in line and losses(out).keys() == {SAVED}


@pytest.mark.slow
def test_a_directory_in_use_is_refused_in_one_line(source, tmp_path):
    """While a run trains, a second run on its checkpoint.dir, or on its run directory, is
    refused before it starts a rank; once the first has ended the directory is free."""
    ck = tmp_path / "ck"
    first = TrainRun.start(config(tmp_path, ck, 1000), tmp_path)
    try:
        first.wait_for(r"^step 0: loss")
        launcher = first.info()["launcher_pid"]
        code, _out, err = train(config(tmp_path, ck, 2, resume=True), tmp_path / "other-run", in_process=True)
        one_line_error(code, err, f"checkpoint.dir: {ck} is in use by another run (pid {launcher} on ")
        code, _out, err = train(config(tmp_path, tmp_path / "other-ck", 2), first.run_dir, in_process=True)
        one_line_error(code, err, f"--run-dir: {first.run_dir} is in use by another run (pid {launcher} on ")
        assert not (tmp_path / "other-ck").exists()
    finally:
        first.proc.send_signal(signal.SIGTERM)
        assert first.finish() == 128 + signal.SIGTERM
    DirectoryLock(ck, "checkpoint.dir").release()
    DirectoryLock(first.run_dir, "--run-dir").release()


def test_a_dangling_symlink_checkpoint_dir_is_refused(tmp_path):
    (tmp_path / "ck").symlink_to(tmp_path / "elsewhere" / "ck")
    code, _out, err = train(config(tmp_path, tmp_path / "ck", 2), tmp_path / "run", in_process=True)
    one_line_error(code, err, f"checkpoint.dir: {tmp_path / 'ck'} is a symbolic link to {tmp_path / 'elsewhere'}")
    assert not (tmp_path / "elsewhere").exists()


def _tmpfs_available() -> bool:
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d && umount $d; rmdir $d"
    return shutil.which("unshare") is not None and \
        subprocess.run(["unshare", "-rm", "sh", "-c", probe], check=False, capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _tmpfs_available(), reason="no user and mount namespaces (unshare -rm) to mount a small tmpfs")
def test_a_full_disk_removes_the_partial_save_and_names_its_path(tmp_path):
    """A 5 MB tmpfs holds one step (3.2 MB) but not two: step 1's save fails."""
    disk = tmp_path / "disk"
    disk.mkdir()
    ck = disk / "ck"
    cfg = config(tmp_path, ck, 3, keep_last=1)
    verify = (f"from pathlib import Path; from mpress.launcher.checkpoints.manifest import read_complete; "
              f"m, why = read_complete(Path({str(step_folder(ck, 0))!r}), verify=True); print('step 0 verifies:', "
              "m is not None and m.step == 0, why)")
    script = (f"mount -t tmpfs -o size=5m tmpfs {disk} && {sys.executable} -m mpress train --config {cfg} "
              f"--run-dir {tmp_path / 'run'} 2>{tmp_path / 'err'}; echo rc=$?; "
              f"find {disk} -mindepth 1 -printf '%P\\n'; {sys.executable} -c \"{verify}\"")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    out, err = done.stdout, (tmp_path / "err").read_text()
    code = int(re.search(r"^rc=(\d+)$", out, re.MULTILINE).group(1))
    tmp = re.search(rf"the partial save ({re.escape(str(ck))}/{re.escape(TEMP_PREFIX)}\S+-step000001) is removed",
                    err)
    assert tmp, err
    one_line_error(code, err, "checkpoint of step 1 not saved: rank ", f"could not write {ck}/{TEMP_PREFIX}",
                   "free on its filesystem", status=1)
    left = out.split("rc=")[1].splitlines()[1:-1]
    assert sorted(left) == sorted(["ck", "ck/.mpress.lock", "ck/step000000", *(f"ck/step000000/{n}" for n in (
        MANIFEST, METADATA, RANK0, RANK1))]), out
    assert out.splitlines()[-1] == "step 0 verifies: True ", out
    assert "checkpoint of step 0 saved" in out and losses(out).keys() == {0, 1}
