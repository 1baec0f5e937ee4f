"""On a real GPU: the reserve a plan leaves on the device covers what CUDA keeps from the
nominal memory, the CUDA context and cuBLAS, as `mpress.hardware.probe` measures them
(in a fresh process, which makes the context). The reserve is the preset's whose device
has this GPU's name, else what `mpress.hardware.gpu_reserve` derives for it. NCCL's buffers need
peers and are not measured here. On CPU: the probe says in one line that there is no GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mpress.errors import UserError
from mpress.hardware.gpu_reserve import reserve_for
from mpress.hardware.server import load_hardware
from mpress.hardware.probe import NO_GPU_EXIT, probe_gpu_memory


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
