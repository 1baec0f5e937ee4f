"""The rewriter: plan + schedule -> per-rank action lists with memory actions: the
program the emulator simulates and the runtime executes (`Plan.actions`).

Where each memory action goes (per rank, in its list):

- right after F(s, m), and run inside it: one swap-out (SO), D2D-out (DO) or drop (DR)
  per unit of stage s that the plan compacts in microbatch m, in layer order (each
  starts when its layer's forward ends); PipeDream's stashed weight version of m goes
  out here too when the plan says so. A swapped-out unit's device bytes are given back
  at the next compute action of the rank (its release point);
- right after B(s, m), and run inside it: a recompute (RC) of each dropped unit, last
  layer first (each runs right before its layer's backward). A split backward's I(s, m)
  stands for B(s, m) here and below: its recomputes run inside it and its swap-ins come
  before it, so what W(s, m) reads (kept from I to W, `stage_memory.split_backward_steps`)
  is on the device before W; W(s, m) itself takes no memory action;
- swap-ins (SI/DI) before the compute action `prefetch_lead` compute actions ahead of
  B(s, m) (never before the F(s, m) that produced the tensor); under the plan's
  `capacity` policy, earlier still: as early as the stage's device has room for them in
  the memory walk of the rank's list (`placement.py`);
- optimizer states and master weights: out (OO) after the stage's OPT, back in (OI)
  `prefetch_lead` compute actions before the stage's last backward, so the copy overlaps
  the last backwards (at the start of the iteration they are on the host);
- a stage whose plan steps its optimizer on the host (`optimizer_step: host`): its OPT
  becomes one OPT per layer, in layer order, as the runtime steps it. Each runs on the
  host, its gradients copied out before and its parameters copied back after, inside the
  action (`lowering.py`): nothing is listed around it, since the runtime issues nothing
  there (`runtime/optimizer_offload.py` HostOptimizerStep; `master_weights.py` makes the
  copies in the step). Its states and masters never come to the device.

A *unit* is what one memory action moves (`mpress.contract.actions.UnitId`): the saved tensors of
one layer that one rule decides in one microbatch (`{s}:LAYER.**@rN`, rule N of the
stage), one layer's chunk of the streamed optimizer step (`{s}:optim:LAYER`) or stashed
weights (`{s}:stash@rN`). Rules are read by `mpress.contract.identity.StageRules`, as the runtime
reads them. A layer's recomputed tensors are one unit (DR, RC): the runtime checkpoints
the layer, which keeps its input, whole when the rules recompute all it saves, else with
the rest cached (`mpress.contract.selective`); such a partial set must be one of the choices the
profile measured (`stage_memory.recompute_choice`), whose memory and replay time the
lowering uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mpress.contract.actions import Action, Kind, Schedule, UnitId, UnitKind
from mpress.errors import PlanError, UserError
from mpress.hardware.server import Hardware
from mpress.contract.stage_rules import LayerTensors, StageRules
from mpress.contract.plan import Plan, StagePlan, TensorRule
from mpress.static.emulate.host_step_time import host_step_s
from mpress.static.emulate.lowering import TensorInfo
from mpress.static.plan.layer_data import LayerData, ahead_position, backward_copies, check_schedule, describe, \
    forward_copies, layer_data
from mpress.static.memory.model import optimizer_step_s
from mpress.static.memory.stage_costs import StageCosts
from mpress.static.memory.stage_memory import Choice, freeable_tensors, recompute_choice, recompute_time_s
from mpress.config.units import ALIGNMENT_BYTES, round_up
from mpress.config.vocabulary import OptimizerStep, Technique

_OUT = {Technique.HOST: Kind.SO, Technique.D2D: Kind.DO}
_IN = {Technique.HOST: Kind.SI, Technique.D2D: Kind.DI}


@dataclass(frozen=True)
class Rewritten:
    """A schedule with memory actions and what each named unit costs."""

    schedule: Schedule
    tensors: dict[str, TensorInfo]


@dataclass(frozen=True)
class _Unit:
    id: UnitId
    layer: int
    """Index of the layer within the stage."""
    rule: TensorRule
    pool_bytes: int = 0
    """What its blocks take in a pinned or peer pool while it is away."""
    largest_block_bytes: int = 0
    """Its largest block there."""


def layer_tensors(costs: StageCosts) -> list[LayerTensors]:
    """The stage's layers and their saved-tensor ids, as the profile has them."""
    return [LayerTensors(name=layer.name, saved=tuple(t.id for t in layer.saved)) for layer in costs.layers]


