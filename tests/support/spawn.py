"""Run a test's worker on several CPU ranks: spawned processes in one gloo group.

`spawn(worker, world, plans, *args)` saves the plans (None: plain pipelining) to a
temporary directory, starts `world` processes, and in each joins a gloo group (file init
method) and runs `worker(rank, world, plan_paths, *args)`.

The processes are forked from a fork server that has imported torch and mpress's runtime
once (`PRELOAD`): a rank started with the "spawn" method imports them itself, seconds of
CPU per rank and launch, which made these launches most of the suite's time. A forked
rank starts from the server's fresh imports, as a spawned one would, not from the test
process's state; the test process's environment is handed to each rank (the server's is
the one it had when it started).
The worker yields one result per job (or returns None: no results); each is saved with
`torch.save` as it comes, so the parent gets, per job and rank, what the worker got to. A worker that raises writes its
error to a file and leaves at once, without tearing down the group (its peers may be
dead); the parent returns the errors by rank.

The worker must be a module-level function of an importable module (the child imports it
by name, e.g. `tests.runtime.test_pipeline_runs._job_worker`), and so must its arguments'
classes; pytest's `pythonpath = ["."]` puts the repository root on the children's path.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mpress.contract.plan import Plan


@dataclass
class Spawned:
    results: list[list[Any]]
    """Per job, per rank: what the worker yielded (None where it did not get that far)."""
    errors: dict[int, str]
    """Per rank that raised: "Type: message", then the traceback."""
    elapsed_s: float
    """Wall time from the first start to the last exit."""


PRELOAD = ["torch", "torch.distributed", "torch.distributed.pipelining", "mpress.runtime.trainer", "tests.support.spawn"]
"""What the fork server imports once, so that each rank forked from it starts with torch
and mpress's runtime loaded."""


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank: int, world: int, init: str, worker: Callable[..., Iterable[Any] | None], plan_paths: list[str | None],
           args: tuple, out_dir: str, group_timeout_s: float | None, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the test's, not the fork server's
    torch.set_num_threads(1)
    try:
        timeout = {} if group_timeout_s is None else {"timeout": timedelta(seconds=group_timeout_s)}
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, **timeout)
        for i, result in enumerate(worker(rank, world, plan_paths, *args) or ()):
            torch.save(result, Path(out_dir, f"{i}-{rank}.pt"))
    except BaseException as exc:  # noqa: BLE001 - report every failure to the test, then leave at once
        Path(out_dir, f"error-{rank}.txt").write_text(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        os._exit(1)  # no destroy_process_group: peers may be dead
    dist.destroy_process_group()


def spawn(worker: Callable[..., Iterable[Any] | None], world: int, plans: list[Plan | None], *args: Any,
          timeout_s: float | None = None, group_timeout_s: float | None = None,
          stop_others_on_error: bool = True) -> Spawned:
    """Run `worker` on `world` ranks for `len(plans)` jobs (see the module docstring).

    timeout_s: after this long, ranks still running have hung: they are killed and the
    call fails (None: wait for ever). group_timeout_s: the gloo group's timeout (None:
    torch's default). stop_others_on_error: once a rank has failed, kill the others
    rather than wait for them; False where the test checks how the others notice."""
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        paths: list[str | None] = []
        for i, plan in enumerate(plans):
            paths.append(None if plan is None else os.path.join(tmp, f"plan{i}.yaml"))
            if plan is not None:
                plan.save(paths[-1])
        init = os.path.join(tmp, "init")
        start = time.monotonic()
        procs = [ctx.Process(target=_entry, args=(r, world, init, worker, paths, args, tmp, group_timeout_s,
                                                  dict(os.environ)))
                 for r in range(world)]
        for p in procs:
            p.start()
        hung: list[int] = []
        while running := [p for p in procs if p.is_alive()]:
            if stop_others_on_error and any(p.exitcode for p in procs if p not in running):
                break
            left = None if timeout_s is None else timeout_s - (time.monotonic() - start)
            if left is not None and left <= 0:
                hung = [r for r, p in enumerate(procs) if p in running]
                break
            wait([p.sentinel for p in running], timeout=left)
        elapsed = time.monotonic() - start
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        assert not hung, f"ranks {hung} hung"
        errors = {r: Path(tmp, f"error-{r}.txt").read_text() for r in range(world)
                  if Path(tmp, f"error-{r}.txt").exists()}
        results = [[torch.load(Path(tmp, f"{i}-{r}.pt"), weights_only=False) if Path(tmp, f"{i}-{r}.pt").exists()
                    else None for r in range(world)] for i in range(len(plans))]
        return Spawned(results=results, errors=errors, elapsed_s=elapsed)
