"""Stopping a rank, naming the dead one, when another rank of a D2D job dies.

A rank blocked in a pipeline recv from a dead rank would otherwise wait for the
collective timeout and, on NCCL, be aborted by its watchdog without a word. The peer
pools know every rank's process (`PeerPools.dead_ranks`), so a thread polls them while
the job trains.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable


class PeerWatch:
    """Polls `dead_ranks` every `interval_s`; on a death prints one line naming it and
    ends this process. `stop` it before the ranks part (they leave at different times).

    rank, stages: this rank and its stages, for the line. `dead_ranks`: None = nothing to
    watch (the job has no peer pools), and the watch does nothing.
    """

    def __init__(self, dead_ranks: Callable[[], list[str]] | None, *, rank: int, stages: list[int],
                 interval_s: float = 1.0) -> None:
        self._dead_ranks = dead_ranks
        self._rank = rank
        self._stages = stages
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpress-peer-watch", daemon=True)
        if dead_ranks is not None:
            self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            dead = self._dead_ranks()
            if dead and not self._stopped.is_set():
                stages = ",".join(map(str, self._stages))
                print(f"mpress.train: rank {self._rank}: SwapError: rank {self._rank} stage {stages}: "
                      f"{'; '.join(dead)}; stopping", file=sys.stderr, flush=True)
                os._exit(1)  # the training thread may be stuck in a collective with the dead rank

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
