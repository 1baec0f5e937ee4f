"""A job's checkpoint state takes no device memory the plan does not have.

Saving builds the state on the host one tensor at a time; the optimizer data the plan
offloads comes to the device one layer's chunk at a time (as for its optimizer step) and
goes out again, storage released, before the next. Resuming copies into the tensors that
already hold the values (parameters, masters, optimizer states) and loads files to the
host (DCP reads into host tensors), never to the device a file was written from.

On a CPU rank, "device" and "host" are one torch device, so the tests watch the rank's
live-bytes tracker: every storage made while saving or resuming counts there. What the
returned state holds is what a GPU run would have on the host; anything beyond it is what
the device would have to find room for: at most one offloaded chunk. A one-rank gloo job
(gpt-tiny, bf16 masters, layers 0 and 1's optimizer data on the host). The CUDA test
checks the allocator's peak on a real GPU. Resumed runs equal to uninterrupted ones bit
for bit are checked by test_optimizer_runs.py and the launcher tests."""

from __future__ import annotations

import dataclasses
import pytest
import torch

from mpress.launcher.checkpoints.checkpoint import Checkpoints
from mpress.contract.live_bytes import LiveBytes, tensors_in
from mpress.config.model_config import load_model_config
from mpress.contract.plan import TensorRule
from mpress.runtime.train_config import CheckpointConfig, TrainConfig
from mpress.runtime.trainer import JobSpec, PipelineJob
from tests.support.compare import assert_masters_equal, assert_states_equal
from tests.support.plans import pipeline_plan
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES, batch

NUM_MICROBATCHES = 2
OFFLOADED = ("layers.0", "layers.1")
BYTES_PER_PARAM_OFFLOADED = 12
"""fp32 master + Adam's exp_avg and exp_avg_sq, 4 bytes each."""


def spec(lr: float = 1e-3) -> JobSpec:
    cfg = dataclasses.replace(load_model_config(MODEL), precision="bf16")
    return JobSpec(model=cfg, schedule="1f1b", ranges=RANGES[1], microbatch_size=MICROBATCH_SIZE,
                   num_microbatches=NUM_MICROBATCHES, seed=3, lr=lr)


def make_job(device: str = "cpu", lr: float = 1e-3) -> PipelineJob:
    s = spec(lr)
    rules = [TensorRule(tensor=f"optim:{layer}", technique="host") for layer in OFFLOADED]
    plan = pipeline_plan("1f1b", 1, NUM_MICROBATCHES, {0: rules}, model=s.model)
    return PipelineJob(s, plan, torch.device(device))


def train(job: PipelineJob, steps: range) -> None:
    for step in steps:
        job.step(*batch(step, NUM_MICROBATCHES))


