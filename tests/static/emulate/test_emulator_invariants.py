"""Emulator invariants on random small pipelines (hypothesis) made the way the rewriter and
the lowering make them: one compute stream per rank, busy + stall = its end, memory the
walk of each rank's list whatever the timing, and more bandwidth never slower; and a
full-size lowered pipeline runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpress.contract.actions import Kind
from mpress.hardware.server import load_hardware
from mpress.static.emulate.emulator import emulate
from mpress.static.emulate.lowering import build_program
from mpress.static.profile.profile import LayerMemory, LayerProfile, Profile
from mpress.static.emulate.program import Cost, Program, Task, Transfer, walk_peaks
from mpress.static.schedules import build_schedule
from tests.static.emulate.test_emulator import BIG, GB, act, compute, copy, program


# ---- invariants on random small pipelines -----------------------------------------------------

@st.composite
def pipelines(draw, dedicated_channels: bool = False):
    """GPipe order (all forwards, then all backwards in reverse), 1-3 stages of one rank
    each, 1-3 microbatches; each forward saves 0-2 tensors that are kept, swapped to host,
    swapped to a peer or dropped and recomputed, as the rewriter and the lowering make
    them: a copy-out gives its bytes back at the next compute action, which waits for it;
    its copy-in comes after that release point (so the last microbatch, whose backward
    directly follows its forward, swaps nothing); a dropped tensor is not kept by the
    forward and is restored by a recompute that starts the backward. Allocations and
    frees balance."""
    num_stages = draw(st.integers(1, 3))
    num_mb = draw(st.integers(1, 3))
    gbps = st.sampled_from([0.5, 1.0, 4.0])
    channels: dict[str, tuple[float, float]] = {}

    def chan(name: str) -> str:
        if dedicated_channels:
            name = f"{name}#{len(channels)}"
        if name not in channels:
            channels[name] = (draw(gbps), draw(st.sampled_from([0.0, 0.01])))
        return name

    ranks = []
    for s in range(num_stages):
        fwd, bwd = [], {}
        for m in range(num_mb):
            kept = saved = 0
            outs, ins, recomputes = [], [], []
            for i in range(draw(st.integers(0, 2))):
                nbytes = draw(st.integers(1, 4)) * GB // 4
                techniques = ["keep", "drop"] + (["host", "d2d"] if m < num_mb - 1 else [])
                tech = draw(st.sampled_from(techniques))
                name = f"t{i}"
                saved += nbytes
                kept += 0 if tech == "drop" else nbytes
                if tech == "host":
                    outs.append(copy(f"{s}SO{m}:{name}", (chan(f"up{s}"), nbytes)))
                    ins.append(copy(f"{s}SI{m}:{name}", (chan(f"down{s}"), nbytes), alloc=nbytes))
                elif tech == "d2d":
                    peer = (s + 1) % 4
                    outs.append(copy(f"{s}DO{m}:{name}", (chan(f"nv{s}-{peer}"), nbytes), cost=Cost.D2D))
                    ins.append(copy(f"{s}DI{m}:{name}", (chan(f"nv{peer}-{s}"), nbytes), alloc=nbytes, cost=Cost.D2D))
                elif tech == "drop":
                    outs.append(Task(act(f"{s}DR{m}:{name}"), cost=Cost.DROP))
                    recomputes.append(compute(f"{s}RC{m}:{name}", draw(st.sampled_from([0.1, 0.3])), alloc=nbytes,
                                              starts=not recomputes, cost=Cost.RECOMPUTE))
            fwd += [compute(f"{s}F{m}", draw(st.sampled_from([0.5, 1.0, 2.0])), alloc=kept)] + outs
            backward = compute(f"{s}B{m}", draw(st.sampled_from([1.0, 2.0])), free=saved, starts=not recomputes,
                               consumes=tuple(t.action.tensor for t in ins))
            bwd[m] = ins + recomputes + [backward]
        # backwards of later microbatches first, each preceded by its swap-ins
        ranks.append(_released(fwd + [t for m in reversed(range(num_mb)) for t in bwd[m]]))
    sends = {(s, s + 1): (Transfer(chan(f"p{s}"), GB // 2),) for s in range(num_stages - 1)}
    grads = {(s + 1, s): (Transfer(chan(f"g{s}"), GB // 2),) for s in range(num_stages - 1)}
    if dedicated_channels:  # no sharing at all: sends go nowhere (zero time)
        sends, grads = {}, {}
    # a tight device must change nothing but `oom`
    capacity = BIG if dedicated_channels else draw(st.sampled_from([BIG, 7 + GB, 7 + 2 * GB]))
    return program(*ranks, channels=channels, capacity=capacity, static=7, sends=sends, grad_sends=grads)


def _released(tasks: list[Task]) -> list[Task]:
    """Each task that starts an action gives back the bytes of the copy-outs before it."""
    out, pending = [], 0
    for t in tasks:
        if t.action.kind in (Kind.SO, Kind.DO):
            pending += t.transfers[0].bytes
        elif t.starts_action:
            t, pending = replace(t, release_bytes=pending), 0
        out.append(t)
    return out


def walk_points(tasks: tuple[Task, ...], static_bytes: int) -> list[int]:
    """The bytes after every memory change of a rank's walk, in list order (as a device
    timeline lists them)."""
    mem, out = static_bytes, [static_bytes]
    for t in tasks:
        changes = ([t.alloc_bytes + t.transient_bytes - t.release_bytes, -(t.free_bytes + t.transient_bytes)]
                   if t.action.is_compute else [t.alloc_bytes, -t.free_bytes])
        for delta in changes:
            if delta:
                mem += delta
                out.append(mem)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_invariants(p):
    r = emulate(p)
    for rank, tasks in enumerate(p.ranks):
        computes = [(s, t) for s, t in zip(r.spans[rank], tasks) if t.action.is_compute]
        busy = sum(t.compute_s for _, t in computes)
        assert r.busy_s_by_rank[rank] == pytest.approx(busy)
        assert r.iteration_s >= busy - 1e-9
        # one compute stream, in list order, each task running exactly its compute time
        for (a, _), (b, _) in zip(computes, computes[1:]):
            assert b.start_s >= a.end_s - 1e-9
        for s, t in computes:
            assert s.end_s - s.start_s == pytest.approx(t.compute_s)
        # the stream is either busy or stalled until its last task ends
        assert busy + r.stall_s_by_rank[rank] == pytest.approx(computes[-1][0].end_s)
        assert all(s.start_s <= s.end_s <= r.iteration_s + 1e-9 for s in r.spans[rank])
        # memory is the walk of the list (one rank per device), whatever the timing
        d = p.rank_device[rank]
        assert [b for _, b in r.timeline[d]] == walk_points(tasks, 7)
        assert r.peak_bytes[d] == max([7, *walk_peaks(tasks, 7)])
        assert r.oom[d] == (r.peak_bytes[d] > p.device_capacity_bytes[d])
    assert sum(r.stall_s_by_cost.values()) == pytest.approx(r.stall_s)
    for d, points in enumerate(r.timeline):
        assert points[0] == (0.0, 7) and points[-1][1] == 7  # allocations and frees balance
        assert max(b for _, b in points) == r.peak_bytes[d]
        assert all(t0 <= t1 for (t0, _), (t1, _) in zip(points, points[1:]))


def _with_bandwidth(p: Program, factor: float) -> Program:
    return replace(p, channels={k: replace(c, gbps=c.gbps * factor) for k, c in p.channels.items()})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines(dedicated_channels=True), st.sampled_from([1.5, 2.0, 10.0]))
def test_more_bandwidth_never_slows_an_iteration(p, factor):
    """Holds when no two transfers share a channel: then every start time is a max of
    earlier end times plus fixed durations, so shorter copies cannot delay anything. (With
    fair sharing, a copy that starts earlier can slow another on its channel.) The memory
    timeline keeps its order, only its times move."""
    slow, fast = emulate(p), emulate(_with_bandwidth(p, factor))
    assert fast.iteration_s <= slow.iteration_s + 1e-9
    assert [[b for _, b in points] for points in fast.timeline] == [[b for _, b in points] for points in slow.timeline]


def test_a_full_size_pipeline_runs():
    # 8 stages x 32 microbatches x 48 layers, 1F1B, lowered from a profile: one layer task per
    # layer, so 32 x 2 x 6 + 1 tasks a rank. (Its speed is bench/emulator.py's business.)
    memory = LayerMemory(kept_bytes=12, forward_peak_bytes=14, backward_peak_bytes=9, input_grad_bytes=2,
                         output_bytes=2)
    layers = [LayerProfile(name=f"layers.{i}", forward_flops=1e9, backward_flops=2e9, forward_time_s=1e-3,
                           backward_time_s=2e-3, param_bytes=4, grad_bytes=4, optim_bytes=8, output_bytes=2,
                           memory=memory) for i in range(48)]
    profile = Profile(model="toy", model_fingerprint="x", source="analytic", device="t", dtype="fp32",
                      microbatch_size=1, layers=layers)
    p = build_program(profile, [(6 * s, 6 * s + 6) for s in range(8)], build_schedule("1f1b", 8, 32),
                      load_hardware("dgx1-v100"), microbatch_size=1)
    r = emulate(p)
    assert [len(tasks) for tasks in p.ranks] == [385] * 8
    opt_s = p.ranks[0][-1].compute_s
    assert r.busy_s_by_rank == pytest.approx((32 * 6 * 3e-3 + opt_s,) * 8)
    for rank, tasks in enumerate(p.ranks):
        assert [b for _, b in r.timeline[rank]] == walk_points(tasks, p.static_bytes[rank])
    assert r.fits
