"""On a real GPU: the reserve a plan leaves on the device covers what CUDA keeps from the
nominal memory, the CUDA context and cuBLAS, as `mpress.hardware.probe` measures them
(in a fresh process, which makes the context). The reserve is the preset's whose device
has this GPU's name, else what `mpress.hardware.gpu_reserve` derives for it. NCCL's buffers need
peers and are not measured here. On CPU: the probe says in one line that there is no GPU.

The end-of-run report then compares like with like: the measured CUDA peak without
cuBLAS's workspaces, which the prediction counts in this reserve, not in the plan's peak
(`mpress.launcher.report.cublas_workspace_bytes`; on CPU with torch's allocator faked)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from mpress.errors import UserError
from mpress.hardware.gpu_reserve import (
    CUBLAS_HANDLES,
    CUBLAS_WORKSPACE_BYTES_HOPPER,
    reserve_for,
)
from mpress.hardware.probe import NO_GPU_EXIT, probe_gpu_memory
from mpress.hardware.server import MiB, load_hardware
from mpress.launcher.report import cublas_workspace_bytes, rank_report
from tests.support.cuda_fakes import FakeAllocator


@pytest.mark.cuda
def test_the_reserve_covers_what_this_gpu_takes_besides_the_plan():
    probe = probe_gpu_memory(0)
    reserve, source = reserve_for(probe.name, cuda_total_bytes=probe.total_bytes, hopper=probe.capability[0] == 9)
    print(f"{probe} -> reserve from {source}: {reserve}")
    assert probe.context_bytes > 0 and probe.cublas_bytes > 0, "the probe saw nothing"
    assert probe.context_bytes <= reserve.context_bytes, (
        f"{probe.name}: the CUDA context takes {probe.context_bytes:,} B ({probe.context_source}), "
        f"the reserve ({source}) allows {reserve.context_bytes:,} B")
    assert probe.cublas_bytes <= reserve.cublas_bytes, (
        f"{probe.name}: cuBLAS takes {probe.cublas_bytes:,} B, the reserve ({source}) allows {reserve.cublas_bytes:,} B")
    if source.startswith("preset "):
        device = load_hardware(source.removeprefix("preset ")).device
        assert probe.total_bytes >= device.memory_bytes - reserve.unreported_bytes, (
            f"{probe.name}: CUDA reports {probe.total_bytes:,} B; the preset counts on "
            f"{device.memory_bytes - reserve.unreported_bytes:,} B")


def test_the_probe_says_in_one_line_when_there_is_no_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = subprocess.run([sys.executable, "-m", "mpress.hardware.probe"], capture_output=True, text=True,
                          check=False)
    assert done.returncode == NO_GPU_EXIT and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "no CUDA GPU" in done.stderr
    with pytest.raises(UserError, match="no CUDA GPU 0"):
        probe_gpu_memory(0)


# ---- measured against predicted: cuBLAS's workspaces are the reserve's -------------------

TENSORS = 700 * MiB
WORKSPACES = CUBLAS_HANDLES * CUBLAS_WORKSPACE_BYTES_HOPPER  # the forward's and the backward's handle on an H100


def _job(device: str) -> SimpleNamespace:
    return SimpleNamespace(rank=0, stage_ids=[0], startup_peak_bytes=0, device=torch.device(device),
                           runtimes=[], peers=None)


def test_the_measured_cuda_peak_leaves_out_cublas_workspaces(monkeypatch):
    allocator = FakeAllocator(TENSORS, WORKSPACES)
    allocator.install(monkeypatch)
    row = rank_report(_job("cuda:0"), None, predicted_bytes=TENSORS, measured_bytes=torch.cuda.max_memory_allocated(),
                      measured_at="B0")
    assert row["measured"] == row["predicted"] == TENSORS
    assert row["cublas_workspaces"] == WORKSPACES
    assert cublas_workspace_bytes(torch.device("cuda:0")) == 0  # freed: measured once


def test_a_cpu_run_counts_every_byte():
    """On CPU `LiveBytes` counts what the plan counts: there are no workspaces."""
    row = rank_report(_job("cpu"), None, predicted_bytes=TENSORS, measured_bytes=TENSORS + 1, measured_at="F0")
    assert row["measured"] == TENSORS + 1 and row["cublas_workspaces"] == 0


@pytest.mark.cuda
def test_the_workspaces_left_out_are_what_the_reserve_counts_for_cublas():
    """A forward's and a backward's matrix products (two cuBLAS handles: this thread's and
    autograd's device thread's) make workspaces that `cublas_workspace_bytes` measures and
    frees, within the reserve's cuBLAS figure."""
    dev = torch.device("cuda", 0)
    a = torch.randn(512, 512, device=dev, requires_grad=True)
    (a @ a).sum().backward()
    workspaces = cublas_workspace_bytes(dev)
    props = torch.cuda.get_device_properties(dev)
    reserve, _source = reserve_for(props.name, cuda_total_bytes=props.total_memory, hopper=props.major == 9)
    assert 0 < workspaces <= reserve.cublas_bytes, workspaces
    assert cublas_workspace_bytes(dev) == 0  # freed; no matrix product since
