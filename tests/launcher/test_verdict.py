"""The one line `mpress train` reduces its ranks' ends to (launcher/verdict.py), from rank
logs as mpress/train.py and the rank watch write them."""

from __future__ import annotations

from pathlib import Path

from mpress.launcher.verdict import RankEnd, diagnose


def _ends(tmp: Path, spec: dict[int, tuple[int, str, bool]]) -> list[RankEnd]:
    """rank -> (return code, log text, killed by the launcher)."""
    ends = []
    for rank, (code, text, killed) in spec.items():
        log = tmp / f"rank{rank}.log"
        log.write_text(text)
        ends.append(RankEnd(rank=rank, pid=100 + rank, returncode=code, killed_by_launcher=killed, log=log))
    return ends


def test_every_rank_finished_is_no_failure(tmp_path):
    assert diagnose(_ends(tmp_path, {r: (0, "", False) for r in range(4)}), tmp_path) is None


def test_a_ranks_own_failure_is_the_line_with_how_many_others_named_it(tmp_path):
    own = "mpress.train: rank 0: SwapError: swap-out failed: rank 0 stage 0 microbatch 1 tensor x: exhausted\n"
    ends = _ends(tmp_path, {0: (1, "warning: something\n" + own, False),
                            **{r: (1, f"mpress.train: rank {r}: stopping: rank 0 failed (SwapError)\n", False)
                               for r in (1, 2, 3)}})
    assert diagnose(ends, tmp_path) == (
        "mpress train: rank 0: SwapError: swap-out failed: rank 0 stage 0 microbatch 1 tensor x: exhausted "
        f"[3 of the other 3 ranks named it; logs in {tmp_path}]", 1)


def test_the_rank_the_others_name_is_the_cause_when_two_failed(tmp_path):
    ends = _ends(tmp_path, {0: (1, "mpress.train: rank 0: RuntimeError: Connection closed by peer\n", False),
                            1: (1, "mpress.train: rank 1: DeviceOutOfMemory: rank 1 over capacity\n", False),
                            2: (1, "mpress.train: rank 2: stopping: rank 1 failed (DeviceOutOfMemory)\n", False)})
    line, code = diagnose(ends, tmp_path)
    assert line.startswith("mpress train: rank 1: DeviceOutOfMemory: rank 1 over capacity [1 of the other 2") and code == 1


def test_bad_input_found_by_a_rank_is_exit_2(tmp_path):
    ends = _ends(tmp_path, {0: (2, "mpress.train: error: plan.yaml: stages: 3 stages, the job runs 4\n", False),
                            1: (2, "", False)})
    assert diagnose(ends, tmp_path) == ("mpress train: error: plan.yaml: stages: 3 stages, the job runs 4", 2)
    ends = _ends(tmp_path, {0: (0, "", False), 1: (2, "mpress.train: rank 1: error: peer pools: too small\n", False)})
    assert diagnose(ends, tmp_path)[1] == 2


def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    ends = _ends(tmp_path, {0: (1, "mpress.train: rank 0: stopping: rank 1 (pid 101) has died\n", False),
                            1: (-9, "", False),
                            2: (-9, "", True)})  # the launcher's own kill is no cause
    assert diagnose(ends, tmp_path) == (
        f"mpress train: rank 1 (pid 101) was killed by SIGKILL [1 of the other 2 ranks named it; logs in "
        f"{tmp_path}]", 1)


def test_a_stalled_rank_the_launcher_killed_is_named_as_stalled(tmp_path):
    stop = "mpress.train: rank {r}: stopping: rank 1 (pid 101) has stalled (no heartbeat for 10 s)\n"
    ends = _ends(tmp_path, {0: (1, stop.format(r=0), False), 1: (-9, "", True), 2: (1, stop.format(r=2), False)})
    assert diagnose(ends, tmp_path) == (
        "mpress train: rank 1 (pid 101) has stalled (no heartbeat for 10 s); the launcher killed it "
        f"[2 of the other 2 ranks named it; logs in {tmp_path}]", 1)


def test_a_rank_that_crashed_without_a_line_is_named_with_its_last_line(tmp_path):
    ends = _ends(tmp_path, {0: (0, "", False), 1: (1, "Traceback (most recent call last):\nImportError: no x\n", False)})
    line, code = diagnose(ends, tmp_path)
    assert line.startswith("mpress train: rank 1 (pid 101) exited with status 1: ImportError: no x [") and code == 1


def test_a_killed_rank_is_the_cause_even_where_a_peer_reports_its_death_as_its_own_error(tmp_path):
    ends = _ends(tmp_path, {0: (1, "mpress.train: rank 0: SwapError: rank 0 stage 0: rank 1 (pid 101, holds the "
                                   "D2D peer pool of device(s) 1) has died\n", False),
                            1: (-15, "", False),
                            2: (1, "mpress.train: rank 2: stopping: rank 1 (pid 101) has died\n", False)})
    assert diagnose(ends, tmp_path) == (
        f"mpress train: rank 1 (pid 101) was killed by SIGTERM [2 of the other 2 ranks named it; logs in {tmp_path}]", 1)
