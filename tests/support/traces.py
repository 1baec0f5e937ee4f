"""Checks of a Chrome / Perfetto trace document as a viewer reads it, written from the
trace event format (not from mpress's writer): times in microseconds, which Perfetto
turns into whole nanoseconds (`round(ts * 1000)`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def _ns(us: float) -> int:
    return round(us * 1000)


def overlaps(events: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """Pairs of complete ("X") events on one (pid, tid) track that overlap without one
    nesting inside the other (slices the viewers drop)."""
    tracks: dict[tuple[int, int], list[tuple[int, int, dict]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            start = _ns(e["ts"])
            tracks[(e["pid"], e["tid"])].append((start, start + _ns(e["dur"]), e))
    bad = []
    for slices in tracks.values():
        slices.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[int, int, dict]] = []
        for s in slices:
            while stack and stack[-1][1] <= s[0]:
                stack.pop()
            if stack and s[1] > stack[-1][1]:
                bad.append((stack[-1][2], s[2]))
            stack.append(s)
    return bad


def events_without_args(events: list[dict[str, Any]]) -> list[dict]:
    """Events with no (or empty) `args`."""
    return [e for e in events if not e.get("args")]


def format_errors(events: list[dict[str, Any]]) -> list[str]:
    """What breaks the format: pid/tid not ints, a slice without a non-negative `dur`, a
    flow start without its finish (or one not bound to a slice on its track)."""
    errors = []
    flows: dict[tuple[str, Any], list[dict]] = defaultdict(list)
    for e in events:
        if not isinstance(e.get("pid"), int) or ("tid" in e and not isinstance(e["tid"], int)):
            errors.append(f"pid/tid not ints: {e}")
        if e.get("ph") == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            errors.append(f"slice without dur: {e}")
        if e.get("ph") in ("s", "f"):
            flows[(e.get("cat"), e.get("id"))].append(e)
    for key, pair in flows.items():
        phases = sorted(p["ph"] for p in pair)
        if phases != ["f", "s"]:
            errors.append(f"flow {key}: phases {phases}")
            continue
        for p in pair:
            if not enclosing_slices(events, p):
                errors.append(f"flow {key}: {p['ph']} at {p['ts']} has no slice on its track")
    return errors


def enclosing_slices(events: list[dict[str, Any]], at: dict[str, Any]) -> list[dict]:
    """The complete events on `at`'s track that enclose its time, outermost first."""
    t = _ns(at["ts"])
    found = [e for e in events if e.get("ph") == "X" and (e["pid"], e["tid"]) == (at["pid"], at["tid"])
             and _ns(e["ts"]) <= t <= _ns(e["ts"]) + _ns(e["dur"])]
    return sorted(found, key=lambda e: -e["dur"])
