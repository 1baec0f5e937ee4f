"""The planner: MPress's search for the cheapest memory technique per tensor.

Steps (PAPERS.md section 1; one `PipelineSetup` in, one `PlanResult` out):

1. Emulate the pipeline without compaction; read each layer's live interval per
   microbatch (forward end to backward start) off the timeline.
2. Per stage, the bytes to shed = memory-model need - device capacity. Candidates:
   optimizer states + master weights of the stage (needed only at the optimizer step:
   the longest live interval there is), PipeDream's stashed weight versions, and the
   saved activations of each layer (in all microbatches: every microbatch passes
   through the in-flight window that sets the peak).
3. Initial assignment, per candidate and microbatch: host swap where the round trip
   hides in the live interval (given the PCIe time the stage has already committed);
   otherwise recompute when its extra latency (the layer's forward) is below the exposed
   part of the swap, else host swap. Candidates are taken cheapest overhead per byte
   first until the stage fits; among equals, later layers first (their recompute delays
   the backward least and leaves earlier tensors longer to hide swaps). Each recomputed
   layer is its own checkpoint: one layer's recomputed tensors are alive at a time.
4. Emulate; where a device still overflows (copies in flight, the optimizer's streamed
   chunks), shed the excess and repeat.
5. D2D rounds (`mpress`, `d2d`): take the compacted layers with the largest emulated
   overhead (stall blamed on their swaps, or their recompute time), move them to D2D
   where the device mapper finds spare peer memory over NVLink (stripes in proportion to
   link bandwidth), keep the step if the emulated iteration gets faster; stop when a
   step gains nothing. Ties prefer the technique that does not use scarce peer memory.

Strategies: `none`, `recompute` (recompute only: cannot touch model data), `host-swap`
(host swap only), `d2d` (D2D only) and `mpress` (all three), from the same code.
Units: bytes, seconds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Literal

from mpress.d2d.static.mapper import MappingProblem, map_devices
from mpress.errors import UserError
from mpress.hardware import Hardware
from mpress.plan import (
    PeerQuota,
    Plan,
    StagePlan,
    Stripe,
    TensorRule,
    fingerprint,
    format_microbatches,
    hardware_fingerprint,
)
from mpress.static.evaluate import Evaluation, PipelineSetup
from mpress.static.liveness import layer_live_intervals, stage_times
from mpress.static.plan_eval import evaluate_plan
from mpress.units import fmt_bytes, round_up

Strategy = Literal["none", "recompute", "host-swap", "d2d", "mpress"]
STRATEGIES: tuple[str, ...] = ("none", "recompute", "host-swap", "d2d", "mpress")
_ALLOWED = {
    "none": (), "recompute": ("recompute",), "host-swap": ("host",), "d2d": ("d2d",),
    "mpress": ("host", "recompute", "d2d"),
}


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """Knobs of the search."""

    headroom_fraction: float = 0.02
    """Share of each device's memory left free (fragmentation, allocator slack)."""
    max_fit_rounds: int = 8
    """Emulate-and-shed rounds before giving up on fitting."""
    max_d2d_rounds: int = 6
    """D2D rounds (each moves the costliest layers to peers and keeps the step if faster)."""
    d2d_layers_per_round: int = 2
    """Layers per overflowing stage moved to D2D in one round."""
    swap_in_policy: Literal["capacity", "layer-ahead"] = "capacity"


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """A strategy's plan, its emulation and what it saved."""

    strategy: str
    plan: Plan
    evaluation: Evaluation
    fits: bool
    reason: str
    """Why it does not fit ("" when it does)."""
    saved_bytes: list[dict[str, int]]
    """Per stage: bytes each technique takes off the device at the stage's peak."""
    peers: list[list[int]]
    """Per stage: devices its D2D stripes go to."""
    host_bytes: int
    """Pinned host memory all stages need."""
    plan_s: float
    mapping_s: float


QUOTA_SLACK = 1.02
QUOTA_SLACK_BYTES = 32 << 10
"""A peer quota holds the mapper's bytes plus this slack: the runtime rounds every stripe
up to the pools' alignment (`ALIGNMENT_BYTES`), and spreads small tensors whole over the peers."""


