"""Emulator: hand-computed timings, memory and stall attribution on tiny programs, and
invariants on random small pipelines (hypothesis)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpress.actions import Action
from mpress.errors import ScheduleError
from mpress.static.emulator import EmulatorResult, emulate
from mpress.static.plots import plot_memory
from mpress.static.program import Channel, Cost, Program, Task, Transfer
from mpress.static.trace import write_trace

GB = 10**9  # channels are in GB/s = 1e9 bytes/s, so 1 GB at 1 GB/s takes 1 s
BIG = 10**15


def act(text: str) -> Action:
    return Action.parse(text)


def compute(text: str, s: float, alloc: int = 0, free: int = 0, **kw) -> Task:
    return Task(act(text), compute_s=s, alloc_bytes=alloc, free_bytes=free, **kw)


def copy(text: str, *transfers: tuple[str, int], alloc: int = 0, free: int = 0, cost: Cost = Cost.HOST) -> Task:
    return Task(act(text), transfers=tuple(Transfer(c, b) for c, b in transfers), alloc_bytes=alloc,
                free_bytes=free, cost=cost)


def program(*ranks: list[Task], channels: dict[str, tuple[float, float]] | None = None, capacity: int = BIG,
            static: int = 0, **kw) -> Program:
    spec = channels or {"up": (1.0, 0.0), "down": (1.0, 0.0)}
    chans = {cid: Channel(cid, gbps, latency_s) for cid, (gbps, latency_s) in spec.items()}
    n = len(ranks)
    return Program(ranks=tuple(tuple(r) for r in ranks), rank_device=tuple(range(n)),
                   device_capacity_bytes=(capacity,) * n, static_bytes=(static,) * n, channels=chans, **kw)


def span(result: EmulatorResult, rank: int, action: str) -> tuple[float, float]:
    for s in result.spans[rank]:
        if s.action == action:
            return s.start_s, s.end_s
    raise KeyError(action)


# ---- channels ---------------------------------------------------------------------------

def test_single_transfer_takes_latency_plus_bytes_over_bandwidth():
    # F ends at 1.0; the swap-out joins the channel 1 ms later and moves 4 GB at 2 GB/s:
    # 1.0 + 0.001 + 2.0 = 3.001
    p = program([compute("0F0", 1.0), copy("0SO0:x", ("up", 4 * GB))], channels={"up": (2.0, 1e-3)})
    r = emulate(p)
    assert span(r, 0, "0SO0:x") == pytest.approx((1.0, 3.001))
    assert r.iteration_s == pytest.approx(3.001)


def test_two_transfers_share_a_channel_fairly():
    # Both issued at 0 on one 1 GB/s channel, each at 0.5 GB/s. a (1 GB) ends at 2.0,
    # having let b (3 GB) move 1 GB too; b's last 2 GB then go at the full 1 GB/s: 4.0.
    p = program([copy("0SO0:a", ("up", GB)), copy("0SO0:b", ("up", 3 * GB)), compute("0F0", 0.5)])
    r = emulate(p)
    assert span(r, 0, "0SO0:a") == pytest.approx((0.0, 2.0))
    assert span(r, 0, "0SO0:b") == pytest.approx((0.0, 4.0))
    assert r.iteration_s == pytest.approx(4.0)


def test_a_later_transfer_slows_the_one_in_flight():
    # a (3 GB) alone from 0 to 1 moves 1 GB. b (1 GB) joins at 1 (after F): both at
    # 0.5 GB/s, b ends at 1 + 1/0.5 = 3.0 while a moves 1 GB more; a's last 1 GB: 4.0.
    p = program([copy("0SO0:a", ("up", 3 * GB)), compute("0F0", 1.0), copy("0SO0:b", ("up", GB))])
    r = emulate(p)
    assert span(r, 0, "0SO0:b") == pytest.approx((1.0, 3.0))
    assert span(r, 0, "0SO0:a") == pytest.approx((0.0, 4.0))


def reference_fair_share(arrivals_s: list[float], sizes: list[int], bytes_per_s: float) -> list[float]:
    """Finish times under processor sharing, stepped from event to event (quadratic, but
    independent of the emulator's virtual clock)."""
    order = sorted(range(len(sizes)), key=lambda j: arrivals_s[j])
    left: dict[int, float] = {}
    finish = [0.0] * len(sizes)
    t = 0.0
    while order or left:
        rate = bytes_per_s / len(left) if left else 0.0
        t_arrive = arrivals_s[order[0]] if order else float("inf")
        t_finish = t + min(left.values()) / rate if left else float("inf")
        t_next = min(t_arrive, t_finish)
        for j in left:
            left[j] -= rate * (t_next - t)
        t = t_next
        for j in [j for j, b in left.items() if b <= 1e-3]:
            finish[j] = t
            del left[j]
        while order and arrivals_s[order[0]] <= t:
            j = order.pop(0)
            left[j] = float(sizes[j])
    return finish


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0]), st.integers(1, 8)), min_size=1, max_size=8),
       st.sampled_from([0.0, 0.1]))
