"""Emulator: hand-computed timings, memory and stall attribution on tiny programs, and
a full device that never makes anything wait. Memory is a walk of each rank's list
(`program.walk_peaks`): timing never changes it (invariants on random pipelines:
test_emulator_invariants.py; copies matched by microbatch: test_emulator_microbatches.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpress.contract.actions import Action
from mpress.errors import ScheduleError
from mpress.static.emulate.emulator import EmulatorResult, emulate
from mpress.static.studies.plots import plot_memory
from mpress.static.emulate.program import Channel, Cost, Program, Task, Transfer, walk_peaks
from mpress.static.emulate.trace import write_trace

GB = 10**9  # channels are in GB/s = 1e9 bytes/s, so 1 GB at 1 GB/s takes 1 s
BIG = 10**15


def act(text: str) -> Action:
    return Action.parse(text)


def compute(text: str, s: float, alloc: int = 0, free: int = 0, *, release: int = 0, starts: bool = True,
            **kw) -> Task:
    """A compute task; by default a whole action, so it starts one (a release point)."""
    return Task(act(text), compute_s=s, alloc_bytes=alloc, free_bytes=free, starts_action=starts,
                release_bytes=release, **kw)


def later_layer(text: str, j: int, s: float, **kw) -> Task:
    """Layer j of an action that an earlier task started."""
    return compute(text, s, layer=j, starts=False, **kw)


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


def points(result: EmulatorResult, device: int = 0) -> list[tuple[float, int]]:
    """The device's memory timeline, times rounded to the nanosecond."""
    return [(round(t, 9), b) for t, b in result.timeline[device]]


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
    # 0F0 is their release point: it waits for both, [4.0, 4.5], the stall blamed on b.
    p = program([copy("0SO0:a", ("up", GB)), copy("0SO0:b", ("up", 3 * GB)), compute("0F0", 0.5)])
    r = emulate(p)
    assert span(r, 0, "0SO0:a") == pytest.approx((0.0, 2.0))
    assert span(r, 0, "0SO0:b") == pytest.approx((0.0, 4.0))
    assert span(r, 0, "0F0") == pytest.approx((4.0, 4.5))
    assert r.stall_s_by_tensor == pytest.approx({"b": 4.0})
    assert r.iteration_s == pytest.approx(4.5)


def test_a_later_transfer_slows_the_one_in_flight():
    # a (3 GB), out after layer 0 of 0F0, alone from 1 to 2 moves 1 GB. b (1 GB) joins at 2
    # (after layer 1, which is no release point): both at 0.5 GB/s, b ends at 2 + 1/0.5 =
    # 4.0 while a moves 1 GB more; a's last 1 GB: 5.0.
    p = program([compute("0F0", 1.0, layer=0), copy("0SO0:a", ("up", 3 * GB)), later_layer("0F0", 1, 1.0),
                 copy("0SO0:b", ("up", GB))])
    r = emulate(p)
    assert span(r, 0, "0SO0:b") == pytest.approx((2.0, 4.0))
    assert span(r, 0, "0SO0:a") == pytest.approx((1.0, 5.0))


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
    # one forward whose layers' durations add up to each copy's arrival time (copies out
    # of one action: no release point between them)
    tasks, arrivals, sizes = [compute("0F0", 0.0, layer=0)], [], []
    clock = 0.0
    for j, (gap_s, quarters) in enumerate(jobs):
        if gap_s:
            tasks.append(later_layer("0F0", j + 1, gap_s))
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


def test_stages_wait_for_the_last_layer_of_the_action_before():
    # 0F0: layer 0 [0,1], layer 1 [1,3]; 1F0 waits for the whole of it: [3,4], [4,5]; 1B0
    # (last layer first) [5,6], [6,8]; 0B0 waits for 1B0's last task: [8,9], [9,10].
    r0 = [compute("0F0", 1, layer=0), later_layer("0F0", 1, 2), compute("0B0", 1, layer=1), later_layer("0B0", 0, 1)]
    r1 = [compute("1F0", 1, layer=0), later_layer("1F0", 1, 1), compute("1B0", 1, layer=1), later_layer("1B0", 0, 2)]
    r = emulate(program(r0, r1))
    assert [(s.action, s.start_s, s.end_s) for s in r.spans[1]] == [
        ("1F0 L0", 3, 4), ("1F0 L1", 4, 5), ("1B0 L1", 5, 6), ("1B0 L0", 6, 8)]
    assert [(s.start_s, s.end_s) for s in r.spans[0][2:]] == [(8, 9), (9, 10)]


