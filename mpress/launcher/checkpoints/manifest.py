"""What a checkpoint directory holds, and which of its steps a job may resume from.

Layout of `checkpoint.dir`:

    step000005/                  a complete step: renamed here whole
        manifest.json            rank 0's, written last: who wrote the step and what it lists
        .metadata, __0_0.distcp  torch.distributed.checkpoint's files (one data file per rank)
    .tmp-<run id>-step000006/    a step being written (or left by a killed run): never read

A step is written into a temporary folder and renamed to `stepNNNNNN` once every rank has
written its files and rank 0 its manifest, so a folder named `stepNNNNNN` never mixes two
runs. It is *complete* only when its manifest parses and every file the manifest lists is
there with the size it lists (a kill during a write, a copy cut short, a file removed by
hand: not complete, never resumed). A resume also *verifies* the step it takes
(`read_complete(verify=True)`): every listed file's sha256 equals the manifest's (a byte
flipped in place, another run's file of the same size: caught), `.metadata` parses as
DCP's metadata, and every data file it reads from is listed. A step that fails is passed
over, named with the file and the reason, for the newest one that verifies. `prune`
keeps the newest `keep_last` complete steps of the run's lineage (the runs that resumed
one from another) and removes temporary folders; only one run uses a directory at a
time (`mpress.launcher.checkpoints.directories`), so no other save is under way.

What must match for a resume (`identity`): the model's dtype, the model (its
fingerprint: layer shapes, sizes, dropout, dtype) and the seed (the seed also draws the synthetic data). The
world size, the stage split and the plan may differ: the state is keyed by parameter name
and resharded on load (`mpress.launcher.checkpoints.checkpoint`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from mpress.config.loader import check_output_path, to_dict
from mpress.config.model_config import ModelConfig
from mpress.errors import ConfigError
from mpress.launcher.checkpoints.directories import check_no_dangling_link
from mpress.runtime.train_config import TrainConfig, model_config

MANIFEST = "manifest.json"
METADATA = ".metadata"
"""DCP's index of the step: which file holds each key, at which offset."""
FORMAT = 2
"""Version of the manifest and of the checkpoint's key layout (2: with sha256 and lineage)."""
HASH = "sha256"
TEMP_PREFIX = ".tmp-"
"""Names of folders (and files) being written; what a save leaves under it when killed."""
_STEP = re.compile(r"step(\d{6,})")


@dataclass(kw_only=True)
class Manifest:
    """Rank 0's record of one saved step (`manifest.json`)."""

    format: int = FORMAT
    step: int
    """The step whose end state this is (the resume runs step + 1 next)."""
    run_id: str
    """The run that wrote it (one id per launch, shared by its ranks)."""
    model: str
    model_fingerprint: str
    dtype: str
    """The model's precision (fp32, bf16, fp16)."""
    seed: int
    plan_fingerprint: str | None
    """Hash of the plan the run executed; None for plain pipelining."""
    world_size: int
    """Ranks of one replica's pipeline."""
    stage_split: list[list[int]]
    """Layer range [start, end) of each stage."""
    schedule: str
    config: dict[str, Any]
    """The run's training config, as loaded."""
    files: dict[str, int] = field(default_factory=dict)
    """Every file of the step but the manifest: name -> bytes."""
    sha256: dict[str, str] = field(default_factory=dict)
    """Every file of `files`: name -> its content's sha256 (hex)."""
    lineage: str = ""
    """The run id of the first run of the chain this step belongs to: a run that resumed
    continues its checkpoint's lineage, any other starts its own (`keep_last` counts
    the steps of one lineage)."""
    dp: int = 1
    """Data-parallel replicas of the pipeline that saved it (they hold one state: dp rank
    0's is saved); a resume may run any number of them."""

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def identity(model: ModelConfig, seed: int) -> dict[str, object]:
    """The fields a resumed job must share with the checkpoint, in the order they are
    checked (the first that differs is the one reported)."""
    return {"dtype": model.precision, "model_fingerprint": model.fingerprint(), "seed": seed}


def step_folder(root: Path, step: int) -> Path:
    return root / f"step{step:06d}"


def temp_folder(root: Path, run_id: str, step: int) -> Path:
    return root / f"{TEMP_PREFIX}{run_id}-step{step:06d}"


