"""How a job ended, in one line: what `mpress train` prints when its ranks did not all
finish, read from how each rank's process ended and the lines it left in its log.

The ranks' lines (mpress/train.py, launcher/rank_watch.py) are, one per rank at most:

- `mpress.train: rank R: <Kind>: <message>` -- rank R's own failure (a runtime error,
  naming stage, microbatch and tensor where there is one), exit status 1;
- `mpress.train: rank R: error: <message>` -- bad input rank R found, exit status 2;
- `mpress.train: error: <message>` -- bad input, said once by rank 0, exit status 2;
- `mpress.train: rank R: stopping: <reasons>` -- rank R stopped because another rank
  failed, died, stalled, or its launcher left, exit status 1;
- `mpress.train: interrupted: after step N, <checkpoint>` -- every rank, stopped at a step
  boundary by Ctrl-C (`interrupted_line`), exit status 130.

The verdict names the cause once: a rank ended by a signal that the launcher did not
send first (the others' errors then echo its death), else a rank's own failure line (the
rank the others' stop lines name most, the lowest on a tie), else a stalled rank the others named (the launcher then killed it),
else a rank that exited badly without a line (its log's last line). It adds how many of
the other ranks named that rank in their lines and where the logs are.
"""

from __future__ import annotations

import re
import signal
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_OWN = re.compile(r"^mpress\.train: rank (\d+): (?!stopping: )(.*)$")
_ERROR = re.compile(r"^mpress\.train: error: (.*)$")
_STOP = re.compile(r"^mpress\.train: rank (\d+): stopping: (.*)$")
_INTERRUPTED = re.compile(r"^mpress\.train: interrupted: (.*)$")
_NAMED = re.compile(r"\brank (\d+)\b")
_STALLED = re.compile(r"\brank (\d+) \(pid \d+\) has stalled[^;]*")
_MAX_LOG_BYTES = 1 << 20
"""Only the end of a rank's log is read (its lines come last)."""


@dataclass(frozen=True)
class RankEnd:
    """How one rank's process ended."""

    rank: int
    pid: int
    returncode: int
    """The process's exit status; -N when signal N ended it."""
    killed_by_launcher: bool
    """The launcher sent the signal that ended it (a stalled or left-over rank)."""
    log: Path
    """The rank's stderr (and, but for rank 0, stdout)."""


def rank_lines(path: Path) -> list[str]:
    """The `mpress.train:` lines of a rank's log (its end only)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - _MAX_LOG_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.startswith("mpress.train:")]


def diagnose(ends: list[RankEnd], run_dir: Path) -> tuple[str, int] | None:
    """The one line and the exit status (2 bad input, 1 runtime failure) for a job some
    rank of which ended badly; None when every rank finished (status 0)."""
    if all(e.returncode == 0 for e in ends):
        return None
    lines = {e.rank: rank_lines(e.log) for e in ends}
    stops = {r: m.group(2) for r, ls in lines.items() for m in map(_STOP.match, ls) if m}
    named = Counter(int(n) for text in stops.values() for n in set(_NAMED.findall(text)))
    by_rank = {e.rank: e for e in ends}
    where = f"logs in {run_dir}"

    def tail(rank: int) -> str:
        others = [r for r, ls in lines.items() if r != rank and any(rank in _named_in(x) for x in ls)]
        said = f"{len(others)} of the other {len(ends) - 1} ranks named it; " if len(ends) > 1 else ""
        return f" [{said}{where}]"

    signalled = [e for e in ends if e.returncode < 0 and not e.killed_by_launcher]
    if signalled:
        e = min(signalled, key=lambda x: (-named[x.rank], x.rank))
        return f"mpress train: rank {e.rank} (pid {e.pid}) was killed by {_signal_name(-e.returncode)}{tail(e.rank)}", 1
    own = [(r, m.group(2)) for r, ls in lines.items() for m in map(_OWN.match, ls) if m]
    if own:
        rank, text = min(own, key=lambda o: (-named[o[0]], o[0]))
        code = 2 if by_rank[rank].returncode == 2 or text.startswith("error: ") else 1
        return f"mpress train: rank {rank}: {text}{tail(rank)}", code
    errors = [m.group(1) for ls in lines.values() for m in map(_ERROR.match, ls) if m]
    if errors:
        return f"mpress train: error: {errors[0]}", 2
    stalled = [m.group(0) for text in stops.values() for m in _STALLED.finditer(text)]
    if stalled:
        rank = int(_NAMED.search(stalled[0]).group(1))  # type: ignore[union-attr]
        return f"mpress train: {stalled[0]}; the launcher killed it{tail(rank)}", 1
    bad = [e for e in ends if e.returncode != 0 and not e.killed_by_launcher] or [e for e in ends if e.returncode]
    e = bad[0]
    last = _last_line(e.log)
    return (f"mpress train: rank {e.rank} (pid {e.pid}) exited with status {e.returncode}"
            f"{f': {last}' if last else ''}{tail(e.rank)}", 1)


def interrupted_line(ends: list[RankEnd], signum: int, run_dir: Path) -> str:
    """The one line of a job the launcher was asked to stop (signal `signum`): the step the
    ranks stopped after and the checkpoint they saved, where they said so."""
    said = next((m.group(1) for e in ends for m in map(_INTERRUPTED.match, rank_lines(e.log)) if m), None)
    return (f"mpress train: interrupted ({_signal_name(signum)}){f' {said};' if said else ':'} "
            f"stopped {len(ends)} ranks; logs in {run_dir}")


def _named_in(line: str) -> set[int]:
    """The ranks a rank's line names (after its own `mpress.train: rank R:` prefix)."""
    body = line.split(": ", 2)[-1] if line.startswith("mpress.train: rank ") else line
    return {int(n) for n in _NAMED.findall(body)}


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    rest = [line.strip() for line in text.splitlines() if line.strip()]
    return rest[-1][:300] if rest else ""
