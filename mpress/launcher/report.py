"""The end-of-run report: per rank, device memory (predicted and measured) and what mpress
moved and recomputed, gathered from every rank and printed as two tables by rank 0."""

from __future__ import annotations

import torch
from rich.table import Table

from mpress.d2d.runtime.peer_pool import PeerPools
from mpress.contract.plan import Plan
from mpress.runtime.trainer import PipelineJob
from mpress.config.units import fmt_bytes, fmt_seconds


def cublas_workspace_bytes(device: torch.device) -> int:
    """What torch's cuBLAS (and cuBLASLt) workspaces hold in the caching allocator of
    `device` now; 0 off CUDA. `max_memory_allocated` counts them (torch allocates one per
    handle and stream there, `CUBLAS_WORKSPACE_CONFIG`'s size, 8 MiB + 128 KiB by
    default, 32 MiB on Hopper) while the plan's prediction has them in the device's
    reserve (`mpress.hardware.gpu_reserve`, cuBLAS). Measured by freeing them
    (`torch._C._cuda_clearCublasWorkspaces`; the next matrix product makes them again),
    so whatever the version, the configuration and the number of handles: call it when
    the run's matrix products are over. It measures what is held at the end, which a
    peak of the first step may not have held (a workspace first made after that peak,
    by a handle or stream the backward opens): with one step, the measured figure less
    these can read low by such workspaces; from the second step on each step holds
    them all, so a run of two or more steps subtracts only what its peak held."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch._C._cuda_clearCublasWorkspaces()
    return max(0, before - torch.cuda.memory_allocated(device))


def rank_report(job: PipelineJob, plan: Plan | None, *, predicted_bytes: int, measured_bytes: int,
                measured_at: str) -> dict[str, object]:
    """This rank's figures for the final tables (summed over its stages): the predicted
    peak of its device (the emulator, same program) and the measured one (every byte:
    `LiveBytes` on CPU, the allocator on CUDA less cuBLAS's workspaces, which the
    prediction counts in the reserve: `cublas_workspace_bytes`), with the action running
    at that moment, and the start-up peak (before the first step, from the rank's first
    allocation). Call it after the last step."""
    workspaces = cublas_workspace_bytes(job.device)
    out: dict[str, object] = {"rank": job.rank, "stage": ",".join(map(str, job.stage_ids)),
                              "predicted": predicted_bytes, "measured": measured_bytes - workspaces,
                              "cublas_workspaces": workspaces, "at": measured_at,
                              "startup": job.startup_peak_bytes,
                              "cuda_reserved": torch.cuda.max_memory_reserved(job.device)
                              if job.device.type == "cuda" else None}
    if plan is not None:
        parts = [plan.stage(s) for s in job.stage_ids]
        out.update(need=sum(sp.need_bytes for sp in parts),
                   rules=", ".join(sorted({r.technique for sp in parts for r in sp.rules})) or "keep")
    runtimes = job.runtimes
    if runtimes:
        engines = [rt.engine.stats for rt in runtimes if rt.engine is not None]
        d2d = [rt.d2d_engine.stats for rt in runtimes if rt.d2d_engine is not None]
        nvme = [rt.nvme_engine.stats for rt in runtimes if rt.nvme_engine is not None]
        drive = [rt.stats.extra["nvme"] for rt in runtimes if "nvme" in rt.stats.extra]
        if drive:  # how the nvme tier's files are open (O_DIRECT, or buffered and why), what went there
            out["nvme"] = "; ".join(sorted(set(drive)))
            out["drive_out"] = sum(st.bytes_out for st in nvme)
        if job.device.type == "cuda":
            out["cuda_check"] = next((rt.stats.extra["cuda_check"] for rt in runtimes
                                      if "cuda_check" in rt.stats.extra), "ok")
        out.update(swapped=sum(rt.router.tensors_swapped for rt in runtimes),
                   recomputed=sum(rt.router.layers_recomputed for rt in runtimes),
                   bytes_out=sum(st.bytes_out for st in engines), peer_out=sum(st.bytes_out for st in d2d),
                   wait_s=sum(st.wait_s for st in engines + d2d + nvme))
    if isinstance(job.peers, PeerPools):
        usage = job.peers.pool_usage().values()
        out["pool"] = (sum(u["high_water_bytes"] for u in usage), sum(u["capacity_bytes"] for u in usage))
    return out


def report_tables(rows: list[dict[str, object]]) -> list[Table]:
    """The end-of-run report: memory per rank, then what mpress moved and recomputed."""
    def b(r: dict[str, object], key: str) -> str:
        v = r.get(key)
        return fmt_bytes(v) if isinstance(v, int) and v else "-"

    memory = Table(title="per rank: device memory, predicted (emulator, same program) and measured (every byte "
                         "but cuBLAS's workspaces, which the reserve counts)")
    for c in ["rank", "stage", "plan", "need w/o mpress", "predicted peak", "measured peak", "measured / predicted",
              "measured peak during", "start-up peak", "CUDA reserved peak"]:
        memory.add_column(c, justify="right")
    traffic = Table(title="per rank: swaps and recompute")
    for c in ["rank", "tensors swapped", "bytes to host", "bytes to peers", "peer pool held (high water / size)",
              "layers recomputed", "swap wait", "bytes to drive (files)"]:
        traffic.add_column(c, justify="right")
    for r in rows:
        predicted, measured = r.get("predicted"), r.get("measured")
        ratio = f"{measured / predicted:.1%}" if isinstance(measured, int) and predicted else "-"
        memory.add_row(str(r["rank"]), str(r["stage"]), str(r.get("rules", "none")), b(r, "need"),
                       b(r, "predicted"), b(r, "measured"), ratio, str(r.get("at") or "-"), b(r, "startup"),
                       b(r, "cuda_reserved"))
        traffic.add_row(str(r["rank"]), str(r.get("swapped", "-")), b(r, "bytes_out"), b(r, "peer_out"),
                        _pool_cell(r.get("pool")), str(r.get("recomputed", "-")),
                        fmt_seconds(float(r.get("wait_s", 0.0))),  # type: ignore[arg-type]
                        f"{b(r, 'drive_out')} ({r['nvme']})" if r.get("nvme") else "-")
    return [memory, traffic]


def _pool_cell(pool: object) -> str:
    if not pool:
        return "-"
    high, size = pool  # type: ignore[misc]
    if not size:
        return "-"
    return f"{fmt_bytes(high)} / {fmt_bytes(size)}"