def file_digest(path: Path) -> str:
    """The sha256 of `path`'s content (hex), read in chunks (`hashlib.file_digest`).
    Remembered per process by (device, inode, size, modification time): a step the
    start-up check verified is not read a second time by the resume."""
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        with open(path, "rb") as f:
            _DIGESTS[key] = hashlib.file_digest(f, HASH).hexdigest()
    return _DIGESTS[key]


_DIGESTS: dict[tuple[int, int, int, int], str] = {}


def write_manifest(folder: Path, manifest: Manifest, digests: dict[str, str] | None = None) -> None:
    """List the files in `folder` into `manifest`, with their sizes and sha256, and write it
    there (through a temporary file: the manifest is whole or absent). `digests`: the
    sha256 of files hashed already (each rank hashes the files it wrote)."""
    names = [p.name for p in sorted(folder.iterdir())
             if p.is_file() and p.name != MANIFEST and not p.name.startswith(TEMP_PREFIX)]
    manifest.files = {name: (folder / name).stat().st_size for name in names}
    manifest.sha256 = {name: (digests or {}).get(name) or file_digest(folder / name) for name in names}
    tmp = folder / f"{TEMP_PREFIX}{MANIFEST}"
    tmp.write_text(json.dumps(to_dict(manifest), indent=1))
    tmp.replace(folder / MANIFEST)


