"""A step's content is verified before it is resumed, keep_last counts a lineage, and one
run holds a directory at a time (no torch.distributed; the steps are DCP's own files,
written in one process). The same cases through `mpress train`, with the ranks resuming:
tests/launcher/test_checkpoint_damage.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mpress.errors import UserError
from mpress.launcher.checkpoints.manifest import (
    MANIFEST,
    METADATA,
    file_digest,
    newest_complete,
    prune,
    read_complete,
    step_folder,
)
from mpress.launcher.checkpoints.directories import LOCK_FILE, DirectoryLock
from tests.launcher.test_checkpoint_manifest import save_step

DATA = "__0_0.distcp"


def flip(path: Path, at: int | None = None, count: int = 8) -> None:
    """Invert `count` bytes of `path` in place (the middle by default): same size, other content."""
    raw = bytearray(path.read_bytes())
    start = len(raw) // 2 if at is None else at
    for i in range(start, min(len(raw), start + count)):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def rewrite_manifest(folder: Path, change) -> None:
    data = json.loads((folder / MANIFEST).read_text())
    change(data)
    (folder / MANIFEST).write_text(json.dumps(data))


def _same_size_from_another_run(folder: Path, other: Path) -> None:
    assert (other / DATA).stat().st_size == (folder / DATA).stat().st_size
    shutil.copyfile(other / DATA, folder / DATA)


def _garbage_metadata_listed(folder: Path) -> None:
    """.metadata replaced by garbage and the manifest rewritten to match it: the hashes agree."""
    (folder / METADATA).write_bytes(b"\x80\x04garbage, not a pickle of DCP's metadata")
    rewrite_manifest(folder, lambda d: (d["files"].__setitem__(METADATA, (folder / METADATA).stat().st_size),
                                        d["sha256"].__setitem__(METADATA, file_digest(folder / METADATA))))


def _data_file_unlisted(folder: Path) -> None:
    """The data file removed and the manifest rewritten without it: every listed file is there."""
    (folder / DATA).unlink()
    rewrite_manifest(folder, lambda d: (d["files"].pop(DATA), d["sha256"].pop(DATA)))


@pytest.mark.parametrize("damage, why", [
    (lambda f, o: flip(f / DATA), f"{DATA} does not match its sha256 in manifest.json"),
    (lambda f, o: flip(f / METADATA), f"{METADATA} does not match its sha256 in manifest.json"),
    (_same_size_from_another_run, f"{DATA} does not match its sha256 in manifest.json"),
    (lambda f, o: _garbage_metadata_listed(f), f"{METADATA} is not torch.distributed.checkpoint metadata"),
    (lambda f, o: _data_file_unlisted(f), f"{METADATA} reads {DATA}, which manifest.json does not list"),
    (lambda f, o: rewrite_manifest(f, lambda d: d.pop("sha256")), f"{METADATA} has no sha256 in manifest.json"),
])
def test_a_step_whose_content_does_not_verify_is_passed_over_naming_file_and_why(tmp_path, damage, why):
    root, other = tmp_path / "ck", tmp_path / "other"
    save_step(root, 1)
    folder = save_step(root, 2)
    save_step(other, 2, run_id="other", seed=0)  # the same keys and shapes: files of the same size
    (other / "step000002" / DATA).write_bytes(bytes(b ^ 1 for b in (other / "step000002" / DATA).read_bytes()))
    damage(folder, other / "step000002")
    assert read_complete(folder, verify=False)[0] is not None  # sizes and presence alone miss every one
    found, m, skipped = newest_complete(root, verify=True)
    assert found == step_folder(root, 1) and m.step == 1
    assert len(skipped) == 1 and skipped[0].startswith("step000002 (") and why in skipped[0], skipped


def test_keep_last_counts_the_steps_of_every_run_of_one_lineage(tmp_path):
    """Run A saved steps 0-4; run B resumed from A's step 4 (A's lineage) and saved 5 and 6:
    keep_last 3 keeps 4, 5 and 6 whichever run wrote them; another lineage's steps stay."""
    for step in range(5):
        save_step(tmp_path, step, run_id="A")
    for step in (5, 6):
        save_step(tmp_path, step, run_id="B", lineage="A")
    save_step(tmp_path, 9, run_id="C")  # unrelated: its own lineage
    prune(tmp_path, keep_last=3, lineage="A")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000004", "step000005", "step000006", "step000009"]


def test_keep_last_leaves_the_steps_above_the_one_saved_alone(tmp_path):
    """Run A saved 0-5; run B resumed from step 1 (2-5 passed over) and saved step 2: the
    lineage's steps up to 2 are counted (1 and 2 kept, 0 removed), 3-5 are not touched
    (they would otherwise count as the newest and remove the step just saved)."""
    for step in range(6):
        save_step(tmp_path, step, run_id="A")
    save_step(tmp_path, 2, run_id="B", lineage="A")
    prune(tmp_path, keep_last=2, lineage="A", upto=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step{s:06d}" for s in range(1, 6)]


def test_a_directory_held_by_a_run_is_refused_until_it_ends(tmp_path):
    with DirectoryLock(tmp_path / "d", "checkpoint.dir", run_id="first"):
        with pytest.raises(UserError) as err:
            DirectoryLock(tmp_path / "d", "checkpoint.dir", run_id="second")
        line = str(err.value)
        assert line.startswith(f"checkpoint.dir: {tmp_path / 'd'} is in use by another run (pid {os.getpid()} on ")
        assert "run first" in line and "\n" not in line
    DirectoryLock(tmp_path / "d", "checkpoint.dir").release()  # released: free again


def test_a_killed_holder_leaves_the_directory_free(tmp_path):
    code = ("import sys, time; from pathlib import Path; from mpress.launcher.checkpoints.directories import DirectoryLock; "
            f"lock = DirectoryLock(Path({str(tmp_path / 'd')!r}), '--run-dir'); print('held', flush=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"pid {proc.pid} on "):
            DirectoryLock(tmp_path / "d", "--run-dir")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    DirectoryLock(tmp_path / "d", "--run-dir").release()
    assert (tmp_path / "d" / LOCK_FILE).exists()  # the file stays, unlocked


def test_a_dangling_symlink_is_refused_not_followed(tmp_path):
    (tmp_path / "ck").symlink_to(tmp_path / "gone" / "ck")
    with pytest.raises(UserError) as err:
        DirectoryLock(tmp_path / "ck" / "sub", "checkpoint.dir")
    assert str(err.value) == (f"checkpoint.dir: {tmp_path / 'ck'} is a symbolic link to {tmp_path / 'gone' / 'ck'}, "
                              "which does not exist: create its target or give another directory")
    assert not (tmp_path / "gone").exists()
