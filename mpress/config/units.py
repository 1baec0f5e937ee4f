"""Sizes and times: parsing and printing for humans (GB = 1e9 bytes, GiB = 2**30), the
one alignment every pool of mpress carves its blocks to, and the pool-size overrides read
from the environment."""

from __future__ import annotations

import math
import os
import re

from mpress.errors import UserError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
ALIGNMENT_BYTES = 512
"""Alignment of every block carved from a pool (pinned host pool, peer pools and the
quotas inside them) and of every D2D stripe boundary: a block can then be viewed as any
dtype and copy engines see aligned addresses. The planner sizes pools in these units."""

MAX_BYTES = 2**60
"""Largest size any size setting may ask for (1 EiB): far above any device or host, and
small enough that sums of sizes stay exact 64-bit integers."""

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e\+?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str, what: str = "size") -> int:
    """`"2GB"` -> 2_000_000_000, `"512MiB"` -> 536870912, `"1e9"` -> 10**9.

    Raises a one-line `UserError` naming `what` for text that is not a size, a size
    below one byte, or one above `MAX_BYTES`.
    """
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise UserError(f"{what}: cannot read {text!r} as a size (e.g. 2GB, 512MiB, 1e9)")
    number = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(number) or number > MAX_BYTES:
        raise UserError(f"{what}: must be at most {MAX_BYTES} bytes (1 EiB), got {text!r}")
    value = int(number)
    if value <= 0:
        raise UserError(f"{what}: must be > 0, got {text!r}")
    return value


def round_up(value: int, multiple: int = ALIGNMENT_BYTES) -> int:
    """`value` rounded up to a multiple of `multiple` (bytes)."""
    return -(-value // multiple) * multiple


def fmt_bytes(num: float) -> str:
    """Bytes in GB/MB/KB (decimal), 3 significant digits."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(num) >= scale:
            return f"{num / scale:.3g} {unit}"
    return f"{int(num)} B"


def fmt_seconds(sec: float) -> str:
    """Seconds as s/ms/us with 3 significant digits."""
    if sec >= 1:
        return f"{sec:.3g} s"
    if sec >= 1e-3:
        return f"{sec * 1e3:.3g} ms"
    return f"{sec * 1e6:.3g} us"


def pool_override(variable: str) -> int | None:
    """$MPRESS_HOST_POOL_BYTES (pinned pool per stage) or $MPRESS_PEER_POOL_BYTES (peer
    pool per importer device) instead of the plan's, for sizing experiments and fault
    tests; unset = the plan's."""
    value = os.environ.get(variable)
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        raise UserError(f"{variable}: expected a whole number of bytes, got {value!r}") from None
    if not 0 < number <= MAX_BYTES:
        raise UserError(f"{variable}: must be between 1 and {MAX_BYTES} bytes (1 EiB), got {value!r}")
    return number
