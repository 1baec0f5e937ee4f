"""Checkpoints on torch.distributed.checkpoint (DCP), keyed by parameter name.

One step is one DCP checkpoint of the whole job: every rank saves what it holds under
global keys

    model.<name>                       parameters and buffers (the stages keep the whole
                                       model's module paths: names are global)
    optimizer.state.<name>.<state>     Adam's exp_avg, exp_avg_sq, step of parameter <name>
    optimizer.param_groups             the hyperparameters (the same on every rank)
    masters.<name>                     fp32 master weights (mixed precision only)
    skips                              the steps skipped so far (`StepGuard.state_dict`)
    rng.rank<r>                        rank r's generator states

and a resume loads, on every rank, the keys of the parameters it holds now, whatever rank
saved them: a checkpoint of 4 ranks resumes on 2, or on another stage split or plan.
Data-parallel replicas (`dp`) hold one state: replica 0's ranks save it (the others only
their generators), and every replica loads it, so a checkpoint resumes on any `dp`. The
files, the manifest, what makes a step complete and how a resume verifies it (each
rank hashes the files it wrote; rank 0 records the hashes; a resume checks them before
DCP reads a byte): `mpress.launcher.checkpoints.manifest`. A save that fails (a full
disk) removes its temporary folder and stops the run with a `CheckpointWriteError`
naming the path.

No checkpoint takes device memory the plan has not planned: the state is built on the
host one tensor at a time (offloaded optimizer data one layer's chunk at a time) and DCP
writes those host tensors; a resume reads into host tensors and copies them into the
job's tensors in place (`mpress.runtime.job_state`). DCP runs over the gloo control group
(NCCL cannot move the host tensors DCP's planning exchanges).

RNG: dropout draws from each rank's generator, whose stream depends on which stages the
rank runs. A resume on the same world size and stage split restores every rank's
generators, so it continues bit for bit. On another world size or split the saved
streams have no rank to go to: every rank is reseeded from (seed, step, rank), which is
deterministic but not the stream an uninterrupted run on the new layout would have drawn
(with `dropout: 0` nothing draws from it, and a resharded resume equals an uninterrupted
run on its own layout bit for bit). The resume line says which of the two happened.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from mpress.config.loader import to_dict
from mpress.config.units import fmt_bytes
from mpress.contract.plan import fingerprint
from mpress.errors import ConfigError, MpressError, UserError
from mpress.launcher.checkpoints.manifest import (
    MANIFEST,
    METADATA,
    Manifest,
    check_resumable,
    file_digest,
    identity,
    lineage_of,
    newest_complete,
    prune,
    publish,
    step_folder,
    temp_folder,
    write_manifest,
)
from mpress.launcher.control import broadcast
from mpress.runtime.train_config import TrainConfig
from mpress.runtime.trainer import PipelineJob

_STATE = "optimizer.state."
_GROUPS = "optimizer.param_groups"
_SKIPS = "skips"


class Checkpoints:
    """Saving and resuming one job's checkpoints in `cfg.checkpoint.dir` (no directory:
    both do nothing). Made on every rank; `save` and `resume` are collectives over
    `control` (the gloo group)."""

    def __init__(self, cfg: TrainConfig, job: PipelineJob, control: dist.ProcessGroup | None, *,
                 dp_rank: int = 0) -> None:
        """dp_rank: the job's replica (`mpress.runtime.data_parallel`); only replica 0 saves
        the model and optimizer state, which every replica holds alike."""
        self.cfg = cfg
        self.dp_rank = dp_rank
        self.job = job
        self.control = control
        self.root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
        self.rank = dist.get_rank(control)
        self.run_id = str(broadcast(uuid.uuid4().hex[:12], control)) if self.root is not None else ""
        """One id for this launch, rank 0's: names its temporary folders and its manifests."""
        self.lineage = self.run_id
        """The first run of the chain of resumes this run continues (`resume` sets it):
        `keep_last` counts its steps."""

    # ---- save --------------------------------------------------------------------------

    def save(self, step: int) -> None:
        """Save the job's state after `step`: every rank's keys into a temporary folder
        (each rank hashes the files it wrote), rank 0's manifest, then the rename that
        makes the step complete; older steps of the lineage beyond `keep_last` and stale
        temporary folders are removed. Rank 0 prints one line. A write that fails (a full
        disk) removes the temporary folder and raises `CheckpointWriteError` naming the
        path, on every rank DCP's save reaches."""
        if self.root is None:
            return
        job = self.job
        tmp = temp_folder(self.root, self.run_id, step)
        flat = flatten(job.state()) if self.dp_rank == 0 else {}
        flat[f"rng.rank{self.rank}"] = rng_state(job.device)
        # the keys are flat already: values that are lists (the groups) are saved whole
        try:
            dcp.save(flat, storage_writer=dcp.FileSystemWriter(tmp), process_group=self.control,
                     planner=dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
            # DCP names a rank's data files after its rank in the group: `__<rank>_<n>.distcp`
            own = {p.name: file_digest(p) for p in tmp.glob(f"__{self.rank}_*")}
        except (CheckpointException, OSError) as exc:
            raise self._failed(step, tmp, exc) from None
        del flat
        digests: list[dict[str, str]] | None = [{} for _ in range(dist.get_world_size(self.control))] \
            if self.rank == 0 else None
        dist.gather_object(own, digests, group=self.control, group_dst=0)
        if self.rank == 0:  # every rank's files are written: DCP's save ends in a collective
            manifest = self._manifest(step)
            final = step_folder(self.root, step)
            try:
                write_manifest(tmp, manifest, {k: v for d in digests or [] for k, v in d.items()})
                publish(tmp, final)
            except OSError as exc:
                raise self._failed(step, tmp, exc) from None
            prune(self.root, self.cfg.checkpoint.keep_last, self.lineage, upto=step)
            print(f"checkpoint of step {step} saved to {final} ({manifest.total_bytes / 1e6:.2f} MB)", flush=True)
        dist.barrier(group=self.control)  # no rank leaves before the step is complete

    def _failed(self, step: int, tmp: Path, exc: BaseException) -> CheckpointWriteError:
        """The error of a save that failed; rank 0 removes its temporary folder (DCP's
        failure reaches every rank once every rank's writes have ended)."""
        rank, cause = self.rank, exc
        if isinstance(exc, CheckpointException):  # the first rank's own error
            rank, (cause, _trace) = next(iter(sorted(exc.failures.items())))
        path = getattr(cause, "filename", None) or tmp
        what = f"{cause.strerror} ({errno.errorcode.get(cause.errno, cause.errno)})" \
            if isinstance(cause, OSError) and cause.strerror else f"{type(cause).__name__}: {_first_line(cause)}"
        try:  # torch's writer may report a full disk as a short write ("unexpected pos"): say how full
            free = f" ({fmt_bytes(shutil.disk_usage(self.root).free)} free on its filesystem)"  # type: ignore[arg-type]
        except OSError:
            free = ""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointWriteError(f"checkpoint of step {step} not saved: rank {rank} could not write {path}: "
                                    f"{what}{free}; the partial save {tmp} is removed")

    def _manifest(self, step: int) -> Manifest:
        spec, plan = self.job.spec, self.job.plan
        return Manifest(step=step, run_id=self.run_id, model=spec.model.name,
                        **identity(spec.model, spec.seed),  # type: ignore[arg-type]
                        plan_fingerprint=None if plan is None else fingerprint(to_dict(plan)),
                        world_size=self.job.world, stage_split=[list(r) for r in spec.ranges],
                        schedule=str(spec.schedule), config=to_dict(self.cfg), dp=self.cfg.dp,
                        lineage=self.lineage)

    # ---- resume ------------------------------------------------------------------------

    def resume(self) -> int:
        """Load the newest complete, verified step when `checkpoint.resume` is set;
        returns the next step to run (0 without one). Rank 0 prints one line saying what
        was loaded and how (resharded or not, RNG restored or reseeded, newer steps passed
        over and why). Step folders none of which verifies, or a checkpoint of another
        model, dtype or seed: a `UserError` naming the folder or manifest and the field."""
        if self.root is None or not self.cfg.checkpoint.resume:
            return 0
        # rank 0 reads and verifies the directory: every rank loads the same step
        folder, manifest, skipped = broadcast(newest_complete(self.root, verify=True) if self.rank == 0 else None,
                                              self.control)  # type: ignore[misc]
        if manifest is None:
            if skipped:  # never a silent restart from step 0 over steps that are there
                raise ConfigError(str(self.root), "checkpoint.resume",
                                  f"no step verifies: {'; '.join(skipped)}; move them away or set resume: false "
                                  "to start at step 0")
            if self.rank == 0:
                print(f"no complete checkpoint in {self.root}: starting at step 0", flush=True)
            return 0
        job = self.job
        check_resumable(manifest, folder, identity(job.spec.model, job.spec.seed))
        self.lineage = lineage_of(manifest)
        split = [list(r) for r in job.spec.ranges]
        same_layout = manifest.world_size == job.world and manifest.stage_split == split and manifest.dp == self.cfg.dp
        reader = dcp.FileSystemReader(folder)
        try:
            metadata = reader.read_metadata()
        except Exception as exc:  # noqa: BLE001 -- verified, then changed: whatever unpickling raises
            raise UserError(f"{folder / METADATA}: not torch.distributed.checkpoint metadata "
                            f"({type(exc).__name__}: {exc})") from None
        dest = destination(job, metadata, folder, rng_of=self.rank if same_layout else None)
        try:
            dcp.load(dest, storage_reader=reader, process_group=self.control, planner=_planner())
        except CheckpointException as exc:
            rank, (cause, _trace) = next(iter(sorted(exc.failures.items())))
            raise UserError(f"{folder}: rank {rank} cannot read the checkpoint ({type(cause).__name__}: "
                            f"{_first_line(cause)})") from None
        job.load_state(unflatten(dest))
        if same_layout:
            set_rng_state(dest[f"rng.rank{self.rank}"], job.device)
        else:
            reseed(manifest.seed, manifest.step, self.rank)
        if self.rank == 0:
            print(self._resume_line(folder, manifest, same_layout, skipped), flush=True)
        return manifest.step + 1

    def _resume_line(self, folder: Path, m: Manifest, same_layout: bool, skipped: list[str]) -> str:
        job = self.job
        line = f"resuming from {folder} (step {m.step} of run {m.run_id}, saved on {_ranks(m.world_size, m.dp)}"
        if same_layout:
            line += "; same ranks and stage split: RNG streams restored"
        else:
            split = [list(r) for r in job.spec.ranges]
            line += (f", stages {m.stage_split}; now {_ranks(job.world, self.cfg.dp)}, stages {split}: resharded by parameter "
                     "name, each rank's RNG reseeded from (seed, step, rank)")
        plan = None if job.plan is None else fingerprint(to_dict(job.plan))
        if plan != m.plan_fingerprint:  # the state is keyed by parameter name: any plan can load it
            line += (f"; made under another plan ({m.plan_fingerprint or 'none'}, now {plan or 'none'}): carried, "
                     "the state is keyed by parameter name")
        if skipped:
            line += f"; passed over {'; '.join(skipped)}"
        return line + ")"


class CheckpointWriteError(MpressError):
    """A checkpoint could not be written (a full disk, a permission taken away): the
    message names the step, the path and the cause."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _ranks(pp: int, dp: int) -> str:
    return f"{pp} ranks" if dp == 1 else f"{dp} x {pp} ranks (dp x pp)"


# ---- the flat, name-keyed layout ----------------------------------------------------------


def flatten(state: dict[str, Any]) -> dict[str, Any]:
    """A job state (`mpress.runtime.job_state` layout) as DCP keys (see the module docstring)."""
    flat: dict[str, Any] = {f"model.{name}": t for name, t in state["model"].items()}
    for name, per_param in state["optimizer"]["state"].items():
        for key, value in per_param.items():
            flat[f"{_STATE}{name}.{key}"] = value
    # which parameters a group holds differs by rank; the hyperparameters do not
    flat[_GROUPS] = [{k: v for k, v in g.items() if k != "params"} for g in state["optimizer"]["param_groups"]]
    flat.update({f"masters.{name}": t for name, t in state.get("masters", {}).items()})
    if "skips" in state:
        flat[_SKIPS] = state["skips"]
    return flat


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """The job state of DCP keys (`flatten`'s inverse; `rng.*` keys are left out)."""
    state: dict[str, Any] = {"model": {}, "optimizer": {"state": {}, "param_groups": flat[_GROUPS]}, "masters": {}}
    if flat.get(_SKIPS) is not None:  # a checkpoint older than the counts has none
        state["skips"] = flat[_SKIPS]
    for key, value in flat.items():
        if key.startswith("model."):
            state["model"][key[len("model."):]] = value
        elif key.startswith("masters."):
            state["masters"][key[len("masters."):]] = value
        elif key.startswith(_STATE):
            name, _, part = key[len(_STATE):].rpartition(".")
            state["optimizer"]["state"].setdefault(name, {})[part] = value
    return state


def destination(job: PipelineJob, metadata: Metadata, folder: Path, *, rng_of: int | None) -> dict[str, Any]:
    """What this rank loads from a checkpoint: host tensors, shaped as the checkpoint has
    them, for the keys of the parameters and buffers it holds now (placeholders for
    non-tensor values, which DCP replaces), plus rank `rng_of`'s generators (None: none)."""
    saved = metadata.state_dict_metadata
    states: dict[str, list[str]] = {}
    for key in saved:
        if key.startswith(_STATE):
            name, _, _part = key[len(_STATE):].rpartition(".")
            states.setdefault(name, []).append(key)

    dest: dict[str, Any] = {_GROUPS: None}
    if _SKIPS in saved:
        dest[_SKIPS] = None
    for m in job.modules:
        for name in m.state_dict():
            key = f"model.{name}"
            if key not in saved:
                raise ConfigError(str(folder / MANIFEST), "model_fingerprint",
                                  f"the checkpoint has no tensor {name}, which this run's model has")
            dest[key] = _empty(saved[key])
    for name in job.masters.names():
        if f"masters.{name}" in saved:
            dest[f"masters.{name}"] = _empty(saved[f"masters.{name}"])
        for key in states.get(name, []):
            dest[key] = _empty(saved[key])
    if rng_of is not None:
        dest[f"rng.rank{rng_of}"] = None
    return dest


def read_step(folder: Path) -> dict[str, Any]:
    """The whole model's state saved in step folder `folder` (every rank's parameters),
    in the job-state layout, on the host: for inspection and tests, in one process."""
    reader = dcp.FileSystemReader(folder)
    saved = reader.read_metadata().state_dict_metadata
    flat = {key: _empty(md) for key, md in saved.items() if not key.startswith("rng.")}
    with warnings.catch_warnings():  # DCP warns that it runs in one process: it is asked to
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(flat, storage_reader=reader, planner=_planner(), no_dist=True)
    return unflatten(flat)


def _empty(md: Any) -> Any:
    """A host tensor to read a saved tensor into, or a placeholder DCP replaces by a saved object."""
    if isinstance(md, BytesStorageMetadata):
        return None
    return torch.empty(md.size, dtype=md.properties.dtype)


def _planner() -> dcp.DefaultLoadPlanner:
    """The keys are flat already: DCP reads each as it is named, objects whole."""
    return dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


# ---- RNG ----------------------------------------------------------------------------------


def rng_state(device: torch.device) -> dict[str, torch.Tensor | None]:
    """This process's generator states: the CPU's and, on CUDA, the device's (dropout on a
    GPU draws from its own generator)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict[str, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed every generator of this process from (seed, step, rank): a resume on another
    layout, where no saved stream belongs to this rank."""
    digest = hashlib.sha256(f"mpress-rng:{seed}:{step}:{rank}".encode()).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
