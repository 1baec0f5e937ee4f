"""The rewriter: plan + schedule -> per-rank action lists with memory actions.

Where each memory action goes (per rank, in its list):

- after F(s, m): one swap-out (SO), D2D-out (DO) or drop (DR) per unit of stage s that
  the plan compacts in microbatch m, in layer order; PipeDream's stashed weight version
  of m goes out here too when the plan says so;
- before B(s, m): recompute (RC) of each dropped unit, in forward order, just before the
  backward; swap-ins (SI/DI) earlier, before the compute action `prefetch_lead` compute
  actions ahead of B(s, m) (never before the F(s, m) that produced the tensor);
- optimizer states and master weights: out (OO) after the stage's OPT, back in (OI)
  `prefetch_lead` compute actions before the stage's last backward, so the copy overlaps
  the last backwards (at the start of the iteration they are on the host).

A *unit* is what one memory action moves (`mpress.actions.UnitId`): the saved tensors of
one layer that one rule decides in one microbatch (`{s}:LAYER.**@rN`, rule N of the
stage), one layer's chunk of the streamed optimizer step (`{s}:optim:LAYER`) or stashed
weights (`{s}:stash@rN`). Rules are read by `mpress.identity.StageRules`, as the runtime
reads them; recompute rules must cover whole layers: the runtime recomputes by
checkpointing each such layer, which keeps the layer's input.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpress.actions import Action, Kind, Schedule, UnitId, UnitKind
from mpress.errors import PlanError
from mpress.hardware import Hardware
from mpress.identity import LayerTensors, StageRules
from mpress.plan import Plan, StagePlan, TensorRule
from mpress.static.lowering import TensorInfo
from mpress.static.memory import StageCosts, optimizer_step_s
from mpress.vocabulary import Technique

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


def layer_tensors(costs: StageCosts) -> list[LayerTensors]:
    """The stage's layers and their saved-tensor ids, as the profile has them."""
    return [LayerTensors(name=layer.name, saved=tuple(t.id for t in layer.saved)) for layer in costs.layers]


