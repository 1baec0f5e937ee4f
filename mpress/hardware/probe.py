"""Measured on a real GPU: what a process takes there besides its tensors.

`probe_gpu_memory(device)` measures, in a fresh Python process (the measurement must make
the CUDA context itself), and returns a `GpuMemoryProbe`:

- `total_bytes`: what CUDA reports as the device's memory (cudaMemGetInfo's total);
- `context_bytes`: device memory the CUDA context takes when torch creates it with
  nothing allocated. With NVML (package nvidia-ml-py) it is the device's used memory
  after the context less before (other processes' changes in between count too);
  without NVML, CUDA's total less free, which also counts other processes' memory;
  `context_source` says which;
- `cublas_bytes`: device memory the first fp32 and bf16 matrix products take beyond
  their outputs (made beforehand): cuBLAS/cuBLASLt handles, workspaces and kernels
  loaded on first use; `cublas_workspace_bytes`: the part in torch's caching allocator.

NCCL's buffers need peers and are not measured here (see `mpress.hardware.gpu_reserve`). The
figures are what the reserve model (`mpress.hardware.gpu_reserve`) must cover; bench/gpu_check.py
prints them and tests/hardware/test_gpu_reserve.py checks. Units: bytes.

Run as `python -m mpress.hardware.probe [--device N]` it prints the probe as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mpress.errors import MpressError, UserError

MATMUL_SIZE = 1024
"""Side of the square matrices of the probing products (large enough for cuBLAS's
tensor-core kernels and their workspace)."""
NO_GPU_EXIT = 3
"""Exit status of the measuring process when it finds no CUDA GPU."""


@dataclass(frozen=True, kw_only=True)
class GpuMemoryProbe:
    """What one GPU showed (see the module docstring); bytes."""

    device: int
    """CUDA device index (as CUDA_VISIBLE_DEVICES numbers them)."""
    name: str
    capability: tuple[int, int]
    total_bytes: int
    context_bytes: int
    context_source: str
    """"nvml": used memory after less before; "cuda-free": total less free."""
    cublas_bytes: int
    cublas_workspace_bytes: int


def measure_here(device: int = 0) -> GpuMemoryProbe:
    """Measure in this process, which must not have made a CUDA context on `device` yet
    (else the context is already there and counted as other memory)."""
    import torch

    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        raise UserError(f"no CUDA GPU {device} here (torch.cuda.device_count() = "
                        f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})")
    props = torch.cuda.get_device_properties(device)  # no context yet
    used_before = _nvml_used(device)
    free, total = torch.cuda.mem_get_info(device)  # makes the context, allocates nothing
    if used_before is not None:
        used_after = _nvml_used(device)
        context, source = used_after - used_before, "nvml"
    else:
        context, source = total - free, "cuda-free"
    return GpuMemoryProbe(device=device, name=props.name, capability=(props.major, props.minor), total_bytes=total,
                          context_bytes=context, context_source=source, **_cublas_bytes(device))


def _nvml_used(device: int) -> int | None:
    """The device's used memory as NVML reports it, or None without NVML."""
    import torch

    try:
        return int(torch.cuda.device_memory_used(device))  # NVML only: makes no CUDA context
    except Exception:  # noqa: BLE001 - no pynvml, no NVML library or an NVMLError: say "cuda-free"
        return None


def _cublas_bytes(device: int) -> dict[str, int]:
    """Device memory the first matrix products take beyond their preallocated outputs."""
    import torch

    dev = torch.device("cuda", device)
    dtypes = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    with torch.cuda.device(dev):
        g = torch.Generator(device=dev).manual_seed(0)
        operands = [(torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=dev, generator=g).to(dt),
                     torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=dev, generator=g).to(dt),
                     torch.empty(MATMUL_SIZE, MATMUL_SIZE, device=dev, dtype=dt)) for dt in dtypes]
        torch.cuda.synchronize(dev)
        free_before, _total = torch.cuda.mem_get_info(dev)
        allocated_before = torch.cuda.memory_allocated(dev)
        for a, b, out in operands:
            torch.mm(a, b, out=out)
        torch.cuda.synchronize(dev)
        free_after, _total = torch.cuda.mem_get_info(dev)
        allocated_after = torch.cuda.memory_allocated(dev)
    return {"cublas_bytes": free_before - free_after, "cublas_workspace_bytes": allocated_after - allocated_before}


def probe_gpu_memory(device: int = 0, *, timeout_s: float = 300.0) -> GpuMemoryProbe:
    """`measure_here` in a fresh Python process (so the context is made by the
    measurement). Raises `UserError` where there is no such GPU, `MpressError` if the
    measurement fails."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "mpress.hardware.probe", "--device", str(device)],
                          capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    if done.returncode == NO_GPU_EXIT:
        raise UserError(last)
    if done.returncode != 0:
        raise MpressError(f"GPU memory probe of device {device} failed (exit {done.returncode}): {last}")
    data = json.loads(done.stdout)
    data["capability"] = tuple(data["capability"])
    return GpuMemoryProbe(**data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpress.hardware.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    args = parser.parse_args(argv)
    try:
        probe = measure_here(args.device)
    except UserError as exc:
        print(str(exc), file=sys.stderr)
        return NO_GPU_EXIT
    print(json.dumps(dataclasses.asdict(probe)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