def test_throughput_figures():
    p = replace(two_stage_program(), samples_per_iteration=21, model_flops_per_iteration=10.5e12)
    r = emulate(p)
    assert r.samples_per_s == pytest.approx(2.0)
    assert r.model_tflops == pytest.approx(1.0)


# ---- swaps and stalls ----------------------------------------------------------------------

def test_swap_that_hides_causes_no_stall():
    # SO after layer 0 of 0F0 [1,2], under layer 1 [1,4]; 0F1, its release point, reached at
    # 4: [4,5]; SI issued then: [5,6]; 0B0 reached at 8 (after 0F2 [5,8]): no wait, [8,10].
    r = emulate(program([compute("0F0", 1, layer=0), copy("0SO0:x", ("up", GB)), later_layer("0F0", 1, 3),
                         compute("0F1", 1), copy("0SI0:x", ("down", GB)), compute("0F2", 3),
                         compute("0B0", 2, consumes=("x",))]))
    assert span(r, 0, "0SI0:x") == pytest.approx((5.0, 6.0))
    assert r.iteration_s == pytest.approx(10.0)
    assert r.stall_s == 0.0 and r.stall_s_by_tensor == {}


def test_the_release_point_waits_for_the_copy_outs_before_it():
    # SO (2 GB) [1,3]; 0F1 is reached at 1 but gives x's bytes back when it starts, so it
    # waits for the copy: [3,4]; the 2 s are blamed on x, host swap. Whatever the capacity
    # (on a 1-byte device, over it from the start, just the same).
    for capacity in (BIG, 1):
        r = emulate(program([compute("0F0", 1, alloc=8), copy("0SO0:x", ("up", 2 * GB)),
                             compute("0F1", 1, release=8)], capacity=capacity))
        assert r.fits == (capacity == BIG)
        assert span(r, 0, "0F1") == pytest.approx((3.0, 4.0))
        assert r.stall_s_by_tensor == pytest.approx({"x": 2.0})
        assert r.stall_s_by_cost == pytest.approx({"host": 2.0})


def test_swap_in_that_stalls_is_blamed_on_its_tensor():
    # SO after layer 0 [1,3], under layer 1 [1,3]; 0F1 [3,4]; SI issued at 4: [4,6]; 0B0
    # reached at 4 starts at 6: 2 s exposed, all on x and host swap.
    r = emulate(program([compute("0F0", 1, layer=0), copy("0SO0:x", ("up", 2 * GB)), later_layer("0F0", 1, 2),
                         compute("0F1", 1), copy("0SI0:x", ("down", 2 * GB)), compute("0B0", 2, consumes=("x",))]))
    assert span(r, 0, "0SI0:x") == pytest.approx((4.0, 6.0))
    assert span(r, 0, "0B0") == pytest.approx((6.0, 8.0))
    assert r.stall_s_by_tensor == pytest.approx({"x": 2.0})
    assert r.stall_s_by_cost == pytest.approx({"host": 2.0})


def test_d2d_stall_is_blamed_on_d2d():
    r = emulate(program([compute("0F0", 1), copy("0DO0:y", ("up", GB), cost=Cost.D2D),
                         copy("0DI0:y", ("down", GB), cost=Cost.D2D), compute("0B0", 1, consumes=("y",))]))
    # DO [1,2], DI waits for it: [2,3], 0B0 reached at 1 starts at 3
    assert span(r, 0, "0DI0:y") == pytest.approx((2.0, 3.0))
    assert r.stall_s_by_cost == pytest.approx({"d2d": 2.0})


