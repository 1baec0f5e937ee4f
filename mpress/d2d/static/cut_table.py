"""The cut-family bound of the device mapper's search (`mapper._Search`): for a mapping
built one stage at a time, the exact optimum of one fixed mapping (`maxflow.py`, "cut
families") once every stage is placed, and a bound on every completion before.

A min cut of the transport network is fixed by the set C of overflowing stages whose
middle arcs it crosses; the least time T is the largest root over the families C of a
concave piecewise-linear sum (`maxflow.solve_concave`). A family's terms are rebuilt per
placement state (the search asks both bounds of each state once): only the devices that
hold a known spare and, for the spares still to place, as many of the free devices
reached as there are spares, fastest first. Units: bytes, bytes per second, seconds.
"""

from __future__ import annotations

import math
from bisect import insort
from collections.abc import Sequence
from operator import add

from mpress.d2d.static.maxflow import INF, solve_concave


class CutTable:
    """The cut families of a mapping built one stage at a time (device-indexed), with a
    relaxation for the devices still free: it bounds every completion of a partial
    mapping, and is exact for a complete one.

    The relaxation drops overflowing stages not yet placed (fewer demands can only help)
    and, for each cut family C separately, gives the spares not yet placed to the free
    devices in the best order for C: largest spare to the device with the highest rate
    from C. That order does not depend on T and is optimal because min(spare, rate x T)
    is supermodular. With `pool=False` (more devices than stages, idle spares that differ)
    each free device instead gets the larger of its idle spare and the largest spare left.
    Rates in bytes/s; `place`/`unplace` must nest (last placed, first removed).
    """

    def __init__(self, *, link_bps: Sequence[Sequence[float]], egress_bps: Sequence[float],
                 ingress_bps: Sequence[float], demand_bytes: Sequence[int], spare_bytes: Sequence[int],
                 idle_spare_bytes: Sequence[int], pool: bool) -> None:
        self._link, self._egress, self._ingress = link_bps, egress_bps, ingress_bps
        self._demand, self._spare, self._idle, self._use_pool = demand_bytes, spare_bytes, idle_spare_bytes, pool
        self._ports = any(math.isfinite(x) for x in list(egress_bps) + list(ingress_bps))
        n = len(link_bps)
        self._linked = [frozenset(d for d, rate in enumerate(row) if rate > 0) for row in link_bps]
        self.stage_on = [-1] * n
        self.device_of = [-1] * len(demand_bytes)
        self._placed: list[int] = []  # overflowing stages in placement order: bit i of a row mask
        self._rows: list[list[float]] = [[0.0] * n]  # rows[mask]: rate from those stages to each device
        self._row_demand = [0]
        self._pool = sorted(spare_bytes)  # spares of stages not yet placed, ascending
        self._cuts: list[tuple[int, int, list[tuple[float, float]], int]] | None = None  # _families of this state
        self._shortfall: int | None = None  # _waiting_shortfall of this state (both bounds ask it)

    def place(self, stage: int, device: int) -> None:
        self._cuts = self._shortfall = None
        self.stage_on[device], self.device_of[stage] = stage, device
        self._pool.remove(self._spare[stage])
        b = self._demand[stage]
        if b > 0:
            link = self._link[device]
            self._rows += [list(map(add, row, link)) for row in self._rows]
            self._row_demand += [x + b for x in self._row_demand]
            self._placed.append(stage)

    def unplace(self, stage: int) -> None:
        self._cuts = self._shortfall = None
        device = self.device_of[stage]
        self.stage_on[device], self.device_of[stage] = -1, -1
        insort(self._pool, self._spare[stage])
        if self._demand[stage] > 0:
            half = len(self._rows) // 2
            del self._rows[half:], self._row_demand[half:]
            self._placed.pop()

    def _families(self) -> list[tuple[int, int, list[tuple[float, float]], int]]:
        """(own demand, need, terms, reach) per cut family of the placed stages: made once
        per placement state (a search asks both bounds of each state)."""
        if self._cuts is None:
            self._cuts = self._cut_families()
        return self._cuts

    def _cut_families(self) -> list[tuple[int, int, list[tuple[float, float]], int]]:
        occ, spare, ingress = self.stage_on, self._spare, self._ingress
        capped = any(math.isfinite(x) for x in ingress)  # else every rate stands as it is
        pool = self._pool[::-1]
        fill = None if self._use_pool else [max(pool[0] if pool else 0, x) for x in self._idle]
        # per device, its spare in this state: its occupant's, (no pool) its best filler's, or
        # the pool's; made once per state, then each family walks only the devices that count
        known: list[tuple[int, int]] = []  # (device, its known spare > 0), ascending devices
        free: list[int] = []  # devices that take the pool's spares
        for d, st in enumerate(occ):
            sp = spare[st] if st >= 0 else (None if fill is None else fill[d])
            if sp is None:
                free.append(d)
            elif sp > 0:
                known.append((d, sp))
        placed = [(i, st, self._demand[st], self._egress[self.device_of[st]])
                  for i, st in enumerate(self._placed)] if self._ports else []
        lent = pool[:sum(1 for sp in pool if sp > 0)]  # the pool's spares that count, largest first
        families = []
        for mask in range(0 if self._ports else 1, len(self._rows)):
            row = self._rows[mask]
            if capped:  # a device's ingress caps the rate into it (a rate of 0 stays out)
                rates = [min(rate, cap) if rate > 0 else 0.0 for rate, cap in zip(row, ingress)]
            else:
                rates = row
            terms, reach = [], 0
            for d, sp in known:
                if row[d] > 0:
                    terms.append((sp, rates[d]))
                    reach += sp
            if lent and free:  # the fastest free devices reached take the largest spares
                into = [rates[d] for d in free if row[d] > 0]
                if len(lent) == 1:
                    into = [max(into)] if into else into
                else:
                    into.sort(reverse=True)
                for rate, sp in zip(into, lent):
                    terms.append((sp, rate))
                    reach += sp
            own = need = self._row_demand[mask]
            for i, _st, b, egress in placed:
                if not mask >> i & 1 and egress < INF:
                    need += b
                    terms.append((b, egress))
            families.append((own, need, terms, reach))
        return families

    def _spare_within(self, devices: set[int]) -> int:
        """Most spare the given devices can hold in any completion."""
        pool = self._pool[::-1]
        free = [d for d in devices if self.stage_on[d] < 0]
        known = sum(self._spare[self.stage_on[d]] for d in devices if self.stage_on[d] >= 0)
        if self._use_pool:
            return known + sum(pool[:len(free)])
        return known + sum(max(pool[0] if pool else 0, self._idle[d]) for d in free)

    def unplaced_bound(self) -> int:
        """Least unplaced bytes of any completion (exact once every stage is placed).

        Besides the cut families of the placed stages: the stages still waiting will sit
        on free devices, so they reach at most the devices linked to a free device.
        """
        worst = max([0] + [own - reach for own, _, _, reach in self._families()])
        waiting = self._waiting_bytes()
        if waiting:
            near_placed = set().union(*(self._linked[self.device_of[st]] for st in self._placed))
            worst = max(worst, self._waiting_shortfall(),
                        waiting + self._row_demand[-1] - self._spare_within(self._near_free() | near_placed))
        return worst

    def _waiting_bytes(self) -> int:
        return sum(b for st, b in enumerate(self._demand) if b > 0 and self.device_of[st] < 0)

    def _near_free(self) -> set[int]:
        return set().union(*(self._linked[v] for v, st in enumerate(self.stage_on) if st < 0))

    def _waiting_shortfall(self) -> int:
        """Bytes that the stages still waiting must leave unplaced whatever happens:
        they will sit on free devices, so they reach only devices linked to a free one."""
        if self._shortfall is None:
            waiting = self._waiting_bytes()
            self._shortfall = max(0, waiting - self._spare_within(self._near_free())) if waiting else 0
        return self._shortfall

    def time_bound(self, unplaced: int, stop_at: float = INF) -> float:
        """Least slowest swap time of any completion that leaves at most `unplaced` bytes
        unplaced (inf if none can); exact once every stage is placed. Stops early once
        the bound reaches stop_at (the value returned is then still a valid bound)."""
        unplaced -= self._waiting_shortfall()  # what the placed stages may leave unplaced
        if unplaced < 0:
            return INF
        worst = 0.0
        for own, need, terms, reach in self._families():
            if own - reach > unplaced:
                t = INF
            elif need <= unplaced:
                continue  # solve_concave's 0: nothing to move
            else:
                t = solve_concave(terms, need - unplaced)
            if t > worst:
                worst = t
                if worst >= stop_at:
                    break
        return worst

    def single_stage_bound(self, unplaced: int) -> float:
        """Bound from each overflowing stage not yet placed, alone on its best free device."""
        pool = self._pool[::-1]
        free_devices = [d for d, st in enumerate(self.stage_on) if st < 0]
        worst = 0.0
        for stage, b in enumerate(self._demand):
            if b <= 0 or self.device_of[stage] >= 0:
                continue
            best = INF
            for v in free_devices:
                terms, free = [], []
                for d, rate in enumerate(self._link[v]):
                    if rate > 0:
                        rate, st = min(rate, self._ingress[d]), self.stage_on[d]
                        if st >= 0:
                            terms.append((self._spare[st], rate))
                        elif self._use_pool:
                            free.append(rate)
                        else:
                            terms.append((max(pool[0] if pool else 0, self._idle[d]), rate))
                free.sort(reverse=True)
                terms += [(sp, rate) for rate, sp in zip(free, pool)]
                t = max(solve_concave([tm for tm in terms if tm[0] > 0], b - unplaced),
                        max(0, b - unplaced) / self._egress[v])
                best = min(best, t)
            worst = max(worst, best)
        return worst