def peer_quota_bytes(nbytes: float) -> int:
    """The quota (whole `ALIGNMENT_BYTES` units) an exporter gets for `nbytes` of D2D data."""
    return round_up(math.ceil(nbytes * QUOTA_SLACK + QUOTA_SLACK_BYTES))


@dataclass
class _Draft:
    """A plan under construction: a technique per (stage, layer, microbatch)."""

    layer_tech: list[list[list[str]]]
    """[stage][layer within stage][microbatch] -> keep | host | recompute | d2d."""
    optim: list[str]
    """Per stage: keep | host | d2d for optimizer states + master weights."""
    stash: list[str]
    """Per stage: keep | host | d2d for stashed weight versions (PipeDream)."""
    stage_to_device: list[int]
    stripes: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    """Per stage: D2D stripes (peer device, fraction) shared by its D2D units."""
    pool_bytes: dict[int, int] = field(default_factory=dict)
    """Per device: peer pool reserved for D2D exporters."""
    quotas: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    """Per stage: (peer device, bytes) of each peer pool it may fill."""
    unplaced_bytes: int = 0
    """D2D bytes no peer could take (the plan then does not fit)."""

    def copy(self) -> "_Draft":
        return _Draft([[list(mb) for mb in st] for st in self.layer_tech], list(self.optim), list(self.stash),
                      list(self.stage_to_device), list(self.stripes), dict(self.pool_bytes), list(self.quotas),
                      self.unplaced_bytes)