def test_a_swap_in_is_issued_where_the_list_puts_it():
    # 0F0 L0 [0,1], SO [1,2] under L1 [1,2]; 0F1 [2,3]. Early: SI issued when 0F1 ends,
    # [3,5], under 0F2 [3,5]; 0B2 [5,6], 0B1 [6,7], 0B0 [7,8].
    head = [compute("0F0", 1, layer=0), copy("0SO0:x", ("up", GB)), later_layer("0F0", 1, 1), compute("0F1", 1)]
    si = copy("0SI0:x", ("down", 2 * GB))
    early = emulate(program(head + [si, compute("0F2", 2), compute("0B2", 1), compute("0B1", 1),
                                    compute("0B0", 1, consumes=("x",))]))
    assert span(early, 0, "0SI0:x") == pytest.approx((3.0, 5.0))
    assert early.iteration_s == pytest.approx(8.0) and early.stall_s == 0.0
    # Late (one compute action ahead): SI issued when 0B2 ends, [6,8]; 0B0 reached at 7: [8,9]
    late = emulate(program(head + [compute("0F2", 2), compute("0B2", 1), si, compute("0B1", 1),
                                   compute("0B0", 1, consumes=("x",))]))
    assert span(late, 0, "0SI0:x") == pytest.approx((6.0, 8.0))
    assert late.iteration_s == pytest.approx(9.0)
    assert late.stall_s_by_tensor == pytest.approx({"x": 1.0})


def test_optimizer_step_waits_for_its_states():
    # OI issued when 0B0 ends (2), [2,3], takes 8 bytes then; OPT reached at 2 starts at 3;
    # OO [4,5] gives the 8 bytes back when it ends (no release point follows it). The OI has
    # no earlier OO (the states were sent out by the previous iteration): it waits for nothing.
    r = emulate(program([compute("0F0", 1), compute("0B0", 1),
                         copy("0OI:optim", ("down", GB), alloc=8, cost=Cost.OPTIMIZER_OFFLOAD),
                         compute("0OPT", 1, consumes=("optim",)),
                         copy("0OO:optim", ("up", GB), free=8, cost=Cost.OPTIMIZER_OFFLOAD)]))
    assert span(r, 0, "0OPT") == pytest.approx((3.0, 4.0))
    assert r.iteration_s == pytest.approx(5.0)
    assert r.stall_s_by_tensor == pytest.approx({"optim": 1.0})
    assert r.stall_s_by_cost == pytest.approx({"optimizer-offload": 1.0})
    assert points(r) == [(0.0, 0), (2.0, 8), (5.0, 0)]


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


def test_swap_out_gives_memory_back_at_its_release_point():
    # static 10; 0F0 takes 60 at 0; the SO runs [1,2]; 0F1 waits for it, then gives x's 60
    # back and takes 50 at 2; 0B1 [2.5,3] frees 50; the SI takes 60 when issued at 3; 0B0
    # [4,5] frees 60. Peak 70, the walk's.
    tasks = [compute("0F0", 1, alloc=60), copy("0SO0:x", ("up", GB)), compute("0F1", 0.5, alloc=50, release=60),
             compute("0B1", 0.5, free=50), copy("0SI0:x", ("down", GB), alloc=60),
             compute("0B0", 1, free=60, consumes=("x",))]
    r = emulate(program(tasks, static=10))
    assert points(r) == [(0.0, 10), (0.0, 70), (2.0, 60), (3.0, 10), (3.0, 70), (5.0, 10)]
    assert walk_peaks(tasks, 10) == [70, 70, 60, 60, 70, 70]
    assert r.peak_bytes == (70,)


def test_a_copy_out_with_no_release_point_after_it_gives_back_when_it_ends():
    r = emulate(program([compute("0F0", 1, alloc=60), copy("0SO0:x", ("up", GB), free=60)]))
    assert points(r) == [(0.0, 0), (0.0, 60), (2.0, 0)]


def test_a_copy_in_takes_its_bytes_when_issued_even_while_it_waits():
    # (program.py: "alloc_bytes taken ... a copy-in's at its issue"; the walk counts it
    # there.) A copy-in listed before its copy-out's release point (the rewriter and the
    # placement never put one there): the SI is issued at 1, right behind its SO [1,2],
    # inside 0F0; layer 1 then runs [1,2] with 10 + 100 transient on top: 40 + 40 + 110 =
    # 190 at 1.
    tasks = [compute("0F0", 1, alloc=40, layer=0), copy("0SO0:x", ("up", GB)), copy("0SI0:x", ("down", GB), alloc=40),
             later_layer("0F0", 1, 1, alloc=10, transient_bytes=100), compute("0B0", 1, free=50, release=40,
                                                                              consumes=("x",))]
    assert max(walk_peaks(tasks, 0)) == 190
    r = emulate(program(tasks))
    assert points(r)[:4] == [(0.0, 0), (0.0, 40), (1.0, 80), (1.0, 190)]
    assert r.peak_bytes == (190,)


