"""The planner's D2D steps (PAPERS.md section 1, steps 3 and 5): what a D2D swap costs
before the mapper has placed it and how much spare peer memory the first step may give
out, which data goes to peers, the device mapping that gives it spare peer memory over
NVLink, and the rounds that move the costliest compacted layers to peers while the
emulated iteration gets faster.

`D2DSteps` is a mixin of the planner (`planner.py`): it reads the planner's setup, costs,
capacity, options, `evaluate` and `cache` (whose mapper answers each problem once), and
records the mapper's time in `mapping_s`.
"""

from __future__ import annotations

import dataclasses
import math
import time

from mpress.contract.actions import UnitId, UnitKind
from mpress.d2d.static.ports import nvlink_egress_gbps
from mpress.d2d.static.mapping import Assignment, MappingProblem, assign_spare, exporter_context_bytes
from mpress.static.plan.evaluate import Evaluation
from mpress.static.plan.plan_draft import D2D, KEEP, RECOMPUTE, Draft, peer_quota_bytes, quota_payload_bytes
from mpress.static.memory.stage_memory import recompute_time_s

MAPPER_WORK_BUDGET = 2000
"""Bound evaluations the device mapper may spend per placement problem while planning: a
work budget, not a time budget, so a plan is the same on every machine however loaded.
On the shipped presets' problems the mapper's incumbent after 1000 evaluations already
equals the proved optimum (proving it takes up to ~16,000); each evaluation costs
~0.1-0.5 ms of CPU."""


