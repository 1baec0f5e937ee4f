"""Capacity-based swap-in placement (`placement.py`): literal action lists and their
lowered tasks in, exact action lists out."""

from __future__ import annotations

from mpress.contract.actions import Action, format_actions, parse_actions
from mpress.static.emulate.placement import place_by_capacity
from mpress.static.emulate.program import Task, walk, walk_peaks

# One stage, four microbatches, x (40 bytes) of microbatch 0 swapped out after its
# forward and back in before B1 (where a prefetch lead of one puts it). Walk (static 0):
#   0F0 +40 | 0SO0:x | 0F1 releases x: 0 + 40 | 0F2 +40 | 0F3 +40 | 0B3 -40 | 0B2 -40 |
#   0SI0:x +40 | 0B1 -40 | 0B0 -40
LIST = "0F0 0SO0:x 0F1 0F2 0F3 0B3 0B2 0SI0:x 0B1 0B0"
TASKS = {
    "0F0": dict(alloc_bytes=40), "0SO0:x": {}, "0F1": dict(alloc_bytes=40, starts_action=True, release_bytes=40),
    "0F2": dict(alloc_bytes=40), "0F3": dict(alloc_bytes=40), "0SI0:x": dict(alloc_bytes=40),
}
FREES = ("0B3", "0B2", "0B1", "0B0")


def lowered(text: str, **extra: dict) -> tuple[list[Action], list[Task], list[int]]:
    """One task per action (compute actions start an action), as `lower_rank_traced`
    gives them: tasks and, per task, the index of its action."""
    actions = parse_actions(text)
    spec = {**TASKS, **{b: dict(free_bytes=40) for b in FREES}, **extra}
    tasks = []
    for a in actions:
        kw = dict(spec.get(str(a), {}))
        kw.setdefault("starts_action", a.is_compute)
        tasks.append(Task(a, **kw))
    return actions, tasks, list(range(len(actions)))


def place(text: str, capacity: int, **extra: dict) -> str:
    actions, tasks, origins = lowered(text, **extra)
    return format_actions(place_by_capacity(actions, tasks, origins, static_bytes=0, capacity_bytes=capacity))


def test_walk_of_the_example():
    _, tasks, _ = lowered(LIST)
    assert walk_peaks(tasks, 0) == [40, 40, 40, 80, 120, 120, 80, 80, 80, 40]


def test_a_roomy_device_takes_the_swap_in_back_to_just_after_the_release_point():
    # x's bytes leave when 0F1 starts: the swap-in may stand before 0F2 at the earliest,
    # never before 0F1 (the bytes would be on the device twice)
    assert place(LIST, 10**9) == "0F0 0SO0:x 0F1 0SI0:x 0F2 0F3 0B3 0B2 0B1 0B0"


def test_the_swap_in_goes_as_early_as_capacity_allows():
    # with x's 40 bytes on top: before 0B2 the walk peaks at 80 + 40, before 0B3 at 120 + 40,
    # before 0F3 at 120 + 40, before 0F2 at 120 + 40
    assert place(LIST, 160) == "0F0 0SO0:x 0F1 0SI0:x 0F2 0F3 0B3 0B2 0B1 0B0"
    assert place(LIST, 159) == "0F0 0SO0:x 0F1 0F2 0F3 0B3 0SI0:x 0B2 0B1 0B0"
    assert place(LIST, 120) == "0F0 0SO0:x 0F1 0F2 0F3 0B3 0SI0:x 0B2 0B1 0B0"


def test_no_room_before_the_listed_place_leaves_the_list_as_it_is():
    assert place(LIST, 119) == LIST
    assert place(LIST, 0) == LIST  # even when it does not fit where it is: the device is reported full, later


def test_two_swap_ins_in_list_order_the_first_takes_the_room():
    # y (30 bytes) of microbatch 1 is swapped out after 0F1 and released by 0F2 (which then
    # takes 40 - 30 more); both swap-ins are listed before 0B1.
    text = "0F0 0SO0:x 0F1 0SO1:y 0F2 0F3 0B3 0B2 0SI0:x 0SI1:y 0B1 0B0"
    extra = {"0F2": dict(alloc_bytes=40, release_bytes=30), "0SI1:y": dict(alloc_bytes=30)}
    _, tasks, _ = lowered(text, **extra)
    # 0F0 40, SO, 0F1 releases x: 40, SO, 0F2 releases y: 10 + 40 = 50, 0F3 90, 0B3 90 -> 50,
    # 0B2 50 -> 10, SI x 50, SI y 80, 0B1 80 -> 40, 0B0 40 -> 0
    assert walk_peaks(tasks, 0) == [40, 40, 40, 40, 50, 90, 90, 50, 50, 80, 80, 40]
    # x first: its earliest place is after 0F1 (before 0F2); the peaks there are at most
    # 90, + 40 = 130 <= 150: before 0F2. Then y (earliest before 0F3, after its release
    # point 0F2): peaks from 0F3 on are now 130, 130, 90, 90 (x counted), + 30 > 150 at 0F3
    # and 0B3; before 0B2: 90 + 30 = 120: it moves there.
    assert place(text, 150, **extra) == "0F0 0SO0:x 0F1 0SO1:y 0SI0:x 0F2 0F3 0B3 0SI1:y 0B2 0B1 0B0"
    # roomier: both as early as their release points allow
    assert place(text, 10**9, **extra) == "0F0 0SO0:x 0F1 0SO1:y 0SI0:x 0F2 0SI1:y 0F3 0B3 0B2 0B1 0B0"