def test_fair_sharing_matches_a_stepped_reference(jobs, latency_s):
    # copy j is issued after compute tasks whose durations add up to its arrival time
    tasks, arrivals, sizes = [], [], []
    clock = 0.0
    for j, (gap_s, quarters) in enumerate(jobs):
        if gap_s:
            tasks.append(compute(f"0F{j}", gap_s))
            clock += gap_s
        arrivals.append(clock + latency_s)
        sizes.append(quarters * GB // 4)
        tasks.append(copy(f"0SO{j}:x", ("up", sizes[-1])))
    r = emulate(program(tasks, channels={"up": (2.0, latency_s)}))
    expected = reference_fair_share(arrivals, sizes, 2.0 * GB)
    assert [span(r, 0, f"0SO{j}:x")[1] for j in range(len(jobs))] == pytest.approx(expected, abs=1e-9)


def test_a_striped_copy_ends_with_its_slowest_stripe():
    # 1 GB over a 1 GB/s link and 1 GB over a 4 GB/s link, in parallel: max(1, 0.25) = 1 s.
    p = program([compute("0F0", 1.0), copy("0DO0:x", ("l1", GB), ("l2", GB), cost=Cost.D2D)],
                channels={"l1": (1.0, 0.0), "l2": (4.0, 0.0)})
    assert span(emulate(p), 0, "0DO0:x") == pytest.approx((1.0, 2.0))


# ---- pipeline dependencies -----------------------------------------------------------------

def two_stage_program() -> Program:
    r0 = [compute("0F0", 1), compute("0F1", 1), compute("0B0", 2), compute("0B1", 2)]
    r1 = [compute("1F0", 1), compute("1B0", 2), compute("1F1", 1), compute("1B1", 2)]
    return program(r0, r1, channels={"p01": (1.0, 0.0), "p10": (1.0, 0.0)},
                   sends={(0, 1): (Transfer("p01", GB),)}, grad_sends={(1, 0): (Transfer("p10", GB // 2),)})


def test_two_stage_pipeline_with_sends():
    # rank 0: 0F0 [0,1], 0F1 [1,2]; activation sends (1 s) [1,2] and [2,3].
    # rank 1: 1F0 waits for the first send: [2,3]; 1B0 [3,5]; gradient send (0.5 s) [5,5.5];
    #         1F1 ready at 3 but the stream is busy: [5,6]; 1B1 [6,8]; gradient send [8,8.5].
    # rank 0: 0B0 reached at 2, waits for the gradient: [5.5,7.5]; 0B1 reached at 7.5: [8.5,10.5].
    r = emulate(two_stage_program())
    assert [x for s in r.spans[0][:4] for x in (s.start_s, s.end_s)] == pytest.approx([0, 1, 1, 2, 5.5, 7.5, 8.5, 10.5])
    assert [x for s in r.spans[1][:4] for x in (s.start_s, s.end_s)] == pytest.approx([2, 3, 3, 5, 5, 6, 6, 8])
    assert span(r, 1, "send:1B0->0") == pytest.approx((5.0, 5.5))
    assert r.iteration_s == pytest.approx(10.5)
    # stalls: rank 0 (5.5 - 2) + (8.5 - 7.5) = 4.5, rank 1 waits 2 for its first input; all bubbles
    assert r.stall_s_by_rank == pytest.approx((4.5, 2.0))
    assert r.stall_s_by_cost == pytest.approx({"pipeline": 6.5})
    assert r.stall_s_by_tensor == {}
    assert r.busy_s_by_rank == pytest.approx((6.0, 6.0))
    assert json.loads(json.dumps(r.summary()))["iteration_s"] == pytest.approx(10.5)


def test_missing_send_means_no_transfer_time():
    p = replace(two_stage_program(), sends={}, grad_sends={})
    # 1F0 [1,2], 1B0 [2,4], 1F1 [4,5], 1B1 [5,7]; 0B0 [4,6], 0B1 [7,9]
    assert emulate(p).iteration_s == pytest.approx(9.0)


def test_throughput_figures():
    p = replace(two_stage_program(), samples_per_iteration=21, model_flops_per_iteration=10.5e12)
    r = emulate(p)
    assert r.samples_per_s == pytest.approx(2.0)
    assert r.model_tflops == pytest.approx(1.0)


# ---- swaps and stalls ----------------------------------------------------------------------

def test_swap_that_hides_causes_no_stall():
    # SO [1,2]; SI issued when 0F1 ends (4), after the SO: [4,5]; 0B0 reached at 7: no wait.
    r = emulate(program([compute("0F0", 1), copy("0SO0:x", ("up", GB)), compute("0F1", 3),
                         copy("0SI0:x", ("down", GB)), compute("0F2", 3), compute("0B0", 2)]))
    assert span(r, 0, "0SI0:x") == pytest.approx((4.0, 5.0))
    assert r.iteration_s == pytest.approx(9.0)
    assert r.stall_s == 0.0 and r.stall_s_by_tensor == {}


def test_swap_that_stalls_is_blamed_on_its_tensor():
    # SO (2 GB) [1,3]; SI issued at 2 waits for the SO: [3,5]; 0B0 reached at 2 starts at 5:
    # 3 s exposed, all on x and host swap.
    r = emulate(program([compute("0F0", 1), copy("0SO0:x", ("up", 2 * GB)), compute("0F1", 1),
                         copy("0SI0:x", ("down", 2 * GB)), compute("0B0", 2)]))
    assert span(r, 0, "0SI0:x") == pytest.approx((3.0, 5.0))
    assert span(r, 0, "0B0") == pytest.approx((5.0, 7.0))
    assert r.stall_s_by_tensor == pytest.approx({"x": 3.0})
    assert r.stall_s_by_cost == pytest.approx({"host": 3.0})


def test_d2d_stall_is_blamed_on_d2d():
    r = emulate(program([compute("0F0", 1), copy("0DO0:y", ("up", GB), cost=Cost.D2D),
                         copy("0DI0:y", ("down", GB), cost=Cost.D2D), compute("0B0", 1)]))
    # DO [1,2], DI [2,3], 0B0 reached at 1 starts at 3
    assert r.stall_s_by_cost == pytest.approx({"d2d": 2.0})


def capacity_program(capacity: int, policy: str = "capacity") -> Program:
    return program([
        compute("0F0", 1, alloc=40),               # [0,1]  40
        copy("0SO0:x", ("up", GB), free=40),       # [1,2]  gives 40 back at 2
        compute("0F1", 2, alloc=40),               # [1,3]  80 at 1, 40 at 2
        compute("0F2", 1, alloc=50),               # [3,4]  90
        copy("0SI0:x", ("down", 2 * GB), alloc=40),  # issued at 4: 90 + 40 > 100
        compute("0B2", 1, free=50),                # [4,5]  40 at 5: now x fits
        compute("0B1", 1, free=40),
        compute("0B0", 1, free=40),
    ], capacity=capacity, swap_in_policy=policy)


def test_capacity_policy_waits_for_memory():
    # Roomy device: SI starts when issued at 4, [4,6]; 0B1 [5,6]; 0B0 [6,7].
    roomy = emulate(capacity_program(BIG))
    assert span(roomy, 0, "0SI0:x") == pytest.approx((4.0, 6.0))
    assert roomy.iteration_s == pytest.approx(7.0)
    # 100 bytes: SI waits until 0B2 frees 50 at 5: [5,7]; 0B0 reached at 6 waits 1 s for x.
    tight = emulate(capacity_program(100))
    assert span(tight, 0, "0SI0:x") == pytest.approx((5.0, 7.0))
    assert span(tight, 0, "0B0") == pytest.approx((7.0, 8.0))
    assert tight.stall_s_by_tensor == pytest.approx({"x": 1.0})
    assert tight.peak_bytes == (90,) and tight.fits


def test_layer_ahead_starts_swap_in_with_the_compute_before_the_consumer():
    # F0 [0,1], SO [1,2], F1 [1,2], F2 [2,4], B2 [4,5], B1 [5,6], B0 consumes x.
    tasks = [compute("0F0", 1), copy("0SO0:x", ("up", GB)), compute("0F1", 1), copy("0SI0:x", ("down", 2 * GB)),
             compute("0F2", 2), compute("0B2", 1), compute("0B1", 1), compute("0B0", 1)]
    # capacity: SI issued at 2 runs [2,4], hidden; B0 [6,7]
    early = emulate(program(tasks, swap_in_policy="capacity"))
    assert span(early, 0, "0SI0:x") == pytest.approx((2.0, 4.0))
    assert early.iteration_s == pytest.approx(7.0)
    # layer-ahead: SI starts with B1 at 5, [5,7]; B0 reached at 6 starts at 7: [7,8]
    late = emulate(program(tasks, swap_in_policy="layer-ahead"))
    assert span(late, 0, "0SI0:x") == pytest.approx((5.0, 7.0))
    assert late.iteration_s == pytest.approx(8.0)
    assert late.stall_s_by_tensor == pytest.approx({"x": 1.0})


def test_optimizer_step_waits_for_its_states():
    # OI issued when 0B0 ends (2), [2,3]; OPT reached at 2 starts at 3; OO [4,5]. The OI has
    # no earlier OO (the states were sent out by the previous iteration): it waits for nothing.
    r = emulate(program([compute("0F0", 1), compute("0B0", 1),
                         copy("0OI:optim", ("down", GB), alloc=8, cost=Cost.OPTIMIZER_OFFLOAD),
                         compute("0OPT", 1), copy("0OO:optim", ("up", GB), free=8, cost=Cost.OPTIMIZER_OFFLOAD)]))
    assert span(r, 0, "0OPT") == pytest.approx((3.0, 4.0))
    assert r.iteration_s == pytest.approx(5.0)
    assert r.stall_s_by_tensor == pytest.approx({"optim": 1.0})
    assert r.stall_s_by_cost == pytest.approx({"optimizer-offload": 1.0})


# ---- memory ---------------------------------------------------------------------------------

def test_ranks_sharing_a_device_add_up():
    # both ranks on device 0 (static 5 each); 0F0 [0,1] holds 10, 1F0 [1,2] adds 20 at 1,
    # 1B0 [2,3] frees 20, 0B0 [3,4] frees 10: peak 10 + 10 + 20 = 40; device 1 stays empty.
    p = replace(program([compute("0F0", 1, alloc=10), compute("0B0", 1, free=10)],
                        [compute("1F0", 1, alloc=20), compute("1B0", 1, free=20)], static=5, capacity=100),
                rank_device=(0, 0))
    r = emulate(p)
    assert r.peak_bytes == (40, 0) and r.fits
    assert [b for _, b in r.timeline[0]] == [10, 20, 40, 20, 10]

def test_swap_out_gives_memory_back_when_the_copy_ends():
    # static 10; 0F0 takes 60 at 0; the SO runs [1,2]; 0F1 takes 50 at 1 while x is still
    # on the device: peak 10 + 60 + 50 = 120 (it would be 60 if the SO freed at issue).
    r = emulate(program([compute("0F0", 1, alloc=60), copy("0SO0:x", ("up", GB), free=60),
                         compute("0F1", 0.5, alloc=50), compute("0B1", 0.5, free=50),
                         copy("0SI0:x", ("down", GB), alloc=60), compute("0B0", 1, free=60)], static=10))
    assert r.peak_bytes == (120,)
    assert (2.0, 60) in [(pytest.approx(t), b) for t, b in r.timeline[0]]
    assert r.timeline[0][0] == (0.0, 10) and r.timeline[0][-1][1] == 10


def test_oom_when_a_swap_in_can_never_fit():
    # x (80) is swapped out [1,2]; 0F2 holds 60 from 3; x cannot come back (60 + 80 > 100)
    # before its consumer 0B0 is reached at 4, so it is forced in: 140 bytes, OOM.
    p = program([compute("0F0", 1, alloc=80), copy("0SO0:x", ("up", GB), free=80), compute("0F1", 2),
                 compute("0F2", 1, alloc=60), copy("0SI0:x", ("down", GB), alloc=80), compute("0B0", 1, free=80),
                 compute("0B1", 1), compute("0B2", 1, free=60)], capacity=100)
    r = emulate(p)
    assert span(r, 0, "0SI0:x") == pytest.approx((4.0, 5.0))
    assert r.peak_bytes == (140,) and r.oom == (True,) and not r.fits


def test_drop_frees_at_once_and_recompute_is_compute():
    r = emulate(program([compute("0F0", 1, alloc=30), Task(act("0DR0:x"), free_bytes=30, cost=Cost.RECOMPUTE),
                         compute("0F1", 1, alloc=5),
                         Task(act("0RC0:x"), compute_s=0.5, alloc_bytes=30, cost=Cost.RECOMPUTE),
                         compute("0B0", 1, free=30), compute("0B1", 1, free=5)]))
    assert r.peak_bytes == (35,)  # 30 at 0, dropped at 1, 5, then 35 when recomputed
    assert r.iteration_s == pytest.approx(4.5)
    assert r.busy_s_by_cost == pytest.approx({"compute": 4.0, "recompute": 0.5})


# ---- errors ----------------------------------------------------------------------------------

def test_deadlock_names_rank_action_and_what_it_waits_for():
    p = program([compute("0F0", 1), compute("0B0", 1)], [compute("1B0", 1), compute("1F0", 1)])
    with pytest.raises(ScheduleError, match=r"rank 1 stuck at 1B0 waiting for 1F0"):
        emulate(p)


def test_dependency_on_a_missing_action():
    p = program([compute("0F0", 1)], [compute("1F1", 1)])
    with pytest.raises(ScheduleError, match=r"rank 1 stuck at 1F1 waiting for 0F1 \(not in the program\)"):
        emulate(p)


def test_unknown_channel_is_rejected():
    with pytest.raises(ScheduleError, match="unknown channel 'nvlink:9->9'"):
        emulate(program([compute("0F0", 1), copy("0SO0:x", ("nvlink:9->9", 1))]))


# ---- outputs --------------------------------------------------------------------------------

def test_trace_is_json_with_an_event_per_task(tmp_path):
    r = emulate(replace(two_stage_program(), ranks=(
        two_stage_program().ranks[0] + (copy("0SO0:x", ("p01", 10), ("p10", 10)),
                                        Task(act("0DR1:y"), cost=Cost.RECOMPUTE)),
        two_stage_program().ranks[1])))
    doc = json.loads(write_trace(r, tmp_path / "t.json").read_text())
    events = doc["traceEvents"]
    names = {e["name"] for e in events if e["ph"] in ("X", "i")}
    assert names == {s.action for spans in r.spans for s in spans}
    striped = [e for e in events if e["name"] == "0SO0:x"]
    assert len(striped) == 2 and len({e["tid"] for e in striped}) == 2
    assert any(e["ph"] == "C" for e in events)
    assert doc["otherData"]["iteration_s"] == pytest.approx(r.iteration_s)


def test_memory_plot_is_a_png(tmp_path):
    out = plot_memory(emulate(capacity_program(100)), tmp_path / "sub" / "mem.png", title="t")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000


# ---- invariants on random small pipelines -----------------------------------------------------

@st.composite
def pipelines(draw, dedicated_channels: bool = False):
    """GPipe order (all forwards, then all backwards in reverse), 1-3 stages of one rank
    each, 1-3 microbatches; each forward saves 0-2 tensors that are kept, swapped to host,
    swapped to a peer or dropped and recomputed. Allocations and frees balance."""
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
        fwd, bwd = [], []
        for m in range(num_mb):
            saved, outs, ins, recomputes = 0, [], [], []
            for i in range(draw(st.integers(0, 2))):
                nbytes = draw(st.integers(1, 4)) * GB // 4
                tech = draw(st.sampled_from(["keep", "host", "d2d", "drop"]))
                name = f"t{i}"
                saved += nbytes
                if tech == "host":
                    outs.append(copy(f"{s}SO{m}:{name}", (chan(f"up{s}"), nbytes), free=nbytes))
                    ins.append(copy(f"{s}SI{m}:{name}", (chan(f"down{s}"), nbytes), alloc=nbytes))
                elif tech == "d2d":
                    peer = (s + 1) % 4
                    outs.append(copy(f"{s}DO{m}:{name}", (chan(f"nv{s}-{peer}"), nbytes), free=nbytes, cost=Cost.D2D))
                    ins.append(copy(f"{s}DI{m}:{name}", (chan(f"nv{peer}-{s}"), nbytes), alloc=nbytes, cost=Cost.D2D))
                elif tech == "drop":
                    outs.append(Task(act(f"{s}DR{m}:{name}"), free_bytes=nbytes, cost=Cost.RECOMPUTE))
                    recomputes.append(Task(act(f"{s}RC{m}:{name}"), compute_s=draw(st.sampled_from([0.1, 0.3])),
                                           alloc_bytes=nbytes, cost=Cost.RECOMPUTE))
            fwd += [compute(f"{s}F{m}", draw(st.sampled_from([0.5, 1.0, 2.0])), alloc=saved)] + outs
            bwd += ins + recomputes + [compute(f"{s}B{m}", draw(st.sampled_from([1.0, 2.0])), free=saved)]
        # backwards of later microbatches first, each preceded by its swap-ins
        order = [t for m in reversed(range(num_mb)) for t in bwd if t.action.microbatch == m]
        ranks.append(fwd + order)
    sends = {(s, s + 1): (Transfer(chan(f"p{s}"), GB // 2),) for s in range(num_stages - 1)}
    grads = {(s + 1, s): (Transfer(chan(f"g{s}"), GB // 2),) for s in range(num_stages - 1)}
    if dedicated_channels:  # no sharing at all: sends go nowhere (zero time)
        sends, grads = {}, {}
    policy = draw(st.sampled_from(["capacity", "layer-ahead"]))
    # a tight device makes the capacity policy hold swap-ins back (and force them in)
    capacity = BIG if dedicated_channels else draw(st.sampled_from([BIG, 7 + GB, 7 + 2 * GB]))
    return program(*ranks, channels=channels, capacity=capacity, static=7, sends=sends, grad_sends=grads,
                   swap_in_policy=policy)


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
    """Holds when no two transfers share a channel and memory never holds a swap-in back:
    then every start time is a max of earlier end times plus fixed durations, so shorter
    copies cannot delay anything. (With fair sharing, a copy that starts earlier can slow
    another on its channel; with a full device, an earlier swap-in can hold back the next.)"""
    assert emulate(_with_bandwidth(p, factor)).iteration_s <= emulate(p).iteration_s + 1e-9


# ---- memory back-pressure -----------------------------------------------------------------

def test_compute_waits_for_swap_out_to_make_room():
    # capacity 10 GB. 0F0 [0,1] takes 8 GB; its swap-out (8 GB at 8 GB/s) runs [1,2] and
    # frees the 8 GB at 2. 0F1 is reached at 1 but 8 + 8 > 10 while a copy-out is in
    # flight, so it waits: [2,3]; the 1 s stall is blamed on tensor x, host swap.
    # Peak: 8 GB (the room is freed before 0F1 takes its 8 GB).
    p = program([compute("0F0", 1.0, alloc=8 * GB), copy("0SO0:x", ("up", 8 * GB), free=8 * GB),
                 compute("0F1", 1.0, alloc=8 * GB)], channels={"up": (8.0, 0.0)}, capacity=10 * GB)
    r = emulate(p)
    assert span(r, 0, "0F1") == pytest.approx((2.0, 3.0))
    assert r.stall_s_by_tensor == pytest.approx({"x": 1.0})
    assert r.stall_s_by_cost == pytest.approx({"host": 1.0})
    assert r.peak_bytes == (8 * GB,) and r.fits


def test_no_copy_out_in_flight_means_oom_not_a_wait():
    # Nothing will free memory: 0F1 starts at once and the device overflows.
    p = program([compute("0F0", 1.0, alloc=8 * GB), compute("0F1", 1.0, alloc=8 * GB)], capacity=10 * GB)
    r = emulate(p)
    assert span(r, 0, "0F1") == pytest.approx((1.0, 2.0))
    assert r.peak_bytes == (16 * GB,) and not r.fits
