"""The planner: MPress's search for the cheapest memory technique per tensor.

Steps (PAPERS.md section 1; one `PipelineSetup` in, one `PlanResult` out):

1. Emulate the pipeline without compaction; read each layer's live interval per
   microbatch (forward end to backward start) off the timeline.
2. Per stage, the bytes to shed = memory-model need - device capacity (the hardware's
   `usable_memory_bytes`: nominal memory less its reserve, which holds what CUDA does not
   report, the CUDA context, cuBLAS, NCCL and allocator fragmentation, `mpress.hardware.gpu_reserve`;
   no further headroom is taken here). Candidates:
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
   Recompute is per tensor: a layer's profile offers op-level choices (part of what it
   saves, rebuilt from cached matrix products at a fraction of its forward) besides the
   whole layer; the choice with the least replay time per byte saved is taken, compared
   per byte with the host swap, and a layer recomputed in part may later be recomputed
   whole when more must go. Every seed is searched with op-level choices and with whole
   layers only, and the emulator picks.
   D2D is weighed in this step too, wherever stages that fit leave spare memory by the
   memory model (`_first_step_peers`): a layer goes to peers when the part of its round
   trip over its device's NVLink that its live interval does not hide is cheaper per byte
   than the host swap / recompute mix, and while that spare lasts; a tie goes to the mix
   (peer memory is scarce). The device mapper then places it; what it cannot place goes
   back and is shed otherwise. Such seeds are tried beside the same seeds without D2D.
4. Emulate; where a device still overflows (copies in flight, the optimizer's streamed
   chunks), shed the excess and repeat.
5. D2D rounds (`mpress`, `d2d`): take the compacted layers with the largest emulated
   overhead (stall blamed on their swaps, or their recompute time), move them to D2D
   where the device mapper finds spare peer memory over NVLink (stripes in proportion to
   link bandwidth), keep the step if the emulated iteration gets faster; stop when a
   step gains nothing. Ties prefer the technique that does not use scarce peer memory.
6. Give spare device memory back to optimizer data the fit moved whole: keep layers'
   states on devices with room while the iteration gets faster (`planner_optim_keep`).

Strategies: `none`, `recompute` (recompute only: cannot touch model data), `host-swap`
(host swap only), `d2d` (D2D only) and `mpress` (all three), from the same code;
`megatron-selective` (Megatron-LM's selective recompute, a fixed policy: `megatron.py`).
Units: bytes, seconds.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from mpress.errors import UserError
from mpress.hardware.server import Hardware
from mpress.contract.plan import Plan
from mpress.static.emulate.channels import host_roundtrip_s, pcie_sharers
from mpress.static.plan.evaluate import Evaluation, PipelineSetup
from mpress.static.emulate.liveness import layer_live_intervals, stage_times
from mpress.static.plan.megatron import megatron_draft
from mpress.static.plan.plan_draft import D2D, HOST, KEEP, RECOMPUTE, Draft, PlanWriter
from mpress.static.plan.plan_cache import PlanCache
from mpress.static.plan.planner_d2d import D2DSteps
from mpress.static.plan.planner_layer_data import LayerDataSteps, host_why, plan_pinned_bytes
from mpress.static.plan.planner_nvme import optimizer_to_drive
from mpress.static.plan.planner_optim_keep import OptimizerKeepSteps
from mpress.static.memory.stage_memory import WHOLE, freeable_bytes, layer_memory, recompute_time_s
from mpress.config.units import fmt_bytes
from mpress.config.vocabulary import Strategy, SwapInPolicy, Technique

_ALLOWED: dict[Strategy, tuple[Technique, ...]] = {
    Strategy.NONE: (), Strategy.RECOMPUTE: (RECOMPUTE,), Strategy.HOST_SWAP: (HOST,), Strategy.D2D: (D2D,),
    Strategy.MPRESS: (HOST, RECOMPUTE, D2D), Strategy.MEGATRON_SELECTIVE: (RECOMPUTE,),
}


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """Knobs of the search."""

    max_fit_rounds: int = 8
    """Emulate-and-shed rounds before giving up on fitting."""
    max_d2d_rounds: int = 6
    """D2D rounds (each moves the costliest layers to peers and keeps the step if faster)."""
    d2d_layers_per_round: int = 2
    """Layers per overflowing stage moved to D2D in one round."""
    swap_in_policy: SwapInPolicy = SwapInPolicy.CAPACITY
    prefetch_lead: int | None = field(default=None, metadata={"min": 1})
    """Compute actions ahead of the backward at which swap-ins start; None: derived per
    stage, enough compute to cover one microbatch's copy back (`PlanWriter._lead`). One
    device out of core takes 1: its first backward follows its last forward."""
    op_level_recompute: bool = True
    """Recompute may keep part of a layer (its profile's `recompute_options`); False: whole
    layers only (for comparison)."""
    drive: bool = True
    """mpress may move optimizer data to the server's local drive when the pins exceed the host's (`planner_nvme`)."""
    layer_data: bool = False
    """mpress may keep layers' parameters and gradients on the host (`mpress plan --layer-data`, size studies)."""
    optimizer_keep: bool = True
    """The last step may keep layers' optimizer data on devices with room (`planner_optim_keep`);
    False: the fit's whole-stage moves stand (a study holding model data fixed across swap-in policies)."""


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
    draft: Draft | None = None
    """The planner's working state the plan was written from (for `ablation.py`)."""


class _Planner(D2DSteps, LayerDataSteps, OptimizerKeepSteps):
    def __init__(self, setup: PipelineSetup, strategy: str, options: PlannerOptions,
                 progress: Callable[[str], None] | None, cache: PlanCache | None = None) -> None:
        if strategy not in Strategy.words():
            raise UserError(f"unknown strategy {strategy!r} (allowed: {', '.join(Strategy.words())})")
        self.setup, self.strategy, self.options = setup, Strategy(strategy), options
        self.cache = cache if cache is not None and cache.setup is setup else PlanCache(setup)
        """Emulations and mappings already made (shared with the other strategies of a run)."""
        self.allowed = _ALLOWED[self.strategy]
        self.layer_allowed: tuple[Technique, ...] = self.allowed
        """Techniques the current seed gives activations."""
        self.model_data_host = HOST in self.allowed
        self.op_level = options.op_level_recompute
        """Whether the current seed may recompute part of a layer."""
        """Whether the current seed may send optimizer data and stashed weights to the host."""
        self.progress = progress or (lambda _msg: None)
        self.hw: Hardware = setup.hardware
        self.sched = setup.schedule
        self.costs = setup.costs
        self.num_mb = self.sched.num_microbatches
        self.capacity = self.hw.usable_memory_bytes
        self.mapping_s = 0.0
        self.in_flight = [m.max_in_flight for m in setup.memory]
        self.writer = PlanWriter(setup, self.strategy, options.swap_in_policy, options.prefetch_lead)
        self.peer_room = 0
        """Spare peer memory the current seed's first step may still give D2D, bytes."""
        self.lenders: list[int] = []
        """Devices with spare memory before any compaction (the first step's D2D targets)."""

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, d: Draft) -> Evaluation:
        """Emulate the draft: its peer pools live in the plan's stages."""
        return self.cache.evaluate(self.setup, self.writer.to_plan(d))

    # -- candidates --------------------------------------------------------------------------
    def _layer_saving(self, s: int, j: int, technique: str, choice: int = WHOLE) -> int:
        """Bytes per microbatch layer j of stage s keeps no more when compacted this way:
        what its forward keeps less what it keeps under recompute choice `choice`
        (recompute), or what swapping all it saved frees."""
        layers = self.costs[s].layers
        if technique == RECOMPUTE:
            return max(layers[j].memory.kept_bytes - layer_memory(layers[j], choice).kept_bytes, 0)
        return freeable_bytes(layers, j, layers[j].saved, [None] * len(layers))

    def _recompute_choices(self, s: int, j: int) -> list[int]:
        """The recompute choices the search may give layer j of stage s: its op-level
        options (unless switched off), then the whole layer."""
        layer = self.costs[s].layers[j]
        options = range(len(layer.recompute_options)) if self.op_level else range(0)
        return [*options, WHOLE]

    def _recompute(self, s: int, j: int) -> tuple[int, float, int]:
        """(choice, time, bytes saved per microbatch) of the recompute choice of layer j of
        stage s with the least time per byte saved."""
        layer = self.costs[s].layers[j]
        best = None
        for choice in self._recompute_choices(s, j):
            saving = self._layer_saving(s, j, RECOMPUTE, choice)
            if saving <= 0:
                continue
            cost = recompute_time_s(layer, choice)
            if best is None or cost / saving < best[1] / best[2]:
                best = (choice, cost, saving)
        return best or (WHOLE, layer.forward_time_s, 0)

    def _host_roundtrip_s(self, nbytes: int, s: int) -> float:
        """A host swap's round trip for stage s, as the emulator runs it while its uplink
        is shared (`channels.host_roundtrip_s`, `_pcie_sharing`)."""
        return host_roundtrip_s(self.hw, nbytes, self._pcie_sharing(s))

    def _pcie_sharing(self, s: int) -> int:
        """GPUs copying on the PCIe uplink of stage s's device at once: its own and those
        behind the same switch whose stages overflow by the memory model (they must shed
        bytes, and shed them to the host; one that fits never copies)."""
        need: dict[int, int] = {}
        for m in self.setup.memory:
            dev = self.setup.stage_to_device[m.stage]
            need[dev] = need.get(dev, 0) + m.total_bytes
        copying = [dev for dev, b in need.items() if b > self.capacity]
        return pcie_sharers(self.hw, self.setup.stage_to_device[s], copying)

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
        roundtrip = self._host_roundtrip_s(layer.saved_bytes, s)
        host_ok = HOST in self.layer_allowed
        rc_ok = RECOMPUTE in self.layer_allowed
        _choice, rc_cost, rc_saving = self._recompute(s, j)
        # a swap frees all the layer saves, a recompute choice perhaps less: per byte
        host_saving = self._layer_saving(s, j, HOST) or 1
        techs = [D2D] * self.num_mb  # the d2d-only strategy does not use this choice
        total = used = 0.0
        for m in sorted(range(self.num_mb), key=lambda m: -live[m]):
            host_cost = max(roundtrip - live[m], 0.0)
            fits_budget = pcie_used_s + used + roundtrip <= pcie_budget_s
            if host_ok and (not rc_ok or (fits_budget and host_cost / host_saving < rc_cost / max(rc_saving, 1))):
                overrun = 0.0 if fits_budget else min(roundtrip, pcie_used_s + used + roundtrip - pcie_budget_s)
                techs[m], cost = HOST, max(host_cost, overrun)
                used += roundtrip
            elif rc_ok:
                techs[m], cost = RECOMPUTE, rc_cost
            else:
                continue
            total += cost
        return techs, total, used

    def _saving(self, s: int, j: int, techs: list[str]) -> int:
        """Bytes per microbatch a layer compacted with `techs` (per microbatch) surely saves."""
        choice = self._recompute(s, j)[0]
        return min(self._layer_saving(s, j, t, choice) for t in set(techs))

    def _model_data_overhead_s(self, s: int, nbytes: int) -> float:
        """Exposed time of streaming `nbytes` of optimizer data in and out around the step:
        the GPUs behind one PCIe switch stream at once, and only the stage's last backward
        overlaps the first chunks."""
        stream_s = nbytes * self._pcie_sharing(s) / (min(self.hw.pcie_gbps("h2d"), self.hw.pcie_gbps("d2h")) * 1e9)
        return max(stream_s - self.costs[s].backward_s, 0.0)

    def shed(self, d: Draft, s: int, need: int, live: list[list[float]]) -> int:
        """Compact more of stage s until `need` bytes are shed at its peak (or nothing is
        left), cheapest overhead per byte first; returns the bytes shed."""
        c, k = self.costs[s], self.in_flight[s]
        # PCIe time this stage's host swaps already take per iteration, and its share of
        # the iteration (a microbatch slot is set by the slowest stage's F + B)
        pcie_used = sum(self._host_roundtrip_s(c.layers[j].saved_bytes, s) * d.layer_tech[s][j].count(HOST)
                        for j in range(len(c.layers)))
        pcie_budget = max(x.forward_s + x.backward_s for x in self.costs) * self.num_mb
        candidates: list[tuple[float, int, int, str, int]] = []
        host = self.model_data_host
        optim_bytes = c.optimizer_data_bytes
        if host and d.optim[s] == KEEP and optim_bytes:
            candidates.append((self._model_data_overhead_s(s, optim_bytes) / optim_bytes, 1, 0, "optim", -1))
        if host and self.sched.weight_stashing and d.stash[s] == KEEP and k > 1 and c.param_bytes:
            stash_live = [min(col) for col in zip(*live)] if live else []
            over = sum(max(self._host_roundtrip_s(c.param_bytes, s) - x, 0.0) for x in stash_live)
            candidates.append((over / ((k - 1) * c.param_bytes), 1, 0, "stash", -1))
        for j in range(len(c.layers)):
            if any(t != KEEP for t in d.layer_tech[s][j]):
                if RECOMPUTE in d.layer_tech[s][j] and d.choice(s, j) != WHOLE:
                    # recomputed in part: the rest of the layer, recomputed too
                    layer, count = c.layers[j], d.layer_tech[s][j].count(RECOMPUTE)
                    more = (self._layer_saving(s, j, RECOMPUTE) - self._layer_saving(s, j, RECOMPUTE, d.choice(s, j)))
                    extra = (layer.forward_time_s - recompute_time_s(layer, d.choice(s, j))) * count
                    if more > 0:
                        candidates.append((extra / (more * k), 1, -j, "whole", j))
                continue
            techs, overhead, _ = self._choose(s, j, live[j], pcie_used, pcie_budget)
            saving = self._saving(s, j, techs) * k
            # D2D where its exposed time per byte beats the host swap / recompute mix; on a
            # tie the mix, which uses no scarce peer memory
            d2d = self._d2d_cost(s, j, live[j])
            d2d_saving = self._layer_saving(s, j, D2D) * k
            if d2d is not None and d2d_saving > 0 and (saving <= 0 or d2d / d2d_saving < overhead / saving * (1 - 1e-3)):
                candidates.append((d2d / d2d_saving, 1, -j, "d2d", j))
                continue
            if saving <= 0:
                continue
            # ties: later layers first (their backward comes first)
            candidates.append((overhead / saving, 1, -j, "layer", j))
        shed = 0
        for _score, _n, _neg, what, j in sorted(candidates):
            if shed >= need:
                break
            if what == "optim":
                d.optim[s] = HOST
                shed += optim_bytes
            elif what == "stash":
                d.stash[s] = HOST
                shed += (k - 1) * c.param_bytes
            elif what == "whole":
                shed += (self._layer_saving(s, j, RECOMPUTE) - self._layer_saving(s, j, RECOMPUTE, d.choice(s, j))) * k
                d.recompute_choice.pop((s, j), None)
            elif what == "d2d" and self._layer_peer_bytes(s, j) <= self.peer_room:
                d.layer_tech[s][j] = [D2D] * self.num_mb
                self.peer_room -= self._layer_peer_bytes(s, j)
                shed += self._layer_saving(s, j, D2D) * k
            else:  # a layer (or a D2D candidate the peer room no longer holds)
                # choose again: earlier picks may have used up the stage's PCIe time
                techs, _, used = self._choose(s, j, live[j], pcie_used, pcie_budget)
                d.layer_tech[s][j] = techs
                choice = self._recompute(s, j)[0]
                if RECOMPUTE in techs and choice != WHOLE:
                    d.recompute_choice[(s, j)] = choice
                shed += self._saving(s, j, techs) * k
                pcie_used += used
        if self.strategy is Strategy.MPRESS and not candidates:  # nothing else left: `planner_layer_data`
            shed += self.shed_layer_data(d, s, need)
        return shed

    # -- search --------------------------------------------------------------------------------
    def run(self) -> PlanResult:
        t0 = time.perf_counter()
        n_st = self.sched.num_stages
        empty = Draft(
            layer_tech=[[[KEEP] * self.num_mb for _ in c.layers] for c in self.costs],
            optim=[KEEP] * n_st, stash=[KEEP] * n_st,
            stage_to_device=list(self.setup.stage_to_device), stripes=[()] * n_st,
        )
        base = self.evaluate(empty)
        if self.strategy is Strategy.NONE:
            return self.result(empty, base, t0)
        if self.strategy is Strategy.MEGATRON_SELECTIVE:  # a fixed policy: no search
            d = megatron_draft(self.costs, empty)
            return self.result(d, self.evaluate(d), t0)
        times = stage_times(base.result, n_st, self.num_mb)
        live = [layer_live_intervals(times[s], self.costs[s]) for s in range(n_st)]
        # mpress seeds its search with the mixed assignment and recompute-first ones, with
        # and without model data on the host (the cost model cannot see every bubble that
        # hides recompute, nor every stall of streamed model data); the emulator picks
        seeds = [(self.allowed, HOST in self.allowed)] if self.strategy is not Strategy.MPRESS else [
            ((HOST, RECOMPUTE), True), ((RECOMPUTE,), True), ((RECOMPUTE,), False)]
        # where stages that fit leave spare memory, D2D is weighed per tensor from the first
        # step on (one more seed: the mapper may place less than the model promises, and
        # peer memory given early is not there for the D2D rounds)
        peer_bytes, self.lenders = self._first_step_peers() if D2D in self.allowed else (0, [])
        if peer_bytes and self.strategy is Strategy.MPRESS:
            seeds = [((*techs, D2D), host) for techs, host in seeds] + seeds
        # each with op-level recompute choices and with whole layers only: choosing per byte
        # is greedy, and a whole layer recomputed can end a fit sooner than several parts
        granularity = (True, False) if self.options.op_level_recompute and RECOMPUTE in self.allowed else (False,)
        best: tuple[Draft, Evaluation, bool] | None = None
        for (layer_techniques, model_data_host), op_level in itertools.product(seeds, granularity):
            self.layer_allowed = layer_techniques
            self.model_data_host = model_data_host
            self.op_level = op_level
            self.peer_room = peer_bytes if D2D in layer_techniques else 0
            d, ev = optimizer_to_drive(self, *self._fit(empty.copy(), base, live))  # mpress: pins over -> drive
            pins_ok = not self._host_why(d, ev)
            # a seed that fits its devices but pins more than the host can does not fit
            if best is None or _better(ev, best[1], pins_ok, best[2]):
                best = (d, ev, pins_ok)
        assert best is not None  # seeds is never empty
        d, ev, _ = best
        if self.strategy is Strategy.MPRESS:
            d, ev = self._d2d_rounds(d, ev)
        return self.result(*self._keep_optimizer_layers(d, ev), t0)

    def _fit(self, d: Draft, base: Evaluation, live: list[list[list[float]]]) -> tuple[Draft, Evaluation]:
        """Shed bytes, emulate, shed the remaining excess, until every device fits."""
        excess = self._device_excess_from_model(d)
        ev = base
        for rnd in range(self.options.max_fit_rounds):
            shed_any = False
            # the memory model may find room that the emulation does not (copies in flight,
            # a transient at the peak): a round asked for nothing still goes on to the
            # emulated excess, or more memory could stop a search that less memory starts
            asked = any(need > 0 for need in excess.values())
            for s, need in excess.items():
                if need > 0:
                    if self.strategy is Strategy.D2D:
                        shed_any |= self._shed_d2d(d, s, need, live[s]) > 0
                    else:
                        shed_any |= self.shed(d, s, need, live[s]) > 0
            if self.strategy is Strategy.D2D and shed_any and not self._map_d2d(d) and d.unplaced_why:
                shed_any = False  # this pipeline cannot be mapped: shedding more would change nothing
            if self.strategy is Strategy.MPRESS and D2D in self.layer_allowed:
                self._place_first_step_d2d(d)
            ev = self.evaluate(d)
            self.progress(f"{self.strategy}: fit round {rnd + 1} ({'+'.join(self.layer_allowed)}), iteration "
                          f"{ev.result.iteration_s:.3f} s, {sum(ev.result.oom)} devices over")
            excess = self._device_excess_from_emulation(ev, d)
            if not any(v > 0 for v in excess.values()) or (asked and not shed_any):
                break
        return d, ev

    def _stages_on(self, d: Draft, device: int) -> list[int]:
        return [s for s, dev in enumerate(d.stage_to_device) if dev == device]

    def _device_excess_from_model(self, d: Draft) -> dict[int, int]:
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

    def _device_excess_from_emulation(self, ev: Evaluation, d: Draft) -> dict[int, int]:
        out = {}
        for dev, peak in enumerate(ev.result.peak_bytes):
            stages = self._stages_on(d, dev)
            over = peak - self.capacity
            for s in stages:
                out[s] = math.ceil(over / len(stages)) if over > 0 else 0
        return out

    # -- result --------------------------------------------------------------------------------
    def result(self, d: Draft, ev: Evaluation, t0: float) -> PlanResult:
        plan = self.writer.to_plan(d, ev)
        saved = []
        peers = []
        for s, c in enumerate(self.costs):
            k = self.in_flight[s]
            by: dict[str, int] = {}
            for j in range(len(c.layers)):
                techs = d.layer_tech[s][j]
                for t in set(techs) - {KEEP}:
                    share = techs.count(t) / self.num_mb
                    by[t] = by.get(t, 0) + int(self._layer_saving(s, j, t, d.choice(s, j)) * k * share)
            if d.optim[s] != KEEP:
                by[d.optim[s]] = by.get(d.optim[s], 0) + d.moved_optim_bytes(s, c)
            if d.stash[s] != KEEP:
                by[d.stash[s]] = by.get(d.stash[s], 0) + (k - 1) * c.param_bytes
            saved.append(by)
            peers.append([dev for dev, _f in (d.stripes[s] if d.stripes else ())] if self._d2d_bytes(d, s) else [])
        host = plan_pinned_bytes(plan, self.costs)
        fits, reason = ev.result.fits, host_why(plan, self.costs, self.hw)
        if reason:
            fits = False
        elif d.unplaced_bytes:
            fits, reason = False, (f"{fmt_bytes(d.unplaced_bytes)} of D2D data "
                                   f"{d.unplaced_why or 'find no spare peer memory over NVLink'}")
        elif not fits:
            reason = self._why_not(ev)
        plan = replace(plan, fits=fits)
        return PlanResult(strategy=self.strategy, plan=plan, evaluation=ev, fits=fits, reason=reason,
                          saved_bytes=saved, peers=peers, host_bytes=host,
                          plan_s=time.perf_counter() - t0, mapping_s=self.mapping_s, draft=d)

    def _host_why(self, d: Draft, ev: Evaluation) -> str:
        """Why the host cannot hold what the plan of draft `d` (emulated as `ev`) puts there ("": it can)."""
        return host_why(self.writer.to_plan(d, ev), self.costs, self.hw)

    def _why_not(self, ev: Evaluation) -> str:
        worst = max(range(len(ev.result.peak_bytes)), key=lambda dev: ev.result.peak_bytes[dev] - self.capacity)
        return f"device {worst} peaks at {fmt_bytes(ev.result.peak_bytes[worst])} of {fmt_bytes(self.capacity)} usable"


def _better(a: Evaluation, b: Evaluation, a_pins_ok: bool = True, b_pins_ok: bool = True) -> bool:
    """Fitting the devices and what the host can pin beats fitting the devices only (whose
    reason, the host, is the one to report), which beats not fitting; then the faster
    iteration."""
    rank_a = (a.result.fits and a_pins_ok, a.result.fits)
    rank_b = (b.result.fits and b_pins_ok, b.result.fits)
    if rank_a != rank_b:
        return rank_a > rank_b
    return a.result.iteration_s < b.result.iteration_s


def plan_strategy(setup: PipelineSetup, strategy: str, options: PlannerOptions | None = None,
                  progress: Callable[[str], None] | None = None, cache: PlanCache | None = None) -> PlanResult:
    """Plan one strategy for a laid-out pipeline. cache: what planning other strategies
    of `setup` emulated and mapped (`plan_cache.PlanCache(setup)`, shared by them); None:
    this strategy's own."""
    return _Planner(setup, strategy, options or PlannerOptions(), progress, cache).run()