def program_over_capacity(capacity: int) -> Program:
    return program([
        compute("0F0", 1, alloc=80),                         # [0,1]  80: x
        copy("0SO0:x", ("up", GB)),                          # [1,2]
        compute("0F1", 2, release=80),                       # [2,4]  waits for the SO; x leaves: 0
        compute("0F2", 1, alloc=60),                         # [4,5]  60
        copy("0SI0:x", ("down", GB), alloc=80),              # [5,6]  140 from 5
        compute("0B0", 1, free=80, consumes=("x",)),         # [6,7]  60
        compute("0B1", 1),
        compute("0B2", 1, free=60),                          # [8,9]  0
    ], capacity=capacity)


def test_a_full_device_never_holds_anything_back():
    # The swap-in is issued where it is listed, whatever the room: on a 100-byte device the
    # run is the same as on a roomy one, and the device is reported out of memory.
    roomy, tight = emulate(program_over_capacity(BIG)), emulate(program_over_capacity(100))
    assert span(tight, 0, "0SI0:x") == pytest.approx((5.0, 6.0))
    assert tight.spans == roomy.spans and tight.timeline == roomy.timeline
    assert [b for _, b in tight.timeline[0]] == [0, 80, 0, 60, 140, 60, 0]
    assert tight.peak_bytes == (140,) and tight.oom == (True,) and not tight.fits
    assert roomy.fits


def test_no_copy_out_in_flight_means_oom_not_a_wait():
    p = program([compute("0F0", 1.0, alloc=8 * GB), compute("0F1", 1.0, alloc=8 * GB)], capacity=10 * GB)
    r = emulate(p)
    assert span(r, 0, "0F1") == pytest.approx((1.0, 2.0))
    assert r.peak_bytes == (16 * GB,) and not r.fits


def test_drop_is_a_marker_and_recompute_is_compute_inside_the_backward():
    # 0F0 keeps 5 (its checkpoint), the drop marker does nothing at 1; the recompute starts
    # 0B0 [3,3.5] and 0B0's layer holds 30 while it runs [3.5,4.5]: peak 5 + 30.
    r = emulate(program([compute("0F0", 1, alloc=5), Task(act("0DR0:x"), cost=Cost.DROP), compute("0F1", 1, alloc=5),
                         compute("0B1", 1, free=5), Task(act("0RC0:x"), compute_s=0.5, starts_action=True,
                                                         cost=Cost.RECOMPUTE),
                         compute("0B0", 1, free=5, transient_bytes=30, starts=False)]))
    assert span(r, 0, "0DR0:x") == (1.0, 1.0)
    assert span(r, 0, "0RC0:x") == pytest.approx((3.0, 3.5))
    assert r.peak_bytes == (35,)
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


def test_consuming_a_tensor_no_copy_in_brings_is_a_deadlock():
    p = program([compute("0F0", 1), compute("0B0", 1, consumes=("x",))])
    with pytest.raises(ScheduleError, match=r"rank 0 stuck at 0B0 waiting for a copy-in of x \(not issued before it\)"):
        emulate(p)


def test_unknown_channel_is_rejected():
    with pytest.raises(ScheduleError, match="unknown channel 'nvlink:9->9'"):
        emulate(program([compute("0F0", 1), copy("0SO0:x", ("nvlink:9->9", 1))]))


# ---- outputs --------------------------------------------------------------------------------

def test_trace_is_json_with_an_event_per_task(tmp_path):
    r = emulate(replace(two_stage_program(), ranks=(
        two_stage_program().ranks[0] + (copy("0SO0:x", ("p01", 10), ("p10", 10)), Task(act("0DR1:y"), cost=Cost.DROP)),
        two_stage_program().ranks[1])))
    doc = json.loads(write_trace(r, tmp_path / "t.json").read_text())
    events = doc["traceEvents"]
    names = {e["args"].get("task") or e["args"].get("send") for e in events if e["ph"] in ("X", "i") and e["cat"] != "action"}
    assert names == {s.action for spans in r.spans for s in spans}
    striped = [e for e in events if e["args"].get("task") == "0SO0:x"]
    assert len(striped) == 2 and len({e["tid"] for e in striped}) == 2
    assert any(e["ph"] == "C" for e in events)
    assert doc["otherData"]["iteration_s"] == pytest.approx(r.iteration_s)


def test_memory_plot_is_a_png(tmp_path):
    out = plot_memory(emulate(program_over_capacity(100)), tmp_path / "sub" / "mem.png", title="t")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000