class _Stage:
    """One stage's rules (read by `mpress.identity.StageRules`) with its profile's bytes."""

    def __init__(self, sp: StagePlan, costs: StageCosts, num_microbatches: int) -> None:
        self.sp = sp
        self.costs = costs
        self.rules = StageRules(sp, layer_tensors(costs), num_microbatches)

    def units(self, microbatch: int) -> list[tuple[_Unit, int]]:
        """(unit, bytes) of every compacted group of saved tensors in `microbatch`."""
        out = []
        for li, layer in enumerate(self.costs.layers):
            for r, positions in sorted(self.rules.layer_groups(li, microbatch).items()):
                nbytes = sum(layer.saved[p].bytes for p in positions)
                unit = UnitId(self.sp.stage, UnitKind.ACTIVATIONS, layer=layer.name, rule=r)
                out.append((_Unit(unit, li, self.sp.rules[r]), nbytes))
        return out

    def optim_chunks(self) -> list[tuple[str, TensorRule | None, int, int]]:
        """Per layer: (layer name, the rule that offloads its optimizer states and master
        weights or None when kept, their bytes, its parameter count)."""
        out = []
        for layer in self.costs.layers:
            found = self.rules.model_data_rule("optim", layer.name)
            out.append((layer.name, found[1] if found else None, layer.optim_bytes + layer.master_bytes,
                        layer.optim_bytes // 8))
        return out

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
        return [(_Unit(UnitId(self.sp.stage, UnitKind.STASH, rule=r), -1, self.sp.rules[r]), b)
                for r, b in sorted(groups.items()) if b]


def _recompute_segments(stage: _Stage, units: list[tuple[_Unit, int]]) -> list[tuple[_Unit, int, float]]:
    """Recompute units with the bytes they free and the forward time that restores them.
    Each recomputed layer is its own checkpoint (`torch.utils.checkpoint` on the layer):
    it keeps its input and recomputes the rest just before its own backward, so only
    one layer's recomputed tensors are alive at a time."""
    layers = stage.costs.layers
    out = []
    for unit, nbytes in sorted((u for u in units if u[0].rule.technique is Technique.RECOMPUTE), key=lambda u: u[0].layer):
        absolute = stage.costs.first_layer + unit.layer
        kept = 0
        if absolute > 0:  # the model's first layer takes token ids: nothing worth keeping
            kept = stage.costs.input_bytes if unit.layer == 0 else layers[unit.layer - 1].output_bytes
        out.append((unit, max(nbytes - kept, 0), layers[unit.layer].forward_time_s))
    return out


def _info(rule: TensorRule, nbytes: int) -> TensorInfo:
    return TensorInfo(bytes=nbytes, stripes=tuple((s.device, s.fraction) for s in rule.stripes))


def rewrite(plan: Plan, schedule: Schedule, costs: list[StageCosts], hardware: Hardware) -> Rewritten:
    """Insert the plan's memory actions into `schedule` (see the module docstring)."""
    if plan.num_stages != schedule.num_stages or plan.num_microbatches != schedule.num_microbatches:
        raise PlanError(f"plan is for {plan.num_stages} stages x {plan.num_microbatches} microbatches, "
                        f"schedule has {schedule.num_stages} x {schedule.num_microbatches}")
    stages = [_Stage(plan.stages[s], costs[s], schedule.num_microbatches) for s in range(schedule.num_stages)]
    tensors: dict[str, TensorInfo] = {}
    new_ranks = []
    for actions in schedule.ranks:
        compute_pos = [i for i, a in enumerate(actions) if a.is_compute]
        before: dict[int, list[Action]] = {}   # action index -> actions inserted before it
        replace: dict[int, list[Action]] = {}  # action index -> actions that replace it
        after: dict[int, list[Action]] = {}    # action index -> actions inserted after it
        produced_at: dict[tuple[int, int], int] = {}
        last_b: dict[int, int] = {}
        for i, a in enumerate(actions):
            if a.kind is Kind.B:
                last_b[a.stage] = i
        for i, a in enumerate(actions):
            st = stages[a.stage] if a.stage < len(stages) else None
            if st is None:
                continue
            if a.kind is Kind.F and a.microbatch is not None:
                produced_at[(a.stage, a.microbatch)] = i
                units = st.units(a.microbatch)
                for unit, nbytes, recompute_s in _recompute_segments(st, units):
                    tensors[str(unit.id)] = TensorInfo(bytes=nbytes, compute_s=recompute_s)
                for unit, nbytes in units + (st.stash_units(a.microbatch)
                                             if schedule.weight_stashing else []):
                    tech = unit.rule.technique
                    key = str(unit.id)
                    if tech is Technique.RECOMPUTE:
                        after.setdefault(i, []).append(Action(a.stage, Kind.DR, a.microbatch, key))
                    else:
                        tensors[key] = _info(unit.rule, nbytes)
                        after.setdefault(i, []).append(Action(a.stage, _OUT[tech], a.microbatch, key))
            elif a.kind is Kind.B and a.microbatch is not None:
                m = a.microbatch
                units = st.units(m)
                for unit, _nbytes, _ in _recompute_segments(st, units):
                    before.setdefault(i, []).append(Action(a.stage, Kind.RC, m, str(unit.id)))
                swaps = [u for u in units if u[0].rule.technique in _IN]
                if schedule.weight_stashing:
                    swaps += st.stash_units(m)
                k = compute_pos.index(i)
                for unit, _nbytes in swaps:
                    lead = unit.rule.prefetch_lead
                    at = compute_pos[max(k - lead, 0)]
                    at = max(at, produced_at.get((a.stage, m), 0) + 1)
                    before.setdefault(at, []).append(
                        Action(a.stage, _IN[unit.rule.technique], m, str(unit.id)))
            elif a.kind is Kind.OPT and a.tensor is None:
                chunks = st.optim_chunks()
                if not any(rule for _name, rule, _b, _p in chunks):
                    continue
                k = compute_pos.index(last_b.get(a.stage, i))
                prefetch_at = compute_pos[max(k - st.optim_lead(), 0)]
                replace[i] = _stream_optimizer(a.stage, chunks, hardware, tensors,
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


def _stream_optimizer(stage: int, chunks: list[tuple[str, TensorRule | None, int, int]], hardware: Hardware,
                      tensors: dict[str, TensorInfo], prefetch: list[Action]) -> list[Action]:
    """Replace a stage's OPT by one OPT per layer, streaming offloaded states through the
    device: the first chunks come in during the last backward (`prefetch`), each later
    one when the step `OPTIMIZER_PREFETCH_DEPTH` chunks earlier is done, and each goes
    out again after its own step. Only a few chunks are ever resident, so states larger
    than the device can still be updated there."""
    names = [str(UnitId(stage, UnitKind.OPTIM, layer=layer)) for layer, _r, _b, _p in chunks]
    offloaded = [n for n, (_l, rule, _b, _p) in zip(names, chunks) if rule]
    for name, (_layer, rule, nbytes, num_params) in zip(names, chunks):
        info = _info(rule, nbytes) if rule else TensorInfo(bytes=nbytes)
        tensors[name] = TensorInfo(bytes=info.bytes, compute_s=optimizer_step_s(num_params, hardware),
                                   stripes=info.stripes)
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


def offloaded_optim_bytes(plan: Plan, costs: list[StageCosts]) -> list[int]:
    """Per stage, optimizer-state + master-weight bytes that live off the device between
    optimizer steps (they are not part of the stage's static memory)."""
    out = []
    for sp, c in zip(plan.stages, costs):
        st = _Stage(sp, c, plan.num_microbatches)
        out.append(sum(b for _l, rule, b, _p in st.optim_chunks() if rule))
    return out


def stash_offloaded(plan: Plan, costs: list[StageCosts]) -> list[bool]:
    """Per stage, whether the plan moves its stashed weight versions off the device."""
    out = []
    for sp, c in zip(plan.stages, costs):
        st = _Stage(sp, c, plan.num_microbatches)
        # a rule may select only some microbatches: any of them moves versions out
        out.append(any(st.stash_units(m) for m in range(plan.num_microbatches)))
    return out