class D2DSteps:
    """D2D placement and rounds (see the module docstring)."""

    def _shed_d2d(self, d: Draft, s: int, need: int, live: list[list[float]]) -> int:
        """D2D-only strategy: move model data, then layers with the longest intervals."""
        c, k = self.costs[s], self.in_flight[s]
        shed = 0
        if d.optim[s] == KEEP and c.optimizer_data_bytes:
            d.optim[s] = D2D
            shed += c.optimizer_data_bytes
        if shed < need and self.sched.weight_stashing and d.stash[s] == KEEP and k > 1:
            d.stash[s] = D2D
            shed += (k - 1) * c.param_bytes
        order = sorted(range(len(c.layers)), key=lambda j: -min(live[j]))
        for j in order:
            if shed >= need:
                break
            if all(t == KEEP for t in d.layer_tech[s][j]) and c.layers[j].saved_bytes:
                d.layer_tech[s][j] = [D2D] * self.num_mb
                shed += self._layer_peer_bytes(s, j)
        return shed

    def _d2d_roundtrip_s(self, nbytes: int, s: int) -> float:
        """A D2D swap's round trip for stage s before the mapper has placed it: out and
        back striped over its device's NVLink to the devices with spare memory
        (`ports.nvlink_egress_gbps`); inf when none is linked to it."""
        gbps = nvlink_egress_gbps(self.hw, self.setup.stage_to_device[s], self.lenders)
        if gbps <= 0:
            return math.inf
        return 2 * (self.hw.nvlink_latency_s + nbytes / (gbps * 1e9))

    def _d2d_cost(self, s: int, j: int, live: list[float]) -> float | None:
        """Exposed seconds of swapping layer j of stage s to peers in every microbatch (the
        part of the round trip its live interval does not hide), or None when the seed
        gives no D2D or its peer room cannot hold the layer's microbatches in flight."""
        layer = self.costs[s].layers[j]
        if D2D not in self.layer_allowed or not layer.saved_bytes \
                or self._layer_peer_bytes(s, j) > self.peer_room:
            return None
        roundtrip = self._d2d_roundtrip_s(layer.saved_bytes, s)
        return sum(max(roundtrip - x, 0.0) for x in live)

    def _layer_peer_bytes(self, s: int, j: int) -> int:
        """Peer-pool bytes layer j of stage s takes when it goes to peers: what it saves,
        in every microbatch in flight at the stage's peak."""
        return self.costs[s].layers[j].saved_bytes * self.in_flight[s]

    def _d2d_bytes(self, d: Draft, s: int) -> int:
        """Peer-pool bytes stage s needs: its D2D data at the stage's peak."""
        c, k = self.costs[s], self.in_flight[s]
        act = sum(self._layer_peer_bytes(s, j) for j in range(len(c.layers)) if D2D in d.layer_tech[s][j])
        if d.optim[s] == D2D:
            act += c.optimizer_data_bytes
        if d.stash[s] == D2D:
            act += (k - 1) * c.param_bytes
        return act

    def _map_d2d(self, d: Draft, peaks: list[int] | None = None, mapping: list[int] | None = None,
                 one_peer: bool = False) -> bool:
        """Run the device mapper for the draft's D2D volumes; set mapping, stripes, pools.
        Returns False when spare peer memory is short, or when the pipeline cannot be
        mapped (interleaved): then what found no peer stays on its device (keep), and
        `d.unplaced_bytes` / `d.unplaced_why` say how much and why. Ablations: `mapping`
        fixes the stage-to-device map (the best use of spare memory under it is still
        found); `one_peer` sends each stage's D2D bytes to its largest stripe's peer only,
        as far as that peer's spare memory takes them (the rest stays on the device)."""
        n_st = self.sched.num_stages
        overflow = [self._d2d_bytes(d, s) for s in range(n_st)]
        if self.sched.num_ranks != n_st:  # interleaved: several stages per device, the mapper maps one each
            for s in range(n_st):
                self._keep_on_device(d, s)
            d.stripes, d.pool_bytes, d.quotas = [()] * n_st, {}, [()] * n_st
            d.unplaced_bytes = sum(overflow)
            d.unplaced_why = (f"cannot go to peers: the device mapper places one stage per device, and "
                              f"{self.sched.name} runs {n_st // self.sched.num_ranks} on each")
            return False
        problem = self._peer_problem(overflow, peaks)
        spare = list(problem.spare_bytes)
        t0 = time.perf_counter()
        a = assign_spare(problem, mapping) if mapping is not None else \
            self.cache.map_devices(problem, work_budget=MAPPER_WORK_BUDGET).assignment
        self.mapping_s += time.perf_counter() - t0
        if one_peer:
            a = _one_peer(a, problem, spare)
        d.stage_to_device = list(a.mapping)
        d.stripes = []
        d.pool_bytes = {}
        d.quotas = []
        for s in range(n_st):
            stripes = a.stripes.get(s, [])
            total = sum(b for _dev, b in stripes)
            d.quotas.append(tuple((dev, peer_quota_bytes(b)) for dev, b in stripes if b > 0))
            d.stripes.append(tuple((dev, b / total) for dev, b in stripes if b > 0) if total else ())
            for dev, b in stripes:
                if b > 0:
                    d.pool_bytes[dev] = d.pool_bytes.get(dev, 0) + peer_quota_bytes(b)
            if overflow[s] and not total:  # no peer can take any of it: it stays on the device
                self._keep_on_device(d, s)
            elif overflow[s] > total:  # peers take part of it: the rest stays on the device
                self._keep_part_on_device(d, s, overflow[s] - total)
        d.unplaced_bytes = a.unplaced_bytes
        d.unplaced_why = ""
        return a.unplaced_bytes == 0

    def _peer_problem(self, overflow: list[int], peaks: list[int] | None = None) -> MappingProblem:
        """The device mapper's problem for per-stage D2D volumes `overflow`, where stage s
        peaks at `peaks[s]` (default: the memory model's need): a stage that exports
        lends nothing. A busy lender keeps room for the contexts its exporters open on it
        (at most one per NVLink peer; which stages end up beside it is the mapper's choice,
        so the most any device can get), and every lender's pool holds the quotas' slack
        on top of the bytes the mapper places (`peer_quota_bytes`): the mapper gets what
        is left."""
        if peaks is None:
            peaks = [m.total_bytes for m in self.setup.memory]
        exporters = sum(1 for b in overflow if b)
        contexts = max(exporter_context_bytes(self.hw, dev, exporters) for dev in range(self.hw.num_devices))
        spare = [0 if overflow[s] else quota_payload_bytes(max(self.capacity - peaks[s] - contexts, 0), exporters)
                 for s in range(len(overflow))]
        problem = MappingProblem.from_hardware(self.hw, overflow, spare)
        return dataclasses.replace(problem, idle_spare_bytes=tuple(
            quota_payload_bytes(b, exporters) for b in problem.idle_spare_bytes))

    def _first_step_peers(self) -> tuple[int, list[int]]:
        """(bytes, devices) of spare peer memory before any compaction, by the memory
        model: what stages that fit leave free, less the contexts and quota slack their
        exporters (the stages that overflow) cost them, and idle devices' memory. This
        is what the first step may give D2D (the device mapper then places it)."""
        if self.sched.num_ranks != self.sched.num_stages:  # interleaved: the mapper cannot map it
            return 0, []
        need = [m.total_bytes for m in self.setup.memory]
        problem = self._peer_problem([int(b > self.capacity) for b in need])
        idle = [dev for dev, b in enumerate(problem.idle_spare_bytes) if b > 0 and dev not in self.setup.stage_to_device]
        devices = {self.setup.stage_to_device[s] for s, b in enumerate(problem.spare_bytes) if b > 0} | set(idle)
        return sum(problem.spare_bytes) + sum(problem.idle_spare_bytes[dev] for dev in idle), sorted(devices)

    def _place_first_step_d2d(self, d: Draft) -> None:
        """Map the D2D layers the first step chose; what the mapper cannot place stays on
        the device (`_map_d2d`), the rest is mapped again, and the seed's peer room is
        spent (the next fit round sheds those layers with the other techniques)."""
        while not self._map_d2d(d):  # each failure keeps some data on its device: this ends
            self.peer_room = 0

    def _keep_part_on_device(self, d: Draft, s: int, nbytes: int) -> None:
        """At least `nbytes` of stage s's D2D data become keep, its last layers first (then
        stashed weights, then optimizer data), so what is left fits the stripes the mapper
        placed (their quotas hold the placed bytes)."""
        c, k = self.costs[s], self.in_flight[s]
        for j in reversed(range(len(c.layers))):
            if nbytes <= 0:
                return
            if D2D in d.layer_tech[s][j]:
                d.layer_tech[s][j] = [KEEP if t == D2D else t for t in d.layer_tech[s][j]]
                nbytes -= self._layer_peer_bytes(s, j)
        if nbytes > 0 and d.stash[s] == D2D:
            d.stash[s] = KEEP
            nbytes -= (k - 1) * c.param_bytes
        if nbytes > 0 and d.optim[s] == D2D:
            d.optim[s] = KEEP

    @staticmethod
    def _keep_on_device(d: Draft, s: int) -> None:
        """Stage s's D2D decisions become keep: what the mapper gave no stripes stays on
        the device (a D2D rule without stripes is no plan)."""
        d.layer_tech[s] = [[KEEP if t == D2D else t for t in mbs] for mbs in d.layer_tech[s]]
        d.optim[s] = KEEP if d.optim[s] == D2D else d.optim[s]
        d.stash[s] = KEEP if d.stash[s] == D2D else d.stash[s]

    def _overhead_by_layer(self, ev: Evaluation, d: Draft) -> list[tuple[float, int, int]]:
        """(overhead seconds, stage, layer) of compacted layers: stall blamed on their
        swaps plus their recompute time."""
        stall: dict[tuple[int, str | None], float] = {}
        for name, seconds in ev.result.stall_s_by_tensor.items():
            unit = UnitId.parse(name)
            if unit.kind is UnitKind.ACTIVATIONS:
                stall[(unit.stage, unit.layer)] = stall.get((unit.stage, unit.layer), 0.0) + seconds
        out = []
        for s, c in enumerate(self.costs):
            for j, layer in enumerate(c.layers):
                techs = d.layer_tech[s][j]
                if all(t in (KEEP, D2D) for t in techs):
                    continue
                rc_s = recompute_time_s(layer, d.choice(s, j))
                o = stall.get((s, layer.name), 0.0) + rc_s * techs.count(RECOMPUTE)
                out.append((o, s, j))
        return sorted(out, reverse=True)

    def _d2d_rounds(self, d: Draft, ev: Evaluation) -> tuple[Draft, Evaluation]:
        """Move the costliest compacted layers to D2D while spare peer memory lasts and the
        emulated iteration gets faster."""
        if not ev.result.fits:
            return d, ev
        for rnd in range(self.options.max_d2d_rounds):
            peaks = [ev.result.peak_bytes[d.stage_to_device[s]] for s in range(self.sched.num_stages)]
            lenders = [s for s in range(self.sched.num_stages) if not self._d2d_bytes(d, s)]
            room = sum(max(self.capacity - peaks[s], 0) for s in lenders) - sum(d.pool_bytes.values())
            chosen: list[tuple[int, int]] = []
            per_stage: dict[int, int] = {}
            for _o, s, j in (x for x in self._overhead_by_layer(ev, d) if x[0] > 0):
                need = self._layer_peer_bytes(s, j)
                if need > room or per_stage.get(s, 0) >= self.options.d2d_layers_per_round:
                    continue
                chosen.append((s, j))
                per_stage[s] = per_stage.get(s, 0) + 1
                room -= need
            trial = None
            while chosen:  # drop the last choice until the mapper places everything
                trial = d.copy()
                for s, j in chosen:
                    trial.layer_tech[s][j] = [D2D] * self.num_mb
                if self._map_d2d(trial, peaks):
                    break
                chosen.pop()
                trial = None
            if trial is None:
                self.progress(f"mpress: D2D round {rnd + 1}: no spare peer memory for the costliest layers")
                break
            cand = self.evaluate(trial)
            faster = cand.result.fits and cand.result.iteration_s < ev.result.iteration_s * (1 - 1e-3)
            self.progress(f"mpress: D2D round {rnd + 1}: {len(chosen)} layers to peers, "
                          f"{cand.result.iteration_s:.3f} s ({'kept' if faster else 'no gain, stop'})")
            if not faster:
                break
            d, ev = trial, cand
        return d, ev


def _one_peer(a: Assignment, problem: MappingProblem, spare: list[int]) -> Assignment:
    """`a` with each stage's stripes folded onto its largest stripe's device, no more than
    that device's spare memory (lenders' pools as the mapper saw them) holds in all;
    what does not fit is unplaced."""
    room = {s: spare[s] for s in range(len(spare))}  # stage index -> its spare, by the device it maps to
    left = {a.mapping[s]: room[s] for s in range(len(spare))}
    for dev, b in enumerate(problem.idle_spare_bytes):
        if dev not in left:
            left[dev] = b
    stripes: dict[int, tuple[tuple[int, int], ...]] = {}
    unplaced = 0
    for s, parts in a.stripes.items():
        total = sum(b for _d, b in parts)
        if not total:
            continue
        dev = max(parts, key=lambda x: x[1])[0]
        take = min(total, left.get(dev, 0))
        left[dev] = left.get(dev, 0) - take
        stripes[s] = ((dev, take),) if take else ()
        unplaced += total - take
    return dataclasses.replace(a, stripes=stripes, unplaced_bytes=a.unplaced_bytes + unplaced)