def held_bytes(state: dict, live: LiveBytes) -> int:
    """Bytes of the distinct storages the state holds that the tracker counts (made while
    it watched: on a GPU they would be host memory)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors_in(state)
                if live.counts(t)}
    return sum(storages.values())


def chunk_bytes(job: PipelineJob, block_bytes: int = 1) -> dict[str, int]:
    """Per offloaded layer: the bytes of its optimizer chunk on the device, each of its
    tensors rounded up to `block_bytes` (CUDA's caching allocator: 512)."""
    params = dict(job.module.named_parameters())
    per_tensor = BYTES_PER_PARAM_OFFLOADED // 3
    return {layer: sum(3 * -(-params[n].numel() * per_tensor // block_bytes) * block_bytes for n in names)
            for layer, names in job.params[0].items() if layer in OFFLOADED}


def device_tensors(job: PipelineJob) -> dict[str, int]:
    """Storage of every parameter, master and optimizer state that stays on the device."""
    out = {f"param {n}": p.untyped_storage()._cdata for n, p in job.module.named_parameters()}
    for name in job.masters.names():
        target = job.masters.target(name)
        if target.numel():
            out[f"master {name}"] = target.untyped_storage()._cdata
        for part, t in job.optimizer.state.get(target, {}).items():
            if part != "step":
                out[f"{part} {name}"] = t.untyped_storage()._cdata
    return out


@pytest.fixture
def job(group):
    torch.manual_seed(7)
    j = make_job()
    train(j, range(2))
    yield j
    j.close()


def test_saving_holds_the_state_on_the_host_and_one_offloaded_chunk_at_a_time(job):
    live: LiveBytes = job.live
    chunks = chunk_bytes(job)
    assert len(chunks) == 2 and all(chunks.values())
    base = live.live_bytes
    live.reset_peak()
    with live.watch():
        state = job.state()
    held = held_bytes(state, live)
    beyond = live.peak_bytes - base - held
    assert beyond <= max(chunks.values()), (
        f"saving took {beyond:,} B beyond the saved state; one offloaded chunk is {max(chunks.values()):,} B")
    assert live.live_bytes == base + held, "offloaded chunks stayed on the device after the save"


def test_resuming_copies_in_place_and_brings_one_offloaded_chunk_at_a_time(job):
    saved = job.state()
    train(job, range(2, 3))  # move on, then go back to the saved state
    before = device_tensors(job)
    live: LiveBytes = job.live
    base = live.live_bytes
    live.reset_peak()
    with live.watch():
        job.load_state(saved)
    moved = sorted(k for k, v in device_tensors(job).items() if before.get(k) != v)
    assert moved == [], f"resuming replaced device tensors instead of copying into them: {moved[:4]}"
    beyond = live.peak_bytes - base
    assert beyond <= max(chunk_bytes(job).values()), f"resuming took {beyond:,} B on the device"
    assert live.live_bytes == base, "offloaded chunks stayed on the device after the resume"
    again = job.state()
    assert_states_equal(saved, again)
    assert_masters_equal(saved, again)


def test_a_resume_trains_with_the_jobs_hyperparameters_not_the_checkpoints(job):
    """The config is what runs: a resume with another learning rate (`--optimizer.lr`)
    steps with it; torch's load_state_dict would put the checkpoint's back silently."""
    saved = job.state()
    assert saved["optimizer"]["param_groups"][0]["lr"] == job.spec.lr
    other = make_job(lr=job.spec.lr / 4)
    try:
        other.load_state(saved)
        assert [g["lr"] for g in other.optimizer.param_groups] == [job.spec.lr / 4]
    finally:
        other.close()


def test_a_dcp_checkpoint_resumes_in_place_and_leaves_nothing_on_the_device(job, tmp_path, capsys):
    """The whole path, through torch.distributed.checkpoint's files: the resumed job holds
    what was saved, in the tensors it had (copied in place), and once the resume is done
    nothing it read stays on the device (DCP reads into host tensors; on a CPU rank they
    count here while they live, so the peak is not the device's: the CUDA test checks it)."""
    cfg = TrainConfig(model=MODEL, checkpoint=CheckpointConfig(dir=str(tmp_path), resume=True), seed=3)
    ckpt = Checkpoints(cfg, job, None)
    saved = job.state()
    ckpt.save(4)
    assert f"checkpoint of step 4 saved to {tmp_path / 'step000004'}" in capsys.readouterr().out
    train(job, range(2, 3))
    before = device_tensors(job)
    live: LiveBytes = job.live
    base = live.live_bytes
    with live.watch():
        assert ckpt.resume() == 5
    moved = sorted(k for k, v in device_tensors(job).items() if before.get(k) != v)
    assert moved == [], f"resuming replaced device tensors instead of copying into them: {moved[:4]}"
    assert live.live_bytes == base, "the resume left tensors behind on the device"
    again = job.state()
    assert_states_equal(saved, again)
    assert_masters_equal(saved, again)


@pytest.mark.cuda
@pytest.mark.parametrize("through", ["state", "dcp"])
def test_cuda_save_and_resume_add_no_copy_of_the_model_or_optimizer(group, tmp_path, through):
    """On a GPU the allocator counts device bytes only: saving and resuming (the job's state
    alone, or the whole DCP checkpoint) take at most one offloaded chunk."""
    torch.manual_seed(7)
    j = make_job("cuda")
    cfg = TrainConfig(model=MODEL, checkpoint=CheckpointConfig(dir=str(tmp_path), resume=True), seed=3)
    ckpt = Checkpoints(cfg, j, None)
    try:
        train(j, range(2))
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.synchronize(device)
        resident = torch.cuda.memory_allocated(device)
        chunk = max(chunk_bytes(j, block_bytes=512).values())
        torch.cuda.reset_peak_memory_stats(device)
        state = j.state()
        if through == "dcp":
            ckpt.save(1)
        assert all(t.device.type == "cpu" for t in tensors_in(state))
        saved_peak = torch.cuda.max_memory_allocated(device) - resident
        train(j, range(2, 3))
        torch.cuda.synchronize(device)
        resident = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        if through == "dcp":
            assert ckpt.resume() == 2
        else:
            j.load_state(state)
        loaded_peak = torch.cuda.max_memory_allocated(device) - resident
        # a copy of what stays on the device (parameters, kept masters and states) is
        # more than one offloaded chunk may take
        assert chunk < resident
        assert saved_peak <= chunk, f"saving took {saved_peak:,} B on the GPU (one chunk: {chunk:,} B)"
        assert loaded_peak <= chunk, f"resuming took {loaded_peak:,} B on the GPU (one chunk: {chunk:,} B)"
        assert_states_equal(state, j.state())
    finally:
        j.close()
