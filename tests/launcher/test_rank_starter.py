"""The rank starter (mpress/launcher/rank_starter.py): a rank it forks is what an
executed `python -m MODULE` would be (its argv, its own environment, stdin empty, stdout
and stderr where asked, its process group, `__main__`, its exit status and atexit
handlers); signals and the starter's death end its ranks; it refuses to fork when a
Python thread runs or its imports fail, so the launcher executes the ranks instead; and
`mpress train` trains the same with forked and executed ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mpress.launcher.rank_starter import RankStarter, StarterRefused, StarterSpec
from tests.faults.run import ROOT

CHILD = "tests.support.starter_child"
GONE_S = 10.0


def _starter(**env: str) -> RankStarter:
    return RankStarter.start(StarterSpec(env={**os.environ, "PYTHONPATH": str(ROOT), **env}, module=CHILD))


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_S
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_rank_is_what_an_executed_one_would_be(tmp_path):
    starter = _starter(MPRESS_T_SHARED="starter")
    try:
        starter.ready()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MPRESS_T_OWN": "rank"}  # MPRESS_T_SHARED is not the rank's
        leader = starter.fork(["report", str(tmp_path / "a.json"), str(tmp_path / "b.json.atexit")], env, out=str(tmp_path / "a.out"),
                              err=str(tmp_path / "a.err"), pgid=0)
        member = starter.fork(["report", str(tmp_path / "b.json")], env, out=str(tmp_path / "b.log"),
                              err=str(tmp_path / "b.log"), pgid=leader.pid)
        assert leader.wait(timeout=60) == 3 and member.wait(timeout=60) == 3
    finally:
        starter.close()
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert a["argv"] == ["report", str(tmp_path / "a.json"), str(tmp_path / "b.json.atexit")] and a["name"] == "__main__"
    assert a["env"] == {"MPRESS_T_OWN": "rank"} and a["stdin"] == ""
    assert a["ppid"] == starter.proc.pid and a["pid"] == leader.pid
    assert a["pgid"] == leader.pid and b["pgid"] == leader.pid  # a group of their own, the second joins the first
    assert a["pgid"] != os.getpgid(0)
    assert (tmp_path / "a.out").read_text() == "to stdout\n" and (tmp_path / "a.err").read_text() == "to stderr\n"
    assert (tmp_path / "b.log").read_text() == "to stdout\nto stderr\n"
    assert (tmp_path / "a.json.atexit").read_text() == "ran" and (tmp_path / "b.json.atexit").read_text() == "ran"


def test_stdout_to_the_launchers_stderr(tmp_path, capfd):
    starter = _starter()
    try:
        starter.ready()
        rank = starter.fork(["report", str(tmp_path / "a.json")], {**os.environ, "PYTHONPATH": str(ROOT)},
                            out="2", err=str(tmp_path / "a.err"), pgid=0)
        assert rank.wait(timeout=60) == 3
    finally:
        starter.close()
    captured = capfd.readouterr()
    assert "to stdout" in captured.err and "to stdout" not in captured.out


def test_signals_end_forked_ranks_with_their_status_and_an_error_is_status_1(tmp_path):
    starter = _starter()
    try:
        starter.ready()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        ranks = [starter.fork([action], env, out=str(tmp_path / f"{i}.log"), err=str(tmp_path / f"{i}.log"), pgid=0)
                 for i, action in enumerate(["sleep", "sleep", "raise"])]
        assert ranks[0].poll() is None
        ranks[0].kill()
        ranks[1].terminate()
        assert [r.wait(timeout=60) for r in ranks] == [-signal.SIGKILL, -signal.SIGTERM, 1]
    finally:
        starter.close()
    assert "RuntimeError: the child failed as asked" in (tmp_path / "2.log").read_text()


def test_killing_the_starter_kills_its_ranks(tmp_path):
    starter = _starter()
    try:
        starter.ready()
        rank = starter.fork(["sleep"], {**os.environ, "PYTHONPATH": str(ROOT)}, out=str(tmp_path / "log"),
                            err=str(tmp_path / "log"), pgid=0)
        starter.proc.kill()
        assert _gone(rank.pid)
        assert rank.wait(timeout=GONE_S) == -signal.SIGKILL
    finally:
        starter.close()


def test_a_forked_rank_runs_torch_on_its_own_thread_count(tmp_path):
    # the starter imports torch before the job, and so each rank's OMP_NUM_THREADS, is known
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    starter = RankStarter.start(StarterSpec(env={**env, "PYTHONPATH": str(ROOT), "MPRESS_T_TORCH": "1"}, module=CHILD))
    try:
        starter.ready()
        for name, threads in (("a", "3"), ("b", "1")):
            rank = starter.fork(["report", str(tmp_path / f"{name}.json")],
                                {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": threads},
                                out=str(tmp_path / "log"), err=str(tmp_path / "log"), pgid=0)
            assert rank.wait(timeout=60) == 3
    finally:
        starter.close()
    assert [json.loads((tmp_path / f"{n}.json").read_text())["threads"] for n in "ab"] == [3, 1]


def test_a_preloaded_module_is_imported_before_the_rank_starts_and_a_failing_one_is_left_to_it(tmp_path):
    loaded = {}
    for preload in ([], ["tabnanny", "tests.no_such_module"]):
        starter = _starter()
        try:
            starter.preload(preload)
            starter.ready()
            rank = starter.fork(["report", str(tmp_path / "a.json")],
                                {**os.environ, "PYTHONPATH": str(ROOT), "MPRESS_T_PROBE": "tabnanny"},
                                out=str(tmp_path / "log"), err=str(tmp_path / "log"), pgid=0)
            assert rank.wait(timeout=60) == 3
        finally:
            starter.close()
        loaded[len(preload)] = json.loads((tmp_path / "a.json").read_text())["probe_loaded"]
    assert loaded == {0: False, 2: True}


def test_a_starter_closed_with_kill_ends_at_once_and_closing_again_does_nothing():
    starter = _starter()  # a job refused while its starter still imports
    starter.close(kill=True)
    assert starter.proc.returncode == -signal.SIGKILL
    starter.close()


def test_a_python_thread_after_the_imports_is_refused():
    starter = _starter(MPRESS_T_THREAD_AT_IMPORT="1")
    try:
        with pytest.raises(StarterRefused, match=r"^it runs 2 Python threads after its imports$"):
            starter.ready()
    finally:
        starter.close()


def test_an_import_that_fails_is_refused():
    starter = RankStarter.start(StarterSpec(env={**os.environ, "PYTHONPATH": str(ROOT)}, module="tests.no_such_module"))
    try:
        with pytest.raises(StarterRefused, match=r"^importing tests\.no_such_module failed: ModuleNotFoundError"):
            starter.ready()
    finally:
        starter.close()


@pytest.mark.slow
def test_forked_and_executed_ranks_train_the_same(tmp_path):
    from tests.faults.run import tiny_config
    config = tiny_config(tmp_path, num_stages=2, steps=3)
    losses, started = {}, {}
    for how in ("fork", "exec"):
        run_dir = tmp_path / how
        res = subprocess.run([sys.executable, "-m", "mpress", "train", "--config", str(config), "--run-dir",
                              str(run_dir)], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "MPRESS_RANK_START": how})
        assert res.returncode == 0, res.stderr
        losses[how] = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                       if '"loss"' in line]
        started[how] = json.loads((run_dir / "run.json").read_text())["started_by"]
    assert len(losses["fork"]) == 3 and losses["fork"] == losses["exec"]
    assert started == {"fork": "fork", "exec": "exec (MPRESS_RANK_START=exec or no fork here)"}