class _Planner:
    def __init__(self, setup: PipelineSetup, strategy: str, options: PlannerOptions,
                 progress: Callable[[str], None] | None) -> None:
        if strategy not in _ALLOWED:
            raise UserError(f"unknown strategy {strategy!r} (allowed: {', '.join(STRATEGIES)})")
        self.setup, self.strategy, self.options = setup, strategy, options
        self.allowed = _ALLOWED[strategy]
        self.layer_allowed: tuple[str, ...] = self.allowed
        """Techniques the initial assignment may give activations (model data: host)."""
        self.progress = progress or (lambda _msg: None)
        self.hw: Hardware = setup.hardware
        self.sched = setup.schedule
        self.costs = setup.costs
        self.num_mb = self.sched.num_microbatches
        self.capacity = int(self.hw.device.memory_bytes * (1 - options.headroom_fraction))
        self.mapping_s = 0.0
        self.in_flight = [m.max_in_flight for m in setup.memory]

    # -- evaluation ------------------------------------------------------------------------
    def to_plan(self, d: _Draft, predicted: Evaluation | None = None) -> Plan:
        stages = []
        for s, c in enumerate(self.costs):
            rules: list[TensorRule] = []
            stripes = [Stripe(device=p, fraction=f) for p, f in (d.stripes[s] if d.stripes else ())]
            if d.optim[s] != "keep":
                rules.append(self._rule("optim:*", "all", d.optim[s], stripes))
            if d.stash[s] != "keep":
                rules.append(self._rule("stash:*", "all", d.stash[s], stripes))
            for j, layer in enumerate(c.layers):
                by_tech: dict[str, list[int]] = {}
                for m, t in enumerate(d.layer_tech[s][j]):
                    if t != "keep":
                        by_tech.setdefault(t, []).append(m)
                for t, mbs in sorted(by_tech.items()):
                    sel = "all" if len(mbs) == self.num_mb else format_microbatches(mbs)
                    rules.append(self._rule(f"{layer.name}.**", sel, t, stripes, self._lead(s, d)))
            peak = predicted.result.peak_bytes[d.stage_to_device[s]] if predicted else 0
            stages.append(StagePlan(
                stage=s, device=d.stage_to_device[s], first_layer=c.first_layer, end_layer=c.end_layer,
                rules=rules, pinned_host_bytes=self._host_bytes(d, s),
                peer_pool_bytes=sum(b for dev, b in d.pool_bytes.items() if dev == d.stage_to_device[s]),
                peer_quotas=[PeerQuota(device=dev, quota_bytes=b) for dev, b in (d.quotas[s] if d.quotas else ())],
                need_bytes=self.setup.memory[s].total_bytes, predicted_peak_bytes=peak,
            ))
        return Plan(
            strategy=self.strategy, model=self.setup.model.name, model_fingerprint=self.setup.model.fingerprint(),
            profile_fingerprint=profile_fingerprint(self.setup), hardware=self.hw.name,
            hardware_fingerprint=hardware_fingerprint(self.hw), num_devices=self.hw.num_devices,
            device_memory_bytes=self.hw.device.memory_bytes, schedule=self.sched.name,  # type: ignore[arg-type]
            num_stages=self.sched.num_stages, num_ranks=self.sched.num_ranks, num_microbatches=self.num_mb,
            microbatch_size=self.setup.microbatch_size, swap_in_policy=self.options.swap_in_policy,
            stage_to_device=list(d.stage_to_device), stages=stages,
            fits=bool(predicted and predicted.result.fits),
            predicted_iteration_s=predicted.result.iteration_s if predicted else 0.0,
        )

    @staticmethod
    def _rule(tensor: str, sel: str, technique: str, stripes: list[Stripe], lead: int = 1) -> TensorRule:
        return TensorRule(tensor=tensor, microbatches=sel, technique=technique,  # type: ignore[arg-type]
                          stripes=stripes if technique == "d2d" else [], prefetch_lead=lead)

    def _lead(self, s: int, d: _Draft) -> int:
        """Compute actions ahead of the backward at which swap-ins start: enough compute to
        cover bringing one microbatch's swapped bytes back over PCIe."""
        c = self.costs[s]
        swapped = sum(c.layers[j].saved_bytes for j in range(len(c.layers))
                      if any(t in ("host", "d2d") for t in d.layer_tech[s][j]))
        per_action_s = max(min(c.forward_s, c.backward_s), 1e-9)
        return max(1, min(8, math.ceil(swapped / (self.hw.pcie_gbps("h2d") * 1e9) / per_action_s)))

    def _host_bytes(self, d: _Draft, s: int) -> int:
        """Pinned host bytes stage s needs: swapped activations of every microbatch that
        can be in flight, offloaded optimizer data, stashed versions."""
        c = self.costs[s]
        act = sum(c.layers[j].saved_bytes for j in range(len(c.layers)) if "host" in d.layer_tech[s][j])
        host = act * self.in_flight[s]
        if d.optim[s] == "host":
            host += c.optim_bytes + c.master_bytes
        if d.stash[s] == "host":
            host += c.param_bytes * self.in_flight[s]
        return host

    def evaluate(self, d: _Draft) -> Evaluation:
        """Emulate the draft: its peer pools live in the plan's stages."""
        return evaluate_plan(self.setup, self.to_plan(d))

    # -- candidates --------------------------------------------------------------------------
    def _layer_saving(self, s: int, j: int, technique: str) -> int:
        c = self.costs[s]
        saved = c.layers[j].saved_bytes
        if technique == "recompute":
            kept = c.input_bytes if j == 0 else c.layers[j - 1].output_bytes
            return max(saved - kept, 0)
        return saved

    def _host_roundtrip_s(self, nbytes: int) -> float:
        return nbytes / (self.hw.pcie_gbps("d2h") * 1e9) + nbytes / (self.hw.pcie_gbps("h2d") * 1e9) \
            + 2 * self.hw.pcie_latency_s

    def _pcie_sharing(self, s: int) -> int:
        """GPUs behind the PCIe switch of stage s's device (they share its bandwidth)."""
        group = self.hw.pcie_group(self.setup.stage_to_device[s])
        return sum(1 for dev in range(self.hw.num_devices) if self.hw.pcie_group(dev) == group)

    def _choose(self, s: int, j: int, live: list[float], pcie_used_s: float,
                pcie_budget_s: float) -> tuple[list[str], float, float]:
        """Per-microbatch technique for layer j of stage s among the initial techniques;
        returns (techniques, overhead seconds, PCIe seconds the choice uses).

        A host swap costs the part of its round trip that does not hide in the microbatch's
        live interval; recompute costs the layer's forward. The stage's PCIe share over an
        iteration (`pcie_budget_s`, of which `pcie_used_s` is committed) is given to the
        microbatches that live longest first: where it runs out, recompute takes over, or,
        without recompute, the swap's overrun of the budget is exposed. So the first
        microbatches of an early 1F1B stage, which wait longest, can be swapped while the
        later ones are recomputed."""
        layer = self.costs[s].layers[j]
        roundtrip = self._host_roundtrip_s(layer.saved_bytes) * self._pcie_sharing(s)
        host_ok = "host" in self.layer_allowed
        rc_ok = "recompute" in self.layer_allowed
        techs = ["d2d"] * self.num_mb  # the d2d-only strategy does not use this choice
        total = used = 0.0
        for m in sorted(range(self.num_mb), key=lambda m: -live[m]):
            host_cost = max(roundtrip - live[m], 0.0)
            fits_budget = pcie_used_s + used + roundtrip <= pcie_budget_s
            if host_ok and (not rc_ok or (fits_budget and host_cost < layer.forward_time_s)):
                overrun = 0.0 if fits_budget else min(roundtrip, pcie_used_s + used + roundtrip - pcie_budget_s)
                techs[m], cost = "host", max(host_cost, overrun)
                used += roundtrip
            elif rc_ok:
                techs[m], cost = "recompute", layer.forward_time_s
            else:
                continue
            total += cost
        return techs, total, used

    def _model_data_overhead_s(self, s: int, nbytes: int) -> float:
        """Exposed time of streaming `nbytes` of optimizer data in and out around the step:
        the GPUs behind one PCIe switch stream at once, and only the stage's last backward
        overlaps the first chunks."""
        stream_s = nbytes * self._pcie_sharing(s) / (min(self.hw.pcie_gbps("h2d"), self.hw.pcie_gbps("d2h")) * 1e9)
        return max(stream_s - self.costs[s].backward_s, 0.0)

    def shed(self, d: _Draft, s: int, need: int, live: list[list[float]]) -> int:
        """Compact more of stage s until `need` bytes are shed at its peak (or nothing is
        left), cheapest overhead per byte first; returns the bytes shed."""
        c, k = self.costs[s], self.in_flight[s]
        # PCIe time this stage's host swaps already take per iteration, and its share of
        # the iteration (a microbatch slot is set by the slowest stage's F + B)
        sharing = self._pcie_sharing(s)
        pcie_used = sum(self._host_roundtrip_s(c.layers[j].saved_bytes) * sharing * d.layer_tech[s][j].count("host")
                        for j in range(len(c.layers)))
        pcie_budget = max(x.forward_s + x.backward_s for x in self.costs) * self.num_mb
        candidates: list[tuple[float, int, int, str, int]] = []
        host = "host" in self.allowed
        optim_bytes = c.optim_bytes + c.master_bytes
        if host and d.optim[s] == "keep" and optim_bytes:
            candidates.append((self._model_data_overhead_s(s, optim_bytes) / optim_bytes, 1, 0, "optim", -1))
        if host and self.sched.weight_stashing and d.stash[s] == "keep" and k > 1 and c.param_bytes:
            stash_live = [min(col) for col in zip(*live)] if live else []
            over = sum(max(self._host_roundtrip_s(c.param_bytes) - x, 0.0) for x in stash_live)
            candidates.append((over / ((k - 1) * c.param_bytes), 1, 0, "stash", -1))
        for j in range(len(c.layers)):
            if any(t != "keep" for t in d.layer_tech[s][j]):
                continue
            techs, overhead, _ = self._choose(s, j, live[j], pcie_used, pcie_budget)
            saving = min(self._layer_saving(s, j, t) for t in set(techs)) * k
            if saving <= 0:
                continue
            # ties: later layers first (their backward comes first)
            candidates.append((overhead / saving, 1, -j, "layer", j))
        shed = 0
        for _score, _n, _neg, what, j in sorted(candidates):
            if shed >= need:
                break
            if what == "optim":
                d.optim[s] = "host"
                shed += optim_bytes
            elif what == "stash":
                d.stash[s] = "host"
                shed += (k - 1) * c.param_bytes
            else:
                # choose again: earlier picks may have used up the stage's PCIe time
                techs, _, used = self._choose(s, j, live[j], pcie_used, pcie_budget)
                d.layer_tech[s][j] = techs
                shed += min(self._layer_saving(s, j, t) for t in set(techs)) * k
                pcie_used += used
        return shed

    # -- search --------------------------------------------------------------------------------
    def run(self) -> PlanResult:
        t0 = time.perf_counter()
        n_st = self.sched.num_stages
        empty = _Draft(
            layer_tech=[[["keep"] * self.num_mb for _ in c.layers] for c in self.costs],
            optim=["keep"] * n_st, stash=["keep"] * n_st,
            stage_to_device=list(self.setup.stage_to_device), stripes=[()] * n_st,
        )
        base = self.evaluate(empty)
        if self.strategy == "none":
            return self.result(empty, base, t0)
        times = stage_times(base.result, n_st, self.num_mb)
        live = [layer_live_intervals(times[s], self.costs[s]) for s in range(n_st)]
        # mpress seeds its search with the mixed assignment and a recompute-first one (the
        # cost model cannot see every bubble that hides recompute); the emulator picks
        seeds = [self.allowed] if self.strategy != "mpress" else [("host", "recompute"), ("recompute",)]
        best: tuple[_Draft, Evaluation] | None = None
        for layer_techniques in seeds:
            self.layer_allowed = layer_techniques
            d, ev = self._fit(empty.copy(), base, live)
            if best is None or _better(ev, best[1]):
                best = (d, ev)
        assert best is not None  # seeds is never empty
        d, ev = best
        if self.strategy == "mpress":
            d, ev = self._d2d_rounds(d, ev)
        return self.result(d, ev, t0)

    def _fit(self, d: _Draft, base: Evaluation, live: list[list[list[float]]]) -> tuple[_Draft, Evaluation]:
        """Shed bytes, emulate, shed the remaining excess, until every device fits."""
        excess = self._device_excess_from_model(d)
        ev = base
        for rnd in range(self.options.max_fit_rounds):
            shed_any = False
            for s, need in excess.items():
                if need > 0:
                    if self.strategy == "d2d":
                        shed_any |= self._shed_d2d(d, s, need, live[s]) > 0
                    else:
                        shed_any |= self.shed(d, s, need, live[s]) > 0
            if self.strategy == "d2d" and shed_any:
                self._map_d2d(d)
            ev = self.evaluate(d)
            self.progress(f"{self.strategy}: fit round {rnd + 1} ({'+'.join(self.layer_allowed)}), iteration "
                          f"{ev.result.iteration_s:.3f} s, {sum(ev.result.oom)} devices over")
            excess = self._device_excess_from_emulation(ev, d)
            if not any(v > 0 for v in excess.values()) or not shed_any:
                break
        return d, ev

    def _stages_on(self, d: _Draft, device: int) -> list[int]:
        return [s for s, dev in enumerate(d.stage_to_device) if dev == device]

    def _device_excess_from_model(self, d: _Draft) -> dict[int, int]:
        """Per stage, bytes over the device capacity by the memory model (stages sharing a
        device split their device's excess in proportion to their need)."""
        need_dev: dict[int, int] = {}
        for m in self.setup.memory:
            dev = d.stage_to_device[m.stage]
            need_dev[dev] = need_dev.get(dev, 0) + m.total_bytes
        out = {}
        for m in self.setup.memory:
            dev = d.stage_to_device[m.stage]
            over = need_dev[dev] - self.capacity
            out[m.stage] = math.ceil(over * m.total_bytes / need_dev[dev]) if over > 0 else 0
        return out

    def _device_excess_from_emulation(self, ev: Evaluation, d: _Draft) -> dict[int, int]:
        out = {}
        for dev, peak in enumerate(ev.result.peak_bytes):
            stages = self._stages_on(d, dev)
            over = peak - self.capacity
            for s in stages:
                out[s] = math.ceil(over / len(stages)) if over > 0 else 0
        return out

    # -- D2D ---------------------------------------------------------------------------------
    def _shed_d2d(self, d: _Draft, s: int, need: int, live: list[list[float]]) -> int:
        """D2D-only strategy: move model data, then layers with the longest intervals."""
        c, k = self.costs[s], self.in_flight[s]
        shed = 0
        if d.optim[s] == "keep" and c.optim_bytes + c.master_bytes:
            d.optim[s] = "d2d"
            shed += c.optim_bytes + c.master_bytes
        if shed < need and self.sched.weight_stashing and d.stash[s] == "keep" and k > 1:
            d.stash[s] = "d2d"
            shed += (k - 1) * c.param_bytes
        order = sorted(range(len(c.layers)), key=lambda j: -min(live[j]))
        for j in order:
            if shed >= need:
                break
            if all(t == "keep" for t in d.layer_tech[s][j]) and c.layers[j].saved_bytes:
                d.layer_tech[s][j] = ["d2d"] * self.num_mb
                shed += c.layers[j].saved_bytes * k
        return shed

    def _d2d_bytes(self, d: _Draft, s: int) -> int:
        """Peer-pool bytes stage s needs: its D2D data at the stage's peak."""
        c, k = self.costs[s], self.in_flight[s]
        act = sum(c.layers[j].saved_bytes for j in range(len(c.layers)) if "d2d" in d.layer_tech[s][j]) * k
        if d.optim[s] == "d2d":
            act += c.optim_bytes + c.master_bytes
        if d.stash[s] == "d2d":
            act += (k - 1) * c.param_bytes
        return act

    def _map_d2d(self, d: _Draft, peaks: list[int] | None = None) -> bool:
        """Run the device mapper for the draft's D2D volumes; set mapping, stripes, pools.
        Returns False (and leaves D2D unplaced) when spare peer memory is short."""
        n_st = self.sched.num_stages
        if self.sched.num_ranks != n_st:
            return False  # interleaved: several stages per device, the mapper maps one each
        overflow = [self._d2d_bytes(d, s) for s in range(n_st)]
        if peaks is None:
            peaks = [m.total_bytes for m in self.setup.memory]
        spare = [0 if overflow[s] else max(self.capacity - peaks[s], 0) for s in range(n_st)]
        problem = MappingProblem.from_hardware(self.hw, overflow, spare)
        t0 = time.perf_counter()
        res = map_devices(problem, time_budget_s=0.5)
        self.mapping_s += time.perf_counter() - t0
        a = res.assignment
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
                d.layer_tech[s] = [["keep" if t == "d2d" else t for t in mbs] for mbs in d.layer_tech[s]]
                d.optim[s] = "keep" if d.optim[s] == "d2d" else d.optim[s]
                d.stash[s] = "keep" if d.stash[s] == "d2d" else d.stash[s]
        d.unplaced_bytes = a.unplaced_bytes
        return a.unplaced_bytes == 0

    def _overhead_by_layer(self, ev: Evaluation, d: _Draft) -> list[tuple[float, int, int]]:
        """(overhead seconds, stage, layer) of compacted layers: stall blamed on their
        swaps plus their recompute time."""
        stall = ev.result.stall_s_by_tensor
        out = []
        for s, c in enumerate(self.costs):
            for j, layer in enumerate(c.layers):
                techs = d.layer_tech[s][j]
                if all(t in ("keep", "d2d") for t in techs):
                    continue
                o = sum(v for name, v in stall.items() if name.startswith(f"{s}:{layer.name}.**@"))
                o += layer.forward_time_s * techs.count("recompute")
                out.append((o, s, j))
        return sorted(out, reverse=True)

    def _d2d_rounds(self, d: _Draft, ev: Evaluation) -> tuple[_Draft, Evaluation]:
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
                need = self.costs[s].layers[j].saved_bytes * self.in_flight[s]
                if need > room or per_stage.get(s, 0) >= self.options.d2d_layers_per_round:
                    continue
                chosen.append((s, j))
                per_stage[s] = per_stage.get(s, 0) + 1
                room -= need
            trial = None
            while chosen:  # drop the last choice until the mapper places everything
                trial = d.copy()
                for s, j in chosen:
                    trial.layer_tech[s][j] = ["d2d"] * self.num_mb
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

    # -- result --------------------------------------------------------------------------------
    def result(self, d: _Draft, ev: Evaluation, t0: float) -> PlanResult:
        plan = self.to_plan(d, ev)
        saved = []
        peers = []
        for s, c in enumerate(self.costs):
            k = self.in_flight[s]
            by: dict[str, int] = {}
            for j in range(len(c.layers)):
                techs = d.layer_tech[s][j]
                for t in set(techs) - {"keep"}:
                    share = techs.count(t) / self.num_mb
                    by[t] = by.get(t, 0) + int(self._layer_saving(s, j, t) * k * share)
            if d.optim[s] != "keep":
                by[d.optim[s]] = by.get(d.optim[s], 0) + c.optim_bytes + c.master_bytes
            if d.stash[s] != "keep":
                by[d.stash[s]] = by.get(d.stash[s], 0) + (k - 1) * c.param_bytes
            saved.append(by)
            peers.append([dev for dev, _f in (d.stripes[s] if d.stripes else ())] if self._d2d_bytes(d, s) else [])
        host = sum(sp.pinned_host_bytes for sp in plan.stages)
        fits, reason = ev.result.fits, ""
        if host > self.hw.host_memory_bytes:
            fits, reason = False, (f"host memory too small for the host-swap volume: needs {fmt_bytes(host)}, "
                                   f"{self.hw.name} has {fmt_bytes(self.hw.host_memory_bytes)}")
        elif d.unplaced_bytes:
            fits, reason = False, f"{fmt_bytes(d.unplaced_bytes)} of D2D data find no spare peer memory over NVLink"
        elif not fits:
            reason = self._why_not(ev)
        plan = replace(plan, fits=fits)
        return PlanResult(strategy=self.strategy, plan=plan, evaluation=ev, fits=fits, reason=reason,
                          saved_bytes=saved, peers=peers, host_bytes=host,
                          plan_s=time.perf_counter() - t0, mapping_s=self.mapping_s)

    def _why_not(self, ev: Evaluation) -> str:
        worst = max(range(len(ev.result.peak_bytes)), key=lambda dev: ev.result.peak_bytes[dev] - self.capacity)
        return (f"device {worst} peaks at {fmt_bytes(ev.result.peak_bytes[worst])} of "
                f"{fmt_bytes(self.hw.device.memory_bytes)}")