def test_a_swap_in_never_splits_a_backward_from_its_recompute():
    # 0RC2:z runs inside 0B2 (before its layer's backward): no swap-in between them. The
    # walk peaks at 200 in 0B2 and 40 at the recompute: with capacity 100 the swap-in could
    # only stand before the recompute, which is no place at all, so it stays.
    text = "0F0 0SO0:x 0F1 0F2 0B2 0RC2:z 0SI0:x 0B1 0B0"
    extra = {"0B2": dict(transient_bytes=120, free_bytes=40), "0RC2:z": dict(starts_action=False)}
    _, tasks, _ = lowered(text, **extra)
    assert walk_peaks(tasks, 0) == [40, 40, 40, 80, 200, 40, 80, 80, 40]
    assert place(text, 100, **extra) == text
    assert place(text, 10**9, **extra) == "0F0 0SO0:x 0F1 0SI0:x 0F2 0B2 0RC2:z 0B1 0B0"


def test_d2d_swap_ins_move_and_optimizer_states_stay():
    text = "0F0 0DO0:x 0F1 0F2 0B2 0DI0:x 0B1 0B0 0OI:o 0OPT"
    extra = {"0DI0:x": dict(alloc_bytes=40), "0OI:o": dict(alloc_bytes=5)}
    assert place(text, 10**9, **extra) == "0F0 0DO0:x 0F1 0DI0:x 0F2 0B2 0B1 0B0 0OI:o 0OPT"


def test_a_layer_task_counts_at_its_action_with_the_highest_of_its_layers():
    # 0F2 lowered as two layer tasks (peaks 50 and 90; 90 and 130 with x back): the action's peak is
    # the higher one, so a capacity of 129 keeps the swap-in after it.
    actions = parse_actions("0F0 0SO0:x 0F1 0F2 0B2 0SI0:x 0B1 0B0")
    tasks = [Task(actions[0], alloc_bytes=40, starts_action=True), Task(actions[1]),
             Task(actions[2], alloc_bytes=40, starts_action=True, release_bytes=40),
             Task(actions[3], layer=0, alloc_bytes=10, starts_action=True),
             Task(actions[3], layer=1, alloc_bytes=10, transient_bytes=30),
             Task(actions[4], layer=1, free_bytes=10, starts_action=True), Task(actions[4], layer=0, free_bytes=10),
             Task(actions[5], alloc_bytes=40), Task(actions[6], free_bytes=40, starts_action=True),
             Task(actions[7], free_bytes=40, starts_action=True)]
    origins = [0, 1, 2, 3, 3, 4, 4, 5, 6, 7]
    # walk: 40, 40, 40, 50, 90 (60 + 30), 60 -> 50, 50 -> 40, 80, 80, 40
    assert walk_peaks(tasks, 0) == [40, 40, 40, 50, 90, 60, 50, 80, 80, 40]
    placed = place_by_capacity(actions, tasks, origins, static_bytes=0, capacity_bytes=129)
    assert format_actions(placed) == "0F0 0SO0:x 0F1 0F2 0SI0:x 0B2 0B1 0B0"
    placed = place_by_capacity(actions, tasks, origins, static_bytes=0, capacity_bytes=130)
    assert format_actions(placed) == "0F0 0SO0:x 0F1 0SI0:x 0F2 0B2 0B1 0B0"


def test_a_swap_in_moved_before_a_release_point_counts_what_it_releases():
    # x (40 bytes, microbatch 0) and y (100, microbatch 1) are swapped out; 0F2 is y's
    # release point. Walk (static 0): 0F0 40 | SO x | 0F1 releases x: 0 + 100 | SO y |
    # 0F2 reached at 100, releases y: 0 + 10 | SI x 50 | 0B0 50 -> 10 | SI y 110 | 0B1
    # 110 -> 10 | 0B2 10 -> 0
    text = "0F0 0SO0:x 0F1 0SO1:y 0F2 0SI0:x 0B0 0SI1:y 0B1 0B2"
    extra = {"0F1": dict(alloc_bytes=100, release_bytes=40), "0F2": dict(alloc_bytes=10, release_bytes=100),
             "0SI1:y": dict(alloc_bytes=100), "0B1": dict(free_bytes=100), "0B2": dict(free_bytes=10)}
    _, tasks, _ = lowered(text, **extra)
    assert walk_peaks(tasks, 0) == [40, 40, 100, 100, 10, 50, 50, 110, 110, 10]
    # Before 0F2, x would be on the device while y still is (0F2 gives y back only when it
    # starts): 100 + 40 = 140 at 0F2's entry, though 0F2's own peak with it is 10 + 40.
    # A capacity of 139 keeps it where it is (peaks alone would have moved it, and the
    # device would hold 140)...
    assert place(text, 139, **extra) == text
    # ...and 140 lets it go there: the walk of the new list peaks at 140, as the swap-in
    # is issued
    moved = "0F0 0SO0:x 0F1 0SO1:y 0SI0:x 0F2 0B0 0SI1:y 0B1 0B2"
    assert place(text, 140, **extra) == moved
    _, tasks, _ = lowered(moved, **extra)
    assert walk_peaks(tasks, 0) == [40, 40, 100, 100, 140, 50, 50, 110, 110, 10]
    assert walk(tasks, 0)[5] == (140, 50)  # 0F2: reached at 140, its own peak 50
