"""`mpress train` over two "nodes" on this machine: two launchers (`--nnodes 2
--node-rank 0/1 --rdzv-endpoint`), each running one replica of a 2-stage pipeline (dp 2 x
pp 2, 4 gloo ranks), the replicas' gradients averaged by DDP; a kill of one rank ends
every rank of both nodes, each survivor with one line naming it, and each launcher with
one line. Also the flags' bad input (one line, exit 2, no rank started)."""

from __future__ import annotations

import os
import re
import signal
import socket
import time

import pytest

from mpress.launcher.startup import plan_for
from mpress.config.model_config import load_model_config
from mpress.runtime.train_config import load_train_config
from tests.faults.run import TrainRun, run_segments, tiny_config, wait_until_gone
from tests.support.documented import run_documented
from tests.support.plans import d2d_rule, pipeline_plan

VICTIM = 3
"""Node 1's second rank: replica 1's stage 1, which lends its peer pool to its stage 0."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(run: TrainRun) -> str:
    lines = run.stderr().splitlines()
    assert len(lines) == 1, run.stderr()
    return lines[0]


@pytest.mark.slow
def test_two_nodes_train_and_a_killed_rank_is_named_on_both(tmp_path):
    # stage 0 of each replica D2D-swaps into the peer pool of its own stage 1: pools stay in a node
    plan = pipeline_plan("1f1b", 2, 4, {0: [d2d_rule("layers.0.**", {1: 1.0})]}, peer_pools={1: 8 << 20})
    config = tiny_config(tmp_path, plan, num_stages=2, dp=2)
    endpoint = f"127.0.0.1:{_free_port()}"
    runs = []
    for node in (0, 1):
        (tmp_path / f"n{node}").mkdir()
        runs.append(TrainRun.start(config, tmp_path / f"n{node}", "--nnodes", "2", "--node-rank", str(node),
                                   "--rdzv-endpoint", endpoint))
    try:
        head = runs[0].wait_for(r"^mpress\.train: gpt-tiny")
        assert "2 replicas (dp x pp = 2 x 2 ranks)" in head, head
        runs[0].wait_for(r"^step 0: loss")  # the fault comes after the first step
        infos = [run.info() for run in runs]
        for info in infos:
            assert run_segments(info["run_id"]), "a node has no peer-pool segment: the /dev/shm check would be idle"
        pid = infos[1]["ranks"][VICTIM - 2]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert [run.finish() for run in runs] == [1, 1]
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.proc.kill()
    # node 1 saw its rank die; node 0 learnt it from its ranks' lines
    assert _one_line(runs[1]) == (f"mpress train: rank {VICTIM} (pid {pid}) was killed by SIGKILL "
                                  f"[1 of the other 1 ranks named it; logs in {runs[1].run_dir}]")
    # node 0 holds no failed rank: its line is its ranks' account, which names the dead one
    assert f"rank {VICTIM} (pid {pid}) has died" in _one_line(runs[0]), _one_line(runs[0])
    for rank in (0, 1, 2):
        run = runs[rank // 2]
        said = [x for x in (run.run_dir / f"rank{rank}.log").read_text().splitlines()
                if x.startswith(f"mpress.train: rank {rank}: ")]
        assert len(said) == 1 and re.search(rf"rank {VICTIM} \(pid {pid}\b.*has died", said[0]), (rank, said)
    for info in infos:
        assert not wait_until_gone(info["run_id"], t0), "processes of the run left after 30 s"
        assert run_segments(info["run_id"]) == []


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "2"], "--rdzv-endpoint: needed with --nnodes > 1: node 0's HOST:PORT, the same on every node"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank: must be in 0..1 with --nnodes 2, got 2"),
    (["--nnodes", "2", "--rdzv-endpoint", "h"], "--rdzv-endpoint: expected HOST:PORT with a port in 1..65535, got 'h'"),
    (["--node-rank", "1"], "--node-rank: 1 needs --nnodes > 1"),
    (["--dp", "3", "--nproc-per-node", "4"], "dp: 4 ranks cannot hold 3 replicas of the pipeline"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--nproc-per-node", "1"],
     "--nproc-per-node: 1 ranks per node would split a replica's 2 pipeline ranks over two nodes"),
])
def test_bad_node_flags_are_one_line_naming_the_flag(tmp_path, flags, message):
    config = tiny_config(tmp_path, num_stages=2)
    code, _out, err = run_documented(["train", "--config", str(config), *flags], in_process=True)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_a_plan_for_replicas_counts_ddps_buckets():
    # plan: none's predicted peaks, one replica and two: DDP's buckets hold a copy of the
    # stage's gradients for the whole run (mpress.hardware.cluster.DDP_GRADIENT_AS_BUCKET_VIEW)
    peaks = {dp: plan_for(load_train_config("gpt-tiny-plain", [("dp", str(dp))]), load_model_config("gpt-tiny"),
                          4, 4).predicted_peak_bytes for dp in (1, 2)}
    assert all(two > one for one, two in zip(peaks[1], peaks[2])), peaks