def _better(a: Evaluation, b: Evaluation) -> bool:
    """Fitting beats not fitting; then the faster iteration."""
    if a.result.fits != b.result.fits:
        return a.result.fits
    return a.result.iteration_s < b.result.iteration_s


def profile_fingerprint(setup: PipelineSetup) -> str:
    """Hash of the profile's layers and costs (what a plan was computed from)."""
    p = setup.profile
    return fingerprint([p.model_fingerprint, p.source, p.microbatch_size,
                        [(x.name, x.forward_time_s, x.backward_time_s, x.saved_bytes, x.param_bytes) for x in p.layers]])


def minimum_need_bytes(setup: PipelineSetup) -> list[int]:
    """Per stage, bytes no technique can move: parameters, gradients, communication
    buffers and workspace (activations, optimizer data and stashes can all go)."""
    return [m.param_bytes + m.grad_bytes + m.comm_bytes + m.workspace_bytes for m in setup.memory]


def plan_strategy(setup: PipelineSetup, strategy: str, options: PlannerOptions | None = None,
                  progress: Callable[[str], None] | None = None) -> PlanResult:
    """Plan one strategy for a laid-out pipeline."""
    return _Planner(setup, strategy, options or PlannerOptions(), progress).run()


def check_fits_at_all(setup: PipelineSetup) -> None:
    """Raise a one-line `UserError` when even moving every movable byte cannot fit."""
    cap = setup.hardware.device.memory_bytes
    for m, floor in zip(setup.memory, minimum_need_bytes(setup)):
        if floor > cap:
            raise UserError(
                f"does not fit even with every tensor swapped: stage {m.stage} needs {floor / 1e9:.1f} GB of "
                f"parameters+gradients on a {cap / 1e9:.1f} GB device")