class _Stage:
    """One stage's rules (read by `mpress.contract.identity.StageRules`) with its profile's bytes."""

    def __init__(self, sp: StagePlan, costs: StageCosts, num_microbatches: int) -> None:
        self.sp = sp
        self.costs = costs
        self.rules = StageRules(sp, layer_tensors(costs), num_microbatches)
        self.layer_data: LayerData = layer_data(self.rules, costs)
        """Its layers whose parameters / gradients live on the host (`layer_data.py`)."""
        self._recomputed: dict[tuple[int, ...], list[Choice]] = {}
        self._units: dict[tuple[int, ...], list[tuple[_Unit, int]]] = {}
        """Answers by the rules selecting a microbatch (`StageRules.selecting`): the forward
        and the backward of one ask the same, and microbatches the same rules select get
        the same."""

    def recomputed(self, microbatch: int) -> list[Choice]:
        """Per layer of the stage: its recompute choice in `microbatch` (`stage_memory.Choice`)."""
        key = self.rules.selecting(microbatch)
        if key not in self._recomputed:
            self._recomputed[key] = self._recompute_choices(microbatch)
        return self._recomputed[key]

    def _recompute_choices(self, microbatch: int) -> list[Choice]:
        return [recompute_choice(layer, self.rules.recompute_set(li, microbatch),
                                 f"stage {self.sp.stage} microbatch {microbatch}")
                for li, layer in enumerate(self.costs.layers)]

    def units(self, microbatch: int) -> list[tuple[_Unit, int]]:
        """(unit, bytes) of every compacted group of saved tensors in `microbatch`: the
        bytes its swap frees (`stage_memory.freeable_bytes`; 0 for a recomputed one). A
        layer's recomputed tensors are one unit, under the first rule recomputing them.
        The list is shared between calls: do not change it."""
        key = self.rules.selecting(microbatch)
        found = self._units.get(key)
        if found is not None:
            return found
        out = []
        recomputed = self.recomputed(microbatch)
        for li, layer in enumerate(self.costs.layers):
            dropped = False
            for r, positions in sorted(self.rules.layer_groups(li, microbatch).items()):
                rule = self.sp.rules[r]
                if rule.technique is Technique.RECOMPUTE:
                    if dropped:
                        continue
                    dropped = True
                moved = [] if rule.technique is Technique.RECOMPUTE else freeable_tensors(
                    self.costs.layers, li, [layer.saved[p] for p in positions], recomputed)
                if rule.technique is not Technique.RECOMPUTE and not moved:
                    continue  # swapping it frees nothing (the stage's input, the targets): it stays
                unit = UnitId(self.sp.stage, UnitKind.ACTIVATIONS, layer=layer.name, rule=r)
                blocks = [round_up(t.bytes, ALIGNMENT_BYTES) for t in moved]
                out.append((_Unit(unit, li, rule, sum(blocks), max(blocks, default=0)), sum(t.bytes for t in moved)))
        self._units[key] = out
        return out

    def optim_chunks(self) -> list[tuple[str, TensorRule | None, int, int]]:
        """Per layer: (layer name, the rule that offloads its optimizer states and master
        weights or None when kept, their bytes, its parameter count). A stage whose step
        runs on the host keeps them there for good: nothing streams (its `optim:` rules
        are subsumed)."""
        out = []
        host_step = _steps_on_host(self.sp)
        for layer in self.costs.layers:
            found = None if host_step else self.rules.model_data_rule("optim", layer.name)
            out.append((layer.name, found[1] if found else None, layer.optimizer_data_bytes,
                        layer.optim_bytes // 8))
        return out

    def optim_pool_bytes(self, layer_name: str) -> int:
        """What one layer's offloaded optimizer data takes in a pool: each parameter's
        two Adam states and fp32 master lie in it each rounded up to the pools' alignment
        (at most one alignment unit more each; the runtime moves them as two groups,
        `optim_group_block_bytes`)."""
        layer = next(x for x in self.costs.layers if x.name == layer_name)
        blocks = layer.param_tensors * (3 if layer.master_bytes else 2)
        return layer.optimizer_data_bytes + blocks * ALIGNMENT_BYTES

    def optim_group_block_bytes(self, layer_name: str) -> int:
        """The largest pool block one layer's offloaded optimizer data takes: the runtime
        moves a chunk as two swap groups (`runtime/optimizer_offload.py`), its Adam states
        in one block and its masters in another, so the states' block (two fp32 states per
        parameter, each tensor rounded up to the alignment) is the largest."""
        layer = next(x for x in self.costs.layers if x.name == layer_name)
        return layer.optim_bytes + 2 * layer.param_tensors * ALIGNMENT_BYTES

    def optim_lead(self) -> int:
        """Prefetch lead of the first offloaded optimizer chunk's rule."""
        return next((rule.prefetch_lead for _n, rule, _b, _p in self.optim_chunks() if rule), 1)

    def stash_units(self, microbatch: int) -> list[tuple[_Unit, int]]:
        """Units of stashed weight versions in `microbatch`: layers grouped by the rule
        that moves them."""
        groups: dict[int, int] = {}
        for layer in self.costs.layers:
            found = self.rules.model_data_rule("stash", layer.name, microbatch)
            if found is not None:
                groups[found[0]] = groups.get(found[0], 0) + layer.param_bytes
        return [(_Unit(UnitId(self.sp.stage, UnitKind.STASH, rule=r), -1, self.sp.rules[r], b), b)
                for r, b in sorted(groups.items()) if b]


def _recomputes(units: list[tuple[_Unit, int]]) -> list[_Unit]:
    """The recomputed units, last layer first: the order the backward recomputes them in
    (each recomputed layer is its own checkpoint, recomputed right before its own
    backward)."""
    return sorted((u for u, _b in units if u.rule.technique is Technique.RECOMPUTE), key=lambda u: -u.layer)


def _backward_follows(actions: Sequence[Action], compute_pos: list[int], i: int) -> bool:
    """Whether the compute action after F at index `i` is that microbatch's backward."""
    k = compute_pos.index(i)
    if k + 1 >= len(compute_pos):
        return False
    nxt = actions[compute_pos[k + 1]]
    return nxt.kind in (Kind.B, Kind.I) and (nxt.stage, nxt.microbatch) == (actions[i].stage, actions[i].microbatch)


def _info(rule: TensorRule, nbytes: int, pool_bytes: int, largest_block_bytes: int = 0) -> TensorInfo:
    return TensorInfo(bytes=nbytes, stripes=tuple((s.device, s.fraction) for s in rule.stripes),
                      pool_bytes=pool_bytes, largest_block_bytes=largest_block_bytes)


def rewrite(plan: Plan, schedule: Schedule, costs: list[StageCosts], hardware: Hardware) -> Rewritten:
    """Insert the plan's memory actions into `schedule` (see the module docstring)."""
    if plan.num_stages != schedule.num_stages or plan.num_microbatches != schedule.num_microbatches:
        raise PlanError(f"plan is for {plan.num_stages} stages x {plan.num_microbatches} microbatches, "
                        f"schedule has {schedule.num_stages} x {schedule.num_microbatches}")
    stages = [_Stage(plan.stages[s], costs[s], schedule.num_microbatches) for s in range(schedule.num_stages)]
    tensors: dict[str, TensorInfo] = {}
    for st in stages:
        check_schedule(st.layer_data, schedule)
        describe(st.layer_data, st.costs, tensors)
    # each rank steps its stages one after the other: the host steps that run at once are
    # one per rank that has one
    host_sharers = len({schedule.stage_to_rank[s] for s, sp in enumerate(plan.stages) if _steps_on_host(sp)})
    new_ranks = []
    for actions in schedule.ranks:
        compute_pos = [i for i, a in enumerate(actions) if a.is_compute]
        before: dict[int, list[Action]] = {}   # action index -> actions inserted before it
        replace: dict[int, list[Action]] = {}  # action index -> actions that replace it
        after: dict[int, list[Action]] = {}    # action index -> actions inserted after it
        produced_at: dict[tuple[int, int], int] = {}
        last_b: dict[int, int] = {}
        for i, a in enumerate(actions):
            if a.kind in (Kind.B, Kind.W):  # what makes the gradients the step reads
                last_b[a.stage] = i
        for i, a in enumerate(actions):
            st = stages[a.stage] if a.stage < len(stages) else None
            if st is None:
                continue
            if a.kind is Kind.F and a.microbatch is not None:
                produced_at[(a.stage, a.microbatch)] = i
                if st.layer_data:
                    ahead, inside = forward_copies(st.layer_data, st.costs, a.microbatch,
                                                   _backward_follows(actions, compute_pos, i))
                    k = compute_pos.index(i)
                    before.setdefault(ahead_position(compute_pos, k, st.layer_data.lead), []).extend(ahead)
                    after.setdefault(i, []).extend(inside)
                units = st.units(a.microbatch) + (st.stash_units(a.microbatch) if schedule.weight_stashing else [])
                if _backward_follows(actions, compute_pos, i):
                    # its swap-in would come before the swap-out's release point: the bytes
                    # would never leave the device, so the unit stays (the program says so)
                    units = [u for u in units if u[0].rule.technique not in _IN]
                choices = st.recomputed(a.microbatch)
                for unit in _recomputes(units):
                    layer, choice = st.costs.layers[unit.layer], choices[unit.layer]
                    tensors[str(unit.id)] = TensorInfo(bytes=0, compute_s=recompute_time_s(layer, choice),
                                                       recompute=choice)
                for unit, nbytes in units:
                    tech = unit.rule.technique
                    key = str(unit.id)
                    if tech is Technique.RECOMPUTE:
                        after.setdefault(i, []).append(Action(a.stage, Kind.DR, a.microbatch, key))
                    else:
                        tensors[key] = _info(unit.rule, nbytes, unit.pool_bytes, unit.largest_block_bytes)
                        after.setdefault(i, []).append(Action(a.stage, _OUT[tech], a.microbatch, key))
            elif a.kind in (Kind.B, Kind.I) and a.microbatch is not None:
                m = a.microbatch
                units = st.units(m)
                for unit in _recomputes(units):  # inside the backward, each before its layer's
                    after.setdefault(i, []).append(Action(a.stage, Kind.RC, m, str(unit.id)))
                if st.layer_data:
                    k = compute_pos.index(i)
                    produced = compute_pos.index(produced_at[(a.stage, m)])
                    ahead, inside = backward_copies(st.layer_data, st.costs, m, k == produced + 1)
                    # not right after F(s, m), where it would read as inside the forward
                    before.setdefault(ahead_position(compute_pos, k, st.layer_data.lead, min(produced + 2, k)),
                                      []).extend(ahead)
                    after.setdefault(i, []).extend(inside)
                swaps = [u for u in units if u[0].rule.technique in _IN]
                if schedule.weight_stashing:
                    swaps += st.stash_units(m)
                k = compute_pos.index(i)
                # not before the release point of its swap-out (the compute action after
                # F(s, m)): the swap-in comes after, so the two never hold the bytes at once
                produced = compute_pos.index(produced_at[(a.stage, m)])
                if k <= produced + 1:
                    continue  # B(s, m) right after F(s, m): nothing to swap (see the F branch)
                for unit, _nbytes in swaps:
                    at = compute_pos[max(k - unit.rule.prefetch_lead, produced + 2)]
                    before.setdefault(at, []).append(
                        Action(a.stage, _IN[unit.rule.technique], m, str(unit.id)))
            elif a.kind is Kind.OPT and a.tensor is None and _steps_on_host(st.sp):
                replace[i] = _host_step(st, hardware, host_sharers, tensors)
            elif a.kind is Kind.OPT and a.tensor is None:
                chunks = st.optim_chunks()
                if not any(rule for _name, rule, _b, _p in chunks):
                    continue
                k = compute_pos.index(last_b.get(a.stage, i))
                prefetch_at = compute_pos[max(k - st.optim_lead(), 0)]
                replace[i] = _stream_optimizer(st, chunks, hardware, tensors,
                                               before.setdefault(prefetch_at, []))
        out: list[Action] = []
        for i, a in enumerate(actions):
            out.extend(before.get(i, ()))
            out.extend(replace.get(i, (a,)))
            out.extend(after.get(i, ()))
        new_ranks.append(out)
    return Rewritten(schedule.with_ranks(new_ranks), tensors)


OPTIMIZER_PREFETCH_DEPTH = 2
"""Offloaded optimizer chunks brought in ahead of the one being updated (with the chunk
whose copy-out is still in flight, at most this many + 1 are resident)."""


def _stream_optimizer(st: _Stage, chunks: list[tuple[str, TensorRule | None, int, int]], hardware: Hardware,
                      tensors: dict[str, TensorInfo], prefetch: list[Action]) -> list[Action]:
    """Replace a stage's OPT by one OPT per layer, streaming offloaded states through the
    device: the first chunks come in during the last backward (`prefetch`), each later
    one when the step `OPTIMIZER_PREFETCH_DEPTH` chunks earlier is done, and each goes
    out again after its own step. Only a few chunks are ever resident, so states larger
    than the device can still be updated there."""
    stage = st.sp.stage
    names = [str(UnitId(stage, UnitKind.OPTIM, layer=layer)) for layer, _r, _b, _p in chunks]
    offloaded = [n for n, (_l, rule, _b, _p) in zip(names, chunks) if rule]
    for name, (layer, rule, nbytes, num_params) in zip(names, chunks):
        largest = st.optim_group_block_bytes(layer)
        drive = rule is not None and rule.technique is Technique.NVME  # files on the drive: no pool blocks
        info = _info(rule, nbytes, 0 if drive else st.optim_pool_bytes(layer), 0 if drive else largest) \
            if rule else TensorInfo(bytes=nbytes)
        tensors[name] = TensorInfo(bytes=info.bytes, compute_s=optimizer_step_s(num_params, hardware),
                                   stripes=info.stripes, pool_bytes=info.pool_bytes,
                                   largest_block_bytes=info.largest_block_bytes, drive=drive)
    prefetch.extend(Action(stage, Kind.OI, None, n) for n in offloaded[:OPTIMIZER_PREFETCH_DEPTH])
    out: list[Action] = []
    for name, (_layer, rule, _b, _p) in zip(names, chunks):
        out.append(Action(stage, Kind.OPT, None, name))
        if rule:
            out.append(Action(stage, Kind.OO, None, name))
            ahead = offloaded.index(name) + OPTIMIZER_PREFETCH_DEPTH
            if ahead < len(offloaded):
                out.append(Action(stage, Kind.OI, None, offloaded[ahead]))
    return out


def _host_step(st: _Stage, hardware: Hardware, sharers: int, tensors: dict[str, TensorInfo]) -> list[Action]:
    """A host-step stage's OPT as one OPT per layer (see the module docstring), each
    costed with its CPU Adam step while `sharers` ranks step on the host at once
    (`host_step_time.host_step_s`). Hardware that states no host DRAM bandwidth (a server
    `mpress topo` detected) cannot time that step: UserError."""
    if hardware.host_memory_gbps is None:
        raise UserError(f"stages[{st.sp.stage}].optimizer_step: host: hardware {hardware.name} states no "
                        f"host_memory_gbps, which times the CPU's optimizer step; give it (GB/s) in the hardware file")
    out = []
    data = st.layer_data
    for j, layer in enumerate(st.costs.layers):
        name = str(UnitId(st.sp.stage, UnitKind.OPTIM, layer=layer.name))
        step_s = host_step_s(layer.optim_bytes // 8, layer.param_bytes, hardware, sharers)
        # gradients already on the host (`grad:` rules) are not copied; parameters kept
        # there (`param:` rules) do not come back
        tensors[name] = TensorInfo(bytes=0 if j in data.grads else layer.grad_bytes, compute_s=step_s,
                                   host_step=True, host_copy=j in data.params)
        out.append(Action(st.sp.stage, Kind.OPT, None, name))
    return out


def offloaded_optim_bytes(plan: Plan, costs: list[StageCosts]) -> list[int]:
    """Per stage, model-data bytes that live off the device between their uses (they are
    not part of the stage's static memory): optimizer states and master weights, all of
    them for a stage stepping on the host, and the working parameters of the layers its
    `param:` host rules name (fetched for each forward and backward, `layer_data.py`)."""
    out = []
    for sp, c in zip(plan.stages, costs):
        if _steps_on_host(sp):
            data = layer_data(StageRules(sp, layer_tensors(c), plan.num_microbatches), c)
            out.append(c.optimizer_data_bytes + sum(c.layers[j].param_bytes for j in data.params))
            continue
        st = _Stage(sp, c, plan.num_microbatches)
        out.append(sum(b for _l, rule, b, _p in st.optim_chunks() if rule))
    return out


HOST_MASTER_BYTES_PER_PARAM = 4
"""A host-step stage's fp32 copy of each parameter, which the CPU's Adam steps (made for
every parameter, fp32 ones included: `runtime/master_weights.py` HOST_COPY)."""


def _steps_on_host(sp: StagePlan) -> bool:
    return sp.optimizer_step is OptimizerStep.HOST


def host_step_stages(plan: Plan) -> frozenset[int]:
    """The stages whose optimizer the plan steps on the host."""
    return frozenset(sp.stage for sp in plan.stages if _steps_on_host(sp))


def host_step_pinned_bytes(plan: Plan, costs: list[StageCosts]) -> list[int]:
    """Per stage, the page-locked host memory a GPU run of `plan` pins for the stage's
    host optimizer step: a staging buffer per parameter in the parameter's dtype
    (gradients come in through it, rounded parameters go out), all of them views of one
    slab of the stage's parameter bytes, pinned in place up to the pool alignment
    (`runtime/master_weights.py` slabs, a `PinnedHostPool`; torch's pinned allocator
    would round each allocation up to a power of two); 0 for a stage stepping on its
    device. Layers whose working parameters live on the host (`param:` host rules) keep
    them in a second slab (the first one takes their gradients as they come). The slabs
    are pinned apart from the stage's pool (`StagePlan.pinned_host_bytes`). A CPU run pins
    none (its parameters are host memory already)."""
    out = []
    for sp, c in zip(plan.stages, costs):
        if not _steps_on_host(sp):
            out.append(0)
            continue
        data = layer_data(StageRules(sp, layer_tensors(c), plan.num_microbatches), c)
        kept = sum(c.layers[j].param_bytes for j in data.params)
        out.append(round_up(c.param_bytes, ALIGNMENT_BYTES) + (round_up(kept, ALIGNMENT_BYTES) if kept else 0))
    return out


def host_step_host_bytes(plan: Plan, costs: list[StageCosts]) -> list[int]:
    """Per stage, the pageable host memory its host optimizer step keeps for good: the
    fp32 copy of every parameter and Adam's two fp32 states (`optimizer_offload.py`
    HostOptimizerStep); 0 for a stage stepping on its device."""
    return [c.optim_bytes + HOST_MASTER_BYTES_PER_PARAM * (c.optim_bytes // 8) if _steps_on_host(sp) else 0
            for sp, c in zip(plan.stages, costs)]


def host_step_bytes(plan: Plan, costs: list[StageCosts]) -> dict[int, tuple[int, int]]:
    """Per stage whose optimizer steps on the host, its step's (pinned, pageable) host
    bytes (`host_step_pinned_bytes`, `host_step_host_bytes`): what the plan check and the
    planner's host sum (`mpress.contract.plan_check.host_bytes`) take."""
    pinned, pageable = host_step_pinned_bytes(plan, costs), host_step_host_bytes(plan, costs)
    return {s: (p, h) for s, (p, h) in enumerate(zip(pinned, pageable)) if p or h}


def stash_offloaded(schedule: Schedule) -> list[bool]:
    """Per stage, whether the rewritten program `schedule` moves its stashed weight
    versions off the device: a rule may select only some microbatches (any of them moves
    versions out), and a stage whose backward directly follows its forward moves none."""
    out = [False] * schedule.num_stages
    for actions in schedule.ranks:
        for a in actions:
            if a.kind in _OUT.values() and UnitId.parse(a.tensor or "").kind is UnitKind.STASH:
                out[a.stage] = True
    return out
