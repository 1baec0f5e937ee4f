"""Emulator: copies and the compute that waits for them are matched by stage, microbatch
and tensor. A unit of memory has one name in every microbatch (`mpress.contract.actions.UnitId`),
so the swap-ins of several microbatches of the same unit can be in flight at once; each
copy-in waits for its own microbatch's copy-out, and each backward for its own
microbatch's copy-ins, as at run time."""

from __future__ import annotations

import pytest

from mpress.contract.actions import Action
from mpress.static.emulate.emulator import emulate
from mpress.static.emulate.program import Channel, Cost, Program, Task, Transfer

GB = 10**9  # channels are in GB/s = 1e9 bytes/s, so 1 GB at 1 GB/s takes 1 s


def compute(text: str, s: float, **kw) -> Task:
    return Task(Action.parse(text), compute_s=s, **kw)


def copy(text: str, channel: str, nbytes: int) -> Task:
    return Task(Action.parse(text), transfers=(Transfer(channel, nbytes),), cost=Cost.HOST)


def one_rank(tasks: list[Task]) -> Program:
    return Program(ranks=(tuple(tasks),), rank_device=(0,), device_capacity_bytes=(10**15,), static_bytes=(0,),
                   channels={c: Channel(c, 1.0) for c in ("up", "down")})


def spans(tasks: list[Task]) -> dict[str, tuple[float, float]]:
    r = emulate(one_rank(tasks))
    return {t.label(): (pytest.approx(s), pytest.approx(e)) for t, s, e in zip(tasks, r.task_start_s[0],
                                                                                 r.task_end_s[0])}


def test_copy_ins_and_backwards_wait_for_their_own_microbatch() -> None:
    # SO0 [1,2] and SO1 [2,4] out; SI0 and SI1 issued at 2, in. SI0 waits for SO0 (done):
    # [2,3]; SI1 for SO1: [4,6]. B0 (reached at 2) waits for SI0 only: [3,4]; B1 for SI1:
    # [6,7]. Matched by name alone, SI0 would wait for SO1 and B0 for SI1.
    tasks = [compute("0F0", 1), copy("0SO0:x", "up", GB), compute("0F1", 1), copy("0SO1:x", "up", 2 * GB),
             copy("0SI0:x", "down", GB), copy("0SI1:x", "down", 2 * GB),
             compute("0B0", 1, consumes=("x",)), compute("0B1", 1, consumes=("x",))]
    got = spans(tasks)
    assert got["0SI0:x"] == (2, 3) and got["0SI1:x"] == (4, 6)
    assert got["0B0"] == (3, 4) and got["0B1"] == (6, 7)


def test_optimizer_chunks_wait_for_their_own_copy_ins() -> None:
    # optimizer chunks have no microbatch: their copies match by stage and tensor. OI:a
    # (1 GB) and OI:b (2 GB) share the down channel from 0 at half rate each: a lands at
    # 2, b's last GB goes alone: 3. The step of chunk a waits for OI:a only.
    tasks = [copy("0OI:a", "down", GB), copy("0OI:b", "down", 2 * GB),
             compute("0OPT:a", 1, consumes=("a",)), compute("0OPT:b", 1, consumes=("b",))]
    got = spans(tasks)
    assert got["0OI:a"] == (0, 2) and got["0OI:b"] == (0, 3)
    assert got["0OPT:a"] == (2, 3) and got["0OPT:b"] == (3, 4)
