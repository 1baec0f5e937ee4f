"""Each rank's environment as `mpress train` starts it (`launch.rank_env`): torchrun's
variables, and CPU threads that share the machine's cores among the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpress.launcher import launch
from mpress.launcher.launch import LaunchSpec, rank_env, threads_per_rank


@pytest.mark.parametrize("nproc,cores,threads", [(8, 16, 2), (4, 64, 16), (4, 2, 1), (1, 2, 2), (3, 8, 2)])
def test_every_rank_gets_an_equal_share_of_the_cores(nproc, cores, threads):
    assert threads_per_rank(nproc, cores) == threads


def _spec(nproc: int, env: dict[str, str] | None = None) -> LaunchSpec:
    return LaunchSpec(config="gpt-tiny-mixed", overrides=[], nproc=nproc, run_dir=Path("."), run_id="t",
                      env=env or {})


def test_a_rank_runs_its_share_of_threads_unless_the_user_said(monkeypatch):
    """A host optimizer step runs Adam on the CPU: one thread per rank (torchrun's
    default) cannot stream the host DRAM share the emulator costs it at."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launch, "threads_per_rank", lambda nproc: 16 // nproc)
    env = rank_env(_spec(4), 1, 29500)
    assert env["OMP_NUM_THREADS"] == "4"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("1", "1", "4")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert rank_env(_spec(4), 1, 29500)["OMP_NUM_THREADS"] == "3"
    assert rank_env(_spec(4, {"OMP_NUM_THREADS": "5"}), 0, 29500)["OMP_NUM_THREADS"] == "5"


def test_nvlink_sharp_is_off_unless_the_user_turns_it_on(monkeypatch):
    """NVLS buffers (GiB per communicator on NVSwitch) serve all-reduces, not the
    pipeline's sends and receives, and no plan budgets them."""
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    assert rank_env(_spec(2), 0, 29500)["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert rank_env(_spec(2), 0, 29500)["NCCL_NVLS_ENABLE"] == "1"
