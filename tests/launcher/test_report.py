"""The end-of-run report compares like with like: the measured CUDA peak without cuBLAS's
workspaces, which the prediction counts in the device's reserve
(`mpress.hardware.gpu_reserve`), not in the plan's peak."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mpress.hardware.gpu_reserve import CUBLAS_HANDLES, CUBLAS_WORKSPACE_BYTES_HOPPER
from mpress.hardware.server import MiB
from mpress.launcher.report import cublas_workspace_bytes, rank_report
from tests.support.cuda_fakes import FakeAllocator

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
