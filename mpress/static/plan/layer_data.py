"""A layer's working parameters and gradients in pinned host memory (`param:LAYER` and
`grad:LAYER` host rules): the copies the rewriter lists for them in a rank's program.

The scheme (a stage with such rules steps its optimizer on the host, `optimizer_step:
host`, which the plan's check demands):

- parameters: the host keeps the layer's working parameters for good (the host step
  writes the updated ones there, nothing comes back after the step). Each forward and
  each backward of a microbatch brings them in one layer ahead and evicts them after the
  layer: `{s}SI{m}:{s}:params:LAYER` (host -> device) and `{s}SO{m}:{s}:params:LAYER` (a
  drop: the host copy is still good, so nothing is copied and the bytes go at once). The
  fetch of the stage's first layer (forward) or last layer (backward) is listed
  `prefetch_lead` compute actions ahead of the compute action, the others right after it
  (inside it: the lowering issues layer j's fetch when the layer before it in that pass
  ends). Where a microbatch's backward directly follows its forward (the last stage of
  1F1B) the last layer's parameters stay on the device between the two.
- gradients: each backward makes the layer's gradients of that microbatch on the device;
  `{s}SO{m}:{s}:grads:LAYER`, listed right after the backward, copies them to the host
  when the layer's backward ends, where they are summed into the host step's staging
  buffer (the first microbatch copies, the later ones add, in microbatch order: the sum
  torch's accumulation makes); their device bytes go when the copy ends. The host step
  then reads them there (no gradient copy in the step).

Traffic per iteration and layer: 2 x microbatches x parameter bytes host -> device (one
less per microbatch where the parameters stay), microbatches x gradient bytes device ->
host, at the hardware's PCIe bandwidth (`channels.host_transfers`). Weight stashing and
split backwards (I/W) are refused: the first keeps parameter versions on the device, the
second would need the weight-gradient half to fetch and drain too.

Units: bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mpress.contract.actions import Action, Kind, Schedule, UnitId, UnitKind
from mpress.contract.stage_rules import StageRules
from mpress.errors import UserError
from mpress.static.emulate.lowering import TensorInfo
from mpress.static.memory.stage_costs import StageCosts


@dataclass(frozen=True)
class LayerData:
    """A stage's layers whose parameters / gradients a host rule keeps on the host."""

    stage: int
    params: tuple[int, ...]
    """Indices (within the stage) of the layers whose parameters live on the host."""
    grads: tuple[int, ...]
    """Indices of the layers whose gradients go to the host after each backward."""
    lead: int = 1
    """Compute actions ahead at which the first fetch of a pass is issued."""

    def __bool__(self) -> bool:
        return bool(self.params or self.grads)


def layer_data(rules: StageRules, costs: StageCosts) -> LayerData:
    """The stage's `param:`/`grad:` host layers, as its rules (read by `StageRules`) say."""
    params, grads, lead = [], [], 1
    for j, layer in enumerate(costs.layers):
        found = rules.model_data_rule("param", layer.name)
        if found is not None:
            params.append(j)
            lead = max(lead, found[1].prefetch_lead)
        if rules.model_data_rule("grad", layer.name) is not None:
            grads.append(j)
    return LayerData(rules.plan.stage, tuple(params), tuple(grads), lead)


def schedule_allows(schedule: Schedule) -> bool:
    """Whether the scheme covers `schedule` (no weight stashing, no split backward)."""
    return not schedule.weight_stashing and not any(a.kind is Kind.W for r in schedule.ranks for a in r)


def check_schedule(data: LayerData, schedule: Schedule) -> None:
    """Refuse, in one line, what the scheme does not cover (see the module docstring)."""
    if not data or schedule_allows(schedule):
        return
    if schedule.weight_stashing:
        raise UserError(f"stages[{data.stage}].rules: param:/grad: host rules do not run under {schedule.name}, "
                        "whose weight stashing keeps parameter versions on the device (use 1f1b or gpipe)")
    if any(a.kind is Kind.W for r in schedule.ranks for a in r):
        raise UserError(f"stages[{data.stage}].rules: param:/grad: host rules do not run under {schedule.name}, "
                        "whose split backward would fetch and drain them twice (use 1f1b or gpipe)")


def describe(data: LayerData, costs: StageCosts, tensors: dict[str, TensorInfo]) -> None:
    """Enter what each of the stage's copies moves into `tensors`."""
    for j in data.params:
        tensors[_name(data, UnitKind.PARAMS, costs, j)] = TensorInfo(bytes=costs.layers[j].param_bytes,
                                                                     host_copy=True)
    for j in data.grads:
        tensors[_name(data, UnitKind.GRADS, costs, j)] = TensorInfo(bytes=costs.layers[j].grad_bytes)


def forward_copies(data: LayerData, costs: StageCosts, microbatch: int, keep_last: bool) -> tuple[list[Action],
                                                                                                     list[Action]]:
    """(listed ahead of F(s, m), listed right after it) for the stage's host parameters:
    the first layer's fetch ahead, the others' fetches and every eviction inside (the
    last layer's eviction not when `keep_last`: its backward follows)."""
    last = len(costs.layers) - 1
    ahead = [_act(data, Kind.SI, microbatch, UnitKind.PARAMS, costs, 0)] if 0 in data.params else []
    inside = [_act(data, Kind.SI, microbatch, UnitKind.PARAMS, costs, j) for j in data.params if j > 0]
    inside += [_act(data, Kind.SO, microbatch, UnitKind.PARAMS, costs, j) for j in data.params
               if not (keep_last and j == last)]
    return ahead, inside


def backward_copies(data: LayerData, costs: StageCosts, microbatch: int, kept_last: bool) -> tuple[list[Action],
                                                                                                      list[Action]]:
    """(listed ahead of B(s, m), listed right after it): the last layer's parameter fetch
    ahead (none when `kept_last`: it stayed since the forward), the other fetches, the
    evictions and the gradients' copies to the host inside."""
    last = len(costs.layers) - 1
    ahead = [] if kept_last or last not in data.params else [
        _act(data, Kind.SI, microbatch, UnitKind.PARAMS, costs, last)]
    inside = [_act(data, Kind.SI, microbatch, UnitKind.PARAMS, costs, j) for j in data.params if j < last]
    inside += [_act(data, Kind.SO, microbatch, UnitKind.PARAMS, costs, j) for j in data.params]
    inside += [_act(data, Kind.SO, microbatch, UnitKind.GRADS, costs, j) for j in data.grads]
    return ahead, inside


def ahead_position(compute_pos: Sequence[int], k: int, lead: int, floor: int = 0) -> int:
    """The list index before which a fetch for compute action number `k` goes: `lead`
    compute actions ahead, never before compute action number `floor`."""
    return compute_pos[max(k - lead, floor, 0)]


def _name(data: LayerData, kind: UnitKind, costs: StageCosts, j: int) -> str:
    return str(UnitId(data.stage, kind, layer=costs.layers[j].name))


def _act(data: LayerData, kind: Kind, microbatch: int, unit: UnitKind, costs: StageCosts, j: int) -> Action:
    return Action(data.stage, kind, microbatch, _name(data, unit, costs, j))