def read_complete(folder: Path, *, verify: bool = False) -> tuple[Manifest | None, str]:
    """The manifest of `folder` if the step is complete (and, with `verify`, its content
    verified: see the module docstring), else None and why not (naming the file)."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text())
        manifest = Manifest(**data)
    except FileNotFoundError:
        held = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        return None, f"no manifest.json; it holds {shown or 'nothing'}"
    except (OSError, ValueError, TypeError) as exc:
        return None, f"unreadable manifest.json ({exc})"
    if manifest.format != FORMAT:
        return None, f"manifest format {manifest.format}, this mpress reads {FORMAT}"
    for name, size in manifest.files.items():
        try:
            actual = (folder / name).stat().st_size
        except OSError:
            return None, f"{name} listed in manifest.json is missing"
        if actual != size:
            return None, f"{name} is {actual} bytes, manifest.json lists {size}"
    why = _verify(folder, manifest) if verify else ""
    return (None, why) if why else (manifest, "")


def _verify(folder: Path, manifest: Manifest) -> str:
    """Why the complete step `folder` cannot be loaded ("": it can): a file whose content
    is not the one saved, DCP's metadata unreadable, or a data file it reads unlisted."""
    for name in manifest.files:
        saved = manifest.sha256.get(name)
        if saved is None:
            return f"{name} has no {HASH} in manifest.json"
        try:
            actual = file_digest(folder / name)
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror})"
        if actual != saved:
            return f"{name} does not match its {HASH} in manifest.json: its content changed after the save"
    if METADATA not in manifest.files:
        return f"manifest.json does not list {METADATA}"
    try:
        metadata = dcp.FileSystemReader(folder).read_metadata()
        read_from = {info.relative_path for info in (metadata.storage_data or {}).values()}
    except Exception as exc:  # noqa: BLE001 -- a pickle of anything else: unpickling may raise any error
        return f"{METADATA} is not torch.distributed.checkpoint metadata ({type(exc).__name__}: {exc})"
    unlisted = sorted(read_from - set(manifest.files))
    if unlisted:
        return f"{METADATA} reads {', '.join(unlisted)}, which manifest.json does not list"
    return ""


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """Folders named `stepNNNNNN` (complete or not), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.fullmatch(p.name))]
    return sorted(found)


def newest_complete(root: Path, *, verify: bool = False) -> tuple[Path | None, Manifest | None, list[str]]:
    """The newest complete (with `verify`: and verified) step: its folder and manifest
    (None, None if there is none), and one note per newer folder passed over, with why."""
    skipped: list[str] = []
    for _step, folder in reversed(step_folders(root)):
        manifest, why = read_complete(folder, verify=verify)
        if manifest is not None:
            return folder, manifest, skipped
        skipped.append(f"{folder.name} ({why})")
    return None, None, skipped


def check_resumable(manifest: Manifest, folder: Path, expected: dict[str, object]) -> None:
    """A `ConfigError` naming the manifest file and the first field of `expected` (see
    `identity`) that the checkpoint does not share."""
    saved = to_dict(manifest)
    for key, value in expected.items():
        if saved[key] != value:
            raise ConfigError(str(folder / MANIFEST), key,
                              f"the checkpoint's is {saved[key]!r}, this run's {value!r}: it is not this run's "
                              "checkpoint (set checkpoint.resume: false or use another checkpoint.dir)")


def lineage_of(manifest: Manifest) -> str:
    return manifest.lineage or manifest.run_id


def prune(root: Path, keep_last: int, lineage: str, *, upto: int | None = None) -> list[Path]:
    """Remove the complete steps of `lineage` (this run's and those of the runs it resumed
    from) numbered up to `upto` (the step just saved; None: all) older than the newest
    `keep_last` of them, and every temporary entry (left by killed saves; call when no
    save of this job is under way). Returns what was removed. Steps numbered above `upto`
    are another branch of the lineage (a resume from an earlier step, the newer ones
    passed over): never counted, never removed here (the run replaces each as it saves
    that step). Other lineages' steps are never removed (a run numbered from 0 must not
    delete its own newest step for an unrelated older run's higher numbers), nor folders
    named `stepNNNNNN` that are not complete (not this format's; a user may want them).
    Completeness here is by sizes (`read_complete` without `verify`): no step is hashed
    on every save."""
    removed: list[Path] = []
    complete = [folder for step, folder in step_folders(root) if upto is None or step <= upto
                if (m := read_complete(folder)[0]) is not None and lineage_of(m) == lineage]
    for folder in complete[:-keep_last]:
        shutil.rmtree(folder)
        removed.append(folder)
    for p in root.iterdir():
        if p.name.startswith(TEMP_PREFIX):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            removed.append(p)
    return removed


def publish(tmp: Path, final: Path) -> None:
    """Rename the written step `tmp` to `final`; a step of that number already there (an
    earlier run's) is moved aside first and removed after."""
    aside = None
    if final.exists():
        aside = tmp.with_name(f"{tmp.name}-replaced")
        final.rename(aside)
    tmp.rename(final)
    if aside is not None:
        shutil.rmtree(aside)


def check_checkpoint_dir(cfg: TrainConfig) -> None:
    """Start-up check of `checkpoint.dir`, before any training: a directory that can be
    made and written (the rule every output path of a config follows,
    `mpress.config.loader.output_path_problem`), and under `checkpoint.resume` its newest
    complete step must verify (`read_complete(verify=True)`) and be this run's
    (`identity`). Every failure is one `UserError`. Reads only: safe to call on every
    rank at once."""
    if cfg.checkpoint.dir is None:
        return
    root = Path(cfg.checkpoint.dir)
    check_output_path(root, "", "checkpoint.dir", "dir")
    check_no_dangling_link(root, "checkpoint.dir")
    folder, manifest, skipped = newest_complete(root, verify=cfg.checkpoint.resume)
    if not cfg.checkpoint.resume:
        if manifest is not None:  # a new run's steps beside them: a later resume would take the highest number
            raise ConfigError(str(root), "checkpoint.resume", f"false, but the directory holds complete "
                                                              f"checkpoints (newest {folder.name}, run {manifest.run_id}); "
                                                              "set checkpoint.resume: true to continue from it, or "
                                                              "use another checkpoint.dir")
        return
    if manifest is not None:
        # a user's or Hugging Face module is built on the meta device: its identity is its
        # structure and dtype (a 7B model is not built for real to be compared)
        meta = cfg.module is not None or cfg.hf_config is not None
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = model_config(cfg)
        check_resumable(manifest, folder, identity(model, cfg.seed))
    elif skipped:  # step folders, none of them a checkpoint: never restart from step 0 unasked
        raise ConfigError(str(root), "checkpoint.resume", f"no complete checkpoint to resume from: "
                                                         f"{'; '.join(skipped)} (not written by this mpress, "
                                                         "its save never finished, or damaged since); move them "
                                                         "away or set resume: false to start at step 0")
