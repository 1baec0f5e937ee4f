"""Shared test set-up: `@pytest.mark.cuda` tests skip where no GPU is present; every test
runs torch on one intra-op thread; `group` is a one-rank process group; the analytic
probe cache (`MPRESS_CACHE_DIR`) and the temporary directory (`TMPDIR`) are the session's
own, not the user's."""

import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

# Parallel test workers (pytest -n) are given COLUMNS=80, which every `mpress` command a
# test launches would inherit and lay its tables out for; the tests read the commands'
# output as a user piping it sees it (mpress.ui: the pipe width unless COLUMNS is set).
os.environ.pop("COLUMNS", None)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _probe_cache(tmp_path_factory):
    # the session's processes (and the subprocesses they start) share one cache, which
    # goes with the session's temporary files
    os.environ.setdefault("MPRESS_CACHE_DIR", str(tmp_path_factory.mktemp("probe-cache")))
    yield


@pytest.fixture(autouse=True, scope="session")
def _session_tmpdir(tmp_path_factory):
    # what the session's processes put in "the" temporary directory goes with the session's
    # temporary files, not into /tmp for good: torchrun's agent makes a torchelastic_*
    # directory per run there and leaves it, `mpress train` without --run-dir makes its run
    # directory there, torch makes its compiler's cache directory there
    old_env, old_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # this process's own tempfile calls follow it too
    yield
    if old_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old_env
    tempfile.tempdir = old_dir


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models on a shared 2-core machine: intra-op threads fighting other processes
    # make a step ~100x slower than one thread does.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A world-1 gloo group, for collectives run in one process (peer-pool setup); reuses
    an existing single-rank group."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a process group of several ranks is already initialised")
        yield None
        return
    init = tmp_path_factory.mktemp("dist") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield None
    dist.destroy_process_group()
